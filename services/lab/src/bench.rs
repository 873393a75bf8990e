//! `engram-bench ttft`: time to first token with and without the prefix cache, and decode
//! throughput by batch size.
//!
//! For each prompt size `P` (real text: the evaluation corpus, tokenized) and a new suffix of
//! `S` tokens, on one engine:
//! - **cold**: an empty cache; prefill all `P + S` tokens;
//! - **hot**: the `P`-token prefix is cached in the hot tier; a different suffix follows;
//! - **warm**: the prefix blocks were spilled to the cold tier first; the lookup warms them
//!   (one bulk copy) and prefills the suffix.
//!
//! TTFT is measured from admission to the first token's logits (sampling is greedy and
//! negligible). Decode: `B` sequences with distinct prompts are prefilled, then `steps` batched
//! decode steps are timed; the sequential baseline decodes the same `B` sequences one at a time.
//! With a constraint (a JSON schema, say), batches 1 and 8 are also decoded under it: each
//! sequence's logits masked and its token committed every step, as the engine's sampler does,
//! so the rows' ratio is what constrained decoding costs a token.

use std::time::Instant;

use engram_kvcore::{CodecKind, TenantId};
use serde::{Deserialize, Serialize};

use engram_engine::Llama;
use engram_engine::StreamCodecs;
use engram_engine::TextTokenizer;
use engram_engine::argmax;
use engram_engine::{Constraint, EngineConfig, EngineCore, SeqId, SequenceSpec};
use engram_engine::{EngineError, EngineResult};

/// Benchmark options.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TtftOptions {
    /// Prompt sizes in tokens.
    pub prompt_tokens: Vec<usize>,
    /// New suffix in tokens.
    pub suffix_tokens: usize,
    /// Batch sizes of the decode measurement.
    pub batches: Vec<usize>,
    /// Decode steps timed per batch.
    pub decode_steps: usize,
    /// Prompt length of each decoding sequence.
    pub decode_prompt: usize,
    /// Decode steps of the constrained and unconstrained measurements (batches 1 and 8).
    pub constrained_steps: usize,
    /// KV codecs (keys and values alike, or one per stream).
    pub codec: StreamCodecs,
    /// The engine's options besides the codec (device, tiers, key centering).
    pub engine: EngineConfig,
}

impl Default for TtftOptions {
    fn default() -> Self {
        Self {
            prompt_tokens: vec![1024, 2048, 4096, 6144],
            suffix_tokens: 128,
            batches: vec![1, 2, 4, 8, 16],
            decode_steps: 16,
            decode_prompt: 128,
            constrained_steps: 128,
            codec: StreamCodecs::CPU_DEFAULT,
            engine: EngineConfig::default(),
        }
    }
}

/// One prompt size's TTFT (a JSON line of `engram-bench ttft --json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TtftRow {
    /// Cached-prefix length.
    pub prompt_tokens: usize,
    /// New tokens after it.
    pub suffix_tokens: usize,
    /// Nothing cached.
    pub cold_ms: f64,
    /// Prefix hot.
    pub hot_ms: f64,
    /// Prefix warmed from the cold tier.
    pub warm_ms: f64,
}

/// One decode measurement (a JSON line).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DecodeRow {
    /// Sequences decoded together (`sequential`: one at a time).
    pub batch: usize,
    /// `batched`, `sequential`, or `constrained` (batched, every token under a constraint).
    pub mode: String,
    /// Total generated tokens per second.
    pub decode_tokens_per_s: f64,
    /// Time per output token of one sequence, ms (a batched step; for `sequential`, one
    /// sequence's step).
    pub ms_per_token: f64,
    /// Prompt length of each sequence (the context decode attends over).
    pub context_tokens: usize,
}

fn engine(model: &Llama, tok: &TextTokenizer, opts: &TtftOptions) -> EngineResult<EngineCore> {
    let config = EngineConfig {
        codec: opts.codec.key,
        value_codec: opts.codec.value_override(),
        ..opts.engine.clone()
    };
    EngineCore::new(model.clone(), tok.clone(), config)
}

fn slice(tokens: &[u32], from: usize, n: usize) -> EngineResult<Vec<u32>> {
    tokens
        .get(from..from + n)
        .map(<[u32]>::to_vec)
        .ok_or(EngineError::InvalidConfig {
            field: "corpus",
            reason: format!(
                "the corpus has {} tokens; {} needed",
                tokens.len(),
                from + n
            ),
        })
}

