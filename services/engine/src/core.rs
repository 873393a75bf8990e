//! The synchronous engine: one model, one block store, the prefix cache and the running
//! sequences. The scheduler drives it from its thread; the evaluation harness and the benches
//! drive it directly.
//!
//! Life of a sequence:
//! 1. [`EngineCore::start`] hashes the prompt's full blocks (all but the last token, which must be
//!    computed to get logits), walks the prefix cache to the first miss, takes a reference on
//!    every hit, and warms the cold ones with one bulk copy;
//! 2. [`EngineCore::prefill_chunk`] computes the rest in chunks; blocks are allocated as needed
//!    (evicting by semantic priority, never a block a running sequence attends) and tagged with
//!    the prompt segment that fills most of them; each block that becomes full is registered in the
//!    cache (which holds its own reference) and, if its layer is stable, pinned under the soft cap;
//! 3. [`EngineCore::decode`] appends one token per sequence for a whole batch in one forward pass;
//!    generated blocks are tagged `AssistantTurn`; they are cached only with
//!    [`EngineConfig::cache_generated`] (see there why it is off by default);
//! 4. [`EngineCore::finish`] drops the sequence's references; blocks the cache does not hold are
//!    freed at once, cached ones stay until eviction (hot → cold → dropped from the cache).
//!
//! Invariants: every block of a running sequence is hot; a cached block's hash names exactly
//! the tokens (and the model, KV format and tenant) it holds; a block is freed only when no
//! sequence and no cache entry owns it.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

use candle_core::Tensor;
use engram_kvcore::{
    BlockId, BlockStore, BlockTags, CodecKind, DEFAULT_ROTATION_SEED, HotTierKind, KvShape,
    LayerCodecs, PinPolicy, PrefixPinManager, PriorityTable, SessionId, SourceLayer, StoreConfig,
    TenantId, Tier, TokenRange,
};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::{EngineError, EngineResult};

mod admit;
mod cache;
mod device;
mod evict;
mod fault;
mod forward;
mod relocate;
mod reserve;
mod shadow;
mod tiers;
use crate::prefix::{BlockHash, PrefixCache, ReadHistory};
pub use cache::{DownTier, EvictReport, ForgetReport};
pub use device::EngineDevice;
use engram_model::{DeviceWeights, KvTap, Llama, TextTokenizer, WeightFormat};
pub use evict::{EvictionMode, EvictionPolicy};
pub use fault::{EngineFault, FaultKind};
pub use relocate::{MAX_SEGMENTS, RelocationPolicy};
pub use reserve::{
    ReservationCounters, ReservationId, ReservationInfo, ReservationState, ReserveRequest,
};
pub use shadow::{
    CHAINS_PER_TENANT, ChainKey, CollectedBytes, Hex32, MAX_CHAINS, RestoreChain, RestoreReport,
    ShadowBlock, ShadowChain,
};
pub use tiers::{CycleReport, TierCosts, TierObservation, TierPolicy};

/// A [`KvTap`] an [`EngineConfig`] carries; two configs carry the same tap when they share it.
#[derive(Debug, Clone)]
pub struct Tap(pub std::sync::Arc<dyn KvTap>);

impl PartialEq for Tap {
    fn eq(&self, other: &Self) -> bool {
        std::sync::Arc::ptr_eq(&self.0, &other.0)
    }
}

