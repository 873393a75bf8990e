//! Typed, layered configuration: defaults in code → a TOML file → environment variables
//! `ENGRAM__SECTION__KEY` (e.g. `ENGRAM__AUTH__ADMIN_KEY`), validated at load.

use std::path::{Path, PathBuf};

pub use engram_memory::MemorySection;
use serde::{Deserialize, Serialize};

mod tiers;
pub use tiers::{EvictionSection, TiersSection};

/// A secret: never printed by `Debug`.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(transparent)]
pub struct Secret(pub String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_empty() {
            "<unset>"
        } else {
            "<redacted>"
        })
    }
}

/// The whole configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// HTTP listener.
    pub server: ServerSection,
    /// Authentication.
    pub auth: AuthSection,
    /// The database.
    pub database: DatabaseSection,
    /// The model and its KV cache.
    pub model: ModelSection,
    /// Defaults for new tenants.
    pub tenants: TenantSection,
    /// The memory graph, its vector index and the reserver.
    pub memory: MemorySection,
    /// The shadow: the cache on disk, recovered at start.
    pub shadow: ShadowSection,
    /// The tier bridge (OODA loop).
    pub tiers: TiersSection,
    /// How idle hot blocks are ranked for eviction (admission and the tier bridge).
    pub eviction: EvictionSection,
    /// Per-tenant fairness limits.
    pub limits: LimitsSection,
    /// Logs: level and format.
    pub log: LogSection,
    /// Prometheus metrics.
    pub metrics: MetricsSection,
}

/// `[log]`: structured logs on stderr.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LogSection {
    /// A `tracing` filter (`info`, `engram_server=debug,warn`…); `RUST_LOG`, when set, wins.
    pub level: String,
    /// `text` (human-readable) or `json` (one JSON object per line, for log pipelines).
    pub format: String,
}

impl Default for LogSection {
    fn default() -> Self {
        Self {
            level: "info".into(),
            format: "text".into(),
        }
    }
}

/// `[metrics]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MetricsSection {
    /// Tenants that get their own `tenant` label on the per-tenant families; the rest are
    /// counted under `tenant="other"`, so the series stay bounded however many tenants come.
    pub tenant_labels: usize,
}

impl Default for MetricsSection {
    fn default() -> Self {
        Self { tenant_labels: 64 }
    }
}

/// `[limits]`: what one tenant may ask of the service, so that none starves the others.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LimitsSection {
    /// Requests per second per tenant, sustained (0: unlimited). Over it: 429 `rate_limited`
    /// with `Retry-After`.
    pub requests_per_sec: u32,
    /// Requests a tenant may send at once above the sustained rate.
    pub burst: u32,
    /// Generations (turns, chat completions) one tenant may run at once (0: unlimited).
    pub concurrent_generations: u32,
    /// How long a turn waits for the turn of the same session that runs, ms; then 409
    /// `session_busy`.
    pub session_wait_ms: u64,
}

impl Default for LimitsSection {
    fn default() -> Self {
        Self {
            requests_per_sec: 50,
            burst: 100,
            concurrent_generations: 8,
            session_wait_ms: 60_000,
        }
    }
}

