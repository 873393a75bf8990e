//! The engine thread: continuous batching over an [`EngineCore`].
//!
//! Callers [`Engine::submit`] a request and get a stream (a `flume` receiver, usable from
//! threads and from async code). Requests wait in a bounded channel; a full channel answers
//! [`EngineError::Overloaded`] at once, so a burst never becomes an unbounded backlog.
//!
//! Each turn of the loop:
//! 1. admits waiting requests while fewer than `max_running` sequences run (blocking only when
//!    nothing runs);
//! 2. runs **one prefill chunk** (`prefill_chunk` tokens) of the oldest sequence still in prefill;
//! 3. runs **one decode step for every decoding sequence at once**: one forward pass of the batch.
//!
//! A long prompt therefore delays running decodes by one chunk per turn, never by its whole
//! prefill. A caller that drops its receiver cancels its sequence at the next turn, and its
//! blocks are released. Cost per turn: one chunk forward plus one batched decode forward.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use engram_kvcore::{
    BlockFilter, BlockPart, KvShape, LayerCodecs, PinState, Precision, SourceLayer, TenantId, Tier,
};

use crate::core::{
    Admission, CacheCounters, ChainKey, CycleReport, EngineCore, EvictReport, FaultKind,
    ForgetReport, Occupancy, PrefixLookup, ReservationCounters, ReservationId, ReservationInfo,
    ReserveRequest, RestoreChain, RestoreReport, SeqId, SequenceSpec, ShadowChain, TierPolicy,
};
use crate::error::{EngineError, EngineResult};
use crate::sampling::{Constraint, Sampler, SamplingParams, TokenLogprob, logprobs_of};
use engram_model::ModelConfig;
use engram_model::{StreamDecoder, TextTokenizer};

mod step;
mod supervise;
use supervise::{injected_panic, panic_text};

/// A generation request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerateRequest {
    /// The prompt and its tags.
    pub spec: SequenceSpec,
    /// Sampling and stopping.
    pub sampling: SamplingParams,
}

/// A generation in the queue: the request, its constraint, where its events go.
struct Queued {
    req: GenerateRequest,
    constraint: Option<Box<dyn Constraint>>,
    tx: flume::Sender<StreamEvent>,
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// A stop token or stop sequence.
    Stop,
    /// `max_tokens`, or the model's context, was reached.
    Length,
}

/// Token accounting of a finished request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Of those, reused from the prefix cache.
    pub cached_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
}

/// What a request's stream carries.
#[derive(Debug)]
pub enum StreamEvent {
    /// Admitted; what the prefix cache provided.
    Started(Admission),
    /// New tokens and the text they complete (text that might begin a stop sequence is held back
    /// until it is known not to).
    Delta {
        /// Token ids since the last delta.
        tokens: Vec<u32>,
        /// Text released.
        text: String,
        /// The tokens' log probabilities, when the request asked ([`SamplingParams::logprobs`]).
        logprobs: Vec<TokenLogprob>,
    },
    /// The end.
    Done {
        /// Why.
        reason: FinishReason,
        /// The stop sequence that ended it, if one did.
        stop_sequence: Option<String>,
        /// Token counts.
        usage: Usage,
    },
    /// The request failed; nothing more follows.
    Failed(EngineError),
}

enum Command {
    Generate(Box<Queued>),
    Snapshot(flume::Sender<EngineSnapshot>),
    Blocks(BlockQuery, flume::Sender<BlockPage>),
    UnpinPrefix([u8; 32], flume::Sender<EngineResult<usize>>),
    Lookup(Box<SequenceSpec>, flume::Sender<PrefixLookup>),
    Reserve(
        Box<ReserveRequest>,
        flume::Sender<EngineResult<ReservationId>>,
    ),
    WarmReservation(ReservationId, flume::Sender<EngineResult<usize>>),
    Reservations(Option<TenantId>, flume::Sender<Vec<ReservationInfo>>),
    ShadowCollect(
        Box<CollectRequest>,
        flume::Sender<EngineResult<Vec<ShadowChain>>>,
    ),
    ShadowRestore(
        Box<RestoreChain>,
        flume::Sender<EngineResult<RestoreReport>>,
    ),
    TierCycle(
        Box<(TierPolicy, Vec<ChainKey>)>,
        flume::Sender<EngineResult<(CycleReport, TierPolicy)>>,
    ),
    Forget(
        (TenantId, u64, u64),
        flume::Sender<EngineResult<ForgetReport>>,
    ),
    /// Evicts a session; with `true`, archives it (its chain record goes too).
    Evict(ChainKey, bool, flume::Sender<EngineResult<EvictReport>>),
}

