//! What every handler shares.

use engram_context::TokenCounter;
use engram_engine::{Engine, TextTokenizer};
use engram_store::Store;
use sha2::{Digest, Sha256};

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use engram_engine::{ChainKey, CycleReport, TierPolicy};
use engram_kvcore::TenantId;
use serde::Serialize;

use crate::config::Config;
use crate::error::ApiError;
use crate::memory::MemoryService;
use crate::metrics::Metrics;
use crate::shadow::Shadow;

/// Cycles of the tier bridge kept for the admin endpoint.
pub const TIER_HISTORY: usize = 32;

/// One tier-bridge cycle as the admin endpoint shows it.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct CycleRecord {
    /// When it ran, ms since the Unix epoch.
    pub at_unix_ms: u64,
    /// What it observed, decided and did.
    #[schema(value_type = Object)]
    pub report: CycleReport,
}

/// The tier bridge's state: its policy (adapted over time), its recent cycles and totals.
#[derive(Debug)]
pub struct TierBridge {
    /// The policy in force.
    pub policy: Mutex<TierPolicy>,
    /// The last cycles, newest last.
    pub history: Mutex<VecDeque<CycleRecord>>,
    /// Cycles run, blocks spilled, warmed, removed.
    pub totals: Mutex<[u64; 4]>,
    /// Sessions' last turn.
    pub activity: Mutex<HashMap<ChainKey, Instant>>,
}

impl TierBridge {
    /// A bridge with `policy`.
    pub fn new(policy: TierPolicy) -> Self {
        Self {
            policy: Mutex::new(policy),
            history: Mutex::new(VecDeque::new()),
            totals: Mutex::new([0; 4]),
            activity: Mutex::new(HashMap::new()),
        }
    }

    /// Notes a turn of a session.
    pub fn touch(&self, key: ChainKey) {
        if let Ok(mut a) = self.activity.lock() {
            a.insert(key, Instant::now());
        }
    }

    /// Forgets the activity of the sessions `gone` selects (deleted).
    pub fn forget(&self, gone: impl Fn(&ChainKey) -> bool) {
        if let Ok(mut a) = self.activity.lock() {
            a.retain(|k, _| !gone(k));
        }
    }

    /// Sessions with a turn within `window`; forgets older ones.
    pub fn active(&self, window: std::time::Duration) -> Vec<ChainKey> {
        let Ok(mut a) = self.activity.lock() else {
            return Vec::new();
        };
        a.retain(|_, t| t.elapsed() <= window);
        let mut keys: Vec<ChainKey> = a.keys().copied().collect();
        keys.sort();
        keys
    }

    /// Records a cycle.
    pub fn record(&self, report: CycleReport, policy: TierPolicy) {
        if let Ok(mut t) = self.totals.lock() {
            t[0] += 1;
            t[1] += report.spilled as u64;
            t[2] += report.warmed as u64;
            t[3] += report.removed as u64;
        }
        if let Ok(mut p) = self.policy.lock() {
            *p = policy;
        }
        if let Ok(mut h) = self.history.lock() {
            if h.len() == TIER_HISTORY {
                h.pop_front();
            }
            h.push_back(CycleRecord {
                at_unix_ms: SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() as u64),
                report,
            });
        }
    }
}

/// Tenants with a cache import running (at most one each).
#[derive(Debug, Default)]
pub struct ImportSlots(Mutex<std::collections::HashSet<String>>);

/// A running import's slot; dropping it frees the tenant's slot.
#[derive(Debug)]
pub struct ImportSlot<'a> {
    slots: &'a ImportSlots,
    tenant: String,
}

impl ImportSlots {
    /// Takes `tenant`'s slot, or `None` while another of its imports runs.
    pub fn begin(&self, tenant: &str) -> Option<ImportSlot<'_>> {
        let mut s = self.0.lock().ok()?;
        s.insert(tenant.to_string()).then(|| ImportSlot {
            slots: self,
            tenant: tenant.to_string(),
        })
    }
}

impl Drop for ImportSlot<'_> {
    fn drop(&mut self) {
        if let Ok(mut s) = self.slots.0.lock() {
            s.remove(&self.tenant);
        }
    }
}

/// How long a deletion's tombstone is kept: longer than any turn runs.
const TOMBSTONE_TTL: std::time::Duration = std::time::Duration::from_secs(3600);

/// Deleted sessions, so that a turn that ran while its session (agent, tenant) was deleted
/// records nothing: no turn log, no episode, no cached chain.
///
/// A delete holds the write side while it works and leaves a tombstone `(tenant salt, mask,
/// value, when)`; a turn records under the read side and only when no tombstone of its session
/// is newer than the turn's start. So a delete waits for the records in progress, and a record
/// after a delete sees it.
#[derive(Debug, Default)]
pub struct Deletions(tokio::sync::RwLock<Vec<(TenantId, u64, u64, Instant)>>);

/// A delete in progress (see [`Deletions::begin`]).
pub type DeleteGuard<'a> = tokio::sync::RwLockWriteGuard<'a, Vec<(TenantId, u64, u64, Instant)>>;

/// A turn's record in progress (see [`Deletions::record`]).
pub type RecordGuard<'a> = tokio::sync::RwLockReadGuard<'a, Vec<(TenantId, u64, u64, Instant)>>;