/// Time to first token for `spec` on `core`, in milliseconds; the sequence is finished after.
fn ttft_ms(core: &mut EngineCore, tokens: Vec<u32>) -> EngineResult<(f64, usize)> {
    let t = Instant::now();
    let (id, adm) = core.start(SequenceSpec::plain(tokens, TenantId(1)))?;
    let logits = core.prefill(id)?;
    let _first = argmax(&logits);
    let ms = t.elapsed().as_secs_f64() * 1e3;
    core.finish(id)?;
    Ok((ms, adm.cached_tokens))
}

/// TTFT rows, one per prompt size.
pub fn ttft(
    model: &Llama,
    tok: &TextTokenizer,
    corpus: &[u32],
    opts: &TtftOptions,
    mut progress: impl FnMut(&str),
) -> EngineResult<Vec<TtftRow>> {
    let mut rows = Vec::new();
    let s = opts.suffix_tokens;
    for &p in &opts.prompt_tokens {
        let mut core = engine(model, tok, opts)?;
        let prefix = slice(corpus, 0, p)?;
        let with = |k: usize| -> EngineResult<Vec<u32>> {
            let mut t = prefix.clone();
            t.extend(slice(corpus, p + k * s, s)?);
            Ok(t)
        };
        let (cold_ms, _) = ttft_ms(&mut core, with(0)?)?;
        let (hot_ms, hot_cached) = ttft_ms(&mut core, with(1)?)?;
        core.spill_idle()?;
        let (warm_ms, warm_cached) = ttft_ms(&mut core, with(2)?)?;
        let bs = core.config().block_size;
        if hot_cached < p / bs * bs || warm_cached < p / bs * bs {
            return Err(EngineError::InvalidConfig {
                field: "prefix cache",
                reason: format!("reused {hot_cached}/{warm_cached} of {p} prefix tokens"),
            });
        }
        progress(&format!(
            "{p}+{s}: cold {cold_ms:.0} ms, hot {hot_ms:.0} ms, warm {warm_ms:.0} ms"
        ));
        rows.push(TtftRow {
            prompt_tokens: p,
            suffix_tokens: s,
            cold_ms,
            hot_ms,
            warm_ms,
        });
    }
    Ok(rows)
}

/// Starts `n` sequences with distinct prompts and prefills them; returns their ids and first
/// tokens.
fn prefilled(
    core: &mut EngineCore,
    corpus: &[u32],
    n: usize,
    len: usize,
) -> EngineResult<Vec<(SeqId, u32)>> {
    (0..n)
        .map(|i| {
            let (id, _) = core.start(SequenceSpec::plain(
                slice(corpus, i * len, len)?,
                TenantId(i as u64 + 1),
            ))?;
            let logits = core.prefill(id)?;
            Ok((id, argmax(&logits)))
        })
        .collect()
}

fn decode_steps(
    core: &mut EngineCore,
    seqs: &mut [(SeqId, u32)],
    steps: usize,
) -> EngineResult<()> {
    for _ in 0..steps {
        let rows = core.decode(seqs)?;
        for (s, logits) in seqs.iter_mut().zip(rows) {
            s.1 = argmax(&logits);
        }
    }
    Ok(())
}

/// Makes a fresh constraint (one per sequence, and again when one is complete).
pub type Constrain<'a> = &'a dyn Fn() -> Result<Box<dyn Constraint>, String>;

fn constraint_error(reason: String) -> EngineError {
    EngineError::Constraint { reason }
}

/// [`decode_steps`] with every token under a constraint: masked, chosen, committed. Answers
/// the seconds spent making constraints (a request's, not a token's cost).
fn constrained_steps(
    core: &mut EngineCore,
    seqs: &mut [(SeqId, u32)],
    steps: usize,
    constrain: Constrain<'_>,
) -> EngineResult<f64> {
    let t = Instant::now();
    let mut made: Vec<Box<dyn Constraint>> = seqs
        .iter()
        .map(|_| constrain())
        .collect::<Result<_, _>>()
        .map_err(constraint_error)?;
    let mut making = t.elapsed().as_secs_f64();
    for _ in 0..steps {
        let rows = core.decode(seqs)?;
        for ((s, mut logits), c) in seqs.iter_mut().zip(rows).zip(made.iter_mut()) {
            c.mask(&mut logits).map_err(constraint_error)?;
            s.1 = argmax(&logits);
            c.commit(s.1).map_err(constraint_error)?;
            if c.finished() {
                let t = Instant::now();
                *c = constrain().map_err(constraint_error)?;
                making += t.elapsed().as_secs_f64();
            }
        }
    }
    Ok(making)
}