/// What the shadow asks the engine for (see [`EngineCore::shadow_collect`]).
#[derive(Debug, Clone, Default)]
pub struct CollectRequest {
    /// Generation of every chain the shadow has written.
    pub written: HashMap<ChainKey, u64>,
    /// Hashes of every block the shadow holds.
    pub known: HashSet<[u8; 32]>,
    /// Only this session (whatever its generation).
    pub only: Option<ChainKey>,
}

/// Occupancy and counters, for admin endpoints and metrics.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct EngineSnapshot {
    /// Tier occupancy.
    pub occupancy: Occupancy,
    /// Cache activity so far.
    pub counters: CacheCounters,
    /// Requests waiting.
    pub queued: usize,
    /// Reservation totals.
    #[serde(default)]
    pub reservations: ReservationCounters,
    /// Tier moves of every block so far ([`EngineCore::tier_moves`]).
    #[serde(default)]
    pub tier_moves: u64,
    /// Of those, a block's move within 100 cycles of its previous one
    /// ([`EngineCore::quick_moves`]).
    #[serde(default)]
    pub quick_moves: u64,
    /// Staged spills ([`engram_kvcore::BlockStore::stage`]): blocks staged now, spills that
    /// took a copy, copies dropped unused.
    #[serde(default)]
    pub staged: engram_kvcore::StageStats,
}

/// A page of the block listing.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct BlockQuery {
    /// Which blocks.
    pub filter: BlockFilter,
    /// Blocks to skip (in id order).
    pub offset: usize,
    /// Blocks to return at most.
    pub limit: usize,
}

/// One block and its meaning.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct BlockInfo {
    /// Id.
    pub id: u64,
    /// Source layer.
    pub source: SourceLayer,
    /// Importance.
    pub importance: f32,
    /// Tenant (the tenant's cache salt).
    pub tenant: u64,
    /// Session key, if any.
    pub session: Option<u64>,
    /// Token positions `[start, end)`.
    pub tokens: [u32; 2],
    /// Tier.
    pub tier: Tier,
    /// How faithful its bytes are: `full`, `reduced` (down-tiered to narrower codecs in the cold
    /// tier) or `restored` (warmed back from there; carries their error).
    pub precision: Precision,
    /// Pin state.
    pub pin: PinState,
    /// Eviction priority.
    pub priority: u16,
    /// Owners (sequences and the prefix cache).
    pub ref_count: u32,
    /// Logical time of the last attention.
    pub last_attended: u64,
    /// Decayed average of the softmax mass sampled decode steps gave the block (the middle
    /// layer's, weight `MASS_WEIGHT` per step).
    pub attention_mass: f32,
    /// Tick of the last sampled step that gave the block at least half a uniform share.
    pub mass_at: u64,
    /// Sampled steps that gave the block at least half a uniform share (its reads).
    pub reads: u32,
    /// Sampled steps since the block was last read (or allocated): past the eviction
    /// policy's `idle_steps`, an unpinned block is demoted.
    pub unread_steps: u64,
    /// Times its codes were copied to another position (relocated segment reuse,
    /// `model.relocate_segments`).
    #[serde(default)]
    pub relocations: u32,
    /// For a block filled by such a copy: its position minus where its keys were computed (0:
    /// computed in place).
    #[serde(default)]
    pub shift: i64,
    /// The chained hash the prefix cache files it under (64 hex digits: tenant salt, parent,
    /// tokens, model): what another tenant would have to match to share it. None for a block
    /// not in the cache (a running sequence's own tail, a reservation's).
    #[serde(default)]
    pub hash: Option<String>,
}

/// A page of blocks and the total that matched.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BlockPage {
    /// Blocks matching the filter.
    pub total: usize,
    /// This page.
    pub blocks: Vec<BlockInfo>,
}

/// What makes blocks of two engines interchangeable: the shadow records it and checks it.
#[derive(Debug, Clone, PartialEq)]
pub struct KvFormat {
    /// The engine's KV fingerprint (model file, codecs, rotation seed, block size, key means).
    pub fingerprint: [u8; 32],
    /// Cache geometry.
    pub shape: KvShape,
    /// Codec of each layer and stream.
    pub codecs: LayerCodecs,
    /// How a block's bytes are laid out.
    pub parts: Vec<BlockPart>,
    /// Bytes of one block.
    pub block_bytes: usize,
}