/// `[shadow]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ShadowSection {
    /// Write the cache to disk and recover it at start.
    pub enabled: bool,
    /// Directory (empty: `shadow/` beside the SQLite file, or `data/shadow/<hash of the URL>`
    /// for PostgreSQL). Unused when `url` is set.
    pub dir: PathBuf,
    /// S3-compatible object storage instead of the directory: `s3://bucket/prefix` (the
    /// binary needs the `s3` feature).
    pub url: String,
    /// Access key id (empty: `AWS_ACCESS_KEY_ID`, or the instance's role).
    pub s3_access_key_id: String,
    /// Secret access key (empty: `AWS_SECRET_ACCESS_KEY`); set it through
    /// `ENGRAM__SHADOW__S3_SECRET_ACCESS_KEY` rather than a file. Never printed.
    pub s3_secret_access_key: Secret,
    /// Endpoint of a non-AWS S3 server, e.g. `http://127.0.0.1:9000` (empty: AWS, or
    /// `AWS_ENDPOINT`).
    pub s3_endpoint: String,
    /// Region (empty: `AWS_REGION`, else `us-east-1`).
    pub s3_region: String,
    /// Allow a plain-HTTP `s3_endpoint`.
    pub s3_allow_http: bool,
    /// Milliseconds between background flushes (a flush also runs at graceful shutdown).
    pub interval_ms: u64,
    /// Load the shadow into the cold tier at start.
    pub recover: bool,
    /// Write rate limit, MiB/s (0: unlimited), so the shadow never takes the disk from the
    /// turn log.
    pub max_write_mib_per_sec: u64,
    /// Recompute a session's lost blocks turn by turn from the turn log before its next turn, so
    /// that its answer equals that of a run that never lost them (CPU prefill is not
    /// batch-invariant). Off: one prefill of the whole gap (faster, may round differently).
    pub replay: bool,
    /// Other nodes' shadows, comma-separated: `s3://` URLs (same endpoint and credentials as
    /// `url`; typically other prefixes of the same bucket) or directories. Read only on a
    /// miss: a session none of this node's tiers holds is looked up there, and an entry found
    /// is loaded, written to this node's shadow and deleted from the other's (adopted, never
    /// duplicated) — a session whose node is gone resumes its cache here.
    pub peers: String,
    /// Read a session's blocks back from the shadow (and the peers') when a turn misses them in
    /// memory, instead of recomputing them (on by default; off, a miss replays or prefills).
    pub read_on_miss: bool,
    /// Bytes of segments the shadow may hold, MiB (0, the default: half the disk space free
    /// under the shadow's directory when the service starts; no limit on S3, whose bucket has
    /// its own). Over it, after a flush, the
    /// least recently written sessions with no turn within `tiers.active_window_secs` are
    /// archived: their KV deleted from memory and disk, their chain kept as a marker; their
    /// next turn replays them from the turn log.
    pub budget_mib: u64,
}

impl ShadowSection {
    /// The peers' locations (see `peers`).
    pub fn peer_list(&self) -> Vec<String> {
        self.peers
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(str::to_string)
            .collect()
    }
}

impl ShadowSection {
    /// The S3-compatible store `url` names, with the endpoint and credentials configured.
    pub fn s3_settings(&self) -> engram_shadow::S3Settings {
        engram_shadow::S3Settings {
            url: self.url.clone(),
            endpoint: self.s3_endpoint.clone(),
            region: self.s3_region.clone(),
            allow_http: self.s3_allow_http,
            credentials: (!self.s3_access_key_id.is_empty()).then(|| {
                (
                    self.s3_access_key_id.clone(),
                    self.s3_secret_access_key.0.clone(),
                )
            }),
        }
    }
}

impl Default for ShadowSection {
    fn default() -> Self {
        Self {
            enabled: true,
            dir: PathBuf::new(),
            url: String::new(),
            s3_access_key_id: String::new(),
            s3_secret_access_key: Secret::default(),
            s3_endpoint: String::new(),
            s3_region: String::new(),
            s3_allow_http: false,
            interval_ms: 60_000,
            recover: true,
            max_write_mib_per_sec: 0,
            replay: true,
            peers: String::new(),
            read_on_miss: true,
            budget_mib: 0,
        }
    }
}

/// `[server]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServerSection {
    /// Address to listen on.
    pub bind: String,
    /// Largest accepted request body in bytes.
    pub body_limit_bytes: usize,
    /// Seconds running requests get to finish on shutdown.
    pub shutdown_grace_secs: u64,
    /// Largest session file a cache import accepts, MiB (streamed to a temporary file, never
    /// held in the request's memory; over it: 413 `payload_too_large`).
    pub import_limit_mib: u64,
    /// How long a turn's read of its agent and layers is remembered, ms (0: every turn reads
    /// the database). A layer written or an agent deleted through this node is seen at once;
    /// through another node sharing the database, within this time.
    pub agent_cache_ms: u64,
}