/// Engine options.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct EngineConfig {
    /// Codec of the keys of every layer, and of the values unless `value_codec` says otherwise
    /// (default TurboQuant-4).
    pub codec: CodecKind,
    /// Codec of the values of every layer, when it differs from `codec`. The default sets keys
    /// at TurboQuant-6 with one outlier per row stored apart and values at TurboQuant-5
    /// ([`crate::StreamCodecs::CPU_DEFAULT`]): with another `codec`, set `None` for one codec in
    /// both streams (an outlier split is a key codec: its values need their own).
    pub value_codec: Option<CodecKind>,
    /// Per-layer and per-stream override of `codec` and `value_codec`.
    pub layer_codecs: Option<LayerCodecs>,
    /// A calibrated profile (`engram calibrate kv`) whose codecs override all of the above; it
    /// must have been calibrated for the model loaded.
    pub kv_profile: Option<std::path::PathBuf>,
    /// Without `kv_profile`: when the loaded checkpoint has a profile built into the engine
    /// (`KvProfile::built_in`: checkpoints whose device default misses the fidelity budget),
    /// its codecs replace `codec`, `value_codec` and `layer_codecs`. Off here; the service's
    /// configuration turns it on when `model.codec` and `model.kv_profile` are unset on the CPU.
    pub built_in_profile: bool,
    /// Tokens per block.
    pub block_size: usize,
    /// Hot-tier budget in bytes (when `hot_tokens` is 0).
    pub hot_bytes: u64,
    /// Cold-tier budget in bytes (when `cold_tokens` is 0).
    pub cold_bytes: u64,
    /// Hot-tier budget in tokens of this model's KV at its codecs (0: `hot_bytes`): the same
    /// number of tokens whatever the model's KV bytes per token.
    pub hot_tokens: u64,
    /// Cold-tier budget in tokens of KV (0: `cold_bytes`).
    pub cold_tokens: u64,
    /// TurboQuant rotation seed (part of the storage format).
    pub rotation_seed: u64,
    /// Prefill chunk in tokens.
    pub prefill_chunk: usize,
    /// Tokens a scheduler step computes at most while sequences decode: one per decoding
    /// sequence, and a prompt chunk of the rest in the same forward pass (at least one token),
    /// so a prefill arriving bounds the running streams' time per token instead of stalling
    /// it. A prefill with nothing decoding takes `prefill_chunk`.
    pub step_tokens: usize,
    /// Threads the CPU kernels split work over (0: `ENGRAM_THREADS` where set, else one per CPU).
    pub threads: usize,
    /// Sequences decoded together at most.
    pub max_running: usize,
    /// Requests waiting at most; beyond it submission answers `Overloaded`.
    pub queue_capacity: usize,
    /// Which layers are pinned, and the soft cap.
    pub pin_policy: PinPolicy,
    /// How GGUF weights are held (kept in their blocks by default; f32 for comparison).
    pub weights: WeightFormat,
    /// Subtract each head's calibrated mean key before storing (exact for attention, lowers
    /// quantization error; part of the KV format).
    pub key_centering: KeyCentering,
    /// A tap on new K/V rows for the fidelity harness (engram-lab's probes; needs `codec:
    /// F32`); never set when serving, and not part of a config file.
    #[serde(skip)]
    pub probe: Option<Tap>,
    /// Where the model and the KV hot tier live.
    pub device: EngineDevice,
    /// How a CUDA device holds the projections (bf16 by default; f32 for the CPU's numerics).
    pub device_weights: DeviceWeights,
    /// Also cache blocks that hold generated tokens (the next turn then reuses the reply's KV
    /// as decode computed it). Off by default: decode and prefill round differently, so a reply
    /// reused from decode and the same reply recomputed by prefill (after an eviction, a crash,
    /// on another node) could steer greedy decoding apart. With it off, every cached block was
    /// computed by prefill and a turn's answer does not depend on what the cache held.
    pub cache_generated: bool,
    /// Down-tiering (off by default): when the cold tier is full, cold blocks are re-encoded
    /// into a pool of narrower codecs instead of being dropped. Needs `kv_profile`, whose
    /// measured sensitivity picks the narrower codecs.
    pub down_tier: Option<DownTier>,
    /// Fault injection, for the supervision tests only (never set in production; never
    /// serialized).
    #[serde(skip)]
    pub fault: Option<EngineFault>,
    /// Session chain records (what the shadow writes) each tenant keeps at most; over it the
    /// tenant's own oldest record goes, never another tenant's.
    #[serde(default = "default_chains_per_tenant")]
    pub chains_per_tenant: usize,
    /// How idle hot blocks are ranked when a turn needs room, and how the tier bridge weighs
    /// attention ([`EvictionPolicy`]; attention-aware by default).
    #[serde(default)]
    pub eviction: EvictionPolicy,
    /// Relocated segment reuse (off by default; CPU engine only): a prompt segment cached at
    /// another position is copied there and read with a query-side RoPE shift instead of being
    /// recomputed (see the `relocate` module docs for what it costs in fidelity).
    #[serde(default)]
    pub relocation: Option<RelocationPolicy>,
}

fn default_chains_per_tenant() -> usize {
    shadow::CHAINS_PER_TENANT
}

impl EngineConfig {
    /// The hot and cold tiers' budgets in bytes for blocks of `block_bytes` holding
    /// `block_size` tokens: a budget in tokens, where one is set, or the one in bytes.
    pub fn tier_bytes(&self, block_bytes: u64, block_size: usize) -> (u64, u64) {
        let of = |tokens: u64, bytes: u64| match tokens {
            0 => bytes,
            t => t
                .div_ceil(block_size.max(1) as u64)
                .saturating_mul(block_bytes),
        };
        (
            of(self.hot_tokens, self.hot_bytes),
            of(self.cold_tokens, self.cold_bytes),
        )
    }