/// Handle to the engine thread. Dropping it stops the thread after the running work.
#[derive(Debug)]
pub struct Engine {
    tx: Option<flume::Sender<Command>>,
    thread: Option<JoinHandle<()>>,
    tokenizer: TextTokenizer,
    kv: KvFormat,
    model: ModelConfig,
    capacity: usize,
    running: Arc<AtomicUsize>,
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Generate(..) => "Command::Generate",
            Self::Snapshot(_) => "Command::Snapshot",
            Self::Blocks(..) => "Command::Blocks",
            Self::UnpinPrefix(..) => "Command::UnpinPrefix",
            Self::Lookup(..) => "Command::Lookup",
            Self::Reserve(..) => "Command::Reserve",
            Self::WarmReservation(..) => "Command::WarmReservation",
            Self::Reservations(..) => "Command::Reservations",
            Self::ShadowCollect(..) => "Command::ShadowCollect",
            Self::ShadowRestore(..) => "Command::ShadowRestore",
            Self::TierCycle(..) => "Command::TierCycle",
            Self::Forget(..) => "Command::Forget",
            Self::Evict(..) => "Command::Evict",
        })
    }
}

impl Engine {
    /// Starts the engine thread over `core`.
    pub fn spawn(core: EngineCore) -> EngineResult<Self> {
        let capacity = core.config().queue_capacity;
        let (tx, rx) = flume::bounded(capacity);
        let tokenizer = core.tokenizer().clone();
        let model = core.model().config().clone();
        let kv = KvFormat {
            fingerprint: core.fingerprint(),
            shape: *core.store().shape(),
            codecs: core.store().codec_kinds().clone(),
            parts: core.store().block_parts(),
            block_bytes: core.store().block_bytes(),
        };
        let running = Arc::new(AtomicUsize::new(0));
        let gauge = running.clone();
        let thread = std::thread::Builder::new()
            .name("engram-engine".into())
            .spawn(move || Worker::new(core, rx, gauge).run())
            .map_err(|source| EngineError::Io {
                path: "engram-engine thread".into(),
                source,
            })?;
        Ok(Self {
            tx: Some(tx),
            thread: Some(thread),
            tokenizer,
            kv,
            model,
            capacity,
            running,
        })
    }

    /// Queues a request; the receiver yields its events. Answers `Overloaded` when the queue is
    /// full and `InvalidSampling`/`ContextOverflow` for a request that can never run.
    pub fn submit(&self, req: GenerateRequest) -> EngineResult<flume::Receiver<StreamEvent>> {
        self.submit_constrained(req, None)
    }

    /// [`Self::submit`] with the tokens it may generate constrained (a grammar): the sampler
    /// masks the logits of this sequence only, so the other sequences of a batch are not held.
    pub fn submit_constrained(
        &self,
        req: GenerateRequest,
        constraint: Option<Box<dyn Constraint>>,
    ) -> EngineResult<flume::Receiver<StreamEvent>> {
        req.sampling.validate()?;
        let prompt: usize = req.spec.segments.iter().map(|s| s.tokens.len()).sum();
        if prompt == 0 {
            return Err(EngineError::EmptyPrompt);
        }
        if prompt + req.sampling.max_tokens > self.model.context_length {
            return Err(EngineError::ContextOverflow {
                requested: prompt + req.sampling.max_tokens,
                context: self.model.context_length,
            });
        }
        let tx = self.tx.as_ref().ok_or(EngineError::Stopped)?;
        let (etx, erx) = flume::unbounded();
        let queued = Queued {
            req,
            constraint,
            tx: etx,
        };
        match tx.try_send(Command::Generate(Box::new(queued))) {
            Ok(()) => Ok(erx),
            Err(flume::TrySendError::Full(_)) => Err(EngineError::Overloaded {
                queued: tx.len(),
                capacity: self.capacity,
            }),
            Err(flume::TrySendError::Disconnected(_)) => Err(EngineError::Stopped),
        }
    }

    fn ask(&self, cmd: Command) -> EngineResult<()> {
        let tx = self.tx.as_ref().ok_or(EngineError::Stopped)?;
        tx.try_send(cmd).map_err(|e| match e {
            flume::TrySendError::Full(_) => EngineError::Overloaded {
                queued: tx.len(),
                capacity: self.capacity,
            },
            flume::TrySendError::Disconnected(_) => EngineError::Stopped,
        })
    }

