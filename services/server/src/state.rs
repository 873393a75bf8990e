//! What every handler shares.

use engram_context::TokenCounter;
use engram_engine::{Engine, TextTokenizer};
use engram_store::Store;
use sha2::{Digest, Sha256};

use crate::config::Config;
use crate::error::ApiError;
use crate::memory::MemoryService;
use crate::metrics::Metrics;

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
        let admin_key_hash = (!key.is_empty()).then(|| Sha256::digest(key.as_bytes()).into());
        Self {
            store,
            engine,
            config,
            admin_key_hash,
            metrics: Metrics::default(),
            memory,
        }
    }

    /// The memory service, or 503 `memory_unavailable`.
    pub fn memory(&self) -> Result<&MemoryService, ApiError> {
        self.memory.as_ref().ok_or_else(|| {
            ApiError::new(
                actix_web::http::StatusCode::SERVICE_UNAVAILABLE,
                "memory_unavailable",
                format!(
                    "the memory graph is off (memory.enabled = {}; embedding model expected at {}; \
                     run `make models`)",
                    self.config.memory.enabled,
                    self.config.memory.embedder_path.display()
                ),
            )
        })
    }

    /// The engine, or 503 `model_unavailable`.
    pub fn engine(&self) -> Result<&Engine, ApiError> {
        self.engine.as_ref().ok_or_else(|| {
            ApiError::new(
                actix_web::http::StatusCode::SERVICE_UNAVAILABLE,
                "model_unavailable",
                format!(
                    "no model is loaded (expected at {}); run `make models`",
                    self.config.model.path.display()
                ),
            )
        })
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