/// How a decode measurement steps its sequences.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DecodeMode {
    /// One forward pass per step for all sequences.
    Batched,
    /// Each sequence decoded to the end before the next starts.
    Sequential,
    /// Batched, every token under a constraint.
    Constrained,
}

/// Tokens per second of `b` fresh sequences decoded `opts.decode_steps` times in `mode`.
fn measure(
    model: &Llama,
    tok: &TextTokenizer,
    corpus: &[u32],
    opts: &TtftOptions,
    b: usize,
    mode: DecodeMode,
    constrain: Option<Constrain<'_>>,
) -> EngineResult<DecodeRow> {
    let mut core = engine(model, tok, opts)?;
    let mut seqs = prefilled(&mut core, corpus, b, opts.decode_prompt)?;
    let t = Instant::now();
    let mut making = 0.0;
    match (mode, constrain) {
        (DecodeMode::Constrained, Some(c)) => {
            making = constrained_steps(&mut core, &mut seqs, opts.decode_steps, c)?;
        }
        (DecodeMode::Batched | DecodeMode::Constrained, _) => {
            decode_steps(&mut core, &mut seqs, opts.decode_steps)?;
        }
        (DecodeMode::Sequential, _) => {
            for s in seqs.chunks_mut(1) {
                decode_steps(&mut core, s, opts.decode_steps)?;
            }
        }
    }
    let secs = t.elapsed().as_secs_f64() - making;
    let steps = match mode {
        DecodeMode::Batched | DecodeMode::Constrained => opts.decode_steps,
        DecodeMode::Sequential => b * opts.decode_steps,
    };
    Ok(DecodeRow {
        batch: b,
        mode: format!("{mode:?}").to_lowercase(),
        decode_tokens_per_s: (b * opts.decode_steps) as f64 / secs,
        ms_per_token: secs * 1e3 / steps.max(1) as f64,
        context_tokens: opts.decode_prompt,
    })
}

/// Decode throughput for each batch size, batched; batch 8 is also measured sequentially (the
/// same eight sequences decoded one after another), the baseline batching must beat; with
/// `constrain`, batches 1 and 8 are also measured with every token under a constraint.
pub fn decode(
    model: &Llama,
    tok: &TextTokenizer,
    corpus: &[u32],
    opts: &TtftOptions,
    constrain: Option<Constrain<'_>>,
    mut progress: impl FnMut(&str),
) -> EngineResult<Vec<DecodeRow>> {
    let mut rows = Vec::new();
    for &b in &opts.batches {
        let mut modes = vec![DecodeMode::Batched];
        if b == 8 {
            modes.push(DecodeMode::Sequential);
        }
        for mode in modes {
            let row = measure(model, tok, corpus, opts, b, mode, None)?;
            progress(&format!(
                "{} {b}: {:.1} tokens/s, {:.1} ms per token",
                row.mode, row.decode_tokens_per_s, row.ms_per_token
            ));
            rows.push(row);
        }
    }
    // Constrained against unconstrained, batches 1 and 8, over more steps (a constrained
    // object takes tens of tokens, and its mask's cost varies along it): measured in turn,
    // twice each, the better of each kept.
    if let Some(c) = constrain {
        let long = TtftOptions {
            decode_steps: opts.constrained_steps,
            ..opts.clone()
        };
        for b in [1, 8] {
            let mut best: [Option<DecodeRow>; 2] = [None, None];
            for _ in 0..2 {
                for (i, mode) in [DecodeMode::Batched, DecodeMode::Constrained]
                    .into_iter()
                    .enumerate()
                {
                    let mut row = measure(model, tok, corpus, &long, b, mode, Some(c))?;
                    if mode == DecodeMode::Batched {
                        row.mode = "unconstrained".into();
                    }
                    if best[i]
                        .as_ref()
                        .is_none_or(|r| row.ms_per_token < r.ms_per_token)
                    {
                        best[i] = Some(row);
                    }
                }
            }
            if let [Some(plain), Some(held)] = best {
                progress(&format!(
                    "batch {b}: {:.2} ms per token unconstrained, {:.2} constrained ({:+.1} %)",
                    plain.ms_per_token,
                    held.ms_per_token,
                    100.0 * (held.ms_per_token / plain.ms_per_token - 1.0)
                ));
                rows.push(plain);
                rows.push(held);
            }
        }
    }
    Ok(rows)
}