    /// Occupancy and counters (answered between engine steps).
    pub fn snapshot(&self) -> EngineResult<flume::Receiver<EngineSnapshot>> {
        let (tx, rx) = flume::bounded(1);
        self.ask(Command::Snapshot(tx))?;
        Ok(rx)
    }

    /// A page of blocks with their meaning.
    pub fn blocks(&self, query: BlockQuery) -> EngineResult<flume::Receiver<BlockPage>> {
        let (tx, rx) = flume::bounded(1);
        self.ask(Command::Blocks(query, tx))?;
        Ok(rx)
    }

    /// Unpins the blocks a stable prefix pinned under `key`; answers how many.
    pub fn unpin_prefix(
        &self,
        key: [u8; 32],
    ) -> EngineResult<flume::Receiver<EngineResult<usize>>> {
        let (tx, rx) = flume::bounded(1);
        self.ask(Command::UnpinPrefix(key, tx))?;
        Ok(rx)
    }

    /// What the prefix cache holds for a prompt, without running it.
    pub fn lookup(&self, spec: SequenceSpec) -> EngineResult<flume::Receiver<PrefixLookup>> {
        let (tx, rx) = flume::bounded(1);
        self.ask(Command::Lookup(Box::new(spec), tx))?;
        Ok(rx)
    }

    /// Reserves cold-tier blocks for a prompt segment and computes them in the background (see
    /// [`EngineCore::reserve`]); answers the reservation once it is admitted (`pending`).
    pub fn reserve(
        &self,
        req: ReserveRequest,
    ) -> EngineResult<flume::Receiver<EngineResult<ReservationId>>> {
        let (tx, rx) = flume::bounded(1);
        self.ask(Command::Reserve(Box::new(req), tx))?;
        Ok(rx)
    }

    /// Promotes a ready reservation to the hot tier; answers how many blocks moved.
    pub fn warm_reservation(
        &self,
        id: ReservationId,
    ) -> EngineResult<flume::Receiver<EngineResult<usize>>> {
        let (tx, rx) = flume::bounded(1);
        self.ask(Command::WarmReservation(id, tx))?;
        Ok(rx)
    }

    /// Live reservations, then recent finished ones (of one tenant, or all).
    pub fn reservations(
        &self,
        tenant: Option<TenantId>,
    ) -> EngineResult<flume::Receiver<Vec<ReservationInfo>>> {
        let (tx, rx) = flume::bounded(1);
        self.ask(Command::Reservations(tenant, tx))?;
        Ok(rx)
    }

    /// Session chains that changed since the shadow wrote them, with the new blocks' bytes.
    pub fn shadow_collect(
        &self,
        req: CollectRequest,
    ) -> EngineResult<flume::Receiver<EngineResult<Vec<ShadowChain>>>> {
        let (tx, rx) = flume::bounded(1);
        self.ask(Command::ShadowCollect(Box::new(req), tx))?;
        Ok(rx)
    }

    /// Validates a chain and loads it into the cold tier and the prefix cache.
    pub fn shadow_restore(
        &self,
        chain: RestoreChain,
    ) -> EngineResult<flume::Receiver<EngineResult<RestoreReport>>> {
        let (tx, rx) = flume::bounded(1);
        self.ask(Command::ShadowRestore(Box::new(chain), tx))?;
        Ok(rx)
    }

    /// Runs one tier-bridge cycle; answers its report and the (possibly adapted) policy.
    pub fn tier_cycle(
        &self,
        policy: TierPolicy,
        active: Vec<ChainKey>,
    ) -> EngineResult<flume::Receiver<EngineResult<(CycleReport, TierPolicy)>>> {
        let (tx, rx) = flume::bounded(1);
        self.ask(Command::TierCycle(Box::new((policy, active)), tx))?;
        Ok(rx)
    }

    /// Forgets a tenant's sessions whose key matches `session & mask == value` (a mask of 0:
    /// all of the tenant's); see [`EngineCore::forget`].
    pub fn forget(
        &self,
        tenant: TenantId,
        mask: u64,
        value: u64,
    ) -> EngineResult<flume::Receiver<EngineResult<ForgetReport>>> {
        let (tx, rx) = flume::bounded(1);
        self.ask(Command::Forget((tenant, mask, value), tx))?;
        Ok(rx)
    }