    /// The codec of each layer and stream these options give a cache of `shape`.
    pub fn codecs(&self, shape: &KvShape) -> EngineResult<LayerCodecs> {
        match &self.layer_codecs {
            Some(c) => Ok(LayerCodecs::per_stream(
                shape,
                c.keys().to_vec(),
                c.values().to_vec(),
            )?),
            None => Ok(LayerCodecs::streams(
                shape,
                self.codec,
                self.value_codec.unwrap_or(self.codec),
            )),
        }
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            codec: crate::StreamCodecs::CPU_DEFAULT.key,
            value_codec: Some(crate::StreamCodecs::CPU_DEFAULT.value),
            layer_codecs: None,
            kv_profile: None,
            built_in_profile: false,
            block_size: engram_kvcore::DEFAULT_BLOCK_SIZE,
            hot_bytes: 1 << 30,
            cold_bytes: 2 << 30,
            hot_tokens: 0,
            cold_tokens: 0,
            rotation_seed: DEFAULT_ROTATION_SEED,
            prefill_chunk: 256,
            step_tokens: 32,
            threads: 0,
            max_running: 16,
            queue_capacity: 64,
            pin_policy: PinPolicy::default(),
            weights: WeightFormat::default(),
            key_centering: KeyCentering::Scaled,
            probe: None,
            device: EngineDevice::Cpu,
            device_weights: DeviceWeights::default(),
            cache_generated: false,
            down_tier: None,
            fault: None,
            chains_per_tenant: shadow::CHAINS_PER_TENANT,
            eviction: EvictionPolicy::default(),
            relocation: None,
        }
    }
}

/// Whether keys are centered before they are stored (see [`Llama::key_means`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KeyCentering {
    /// Keys are stored as computed.
    Off,
    /// Each (layer, KV head) subtracts its mean key over the calibration text.
    Calibrated,
    /// As `Calibrated`, and each key channel is divided by its calibrated scale, the queries
    /// multiplied by it ([`Llama::key_scales`]; CPU only: a CUDA engine centers only). The
    /// default: at `tq6o1/tq5` it lowers KL against exact KV from 0.0147 to 0.0064 nats on
    /// Qwen2.5-Coder-0.5B and from 0.0149 to 0.0086 on Gemma-3-270M (`docs/kv-fidelity.md`).
    #[default]
    Scaled,
}

impl KeyCentering {
    /// `calibrated` or `off`.
    pub fn parse(s: &str) -> EngineResult<Self> {
        match s.trim() {
            "calibrated" => Ok(Self::Calibrated),
            "scaled" => Ok(Self::Scaled),
            "off" => Ok(Self::Off),
            other => Err(EngineError::InvalidConfig {
                field: "key_centering",
                reason: format!("unknown key centering `{other}` (calibrated, scaled, off)"),
            }),
        }
    }
}

/// A running sequence's handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SeqId(pub u64);

/// Whether a sequence may reuse and publish cached prefix blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PrefixReuse {
    /// Reuse cached blocks and register new ones (the default).
    #[default]
    Enabled,
    /// Compute everything; cache nothing (evaluation).
    Disabled,
}

/// A tagged run of prompt tokens (one prompt layer).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PromptSegment {
    /// The tokens.
    pub tokens: Vec<u32>,
    /// Which prompt layer they come from.
    pub source: SourceLayer,
    /// Importance in 0..=1.
    pub importance: f32,
}

/// What to run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SequenceSpec {
    /// The prompt, in order.
    pub segments: Vec<PromptSegment>,
    /// Owner; also the prefix cache's salt.
    pub tenant: TenantId,
    /// Session, if any.
    pub session: Option<SessionId>,
    /// Prefix reuse.
    pub reuse: PrefixReuse,
    /// Hot blocks the tenant's running sequences may hold together (checked at admission
    /// against the prompt; decode may exceed it by the generated blocks).
    #[serde(default)]
    pub hot_block_quota: Option<usize>,
    /// Names the stable prefix this sequence pins (e.g. a hash of tenant and prefix text), so
    /// that [`EngineCore::unpin_prefix`] can release exactly those pins when the prefix changes.
    #[serde(default)]
    pub pin_key: Option<[u8; 32]>,
    /// Cold-tier blocks the tenant's cached blocks may occupy: a spill past it drops the
    /// tenant's own lowest-priority cold blocks (never another tenant's).
    #[serde(default)]
    pub cold_block_quota: Option<usize>,
    /// Leading prompt tokens an operator marked public. The full blocks inside them are hashed
    /// with [`PUBLIC_TENANT`]'s salt instead of the tenant's and owned by [`PUBLIC_TENANT`], so
    /// every tenant whose prompt starts with the same public tokens reuses them.
    #[serde(default)]
    pub public_tokens: usize,
    /// The key public blocks are pinned under (instead of `pin_key`), so that one tenant's
    /// edit never unpins blocks other tenants share.
    #[serde(default)]
    pub public_pin_key: Option<[u8; 32]>,
}