/// Options of `engram-bench e2e`: a model served to random prompts of given lengths, one or
/// many at a time, timed as a client sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct E2eOptions {
    /// Prompt lengths in tokens.
    pub prompts: Vec<usize>,
    /// Sequences decoding together.
    pub batches: Vec<usize>,
    /// Tokens generated per sequence after its first.
    pub steps: usize,
    /// Seed of the random prompts.
    pub seed: u64,
}

/// One (prompt, batch) measurement of [`e2e`] (a JSON line).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct E2eRow {
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Sequences decoding together.
    pub batch: usize,
    /// Time to first token of a sequence prefilled alone (start to its first token), ms:
    /// the median over the batch's sequences.
    pub ttft_ms_p50: f64,
    /// The slowest sequence's.
    pub ttft_ms_max: f64,
    /// Time per output token after the first: the median gap between a sequence's successive
    /// token arrivals (a batched step delivers one token to every sequence), ms.
    pub tpot_ms_p50: f64,
    /// The mean gap.
    pub tpot_ms_mean: f64,
    /// The 90th percentile gap.
    pub tpot_ms_p90: f64,
    /// Gaps measured per sequence.
    pub steps: usize,
    /// Where a decode step's time went on the host, ms a step (means over the steps).
    #[serde(default)]
    pub step_ms: engram_engine::ForwardTimes,
}

/// The `q`-quantile of `v` (sorted in place), nearest rank.
/// This machine's memory read bandwidth in GB/s: `threads` threads summing their shares of a
/// 1 GiB buffer (far past any cache), the best of three passes. Decode of a model whose
/// weights dwarf its caches cannot read faster than this.
pub fn read_bandwidth(threads: usize) -> f64 {
    let words = (1usize << 30) / 8;
    // Written once, so every page is resident before the timed passes.
    let buf: Vec<u64> = (0..words as u64).collect();
    let share = words.div_ceil(threads.max(1));
    let mut best = 0f64;
    for _ in 0..3 {
        let t = Instant::now();
        let total = std::thread::scope(|sc| {
            let parts: Vec<_> = buf
                .chunks(share)
                .map(|c| sc.spawn(move || c.iter().fold(0u64, |a, &x| a.wrapping_add(x))))
                .collect();
            parts
                .into_iter()
                .map(|h| h.join().unwrap_or(0))
                .fold(0u64, u64::wrapping_add)
        });
        std::hint::black_box(total);
        best = best.max((words * 8) as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    best
}

fn quantile(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n => v[((n - 1) as f64 * q).round() as usize],
    }
}

/// Serving speed on `core`'s model: for each prompt length and batch, `batch` sequences of
/// random token ids are started and prefilled one after another (each one's TTFT from its
/// start to its first token), then decoded together for `steps` steps, each step's tokens
/// arriving at once; TPOT is the gap between arrivals. Sequences are finished after, so every
/// measurement starts from the same empty running set; prompts are distinct (no cache hits).
pub fn e2e(
    core: &mut EngineCore,
    opts: &E2eOptions,
    mut progress: impl FnMut(&str),
) -> EngineResult<Vec<E2eRow>> {
    let vocab = core.model().config().vocab_size as u64;
    let stops = core.tokenizer().stop_ids().to_vec();
    let mut rng = engram_kvcore::SplitMix64::new(opts.seed);
    let mut draw = |n: usize| -> Vec<u32> {
        let mut v = Vec::with_capacity(n);
        while v.len() < n {
            let t = (rng.next_u64() % vocab) as u32;
            if !stops.contains(&t) {
                v.push(t);
            }
        }
        v
    };
    let mut rows = Vec::new();
    for &p in &opts.prompts {
        for &b in &opts.batches {
            let mut seqs = Vec::with_capacity(b);
            let mut ttft = Vec::with_capacity(b);
            for i in 0..b {
                let t = Instant::now();
                let (id, _) = core.start(SequenceSpec::plain(draw(p), TenantId(i as u64 + 1)))?;
                let first = argmax(&core.prefill(id)?);
                ttft.push(t.elapsed().as_secs_f64() * 1e3);
                seqs.push((id, first));
            }
            let mut gaps = Vec::with_capacity(opts.steps);
            let mut last = Instant::now();
            engram_engine::take_forward_times();
            for _ in 0..opts.steps {
                let logits = core.decode(&seqs)?;
                for (s, l) in seqs.iter_mut().zip(&logits) {
                    s.1 = argmax(l);
                }
                let now = Instant::now();
                gaps.push((now - last).as_secs_f64() * 1e3);
                last = now;
            }
            let mut step_ms = engram_engine::take_forward_times();
            let per = opts.steps.max(1) as f64;
            for v in [
                &mut step_ms.room,
                &mut step_ms.prep,
                &mut step_ms.launch,
                &mut step_ms.sync,
                &mut step_ms.mass,
                &mut step_ms.register,
            ] {
                *v /= per;
            }
            for (id, _) in &seqs {
                core.finish(*id)?;
            }
            let mean = gaps.iter().sum::<f64>() / gaps.len().max(1) as f64;
            let row = E2eRow {
                prompt_tokens: p,
                batch: b,
                ttft_ms_p50: quantile(&mut ttft, 0.5),
                ttft_ms_max: quantile(&mut ttft, 1.0),
                tpot_ms_p50: quantile(&mut gaps, 0.5),
                tpot_ms_mean: mean,
                tpot_ms_p90: quantile(&mut gaps, 0.9),
                steps: opts.steps,
                step_ms,
            };
            progress(&format!(
                "prompt {p} batch {b}: TTFT p50 {:.1} ms (max {:.1}), TPOT p50 {:.2} ms (mean {:.2}, p90 {:.2}); a step: room {:.2}, prep {:.2}, launch {:.2}, sync {:.2}, mass {:.2}, register {:.2} ms",
                row.ttft_ms_p50,
                row.ttft_ms_max,
                row.tpot_ms_p50,
                row.tpot_ms_mean,
                row.tpot_ms_p90,
                row.step_ms.room,
                row.step_ms.prep,
                row.step_ms.launch,
                row.step_ms.sync,
                row.step_ms.mass,
                row.step_ms.register,
            ));
            rows.push(row);
        }
    }
    Ok(rows)
}

/// One step of [`device_parity`] (a JSON line of `engram check device`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ParityRow {
    /// `prefill` (last-token logits of each sequence) or `decode` (a batched step).
    pub phase: String,
    /// Step index within the phase.
    pub step: usize,
    /// Relative L2 distance of the device's logits from the CPU engine's.
    pub rel_l2: f64,
    /// Whether both pick the same greedy token for every sequence.
    pub same_argmax: bool,
    /// SHA-256 of the CPU logits' f32 bits (first 16 hex digits): two runs compare bitwise by
    /// it.
    pub cpu_logits_sha256: String,
    /// SHA-256 of the device logits' f32 bits (first 16 hex digits).
    pub device_logits_sha256: String,
    /// After a decode step: relative L2 distance of the blocks' attention mass (the decayed
    /// average each engine folds from its middle layer, prompt chunks' last rows and decode
    /// steps) on the device's store from the CPU's, over both sequences' blocks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mass_rel_l2: Option<f64>,
}