    /// Drops a session's own unpinned, idle blocks from the hot and cold tiers, keeping its
    /// chain record; see [`EngineCore::evict_session`].
    pub fn evict_session(
        &self,
        key: ChainKey,
    ) -> EngineResult<flume::Receiver<EngineResult<EvictReport>>> {
        let (tx, rx) = flume::bounded(1);
        self.ask(Command::Evict(key, false, tx))?;
        Ok(rx)
    }

    /// Evicts a session and drops its chain record (the tokens-only archive); see
    /// [`EngineCore::archive_session`].
    pub fn archive_session(
        &self,
        key: ChainKey,
    ) -> EngineResult<flume::Receiver<EngineResult<EvictReport>>> {
        let (tx, rx) = flume::bounded(1);
        self.ask(Command::Evict(key, true, tx))?;
        Ok(rx)
    }

    /// The KV format of this engine's blocks.
    pub fn kv_format(&self) -> &KvFormat {
        &self.kv
    }

    /// The tokenizer (for building prompts).
    pub fn tokenizer(&self) -> &TextTokenizer {
        &self.tokenizer
    }

    /// The model's hyper-parameters.
    pub fn model_config(&self) -> &ModelConfig {
        &self.model
    }

    /// Requests waiting in the queue.
    pub fn queued(&self) -> usize {
        self.tx.as_ref().map_or(0, |t| t.len())
    }

    /// Whether the engine thread still runs (false once it has ended, whatever the cause).
    pub fn is_alive(&self) -> bool {
        self.thread.as_ref().is_some_and(|t| !t.is_finished())
    }

    /// Sequences running now.
    pub fn running(&self) -> usize {
        self.running.load(Ordering::Relaxed)
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

enum Phase {
    Prefill,
    Decode(u32),
}

struct Active {
    id: SeqId,
    tenant: TenantId,
    tx: flume::Sender<StreamEvent>,
    sampler: Sampler,
    /// What the sequence's tokens are constrained to, if anything.
    constraint: Option<Box<dyn Constraint>>,
    decoder: StreamDecoder,
    phase: Phase,
    admission: Admission,
    generated: usize,
    /// Set when the stream has ended; `reap` releases the sequence.
    finished: bool,
    pending_tokens: Vec<u32>,
    /// Their log probabilities, when the request asked.
    pending_logprobs: Vec<TokenLogprob>,
    /// Decoded text and how much of it was released.
    text: String,
    released: usize,
}

struct Worker {
    core: EngineCore,
    rx: flume::Receiver<Command>,
    running: Vec<Active>,
    /// Reservations being computed: prefilled only when no request is in prefill.
    reserving: Vec<(SeqId, ReservationId)>,
    gauge: Arc<AtomicUsize>,
    /// Sequences the current stage works on (failed if it panics).
    serving: Vec<SeqId>,
    /// Generations taken from the channel, not yet admitted.
    waiting: VecDeque<Box<Queued>>,
    /// Admissions so far, and each tenant's last one (fair admission).
    admissions: u64,
    last_admitted: HashMap<TenantId, u64>,
}

impl Worker {
    fn new(core: EngineCore, rx: flume::Receiver<Command>, gauge: Arc<AtomicUsize>) -> Self {
        Self {
            core,
            rx,
            running: Vec::new(),
            reserving: Vec::new(),
            gauge,
            serving: Vec::new(),
            waiting: VecDeque::new(),
            admissions: 0,
            last_admitted: HashMap::new(),
        }
    }

    /// The supervised loop: a panic while serving fails the requests being served at that
    /// moment (their callers get [`EngineError::Panicked`]; a command's caller sees its reply
    /// channel close) and the loop goes on with the others.
    fn run(mut self) {
        loop {
            self.serving.clear();
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.step())) {
                Ok(true) => {}
                Ok(false) => return,
                Err(payload) => self.recover(panic_text(payload.as_ref())),
            }
            self.gauge.store(self.running.len(), Ordering::Relaxed);
        }
    }

    /// One turn of the loop; false when the engine should stop.
    fn step(&mut self) -> bool {
        if !self.admit() {
            return false;
        }
        if self.core.next_expiry().is_some_and(|t| t <= Instant::now()) {
            let _ = self.core.expire_reservations(Instant::now());
        }
        if self.fault(FaultKind::Stop, None) {
            tracing::error!("engine: injected fault: the engine thread stops");
            return false;
        }
        self.compute();
        true
    }