/// The CPU engine's numerics, hashed into the KV fingerprint: K/V computed by other numerics (an
/// older engine's shadow, say) is recomputed once rather than mixed with this engine's. Bump it
/// whenever a kernel change can move stored KV.
pub const NUMERICS: &str = "cpu-numerics/7: simd decode attention with tile transpose-reduce \
     scores (one kernel for TQ4 and one for every other codec pair, on AVX-512 and on AVX2; on \
     AVX-512 prefill reads the codes of every codec pair), key-split merge, causal prefill over \
     codes in register blocks of heads or over the prefix decoded once in row-independent key \
     tiles (prompt rows never take the decode kernel), weight products by row (the weight \
     format's own id is hashed beside)";

/// The owner and hash salt of blocks an operator marked public (tenants' salts are never 0).
pub const PUBLIC_TENANT: TenantId = TenantId(0);

impl SequenceSpec {
    /// One untagged segment (a user turn) for `tenant`.
    pub fn plain(tokens: Vec<u32>, tenant: TenantId) -> Self {
        Self {
            segments: vec![PromptSegment {
                tokens,
                source: SourceLayer::UserTurn,
                importance: 0.5,
            }],
            tenant,
            session: None,
            reuse: PrefixReuse::Enabled,
            hot_block_quota: None,
            pin_key: None,
            cold_block_quota: None,
            public_tokens: 0,
            public_pin_key: None,
        }
    }
}

/// What [`EngineCore::start`] found in the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Admission {
    /// Prompt length.
    pub prompt_tokens: usize,
    /// Leading tokens whose blocks were reused.
    pub cached_tokens: usize,
    /// Of those blocks, how many were found hot (the rest were warmed from the cold tier).
    #[serde(default)]
    pub hot_blocks: usize,
    /// Of those blocks, how many were warmed from the cold tier.
    pub warmed_blocks: usize,
    /// Full prompt blocks the cache did not hold, computed by the prefill (as
    /// [`CacheCounters::misses`] counts them).
    #[serde(default)]
    pub computed_blocks: usize,
    /// Of those blocks, how many a reservation held (see [`EngineCore::reserve`]).
    #[serde(default)]
    pub reserved_blocks: usize,
    /// Prompt tokens filled from a segment cached at another position
    /// ([`EngineConfig::relocation`]) and tokens of blocks cached after such a run, not
    /// computed.
    #[serde(default)]
    pub relocated_tokens: usize,
}

/// Running totals of cache activity, for metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CacheCounters {
    /// Prompt blocks found hot in the prefix cache.
    pub hot_hits: u64,
    /// Prompt blocks found cold and warmed.
    pub cold_hits: u64,
    /// Full prompt blocks that had to be computed.
    pub misses: u64,
    /// Blocks spilled to the cold tier, by source layer.
    pub spilled: BTreeMap<SourceLayer, u64>,
    /// Blocks whose bytes were dropped (hot or cold), by source layer.
    pub dropped: BTreeMap<SourceLayer, u64>,
    /// Of the dropped blocks, those dropped because their tenant was over its cold quota.
    #[serde(default)]
    pub cold_quota_dropped: u64,
    /// Cold blocks re-encoded into the reduced pool instead of being dropped (down-tiering).
    #[serde(default)]
    pub down_tiered: u64,
    /// Down-tiered blocks a turn warmed back (re-encoded to the layer's codecs).
    #[serde(default)]
    pub down_tier_hits: u64,
    /// Hot blocks spilled or dropped at admission because the hot tier was full (the tier
    /// bridge left too little room): the bridge's signal to demote sooner.
    #[serde(default)]
    pub admission_evictions: u64,
    /// Of those, spills onto a copy the bridge staged (`TierPolicy::stage`): nothing copied on
    /// the turn's path, so not the bridge's signal to demote sooner.
    #[serde(default)]
    pub admission_staged: u64,
    /// Prompts that reused a segment cached at another position ([`EngineConfig::relocation`]).
    #[serde(default)]
    pub relocated_runs: u64,
    /// Prompt blocks those runs filled by copying codes instead of computing them.
    #[serde(default)]
    pub relocated_blocks: u64,
}

/// What the prefix cache holds for a prompt (see [`EngineCore::lookup`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefixLookup {
    /// Leading blocks cached in the hot tier.
    pub hot: usize,
    /// Leading blocks cached in the cold tier (warmed on use).
    pub cold: usize,
    /// Blocks the prompt spans.
    pub blocks: usize,
}