impl Deletions {
    /// Starts deleting the sessions of `tenant` with `session & mask == value` (mask 0: all):
    /// waits for the records in progress, and holds new ones until the guard drops.
    pub async fn begin(&self, tenant: TenantId, mask: u64, value: u64) -> DeleteGuard<'_> {
        let mut g = self.0.write().await;
        g.retain(|t| t.3.elapsed() < TOMBSTONE_TTL);
        g.push((tenant, mask, value, Instant::now()));
        g
    }

    /// Starts recording a turn of `session` (of `tenant`) that started at `started`: `None` when
    /// the session was deleted since, else a guard that holds deletes off until it drops.
    pub async fn record(
        &self,
        tenant: TenantId,
        session: u64,
        started: Instant,
    ) -> Option<RecordGuard<'_>> {
        let g = self.0.read().await;
        let deleted = g
            .iter()
            .any(|&(t, mask, value, at)| t == tenant && session & mask == value && at >= started);
        (!deleted).then_some(g)
    }
}

/// Shared state (held in `web::Data`).
#[derive(Debug)]
pub struct AppState {
    /// The durable store.
    pub store: Store,
    /// The engine; `None` when no model could be loaded (generation answers 503).
    pub engine: Option<Engine>,
    /// The configuration.
    pub config: Config,
    /// SHA-256 of the admin key (none: admin endpoints are closed).
    pub admin_key_hash: Option<[u8; 32]>,
    /// Server-side metrics.
    pub metrics: Metrics,
    /// The memory graph; `None` when disabled or its embedding model is missing (the memory API
    /// answers 503).
    pub memory: Option<MemoryService>,
    /// The shadow; `None` when disabled or without an engine.
    pub shadow: Option<Shadow>,
    /// The tier bridge.
    pub tiers: TierBridge,
    /// Cache imports running, per tenant.
    pub imports: ImportSlots,
    /// Per-tenant request rates and generation slots.
    pub limits: crate::limits::Limits,
    /// Deletes in progress and recent ones, against turns that ran meanwhile.
    pub deletions: Deletions,
}

impl AppState {
    /// State over a store and an optional engine.
    pub fn new(
        store: Store,
        engine: Option<Engine>,
        memory: Option<MemoryService>,
        config: Config,
    ) -> Self {
        let key = &config.auth.admin_key.0;
        let tiers = TierBridge::new(config.tiers.policy());
        let limits = crate::limits::Limits::new(&config.limits);
        let admin_key_hash = (!key.is_empty()).then(|| Sha256::digest(key.as_bytes()).into());
        Self {
            store,
            engine,
            config,
            admin_key_hash,
            metrics: Metrics::default(),
            memory,
            shadow: None,
            tiers,
            imports: ImportSlots::default(),
            limits,
            deletions: Deletions::default(),
        }
    }

    /// The shadow, or 503 `shadow_unavailable`.
    pub fn shadow(&self) -> Result<&Shadow, ApiError> {
        self.shadow.as_ref().ok_or_else(|| {
            ApiError::new(
                actix_web::http::StatusCode::SERVICE_UNAVAILABLE,
                "shadow_unavailable",
                if self.config.shadow.enabled {
                    "the shadow is off (no model is loaded)"
                } else {
                    "the shadow is off (shadow.enabled = false)"
                },
            )
        })
    }

    /// The memory service, or 503 `memory_unavailable`.
    pub fn memory(&self) -> Result<&MemoryService, ApiError> {
        self.memory.as_ref().ok_or_else(|| {
            ApiError::new(
                actix_web::http::StatusCode::SERVICE_UNAVAILABLE,
                "memory_unavailable",
                if self.config.memory.enabled {
                    "the memory graph is off (no embedding model; see the server log)"
                } else {
                    "the memory graph is off (memory.enabled = false)"
                },
            )
        })
    }

    /// The engine, or 503 `model_unavailable` (no model loaded, or its thread has ended).
    pub fn engine(&self) -> Result<&Engine, ApiError> {
        let unavailable = |why: &str| {
            ApiError::new(
                actix_web::http::StatusCode::SERVICE_UNAVAILABLE,
                "model_unavailable",
                why,
            )
        };
        match &self.engine {
            Some(e) if e.is_alive() => Ok(e),
            Some(_) => Err(unavailable("the engine has stopped; see the server log")),
            None => Err(unavailable("no model is loaded; see the server log")),
        }
    }

    /// Whether generation can be served: a model is loaded and its thread runs.
    pub fn engine_ready(&self) -> bool {
        self.engine.as_ref().is_some_and(Engine::is_alive)
    }

    /// Counts tokens with the model's tokenizer, or estimates 4 bytes per token without one.
    pub fn counter(&self) -> Counter<'_> {
        Counter(self.engine.as_ref().map(Engine::tokenizer))
    }
}

/// A token counter over the engine's tokenizer (or an estimate).
#[derive(Debug, Clone, Copy)]
pub struct Counter<'a>(Option<&'a TextTokenizer>);

impl TokenCounter for Counter<'_> {
    fn count(&self, text: &str) -> usize {
        match self.0.map(|t| t.encode(text)) {
            Some(Ok(ids)) => ids.len(),
            _ => text.len().div_ceil(4),
        }
    }
}