    /// Takes commands (answering the others at once, queueing generations), then admits
    /// waiting generations fairly while there is room; false when the handle is gone and no
    /// work is left.
    ///
    /// Fair admission: of the waiting requests, the one whose tenant has the fewest sequences
    /// running goes first, then the one whose tenant was admitted least recently, then the
    /// oldest. A tenant that floods the queue gets its share of the running slots, not all.
    fn admit(&mut self) -> bool {
        let max = self.core.config().max_running;
        let cap = self.core.config().queue_capacity;
        loop {
            let idle =
                self.running.is_empty() && self.reserving.is_empty() && self.waiting.is_empty();
            let cmd = if idle {
                // Idle: wait for a command, or until the next reservation expires.
                let got = match self.core.next_expiry() {
                    Some(t) => self
                        .rx
                        .recv_deadline(t)
                        .map_err(|e| matches!(e, flume::RecvTimeoutError::Disconnected)),
                    None => self.rx.recv().map_err(|_| true),
                };
                match got {
                    Ok(c) => c,
                    Err(true) => return false,
                    Err(false) => break,
                }
            } else if self.waiting.len() < cap {
                match self.rx.try_recv() {
                    Ok(c) => c,
                    Err(_) => break,
                }
            } else {
                break;
            };
            match cmd {
                Command::Generate(q) => self.waiting.push_back(q),
                Command::Snapshot(reply) => {
                    let _ = reply.send(EngineSnapshot {
                        occupancy: self.core.occupancy(),
                        counters: self.core.counters().clone(),
                        queued: self.rx.len() + self.waiting.len(),
                        reservations: self.core.reservation_counters(),
                        tier_moves: self.core.tier_moves(),
                        quick_moves: self.core.quick_moves(),
                        staged: self.core.stage_stats(),
                    });
                }
                Command::Blocks(q, reply) => {
                    let _ = reply.send(self.page(&q));
                }
                Command::Lookup(spec, reply) => {
                    let _ = reply.send(self.core.lookup(&spec));
                }
                Command::UnpinPrefix(key, reply) => {
                    let _ = reply.send(self.core.unpin_prefix(&key));
                }
                Command::Reserve(req, reply) => {
                    let answer = if self.reserving.len() >= max {
                        Err(EngineError::Overloaded {
                            queued: self.reserving.len(),
                            capacity: max,
                        })
                    } else {
                        self.core.reserve(*req).map(|(id, seq)| {
                            self.reserving.push((seq, id));
                            id
                        })
                    };
                    let _ = reply.send(answer);
                }
                Command::WarmReservation(id, reply) => {
                    let _ = reply.send(self.core.warm_reservation(id));
                }
                Command::Reservations(tenant, reply) => {
                    let _ = reply.send(self.core.reservations(tenant));
                }
                Command::ShadowCollect(req, reply) => {
                    let _ =
                        reply.send(self.core.shadow_collect(&req.written, &req.known, req.only));
                }
                Command::ShadowRestore(chain, reply) => {
                    let _ = reply.send(self.core.shadow_restore(*chain));
                }
                Command::Forget((tenant, mask, value), reply) => {
                    let _ = reply.send(self.core.forget(tenant, mask, value));
                }
                Command::Evict((tenant, session), archive, reply) => {
                    let _ = reply.send(if archive {
                        self.core.archive_session(tenant, session)
                    } else {
                        self.core.evict_session(tenant, session)
                    });
                }
                Command::TierCycle(args, reply) => {
                    let (mut policy, active) = *args;
                    let answer = self
                        .core
                        .tier_cycle(&mut policy, &active)
                        .map(|r| (r, policy));
                    let _ = reply.send(answer);
                }
            }
        }
        while self.running.len() < max {
            let Some(i) = self.next_fair() else { break };
            let Some(q) = self.waiting.remove(i) else {
                break;
            };
            let Queued {
                req,
                constraint,
                tx,
            } = *q;
            if tx.is_disconnected() {
                continue;
            }
            let tenant = req.spec.tenant;
            self.admissions += 1;
            self.last_admitted.insert(tenant, self.admissions);
            match self.core.start(req.spec) {
                Ok((id, admission)) => {
                    let _ = tx.send(StreamEvent::Started(admission));
                    self.running.push(Active {
                        id,
                        tenant,
                        tx,
                        sampler: Sampler::new(req.sampling),
                        constraint,
                        decoder: StreamDecoder::default(),
                        phase: Phase::Prefill,
                        admission,
                        generated: 0,
                        finished: false,
                        pending_tokens: Vec::new(),
                        pending_logprobs: Vec::new(),
                        text: String::new(),
                        released: 0,
                    });
                }
                Err(e) => {
                    let _ = tx.send(StreamEvent::Failed(e));
                }
            }
        }
        true
    }