/// Occupancy of the tiers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Occupancy {
    /// Hot-tier capacity in blocks.
    pub hot_capacity: usize,
    /// Hot blocks in use.
    pub hot_used: usize,
    /// Cold-tier capacity in blocks.
    pub cold_capacity: usize,
    /// Cold blocks in use.
    pub cold_used: usize,
    /// Blocks in the prefix cache.
    pub cached_blocks: usize,
    /// Bytes of one block (all layers, K and V).
    pub block_bytes: usize,
    /// Slots of the pool of down-tiered blocks (0 when down-tiering is off).
    #[serde(default)]
    pub reduced_capacity: usize,
    /// Down-tiered blocks held.
    #[serde(default)]
    pub reduced_used: usize,
    /// Running sequences.
    pub running: usize,
}

/// What one [`EngineCore::step`] computed.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepOutput {
    /// The next-token logits of each decoded sequence, in the order asked.
    pub decoded: Vec<Vec<f32>>,
    /// The prompt chunk computed, if one was asked.
    pub prefilled: Option<PrefillStep>,
}

/// The prompt chunk of an [`EngineCore::step`].
#[derive(Debug, Clone, PartialEq)]
pub struct PrefillStep {
    /// Its sequence.
    pub id: SeqId,
    /// Prompt tokens computed.
    pub tokens: usize,
    /// Prompt tokens left after it.
    pub remaining: usize,
    /// The last prompt position's logits, once the prompt is done.
    pub logits: Option<Vec<f32>>,
}

/// What one prefill chunk did.
#[derive(Debug, Clone)]
pub struct ChunkOutput {
    /// Logits of the chunk's rows (all, or the last).
    pub logits: Tensor,
    /// Tokens the chunk computed.
    pub tokens: usize,
    /// Prompt tokens still to compute.
    pub remaining: usize,
}

#[derive(Debug, Clone)]
struct Sequence {
    tokens: Vec<u32>,
    /// (end, source, importance) of each prompt segment.
    segments: Vec<(usize, SourceLayer, f32)>,
    prompt_len: usize,
    blocks: Vec<BlockId>,
    /// Tokens whose K/V are in `blocks`.
    computed: usize,
    /// Hashes of the leading full blocks.
    hashes: Vec<BlockHash>,
    tenant: TenantId,
    session: Option<SessionId>,
    reuse: PrefixReuse,
    pin_key: Option<[u8; 32]>,
    /// Leading full blocks that are public (hashed with the public salt).
    public_blocks: usize,
    public_pin_key: Option<[u8; 32]>,
    /// Its session was forgotten while it ran ([`EngineCore::forget`]): it registers no more
    /// blocks and records no chain, so nothing of the session outlives it.
    forgotten: bool,
    /// A run filled from a segment cached elsewhere ([`EngineConfig::relocation`]).
    relocation: Option<relocate::SeqRelocation>,
    /// Its segments are in the content index.
    indexed: bool,
}

impl Sequence {
    /// Prompt tokens the next prefill chunk may compute: up to a relocated run it skips.
    fn prefill_room(&self) -> usize {
        match &self.relocation {
            Some(r) if self.computed < r.run.start => r.run.start - self.computed,
            _ => self.prompt_len.saturating_sub(self.computed),
        }
    }

    /// Leading blocks whose hashes are exact (the chain before a relocated run).
    fn exact_blocks(&self, bs: usize) -> usize {
        self.relocation
            .as_ref()
            .map_or(self.hashes.len(), |r| r.run.start / bs)
            .min(self.hashes.len())
    }

    /// The relocated runs a forward pass over this sequence reads (a run is read once it is
    /// filled).
    fn relocated_runs(&self) -> &[engram_kvcore::Relocated] {
        match &self.relocation {
            Some(r) if self.computed >= r.run.end => std::slice::from_ref(&r.run),
            _ => &[],
        }
    }
}

/// The hash salt of block `b` of a prompt whose first `public_blocks` blocks are public.
fn block_salt(tenant: TenantId, public_blocks: usize, b: usize) -> u64 {
    if b < public_blocks {
        PUBLIC_TENANT.0
    } else {
        tenant.0
    }
}

