//! What the shadow archives to stay within its byte budget and each tenant within its quota:
//! the least recently written sessions first, never the ones the caller keeps (active).

use std::collections::HashMap;

use engram_engine::ChainKey;
use engram_kvcore::{SessionId, TenantId};

use crate::{EntryKind, Shadow, entry_bytes, totals};

impl Shadow {
    /// The sessions to archive for the shadow to fit in `budget` bytes: the least recently
    /// written first, skipping those `keep` names (active ones), until what is left fits.
    /// Empty when it fits already.
    pub async fn over_budget(&self, budget: u64, keep: impl Fn(ChainKey) -> bool) -> Vec<ChainKey> {
        let state = self.state.lock().await;
        let (_, _, mut bytes) = totals(&state);
        if bytes <= budget {
            return Vec::new();
        }
        let mut sessions: Vec<(u64, ChainKey, u64)> = state
            .manifests
            .values()
            .filter(|m| m.kind == EntryKind::Session)
            .filter_map(|m| {
                let key = (TenantId(m.tenant), SessionId(m.session?));
                Some((m.updated_unix_ms, key, entry_bytes(&state, m)))
            })
            .filter(|(_, key, _)| !keep(*key))
            .collect();
        sessions.sort_unstable();
        let mut out = Vec::new();
        for (_, key, size) in sessions {
            if bytes <= budget {
                break;
            }
            bytes = bytes.saturating_sub(size);
            out.push(key);
        }
        out
    }

    /// The sessions to archive for every tenant to fit in its own budget (`budget_of` its
    /// salt, in bytes; 0: none): each tenant over it loses its least recently written sessions
    /// first, skipping those `keep` names, until what it holds (its session and prefix
    /// entries) fits. Empty when every tenant fits.
    pub async fn over_tenant_budgets(
        &self,
        budget_of: impl Fn(TenantId) -> u64,
        keep: impl Fn(ChainKey) -> bool,
    ) -> Vec<ChainKey> {
        let state = self.state.lock().await;
        let mut held: HashMap<TenantId, u64> = HashMap::new();
        let mut sessions: HashMap<TenantId, Vec<(u64, ChainKey, u64)>> = HashMap::new();
        for m in state.manifests.values() {
            let tenant = TenantId(m.tenant);
            let size = entry_bytes(&state, m);
            *held.entry(tenant).or_default() += size;
            if let (EntryKind::Session, Some(s)) = (m.kind, m.session) {
                let key = (tenant, SessionId(s));
                if !keep(key) {
                    sessions
                        .entry(tenant)
                        .or_default()
                        .push((m.updated_unix_ms, key, size));
                }
            }
        }
        let mut out = Vec::new();
        for (tenant, mut bytes) in held {
            let budget = budget_of(tenant);
            if budget == 0 || bytes <= budget {
                continue;
            }
            let mut list = sessions.remove(&tenant).unwrap_or_default();
            list.sort_unstable();
            for (_, key, size) in list {
                if bytes <= budget {
                    break;
                }
                bytes = bytes.saturating_sub(size);
                out.push(key);
            }
        }
        out.sort_unstable();
        out
    }
}