/// `[auth]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AuthSection {
    /// The operator's key (at least 16 characters); admin endpoints need it.
    pub admin_key: Secret,
    /// How long an API key's lookup is remembered, ms (0: every request asks the database).
    /// A key revoked or a tenant deleted through this node is forgotten at once; through
    /// another node sharing the database, within this time.
    pub key_cache_ms: u64,
    /// How long an unknown key is remembered as unknown, ms (0: not at all): a client retrying
    /// a wrong key costs no database query meanwhile. A key created on another node works on
    /// this one after at most this time if it was tried here before it existed.
    pub unknown_key_cache_ms: u64,
    /// Database lookups of keys neither cache holds, per second per client IP, sustained (0:
    /// unlimited); over it, 429 `rate_limited` before the key is looked up. Keys in use are
    /// cached, so this bounds what a stream of made-up keys costs, not a busy client.
    pub lookups_per_ip_per_sec: u32,
    /// Lookups one IP may make at once above the sustained rate.
    pub lookup_burst: u32,
}

impl Default for AuthSection {
    fn default() -> Self {
        Self {
            admin_key: Secret::default(),
            key_cache_ms: 5_000,
            unknown_key_cache_ms: 2_000,
            lookups_per_ip_per_sec: 20,
            lookup_burst: 50,
        }
    }
}

/// `[database]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DatabaseSection {
    /// `sqlite://…` (default, under ./data) or `postgres://…`.
    pub url: String,
}

/// `[model]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelSection {
    /// GGUF file or safetensors directory; generation answers 503 when it is missing.
    pub path: PathBuf,
    /// KV codec: f32, f16, q8, tq6 … tq2, or tqBoN (TurboQuant with N outliers per row stored
    /// apart, such as tq6o1) for keys and values alike, or one per stream, keys first:
    /// `q8/tq4`. Empty (the default): the device's built-in default, `tq6o1/tq5` on the CPU and
    /// `tq4` on CUDA — on the CPU, a checkpoint the engine ships a calibrated profile for takes
    /// that profile's codecs instead (Gemma-3-270M: docs/kv-fidelity.md). An outlier split is a
    /// key codec: `tq6o1` alone is refused.
    pub codec: String,
    /// A calibrated KV profile (`engram calibrate kv --out FILE`) whose per-layer, per-stream
    /// codecs replace `codec`; empty for none. It must be calibrated for `path`'s model.
    pub kv_profile: String,
    /// Down-tiering: when the cold tier is full, cold blocks are re-encoded to narrower codecs
    /// instead of being dropped, within this looser KL budget (nats) as `kv_profile`'s measured
    /// sensitivity predicts it. 0 (the default): off. Needs `kv_profile`.
    pub down_tier_kl: f64,
    /// MiB of the pool of down-tiered blocks (with `down_tier_kl`).
    pub down_tier_mib: u64,
    /// Hot-tier budget in MiB; unset (the default): `hot_tokens` tokens of the model's KV.
    #[serde(
        deserialize_with = "optional_u64",
        skip_serializing_if = "Option::is_none"
    )]
    pub hot_mib: Option<u64>,
    /// Hot tier in tokens of KV at the model's KV bytes per token and codecs, when `hot_mib` is
    /// unset: 131,072 (four 32K contexts; 1.1 GiB for SmolLM2-135M or Qwen2.5-1.5B at the
    /// default codecs, 6 GiB for a Llama-3-8B shape). The start-up log prints the sizes.
    pub hot_tokens: u64,
    /// Cold-tier budget in MiB (0: no cold tier); unset (the default): `cold_tokens`.
    #[serde(
        deserialize_with = "optional_u64",
        skip_serializing_if = "Option::is_none"
    )]
    pub cold_mib: Option<u64>,
    /// Cold tier in tokens of KV when `cold_mib` is unset: 262,144.
    pub cold_tokens: u64,
    /// Where the engine runs: `cpu`, `cuda` or `cuda:N` (CUDA needs a build with `--features
    /// cuda`, e.g. `make build-cuda`).
    pub device: String,
    /// Also cache the blocks of generated replies as decode computed them (faster next turns;
    /// answers may then depend on what the cache held — see `EngineConfig::cache_generated`).
    pub cache_generated: bool,
    /// Relocated segment reuse (off by default; CPU only): a prompt layer or message cached at
    /// another position — the same rules after a different identity, say — is copied there and
    /// read with a query-side RoPE shift instead of being recomputed. Approximate: the
    /// segment's KV was computed after another prefix (`engram eval kv --relocate` measures
    /// what that costs); answers then depend on what the cache held.
    pub relocate_segments: bool,
    /// Tokens a relocated run reuses at least (with `relocate_segments`).
    pub relocate_min_tokens: usize,
    /// Session chain records (what the shadow writes) the engine keeps per tenant; over it the
    /// tenant's own least recently recorded session stops being shadowed, never another
    /// tenant's. All tenants together keep at most 16,384.
    pub chains_per_tenant: usize,
    /// Sequences the engine runs at once; waiting requests are admitted fairly across tenants
    /// (the tenant with the fewest running, then the one served least recently, goes first).
    pub max_running: usize,
    /// Tokens one engine step computes at most while sequences decode: their next tokens and a
    /// prompt chunk of a new request in the same forward pass (see `EngineConfig::step_tokens`).
    pub step_tokens: usize,
    /// Threads the CPU kernels split work over (0: `ENGRAM_THREADS` where set, else one per CPU).
    pub threads: usize,
    /// How GGUF weights are held and multiplied on the CPU: `int16` (the default: kept in their
    /// blocks, the 4-bit ones multiplied by int16 activations; the answers of f32 activations
    /// to 2e-7 nats), `quantized` (blocks, f32 activations), `int8` (int8 activations,
    /// llama.cpp's numerics: fastest, moves answers) or `f32` (dequantized at load).
    pub weights: String,
    /// How the projections are held and multiplied on a CUDA device: `bf16` (the default:
    /// dequantized and rounded once at load, products through cuBLAS with f32 accumulation,
    /// half the bytes a step) or `f32` (the CPU engine's numerics). Unused on the CPU.
    pub device_weights: String,
    /// Share of the pin cap (a quarter of the hot tier) one tenant may hold pinned, in (0, 1].
    pub pin_tenant_share: f64,
    /// Tokens of context a turn's prompt and reply fit in (0: the model's own context; else at
    /// most it, at least 256): the layers' budgets and the conversation's window follow it.
    pub context_tokens: usize,
    /// Fault injection for the supervision tests, `panic:MARKER` or `stop:MARKER` (a prompt
    /// holding MARKER makes the engine panic, or its thread end). Only in builds with the
    /// test-only feature `fault-injection`: a release binary refuses the key.
    #[cfg(feature = "fault-injection")]
    pub fault: String,
}