    /// The waiting request fair admission takes next (see [`Self::admit`]).
    fn next_fair(&self) -> Option<usize> {
        let mut running: HashMap<TenantId, usize> = HashMap::new();
        for a in self.running.iter().filter(|a| !a.finished) {
            *running.entry(a.tenant).or_default() += 1;
        }
        self.waiting
            .iter()
            .enumerate()
            .min_by_key(|(i, q)| {
                let t = q.req.spec.tenant;
                (
                    running.get(&t).copied().unwrap_or(0),
                    self.last_admitted.get(&t).copied().unwrap_or(0),
                    *i,
                )
            })
            .map(|(i, _)| i)
    }

    fn page(&self, q: &BlockQuery) -> BlockPage {
        let meta = self.core.store().metadata();
        let matching = meta.iter().filter(|m| q.filter.matches(m));
        let total = meta.count(&q.filter);
        let steps = meta.steps();
        let blocks = matching
            .skip(q.offset)
            .take(q.limit)
            .map(|m| BlockInfo {
                id: m.id().get(),
                source: m.source(),
                importance: m.importance(),
                tenant: m.tenant().0,
                session: m.session().map(|s| s.0),
                tokens: [m.tokens().start, m.tokens().end],
                tier: m.tier(),
                precision: m.precision(),
                pin: m.pin(),
                priority: m.priority(),
                ref_count: m.ref_count(),
                last_attended: m.last_attended(),
                attention_mass: m.mass(),
                mass_at: m.mass_at(),
                reads: m.reads(),
                unread_steps: steps.saturating_sub(m.read_step()),
                relocations: m.relocations(),
                shift: m.shift(),
                hash: self
                    .core
                    .cache()
                    .hash_of(m.id())
                    .map(|h| crate::Hex32(*h).to_hex()),
            })
            .collect();
        BlockPage { total, blocks }
    }

    /// Samples the next token of sequence `i` from `logits` and streams what it completes.
    fn accept(&mut self, i: usize, logits: &[f32]) {
        let stop_ids = self.core.tokenizer().stop_ids().to_vec();
        let context = self.core.model().config().context_length;
        let seq_len = self.core.tokens(self.running[i].id).map_or(0, <[u32]>::len);
        let a = &mut self.running[i];
        let tok = match a
            .sampler
            .sample_constrained(logits, a.constraint.as_deref_mut())
        {
            Ok(t) => t,
            Err(reason) => {
                self.fail(i, EngineError::Constraint { reason });
                return;
            }
        };
        if let Some(top) = a.sampler.params().logprobs
            && !stop_ids.contains(&tok)
        {
            a.pending_logprobs.push(logprobs_of(logits, tok, top));
        }
        let mut finish = None;
        let mut stop_sequence = None;
        if stop_ids.contains(&tok) {
            finish = Some(FinishReason::Stop);
        } else {
            a.generated += 1;
            a.pending_tokens.push(tok);
            match a.decoder.push(self.core.tokenizer(), tok) {
                Ok(piece) => a.text.push_str(&piece),
                Err(e) => {
                    self.fail(i, e.into());
                    return;
                }
            }
            if let Some(pos) = find_stop(&a.text, a.released, &a.sampler.params().stop) {
                stop_sequence = a
                    .sampler
                    .params()
                    .stop
                    .iter()
                    .find(|s| a.text[pos..].starts_with(s.as_str()))
                    .cloned();
                a.text.truncate(pos);
                finish = Some(FinishReason::Stop);
            } else if a.constraint.as_ref().is_some_and(|c| c.finished()) {
                finish = Some(FinishReason::Stop);
            } else if a.generated >= a.sampler.params().max_tokens || seq_len + 1 >= context {
                finish = Some(FinishReason::Length);
            }
        }
        // Ended by a stop token or the length: what the decoder still holds (a character cut
        // short) goes out too, so the streamed text is the decode of the streamed tokens.
        let cut_by_stop_sequence = finish == Some(FinishReason::Stop)
            && !stop_ids.contains(&tok)
            && !a.constraint.as_ref().is_some_and(|c| c.finished());
        if finish.is_some() && !cut_by_stop_sequence {
            match a.decoder.flush(self.core.tokenizer()) {
                Ok(rest) => a.text.push_str(&rest),
                Err(e) => {
                    self.fail(i, e.into());
                    return;
                }
            }
        }
        let hold = match finish {
            Some(_) => 0,
            None => held_back(&a.text, a.released, &a.sampler.params().stop),
        };
        let upto = a.text.len() - hold;
        if upto > a.released || (finish.is_some() && !a.pending_tokens.is_empty()) {
            let delta = StreamEvent::Delta {
                tokens: std::mem::take(&mut a.pending_tokens),
                text: a.text[a.released..upto].to_string(),
                logprobs: std::mem::take(&mut a.pending_logprobs),
            };
            a.released = upto;
            let _ = a.tx.send(delta);
        }
        match finish {
            Some(reason) => {
                let usage = Usage {
                    prompt_tokens: a.admission.prompt_tokens,
                    cached_tokens: a.admission.cached_tokens,
                    completion_tokens: a.generated,
                };
                let _ = a.tx.send(StreamEvent::Done {
                    reason,
                    stop_sequence,
                    usage,
                });
                a.finished = true;
            }
            None => a.phase = Phase::Decode(tok),
        }
    }

