//! What every handler shares.

use engram_context::TokenCounter;
use engram_engine::{Engine, TextTokenizer};
use engram_store::Store;
use sha2::{Digest, Sha256};

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use engram_kvcore::TenantId;

use crate::metrics::Metrics;
use engram_config::Config;
use engram_engine::TierBridge;
use engram_memory::MemoryService;
use engram_shadow::Shadow;

/// Tenants with a cache import (or an agent export) running: at most one each.
#[derive(Debug, Default)]
pub struct ImportSlots(Arc<Mutex<std::collections::HashSet<String>>>);

/// A running import's (or export's) slot; dropping it frees the tenant's slot. It owns its
/// share of the set, so a streaming answer can hold it until its last byte.
#[derive(Debug)]
pub struct ImportSlot {
    slots: Arc<Mutex<std::collections::HashSet<String>>>,
    tenant: String,
}

impl ImportSlots {
    /// Takes `tenant`'s slot, or `None` while another of its imports (exports) runs.
    pub fn begin(&self, tenant: &str) -> Option<ImportSlot> {
        let mut s = self.0.lock().ok()?;
        s.insert(tenant.to_string()).then(|| ImportSlot {
            slots: self.0.clone(),
            tenant: tenant.to_string(),
        })
    }
}

impl Drop for ImportSlot {
    fn drop(&mut self) {
        if let Ok(mut s) = self.slots.lock() {
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

/// One turn of a session at a time: a turn holds its session's slot from its admission to its
/// record, and the next one waits for it (bounded).
#[derive(Debug, Default)]
pub struct SessionSlots(Mutex<HashMap<(TenantId, u64), SessionLock>>);

/// The lock a session's turns take in turn.
type SessionLock = Arc<tokio::sync::Mutex<()>>;

/// A session's slot, held by the turn that runs.
pub type SessionSlot = tokio::sync::OwnedMutexGuard<()>;

impl SessionSlots {
    /// Waits at most `wait` for the slot of `session` (of `tenant`); `None` when the turn that
    /// holds it is still running then.
    pub async fn acquire(
        &self,
        tenant: TenantId,
        session: u64,
        wait: std::time::Duration,
    ) -> Option<SessionSlot> {
        let slot = {
            let mut slots = self
                .0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            // Slots nobody holds or waits for are dropped as we go.
            slots.retain(|_, s| Arc::strong_count(s) > 1);
            slots.entry((tenant, session)).or_default().clone()
        };
        tokio::time::timeout(wait, slot.lock_owned()).await.ok()
    }
}

/// A part of the service that is off (answered 503 with the part's code).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Unavailable {
    /// No model is loaded, or the engine thread has ended (`model_unavailable`).
    #[error("{why}")]
    Model {
        /// Which of the two.
        why: &'static str,
    },
    /// The memory graph is off (`memory_unavailable`).
    #[error("{why}")]
    Memory {
        /// Why.
        why: &'static str,
    },
    /// The shadow is off (`shadow_unavailable`).
    #[error("{why}")]
    Shadow {
        /// Why.
        why: &'static str,
    },
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
    /// API-key lookups remembered for a short time.
    pub keys: crate::keys::KeyCache,
    /// Operator-key lookups remembered for a short time.
    pub operators: crate::keys::OperatorKeys,
    /// Turns' agent and layer reads remembered for a short time.
    pub agents: AgentCache,
    /// The memory graph; `None` when disabled or its embedding model is missing (the memory API
    /// answers 503).
    pub memory: Option<MemoryService>,
    /// The shadow; `None` when disabled or without an engine.
    pub shadow: Option<Shadow>,
    /// The tier bridge.
    pub tiers: TierBridge,
    /// Cache imports running, per tenant.
    pub imports: ImportSlots,
    /// Agent exports running, per tenant.
    pub exports: ImportSlots,
    /// Per-tenant request rates and generation slots.
    pub limits: crate::limits::Limits,
    /// Deletes in progress and recent ones, against turns that ran meanwhile.
    pub deletions: Deletions,
    /// The turn running in each session.
    pub sessions: SessionSlots,
    /// Prompt segments' token ids, kept across turns.
    pub tokens: crate::tokens::TokenCache,
    /// The neighbourhood each session's last prefetch reserved, for the prefetch hit rate.
    pub prefetched: Prefetched,
    /// `/readyz`'s last database ping.
    pub ready: crate::readiness::ReadyCache,
    /// The model's vocabulary compiled for constrained decoding, on first use.
    pub grammars:
        std::sync::OnceLock<Result<Arc<engram_grammar::Grammars>, engram_grammar::GrammarError>>,
    /// When the state was built (the clock `/readyz` ages its answer by).
    pub started: Instant,
    /// The shadow's byte budget in force (`shadow.budget_mib`, or half the free disk under the
    /// shadow at start when that is 0; 0: none).
    pub shadow_budget: u64,
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
        let mut policy = config.tiers.policy.clone();
        if !(config.shadow.enabled && config.shadow.read_on_miss) {
            // No read on a miss: a block dropped from cold is recomputed.
            policy.costs.disk_ns_per_byte = 0.0;
        }
        let tiers = TierBridge::new(policy);
        let limits = crate::limits::Limits::new(&config.limits, &config.auth);
        let metrics = Metrics::new(config.metrics.tenant_labels);
        let keys =
            crate::keys::KeyCache::new(config.auth.key_cache_ms, config.auth.unknown_key_cache_ms);
        let operators = crate::keys::OperatorKeys::new(
            config.auth.key_cache_ms,
            config.auth.unknown_key_cache_ms,
        );
        let agents = AgentCache::new(config.server.agent_cache_ms);
        let admin_key_hash = (!key.is_empty()).then(|| Sha256::digest(key.as_bytes()).into());
        Self {
            store,
            engine,
            config,
            admin_key_hash,
            metrics,
            keys,
            operators,
            agents,
            memory,
            shadow: None,
            tiers,
            imports: ImportSlots::default(),
            exports: ImportSlots::default(),
            limits,
            deletions: Deletions::default(),
            sessions: SessionSlots::default(),
            tokens: crate::tokens::TokenCache::default(),
            prefetched: Prefetched::new(),
            ready: crate::readiness::ReadyCache::default(),
            grammars: std::sync::OnceLock::new(),
            started: Instant::now(),
            shadow_budget: 0,
        }
    }

    /// Waits at most `limits.session_wait_ms` for the slot of `session` of `tenant` (one turn,
    /// injection or fork of a session at a time); `None` when it is still held then.
    pub async fn session_slot(&self, tenant: TenantId, session: u64) -> Option<SessionSlot> {
        let wait = std::time::Duration::from_millis(self.config.limits.session_wait_ms);
        self.sessions.acquire(tenant, session, wait).await
    }

    /// The shadow, or [`Unavailable::Shadow`].
    pub fn shadow(&self) -> Result<&Shadow, Unavailable> {
        self.shadow.as_ref().ok_or(Unavailable::Shadow {
            why: if self.config.shadow.enabled {
                "the shadow is off (no model is loaded)"
            } else {
                "the shadow is off (shadow.enabled = false)"
            },
        })
    }

    /// The memory service, or [`Unavailable::Memory`].
    pub fn memory(&self) -> Result<&MemoryService, Unavailable> {
        self.memory.as_ref().ok_or(Unavailable::Memory {
            why: if self.config.memory.enabled {
                "the memory graph is off (no embedding model; see the server log)"
            } else {
                "the memory graph is off (memory.enabled = false)"
            },
        })
    }

    /// The engine, or [`Unavailable::Model`] (no model loaded, or its thread has
    /// ended).
    pub fn engine(&self) -> Result<&Engine, Unavailable> {
        match &self.engine {
            Some(e) if e.is_alive() => Ok(e),
            Some(_) => Err(Unavailable::Model {
                why: "the engine has stopped; see the server log",
            }),
            None => Err(Unavailable::Model {
                why: "no model is loaded; see the server log",
            }),
        }
    }

    /// Whether generation can be served: a model is loaded and its thread runs.
    pub fn engine_ready(&self) -> bool {
        self.engine.as_ref().is_some_and(Engine::is_alive)
    }

    /// How the model frames messages (its chat template; ChatML without a model).
    pub fn chat_format(&self) -> &engram_context::ChatFormat {
        self.engine
            .as_ref()
            .map_or(&*engram_context::CHATML, |e| e.tokenizer().chat_format())
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

/// An agent's current layers, shared.
type Layers = Arc<[engram_store::LayerRow]>;

/// The memory nodes (ids, in the order the memories layer shows them) the last prefetch of
/// each session reserved, for at most an hour (a reservation lives for
/// `memory.reservation_ttl_secs`): the session's next turn counts a prefetch hit when it shows
/// exactly them, a miss otherwise, and forgets them.
#[derive(Debug)]
pub struct Prefetched(moka::sync::Cache<(u64, u64), std::sync::Arc<[u64]>>);

impl Prefetched {
    fn new() -> Self {
        Self(
            moka::sync::Cache::builder()
                .max_capacity(100_000)
                .time_to_live(std::time::Duration::from_secs(3600))
                .build(),
        )
    }

    /// Records what a prefetch of `session` of `tenant` reserved.
    pub fn put(&self, tenant: TenantId, session: u64, ids: Vec<u64>) {
        self.0.insert((tenant.0, session), ids.into());
    }

    /// What the last prefetch of the session reserved, forgotten as it is read.
    pub fn take(&self, tenant: TenantId, session: u64) -> Option<std::sync::Arc<[u64]>> {
        self.0.remove(&(tenant.0, session))
    }

    /// Forgets the session's last prefetch (the session was deleted).
    pub fn forget(&self, tenant: TenantId, session: u64) {
        self.0.invalidate(&(tenant.0, session));
    }

    /// The session's last prefetch, left in place.
    pub fn get(&self, tenant: TenantId, session: u64) -> Option<std::sync::Arc<[u64]>> {
        self.0.get(&(tenant.0, session))
    }
}

/// A turn's agent and layer reads, remembered for `server.agent_cache_ms` (moka). Writes through
/// this node ([`AgentCache::invalidate`]: a layer stored or marked public, an agent or tenant
/// deleted) bump a generation, so an entry read before the write is never served after it, even
/// when its read raced the write.
#[derive(Debug)]
pub struct AgentCache {
    agents: Option<moka::sync::Cache<(String, String), (u64, engram_store::Agent)>>,
    layers: Option<moka::sync::Cache<String, (u64, Layers)>>,
    generation: std::sync::atomic::AtomicU64,
}

impl AgentCache {
    /// Entries live `ttl_ms` (no cache when 0).
    pub fn new(ttl_ms: u64) -> Self {
        let ttl = std::time::Duration::from_millis(ttl_ms);
        Self {
            agents: (ttl_ms > 0).then(|| {
                moka::sync::Cache::builder()
                    .max_capacity(10_000)
                    .time_to_live(ttl)
                    .build()
            }),
            layers: (ttl_ms > 0).then(|| {
                moka::sync::Cache::builder()
                    .max_capacity(10_000)
                    .time_to_live(ttl)
                    .build()
            }),
            generation: std::sync::atomic::AtomicU64::new(0),
        }
    }

    fn generation(&self) -> u64 {
        self.generation.load(std::sync::atomic::Ordering::Acquire)
    }

    /// `tenant`'s agent named (or with the id) `key`.
    pub async fn agent(
        &self,
        store: &Store,
        tenant: &str,
        key: &str,
    ) -> Result<engram_store::Agent, engram_store::StoreError> {
        let Some(cache) = &self.agents else {
            return store.agent(tenant, key).await;
        };
        let g = self.generation();
        let k = (tenant.to_string(), key.to_string());
        if let Some((at, a)) = cache.get(&k)
            && at == g
        {
            return Ok(a);
        }
        let a = store.agent(tenant, key).await?;
        cache.insert(k, (g, a.clone()));
        Ok(a)
    }

    /// The agent's current layers.
    pub async fn layers(
        &self,
        store: &Store,
        agent: &str,
    ) -> Result<Arc<[engram_store::LayerRow]>, engram_store::StoreError> {
        let Some(cache) = &self.layers else {
            return Ok(store.layers(agent).await?.into());
        };
        let g = self.generation();
        if let Some((at, l)) = cache.get(agent)
            && at == g
        {
            return Ok(l);
        }
        let l: Arc<[engram_store::LayerRow]> = store.layers(agent).await?.into();
        cache.insert(agent.to_string(), (g, l.clone()));
        Ok(l)
    }

    /// Forgets everything (an agent's layers changed, or an agent or tenant went).
    pub fn invalidate(&self) {
        self.generation
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        if let Some(c) = &self.agents {
            c.invalidate_all();
        }
        if let Some(c) = &self.layers {
            c.invalidate_all();
        }
    }
}