/// `[tenants]`: quotas given to new tenants.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TenantSection {
    /// Hot-tier blocks per tenant.
    pub hot_blocks: u64,
    /// Cold-tier blocks per tenant.
    pub cold_blocks: u64,
    /// Sessions per tenant.
    pub sessions: u64,
    /// Shadow MiB per tenant (0: no bound of its own; `shadow.budget_mib` still applies).
    pub shadow_mib: u64,
}

impl Default for ServerSection {
    fn default() -> Self {
        Self {
            bind: "127.0.0.1:8080".into(),
            body_limit_bytes: 1 << 20,
            shutdown_grace_secs: 10,
            import_limit_mib: 256,
            agent_cache_ms: 2_000,
        }
    }
}

impl Default for DatabaseSection {
    fn default() -> Self {
        Self {
            url: "sqlite://data/engram.db?mode=rwc".into(),
        }
    }
}

impl ModelSection {
    /// The engine's configuration (the values were checked at load).
    pub fn engine_config(&self) -> Result<engram_engine::EngineConfig, engram_engine::EngineError> {
        let device = engram_engine::EngineDevice::parse(&self.device)?;
        let codecs = engram_engine::StreamCodecs::parse_or_default(&self.codec, device)?;
        Ok(engram_engine::EngineConfig {
            codec: codecs.key,
            value_codec: codecs.value_override(),
            hot_bytes: self.hot_mib.unwrap_or(0) << 20,
            cold_bytes: self.cold_mib.unwrap_or(0) << 20,
            hot_tokens: if self.hot_mib.is_some() {
                0
            } else {
                self.hot_tokens
            },
            cold_tokens: if self.cold_mib.is_some() {
                0
            } else {
                self.cold_tokens
            },
            device,
            cache_generated: self.cache_generated,
            relocation: self
                .relocate_segments
                .then_some(engram_engine::RelocationPolicy {
                    min_tokens: self.relocate_min_tokens,
                }),
            kv_profile: (!self.kv_profile.is_empty()).then(|| PathBuf::from(&self.kv_profile)),
            built_in_profile: self.codec.is_empty()
                && self.kv_profile.is_empty()
                && device == engram_engine::EngineDevice::Cpu,
            down_tier: (self.down_tier_kl > 0.0).then_some(engram_engine::DownTier {
                budget_kl: self.down_tier_kl,
                bytes: self.down_tier_mib << 20,
            }),
            max_running: self.max_running,
            step_tokens: self.step_tokens,
            chains_per_tenant: self.chains_per_tenant,
            threads: self.threads,
            weights: engram_engine::WeightFormat::parse(&self.weights).unwrap_or_default(),
            device_weights: engram_engine::DeviceWeights::parse(&self.device_weights)
                .unwrap_or_default(),
            pin_policy: engram_kvcore::PinPolicy {
                tenant_share: self.pin_tenant_share,
                ..engram_kvcore::PinPolicy::default()
            },
            #[cfg(feature = "fault-injection")]
            fault: (!self.fault.is_empty())
                .then(|| engram_engine::EngineFault::parse(&self.fault))
                .transpose()?,
            ..engram_engine::EngineConfig::default()
        })
    }
}