/// The model on `device` and a block store whose hot tier is on the same device (what
/// [`EngineCore::new`] opens; the device checks open it alone).
pub fn open_on(
    device: EngineDevice,
    held: DeviceWeights,
    model: Llama,
    store: StoreConfig,
) -> EngineResult<(Llama, BlockStore)> {
    match device {
        EngineDevice::Cpu if model.device().is_cpu() => Ok((model, BlockStore::new(store)?)),
        EngineDevice::Cpu => Ok((
            model.to_device(&candle_core::Device::Cpu)?,
            BlockStore::new(store)?,
        )),
        EngineDevice::Cuda { ordinal } => on_cuda(model, held, store, ordinal),
    }
}

/// The model on CUDA device `ordinal` (unless it is on a device already) and a store whose hot
/// tier shares the model's stream.
#[cfg(feature = "cuda")]
fn on_cuda(
    model: Llama,
    held: DeviceWeights,
    store: StoreConfig,
    ordinal: usize,
) -> EngineResult<(Llama, BlockStore)> {
    let model = match model.device() {
        candle_core::Device::Cuda(_) => model,
        _ => model.to_device_as(&candle_core::Device::new_cuda(ordinal)?, held)?,
    };
    let cuda = model.device().as_cuda_device()?;
    let store = BlockStore::on_cuda_stream(store, cuda.cuda_stream())?;
    // The hot tier's copy stream puts cudarc in its multi-stream mode, where every kernel
    // argument costs an event wait and an event record on the host and every allocation two new
    // events: ~10 launches a layer made that a large part of a batch-1 step. Nothing here needs
    // it: the model's work is on one stream, and the tier settles the context before each copy
    // (kvcore's `store::cuda` docs). `ENGRAM_CUDA_EVENTS=tracked` keeps cudarc's tracking (a
    // diagnostic switch, to measure the difference).
    if !std::env::var("ENGRAM_CUDA_EVENTS").is_ok_and(|v| v == "tracked") {
        // The model queues all its work on the store's stream; the attention mass copy waits on
        // its own event (`PinnedF32`).
        store.untrack_device_events();
    }
    Ok((model, store))
}

#[cfg(not(feature = "cuda"))]
fn on_cuda(
    _model: Llama,
    _held: DeviceWeights,
    _store: StoreConfig,
    _ordinal: usize,
) -> EngineResult<(Llama, BlockStore)> {
    Err(EngineError::InvalidConfig {
        field: "device",
        reason: "this build has no CUDA support (build with feature `cuda`)".into(),
    })
}

/// The synchronous engine (see the module docs).
#[derive(Debug)]
pub struct EngineCore {
    model: Llama,
    tokenizer: TextTokenizer,
    store: BlockStore,
    cache: PrefixCache,
    /// Read counts of dropped blocks by hash, carried to their recomputed successors.
    history: ReadHistory,
    /// The sampled step at which the counts were last halved (`eviction.use_half_life`).
    aged_at: u64,
    pins: PrefixPinManager,
    config: EngineConfig,
    fingerprint: [u8; 32],
    seqs: BTreeMap<SeqId, Sequence>,
    next_seq: u64,
    key_means: Option<Vec<f32>>,
    key_scales: Option<Vec<f32>>,
    counters: CacheCounters,
    pins_by_key: HashMap<[u8; 32], Vec<BlockId>>,
    /// Per public pin key, the tenants' prefix keys that use it: its blocks stay pinned while
    /// one is left (one tenant's edit never unpins what another still uses).
    public_users: HashMap<[u8; 32], HashSet<[u8; 32]>>,
    cold_quotas: HashMap<TenantId, usize>,
    reservations: reserve::Reservations,
    chains: shadow::Chains,
    bridge: tiers::BridgeState,
    /// Segments by content ([`EngineConfig::relocation`]).
    index: relocate::SegmentIndex,
    /// Source blocks of a copy under way: room-making never evicts them.
    relocating: Vec<BlockId>,
}

impl EngineCore {
    /// Loads the model at `path` (GGUF file or safetensors directory) and its tokenizer.
    pub fn load(path: &Path, config: EngineConfig) -> EngineResult<Self> {
        let model = Llama::load_as(path, config.weights)?;
        let tokenizer = TextTokenizer::for_model(path)?;
        Self::new(model, tokenizer, config)
    }