/// SHA-256 of the f32 bits of `rows`, its first 8 bytes as 16 hex digits.
fn logits_digest(rows: &[Vec<f32>]) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for v in rows.iter().flatten() {
        h.update(v.to_bits().to_le_bytes());
    }
    h.finalize()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The forward pass on `device` against the CPU on the same random weights (`shape`; for a GPU
/// the CPU multiplies them in bf16 as the GPU does): two
/// sequences of `prompt` and `prompt / 2 + 7` random tokens prefilled in 256-token chunks
/// through TurboQuant-4 blocks, then `steps` batched decode steps fed the CPU's greedy tokens.
pub fn device_parity(
    device: engram_engine::EngineDevice,
    held: engram_engine::DeviceWeights,
    shape: engram_engine::ModelConfig,
    prompt: usize,
    steps: usize,
) -> EngineResult<Vec<ParityRow>> {
    use engram_kvcore::{
        BlockStore, BlockTags, KvShape, SourceLayer, SplitMix64, StoreConfig, Tier, TokenRange,
    };

    use engram_engine::{LogitRows, SeqInput};

    // The reference multiplies as the device does (bf16 weights and matmul operands on a
    // GPU), so the comparison checks the device's kernels, not the choice of bf16 numerics.
    let cpu = Llama::random(shape.clone(), &candle_core::Device::Cpu, 7)?;
    let cpu = match device {
        engram_engine::EngineDevice::Cpu => cpu,
        engram_engine::EngineDevice::Cuda { .. } => cpu.rounded_for_device(held)?,
    };
    let kv = KvShape::with_block_size(
        shape.num_layers,
        shape.num_kv_heads,
        shape.head_dim,
        engram_kvcore::DEFAULT_BLOCK_SIZE,
    )?;
    let lens = [prompt, prompt / 2 + 7];
    let blocks_per = (prompt + steps).div_ceil(kv.block_size) + 1;
    let config = StoreConfig::new(kv, CodecKind::TQ4, (3 * blocks_per) as u32, 0);
    let (dev_model, mut dev_store) =
        engram_engine::open_on(device, held, cpu.clone(), config.clone())?;
    let mut cpu_store = BlockStore::new(config)?;
    let tags = vec![
        BlockTags {
            source: SourceLayer::UserTurn,
            importance: 0.5,
            tenant: TenantId(1),
            session: None,
            tokens: TokenRange::new(0, 16),
        };
        blocks_per
    ];
    let mut rng = SplitMix64::new(3);
    let mut seqs = Vec::new();
    for &len in &lens {
        let tokens: Vec<u32> = (0..len)
            .map(|_| (rng.next_u64() % shape.vocab_size as u64) as u32)
            .collect();
        let a = cpu_store.allocate(Tier::Hot, &tags)?;
        let b = dev_store.allocate(Tier::Hot, &tags)?;
        seqs.push((tokens, a, b));
    }
    let compare = |phase: &str,
                   step: usize,
                   a: &candle_core::Tensor,
                   b: &candle_core::Tensor|
     -> EngineResult<ParityRow> {
        let (x, y): (Vec<Vec<f32>>, Vec<Vec<f32>>) = (a.to_vec2()?, b.to_vec2()?);
        let (mut num, mut den, mut same) = (0.0f64, 0.0f64, true);
        for (r, s) in x.iter().zip(&y) {
            for (&p, &q) in r.iter().zip(s) {
                num += f64::from(p - q).powi(2);
                den += f64::from(p).powi(2);
            }
            same &= argmax(r) == argmax(s);
        }
        Ok(ParityRow {
            phase: phase.into(),
            step,
            rel_l2: (num / den.max(1e-30)).sqrt(),
            same_argmax: same,
            cpu_logits_sha256: logits_digest(&x),
            device_logits_sha256: logits_digest(&y),
            mass_rel_l2: None,
        })
    };
    let mut rows = Vec::new();
    let mut next: Vec<u32> = Vec::new();
    for (i, (tokens, a, b)) in seqs.iter().enumerate() {
        let (mut la, mut lb) = (None, None);
        for start in (0..tokens.len()).step_by(256) {
            let chunk = &tokens[start..tokens.len().min(start + 256)];
            let input = |blocks| SeqInput {
                tokens: chunk,
                start,
                blocks,
                logits: LogitRows::Last,
                prompt: true,
                relocated: &[],
            };
            la = Some(cpu.forward(&mut cpu_store, &[input(a)])?);
            lb = Some(dev_model.forward(&mut dev_store, &[input(b)])?);
        }
        if let (Some(la), Some(lb)) = (la, lb) {
            rows.push(compare("prefill", i, &la, &lb)?);
            next.push(argmax(&la.to_vec2::<f32>()?.concat()));
        }
    }
    let mut pos: Vec<usize> = lens.to_vec();
    for step in 0..steps {
        let toks: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
        let batch = |side: usize| -> Vec<SeqInput<'_>> {
            seqs.iter()
                .zip(&toks)
                .zip(&pos)
                .map(|(((_, a, b), t), &p)| SeqInput {
                    tokens: t,
                    start: p,
                    blocks: if side == 0 { a } else { b },
                    logits: LogitRows::Last,
                    prompt: false,
                    relocated: &[],
                })
                .collect()
        };
        let la = cpu.forward(&mut cpu_store, &batch(0))?;
        let lb = dev_model.forward(&mut dev_store, &batch(1))?;
        let mut row = compare("decode", step, &la, &lb)?;
        let (mut num, mut den) = (0.0f64, 0.0f64);
        for (_, a, b) in &seqs {
            for (x, y) in a.iter().zip(b) {
                let mass = |store: &BlockStore, id| {
                    store
                        .metadata()
                        .get(id)
                        .map_or(0.0, |m| f64::from(m.mass()))
                };
                let (p, q) = (mass(&cpu_store, *x), mass(&dev_store, *y));
                num += (p - q).powi(2);
                den += p * p;
            }
        }
        row.mass_rel_l2 = Some((num / den.max(1e-30)).sqrt());
        rows.push(row);
        next = la.to_vec2::<f32>()?.iter().map(|r| argmax(r)).collect();
        pos.iter_mut().for_each(|p| *p += 1);
    }
    Ok(rows)
}