impl Default for ModelSection {
    fn default() -> Self {
        Self {
            path: PathBuf::from("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
            codec: String::new(),
            kv_profile: String::new(),
            down_tier_kl: 0.0,
            down_tier_mib: 256,
            hot_mib: None,
            hot_tokens: 131_072,
            cold_mib: None,
            cold_tokens: 262_144,
            device: "cpu".into(),
            cache_generated: false,
            relocate_segments: false,
            relocate_min_tokens: engram_engine::RelocationPolicy::default().min_tokens,
            chains_per_tenant: engram_engine::CHAINS_PER_TENANT,
            max_running: 16,
            step_tokens: 32,
            threads: 0,
            weights: "int16".into(),
            device_weights: "bf16".into(),
            pin_tenant_share: 0.5,
            context_tokens: 0,
            #[cfg(feature = "fault-injection")]
            fault: String::new(),
        }
    }
}

impl Default for TenantSection {
    fn default() -> Self {
        Self {
            hot_blocks: 4096,
            cold_blocks: 16_384,
            sessions: 1000,
            shadow_mib: 0,
        }
    }
}

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file or an override is not valid.
    #[error("invalid configuration: {0}")]
    Parse(String),
    /// A value is out of range.
    #[error("invalid configuration `{key}`: {reason}")]
    Invalid {
        /// The key, as `section.key`.
        key: &'static str,
        /// Why.
        reason: String,
    },
}