    /// An engine over a loaded model (cheap to repeat: weights are shared).
    pub fn new(model: Llama, tokenizer: TextTokenizer, config: EngineConfig) -> EngineResult<Self> {
        let shape = model.kv_shape(config.block_size)?;
        let profile = match &config.kv_profile {
            Some(path) => Some(crate::profile::KvProfile::load(path, &model)?),
            None if config.built_in_profile => crate::profile::KvProfile::built_in(&model)?,
            None => None,
        };
        let codecs = match &profile {
            Some(p) => p.codecs.clone(),
            None => config.codecs(&shape)?,
        };
        let reduced = cache::reduced_pool(&config, profile.as_ref(), &codecs, &shape)?;
        let block_bytes = shape.block_size * codecs.token_bytes(&shape);
        let per_context = model.config().context_length.div_ceil(shape.block_size);
        let (hot_bytes, cold_bytes) = config.tier_bytes(block_bytes as u64, shape.block_size);
        let hot = hot_bytes / block_bytes as u64;
        if hot < per_context as u64 {
            return Err(EngineError::InvalidConfig {
                field: if config.hot_tokens > 0 {
                    "hot_tokens"
                } else {
                    "hot_bytes"
                },
                reason: format!(
                    "{hot_bytes} bytes hold {hot} blocks of {block_bytes} bytes; one full context needs {per_context}"
                ),
            });
        }
        for (field, v) in [
            ("prefill_chunk", config.prefill_chunk),
            ("step_tokens", config.step_tokens),
            ("max_running", config.max_running),
            ("queue_capacity", config.queue_capacity),
        ] {
            if v == 0 {
                return Err(EngineError::InvalidConfig {
                    field,
                    reason: "must be at least 1".into(),
                });
            }
        }
        if config.probe.is_some() && codecs.single() != Some(CodecKind::F32) {
            return Err(EngineError::InvalidConfig {
                field: "probe",
                reason: "a probe stores its round-tripped rows exactly: use codec f32".into(),
            });
        }
        let clamp = |v: u64| u32::try_from(v).unwrap_or(u32::MAX);
        config.eviction.validate()?;
        if config.relocation.is_some() && config.device != EngineDevice::Cpu {
            return Err(EngineError::InvalidConfig {
                field: "relocation",
                reason: "relocated segment reuse runs on the CPU engine only".into(),
            });
        }
        if config
            .relocation
            .is_some_and(|r| r.min_tokens < config.block_size)
        {
            return Err(EngineError::InvalidConfig {
                field: "relocation.min_tokens",
                reason: format!("must be at least one block ({} tokens)", config.block_size),
            });
        }
        let pins = PrefixPinManager::new(config.pin_policy.clone())?;
        let key_means = match config.key_centering {
            KeyCentering::Off => None,
            KeyCentering::Calibrated | KeyCentering::Scaled => {
                Some(model.key_means(&tokenizer)?.to_vec())
            }
        };
        let key_scales = match (config.key_centering, config.device) {
            (KeyCentering::Scaled, EngineDevice::Cpu) => {
                Some(model.key_scales(&tokenizer)?.to_vec())
            }
            _ => None,
        };
        let store_config = StoreConfig {
            shape,
            codecs: codecs.clone(),
            hot_kind: HotTierKind::Host,
            hot_blocks: clamp(hot),
            cold_blocks: clamp(cold_bytes / block_bytes as u64),
            rotation_seed: config.rotation_seed,
            priorities: PriorityTable::default(),
        };
        let threads = match config.threads {
            0 => engram_kvcore::team::default_threads(),
            n => n,
        };
        let model = model.with_threads(threads);
        let (model, store) = open_on(config.device, config.device_weights, model, store_config)?;
        let mut store = match reduced {
            Some((codecs, blocks)) => store.with_reduced_pool(codecs, clamp(blocks))?,
            None => store,
        };
        store.set_move_window(tiers::FLIP_WINDOW_CYCLES);
        let mut h = Sha256::new();
        if let Some(m) = &key_means {
            m.iter().for_each(|x| h.update(x.to_le_bytes()));
        }
        if let Some(s) = &key_scales {
            h.update(b"key-scales");
            s.iter().for_each(|x| h.update(x.to_le_bytes()));
        }
        h.update(model.fingerprint());
        h.update(engram_kvcore::LAYOUT.as_bytes());
        h.update(NUMERICS.as_bytes());
        h.update(model.weight_format().numerics().as_bytes());
        if let Some(n) = model.device_weight_numerics() {
            h.update(n.as_bytes());
        }
        h.update(serde_json::to_vec(&codecs).unwrap_or_default());
        h.update(config.rotation_seed.to_le_bytes());
        h.update((shape.block_size as u64).to_le_bytes());
        let chains = shadow::Chains::new(config.chains_per_tenant, MAX_CHAINS);
        // Twice the blocks both tiers hold, at least 4,096 (~64 bytes an entry); none with
        // priority-only eviction (the rule from before: it carries nothing).
        let history_capacity = if config.eviction.mode == EvictionMode::Priority {
            0
        } else {
            usize::try_from(
                hot.saturating_add(cold_bytes / block_bytes as u64)
                    .saturating_mul(2),
            )
            .unwrap_or(usize::MAX)
            .max(4096)
        };
        Ok(Self {
            fingerprint: h.finalize().into(),
            model,
            tokenizer,
            store,
            cache: PrefixCache::default(),
            history: ReadHistory::new(history_capacity),
            aged_at: 0,
            pins,
            config,
            seqs: BTreeMap::new(),
            next_seq: 1,
            key_means,
            key_scales,
            counters: CacheCounters::default(),
            pins_by_key: HashMap::new(),
            public_users: HashMap::new(),
            cold_quotas: HashMap::new(),
            reservations: reserve::Reservations::default(),
            chains,
            bridge: tiers::BridgeState::default(),
            index: relocate::SegmentIndex::default(),
            relocating: Vec::new(),
        })
    }