    /// Ends sequence `i` with an error (released by the next `reap`).
    fn fail(&mut self, i: usize, e: EngineError) {
        let a = &mut self.running[i];
        let _ = a.tx.send(StreamEvent::Failed(e));
        a.finished = true;
    }

    /// Ends finished sequences.
    fn reap(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].finished {
                let a = self.running.remove(i);
                let _ = self.core.finish(a.id);
            } else {
                i += 1;
            }
        }
    }

    /// Ends sequences whose caller went away.
    fn drop_cancelled(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].tx.is_disconnected() {
                let a = self.running.remove(i);
                let _ = self.core.finish(a.id);
            } else {
                i += 1;
            }
        }
    }
}

/// Byte position of the earliest stop sequence that ends after `from`, if any.
fn find_stop(text: &str, from: usize, stops: &[String]) -> Option<usize> {
    stops
        .iter()
        .filter_map(|s| {
            let start = from.saturating_sub(s.len()).min(text.len());
            let start = (0..=start).rev().find(|&i| text.is_char_boundary(i))?;
            text[start..].find(s.as_str()).map(|p| start + p)
        })
        .min()
}

/// Length of the longest suffix of `text[from..]` that begins some stop sequence.
fn held_back(text: &str, from: usize, stops: &[String]) -> usize {
    let tail = &text[from..];
    stops
        .iter()
        .flat_map(|s| {
            (1..s.len().min(tail.len()) + 1)
                .filter(move |&k| tail.is_char_boundary(tail.len() - k))
                .filter(move |&k| s.starts_with(&tail[tail.len() - k..]))
        })
        .max()
        .unwrap_or(0)
}

/// Errors are not `Clone` (they carry I/O sources); a batch failure is reported to each caller
/// by kind.
fn clone_error(e: &EngineError) -> EngineError {
    match e {
        EngineError::ContextOverflow { requested, context } => EngineError::ContextOverflow {
            requested: *requested,
            context: *context,
        },
        EngineError::NoHotRoom { needed, available } => EngineError::NoHotRoom {
            needed: *needed,
            available: *available,
        },
        other => EngineError::InvalidConfig {
            field: "decode",
            reason: other.to_string(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_sequences_are_found_and_held_back() {
        let stops = vec!["END".to_string(), "\n\n".to_string()];
        assert_eq!(find_stop("abc END x", 0, &stops), Some(4));
        assert_eq!(find_stop("abc\n\nx", 0, &stops), Some(3));
        assert_eq!(find_stop("abc EN", 0, &stops), None);
        // "EN" may begin "END": hold two bytes back.
        assert_eq!(held_back("abc EN", 0, &stops), 2);
        assert_eq!(held_back("abc\n", 0, &stops), 1);
        assert_eq!(held_back("abc", 0, &stops), 0);
        // A stop that straddles the released boundary is still found.
        assert_eq!(find_stop("abc END", 5, &stops), Some(4));
    }
}