impl Config {
    /// Defaults, then `file` (if any), then `ENGRAM__SECTION__KEY` variables of `env`.
    pub fn load(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, ConfigError> {
        let mut value = toml::Value::try_from(Self::default())
            .map_err(|e| ConfigError::Parse(e.to_string()))?;
        if let Some(path) = file {
            let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                path: path.to_path_buf(),
                source,
            })?;
            let file: toml::Value =
                toml::from_str(&text).map_err(|e| ConfigError::Parse(e.to_string()))?;
            merge(&mut value, file);
        }
        for (key, raw) in env {
            let Some(path) = key.strip_prefix("ENGRAM__") else {
                continue;
            };
            let parts: Vec<String> = path.split("__").map(str::to_lowercase).collect();
            let [section, name] = parts.as_slice() else {
                return Err(ConfigError::Parse(format!(
                    "{key}: expected ENGRAM__SECTION__KEY"
                )));
            };
            // The field's type decides: a number or a boolean is parsed as one, anything else
            // (an admin key of digits, say) stays the string it was given.
            let current = value
                .get(section.as_str())
                .and_then(|t| t.get(name.as_str()));
            let v = typed_env_value(&key, current, &raw)?;
            let mut patch = toml::map::Map::new();
            let mut inner = toml::map::Map::new();
            inner.insert(name.clone(), v);
            patch.insert(section.clone(), toml::Value::Table(inner));
            merge(&mut value, toml::Value::Table(patch));
        }
        let config: Self = value
            .try_into()
            .map_err(|e: toml::de::Error| ConfigError::Parse(e.to_string()))?;
        config.validate()?;
        Ok(config)
    }

    /// Checks ranges and formats.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |key, reason: &str| {
            Err(ConfigError::Invalid {
                key,
                reason: reason.to_string(),
            })
        };
        if self.server.bind.parse::<std::net::SocketAddr>().is_err() {
            return bad("server.bind", "must be an address like 127.0.0.1:8080");
        }
        if self.server.agent_cache_ms > 600_000 {
            return bad(
                "server.agent_cache_ms",
                "must be at most 600000 (10 minutes)",
            );
        }
        if self.auth.key_cache_ms > 600_000 {
            return bad("auth.key_cache_ms", "must be at most 600000 (10 minutes)");
        }
        if self.auth.unknown_key_cache_ms > 60_000 {
            return bad(
                "auth.unknown_key_cache_ms",
                "must be at most 60000 (1 minute)",
            );
        }
        if self.auth.lookups_per_ip_per_sec > 0 && self.auth.lookup_burst == 0 {
            return bad(
                "auth.lookup_burst",
                "must be at least 1 when lookups_per_ip_per_sec is set",
            );
        }
        if !matches!(self.log.format.as_str(), "text" | "json") {
            return bad("log.format", "must be text or json");
        }
        if self.metrics.tenant_labels > 10_000 {
            return bad("metrics.tenant_labels", "must be at most 10000");
        }
        if self.server.body_limit_bytes < 1024 {
            return bad("server.body_limit_bytes", "must be at least 1024");
        }
        if self.server.import_limit_mib == 0 || self.server.import_limit_mib > 64 * 1024 {
            return bad("server.import_limit_mib", "must be 1 to 65536");
        }
        let key = &self.auth.admin_key.0;
        if !key.is_empty() && key.len() < 16 {
            return bad("auth.admin_key", "must be at least 16 characters");
        }
        let url = &self.database.url;
        if !(url.starts_with("sqlite:")
            || url.starts_with("postgres:")
            || url.starts_with("postgresql:"))
        {
            return bad("database.url", "must start with sqlite: or postgres:");
        }
        let any_device = engram_engine::EngineDevice::Cpu;
        if engram_engine::StreamCodecs::parse_or_default(&self.model.codec, any_device).is_err() {
            return bad(
                "model.codec",
                "a codec (f32, f16, q8, tq6 … tq2), or KEYS/VALUES such as q8/tq4 or tq6o1/tq5 \
                 (tqBoN, an outlier split, is for keys only)",
            );
        }
        if !self.model.kv_profile.is_empty() && !Path::new(&self.model.kv_profile).is_file() {
            return bad("model.kv_profile", "no such file");
        }
        if !self.model.down_tier_kl.is_finite() || self.model.down_tier_kl < 0.0 {
            return bad("model.down_tier_kl", "a KL budget in nats ≥ 0 (0: off)");
        }
        if self.model.down_tier_kl > 0.0 && self.model.kv_profile.is_empty() {
            return bad(
                "model.down_tier_kl",
                "down-tiering needs model.kv_profile (its sensitivity picks the codecs)",
            );
        }
        #[cfg(feature = "fault-injection")]
        if !self.model.fault.is_empty()
            && engram_engine::EngineFault::parse(&self.model.fault).is_err()
        {
            return bad("model.fault", "panic:MARKER or stop:MARKER");
        }
        if self.model.context_tokens != 0 && self.model.context_tokens < 256 {
            return bad(
                "model.context_tokens",
                "must be 0 (the model's) or at least 256",
            );
        }
        if !(self.model.pin_tenant_share > 0.0 && self.model.pin_tenant_share <= 1.0) {
            return bad("model.pin_tenant_share", "must be in (0, 1]");
        }
        if !(1..=256).contains(&self.model.max_running) {
            return bad("model.max_running", "must be 1 to 256");
        }
        if !(1..=engram_engine::MAX_CHAINS).contains(&self.model.chains_per_tenant) {
            return bad("model.chains_per_tenant", "must be 1 to 16384");
        }
        if !(1..=65_536).contains(&self.model.step_tokens) {
            return bad("model.step_tokens", "must be 1 to 65536");
        }
        if engram_engine::WeightFormat::parse(&self.model.weights).is_none() {
            return bad("model.weights", "one of quantized, int16, int8, f32");
        }
        if engram_engine::DeviceWeights::parse(&self.model.device_weights).is_none() {
            return bad("model.device_weights", "bf16 or f32");
        }
        if self.model.threads > 1024 {
            return bad("model.threads", "must be 0 (one per CPU) to 1024");
        }
        if self.limits.requests_per_sec > 0 && self.limits.burst == 0 {
            return bad(
                "limits.burst",
                "must be at least 1 when requests_per_sec is set",
            );
        }
        if self.model.hot_mib == Some(0) {
            return bad("model.hot_mib", "must be positive");
        }
        if self.model.hot_mib.is_none() && self.model.hot_tokens == 0 {
            return bad(
                "model.hot_tokens",
                "must be positive (or set model.hot_mib)",
            );
        }
        if self.memory.recall_k > 256 {
            return bad("memory.recall_k", "must be at most 256");
        }
        if self.memory.hops > 8 {
            return bad("memory.hops", "must be at most 8");
        }
        if self.memory.reservation_ttl_secs == 0 {
            return bad("memory.reservation_ttl_secs", "must be positive");
        }
        if self.shadow.interval_ms < 10 {
            return bad("shadow.interval_ms", "must be at least 10");
        }
        for peer in self.shadow.peer_list() {
            if peer.starts_with("s3://")
                && let Err(e) = engram_shadow::S3Settings::parse(&peer)
            {
                return bad("shadow.peers", &e.to_string());
            }
            if peer.contains("://") && !peer.starts_with("s3://") {
                return bad("shadow.peers", "each peer is an s3:// URL or a directory");
            }
        }
        if !self.shadow.url.is_empty()
            && let Err(e) = engram_shadow::S3Settings::parse(&self.shadow.url)
        {
            return Err(ConfigError::Invalid {
                key: "shadow.url",
                reason: e,
            });
        }
        if self.tiers.interval_ms < 10 {
            return bad("tiers.interval_ms", "must be at least 10");
        }
        if let Err(engram_engine::EngineError::InvalidConfig { field, reason }) =
            self.eviction.validate()
        {
            return bad(field, &reason);
        }
        if let Err(e) = self.tiers.policy.validate() {
            return Err(ConfigError::Invalid {
                key: "tiers",
                reason: e.to_string(),
            });
        }
        Ok(())
    }
}