    /// The model.
    pub fn model(&self) -> &Llama {
        &self.model
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &TextTokenizer {
        &self.tokenizer
    }

    /// The options.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// The block store (metadata, tiers).
    pub fn store(&self) -> &BlockStore {
        &self.store
    }

    /// The prefix cache.
    pub fn cache(&self) -> &PrefixCache {
        &self.cache
    }

    /// Hash of the model and KV format: the prefix cache's namespace.
    pub fn fingerprint(&self) -> [u8; 32] {
        self.fingerprint
    }

    /// Cache activity so far.
    pub fn counters(&self) -> &CacheCounters {
        &self.counters
    }

    /// The codec of each layer and stream the cache stores.
    pub fn codecs(&self) -> &LayerCodecs {
        self.store.codec_kinds()
    }

    /// Tier occupancy.
    pub fn occupancy(&self) -> Occupancy {
        let cap = |t| self.store.capacity(t);
        Occupancy {
            hot_capacity: cap(Tier::Hot),
            hot_used: cap(Tier::Hot) - self.store.free_blocks(Tier::Hot),
            cold_capacity: cap(Tier::Cold),
            cold_used: cap(Tier::Cold) - self.store.free_blocks(Tier::Cold),
            cached_blocks: self.cache.len(),
            block_bytes: self.store.block_bytes(),
            reduced_capacity: self.store.reduced_capacity(),
            reduced_used: self.store.reduced_capacity() - self.store.free_reduced(),
            running: self.seqs.len(),
        }
    }

    /// Running sequences.
    pub fn running(&self) -> usize {
        self.seqs.len()
    }

    /// A sequence's tokens so far (prompt and generated).
    pub fn tokens(&self, id: SeqId) -> Option<&[u32]> {
        self.seqs.get(&id).map(|s| s.tokens.as_slice())
    }

    /// A sequence's block table.
    pub fn blocks(&self, id: SeqId) -> Option<&[BlockId]> {
        self.seqs.get(&id).map(|s| s.blocks.as_slice())
    }

    /// Ends a sequence: drops its block references (cached blocks stay cached).
    pub fn finish(&mut self, id: SeqId) -> EngineResult<()> {
        if let Some(seq) = self.seqs.remove(&id) {
            if !seq.forgotten {
                self.record_chain(&seq);
            }
            self.store.release(&seq.blocks)?;
        }
        Ok(())
    }

    /// Ends a sequence without recording its chain (a reservation's background sequence).
    pub(crate) fn drop_sequence(&mut self, id: SeqId) -> EngineResult<()> {
        if let Some(seq) = self.seqs.remove(&id) {
            self.store.release(&seq.blocks)?;
        }
        Ok(())
    }

    fn seq(&self, id: SeqId) -> EngineResult<&Sequence> {
        self.seqs.get(&id).ok_or(EngineError::InvalidConfig {
            field: "sequence",
            reason: format!("no running sequence {}", id.0),
        })
    }
}

/// Tags of block `b`: the prompt segment covering most of its prompt positions (earlier wins
/// ties); a block past the prompt holds the assistant's turn.
fn block_tags(seq: &Sequence, b: usize, bs: usize) -> BlockTags {
    let (lo, hi) = (b * bs, (b + 1) * bs);
    let mut best = (0usize, SourceLayer::AssistantTurn, 0.5f32);
    let mut seg_start = 0;
    for &(end, source, importance) in &seq.segments {
        let overlap = end.min(hi).saturating_sub(seg_start.max(lo));
        if overlap > best.0 {
            best = (overlap, source, importance);
        }
        seg_start = end;
    }
    BlockTags {
        source: best.1,
        importance: best.2,
        tenant: if b < seq.public_blocks {
            PUBLIC_TENANT
        } else {
            seq.tenant
        },
        session: if b < seq.public_blocks {
            None
        } else {
            seq.session
        },
        tokens: TokenRange::new(lo as u32, hi as u32),
    }
}