/// An environment value as the type of the field it sets (`current`: the field's value so far;
/// `None` for a key no section has, which the typed load then refuses by name).
fn typed_env_value(
    key: &str,
    current: Option<&toml::Value>,
    raw: &str,
) -> Result<toml::Value, ConfigError> {
    let bad = |what: &str| ConfigError::Parse(format!("{key}: expected {what}, got `{raw}`"));
    Ok(match current {
        Some(toml::Value::Integer(_)) => {
            toml::Value::Integer(raw.trim().parse::<i64>().map_err(|_| bad("an integer"))?)
        }
        Some(toml::Value::Float(_)) => {
            toml::Value::Float(raw.trim().parse::<f64>().map_err(|_| bad("a number"))?)
        }
        Some(toml::Value::Boolean(_)) => {
            toml::Value::Boolean(match raw.trim().to_ascii_lowercase().as_str() {
                "true" | "1" | "yes" | "on" => true,
                "false" | "0" | "no" | "off" => false,
                _ => return Err(bad("true or false")),
            })
        }
        _ => toml::Value::String(raw.to_string()),
    })
}

/// An optional count, from a number (a file) or a string of digits (an environment variable:
/// an unset field has no type to parse the variable by).
fn optional_u64<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        Number(u64),
        Text(String),
    }
    match Option::<Raw>::deserialize(d)? {
        None => Ok(None),
        Some(Raw::Number(n)) => Ok(Some(n)),
        Some(Raw::Text(t)) => t.trim().parse::<u64>().map(Some).map_err(|_| {
            serde::de::Error::custom(format!("expected a non-negative integer, got `{t}`"))
        }),
    }
}

fn merge(base: &mut toml::Value, patch: toml::Value) {
    match (base, patch) {
        (toml::Value::Table(b), toml::Value::Table(p)) => {
            for (k, v) in p {
                match b.get_mut(&k) {
                    Some(existing) => merge(existing, v),
                    None => {
                        b.insert(k, v);
                    }
                }
            }
        }
        (b, p) => *b = p,
    }
}

#[cfg(test)]
mod tests;
