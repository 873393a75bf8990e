//! A Llama-family decoder whose attention reads and writes kvcore blocks.
//!
//! Weights are in Hugging Face layout (`[out, in]`, q/k rows in the half-split RoPE order). GGUF
//! projections stay in their blocks by default (`engram-qmatmul`'s integer kernels; the q/k
//! rows un-permuted from llama.cpp's interleaved order as whole block rows), or are dequantized
//! to f32 at load ([`WeightFormat::F32`]); safetensors directories are read as f32. The CPU
//! forward (`model_cpu.rs`) runs on plain f32 buffers, the device forward on candle tensors.
//!
//! One [`Llama::forward`] call runs a ragged batch: every sequence contributes its new tokens
//! (a prefill chunk or one decode token), all rows go through the projections and the MLP as one
//! matrix, and attention is per sequence over its block table:
//! - each layer first **writes** the new rows' K (after RoPE) and V into the sequence's blocks
//!   through the layer's codec;
//! - a single new token (decode) then attends with [`BlockStore::attend`], straight from the
//!   packed codes;
//! - a chunk of several tokens (prefill) decodes the blocks it needs once per layer
//!   ([`BlockStore::read`]) and attends causally with dense matrix products.
//!
//! Both paths read what the store holds, so a prefix computed once and reused, or computed again,
//! gives the same logits, and the codec's error shows in every position, exactly as in decode.
//! Cost per layer: projections O(rows · hidden²); attention O(new · context · heads · head_dim).

use std::path::Path;

use candle_core::{D, DType, Device, Tensor};
use std::sync::{Arc, OnceLock};

use engram_kvcore::{BlockId, BlockStore, BlockTags, CodecKind, KvShape, StoreConfig, Tier};

use crate::arch::Arch;
use crate::error::{ModelError, ModelResult};
use crate::held::{DeviceWeights, Embedding, Linear};
use crate::tap::KvTap;
use crate::tokenizer::TextTokenizer;
use crate::weights::{Layer, ModelConfig, WeightFormat, Weights};
use engram_qmatmul::Activations;

// The CUDA forward, or without the `cuda` feature a stand-in whose types are empty and whose
// forward is never reached (no CUDA hot tier can exist): the rest of the model has no `cfg`.
#[cfg(feature = "cuda")]
#[path = "cuda.rs"]
mod cuda;
#[cfg(not(feature = "cuda"))]
#[path = "cuda_stub.rs"]
mod cuda;

#[path = "cpu.rs"]
mod cpu;

#[path = "key_basis.rs"]
mod key_basis;
use key_basis::{KeyBasis, QueryEnergy, key_scales_from};

/// A loaded model.
#[derive(Debug, Clone)]
pub struct Llama {
    /// The family (what the forward adds to Llama's layer is in each layer's `extra`).
    arch: &'static Arch,
    device: Device,
    kernels: cuda::KernelCache,
    /// Per layer on a CUDA device, its projections that read one input stacked (empty on the
    /// CPU).
    device_stacks: Arc<Vec<cuda::DeviceStack>>,
    config: ModelConfig,
    embed: Embedding,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Linear,
    cos: Tensor,
    sin: Tensor,
    /// The window layers' RoPE tables, when their base differs ([`ModelConfig::rope_local_theta`]).
    local_rope: Option<(Tensor, Tensor)>,
    fingerprint: [u8; 32],
    key_means: Arc<OnceLock<KeyBasis>>,
    /// Per layer, its block projections stacked where they share an input (CPU only).
    stacked: Vec<Option<Stacked>>,
    /// Threads the CPU kernels split work over.
    threads: usize,
}

/// A layer's block projections that read the same input, stacked into one matrix each: one
/// product (and one hand-off to the other threads) instead of three, and two, per layer. Every
/// output is computed as by its own matrix (bit for bit in decode, to rounding in prefill).
#[derive(Debug, Clone)]
pub(crate) struct Stacked {
    /// `[wq; wk; wv]`.
    pub qkv: Arc<engram_qmatmul::QMatrix>,
    /// `[w_gate; w_up]`.
    pub gate_up: Arc<engram_qmatmul::QMatrix>,
    /// Rows of `wq` and `wk` in `qkv`.
    qkv_rows: [usize; 2],
    /// Rows of `w_gate` in `gate_up`.
    gate_rows: usize,
}

impl Stacked {
    /// The stacks of `layer`, when all five projections are blocks of one form and width; the
    /// layer's projections then become parts of the stacks (the weights are held once).
    fn of(layer: &mut Layer) -> Option<Self> {
        let blocks = |w: &Linear| match w {
            Linear::Blocks(q) => Some(q.clone()),
            Linear::Dense(_) | Linear::Part { .. } => None,
        };
        let (q, k, v) = (blocks(&layer.wq)?, blocks(&layer.wk)?, blocks(&layer.wv)?);
        let (g, u) = (blocks(&layer.w_gate)?, blocks(&layer.w_up)?);
        let qkv = engram_qmatmul::QMatrix::stack(&[&q, &k, &v]).ok()?;
        let gate_up = engram_qmatmul::QMatrix::stack(&[&g, &u]).ok()?;
        let s = Self {
            qkv: Arc::new(qkv),
            gate_up: Arc::new(gate_up),
            qkv_rows: [q.rows(), k.rows()],
            gate_rows: g.rows(),
        };
        s.point(layer);
        Some(s)
    }

    /// Makes `layer`'s stacked projections parts of these stacks.
    fn point(&self, layer: &mut Layer) {
        let [nq, nk] = self.qkv_rows;
        let part = |stack: &Arc<engram_qmatmul::QMatrix>, rows| Linear::Part {
            stack: stack.clone(),
            rows,
        };
        layer.wq = part(&self.qkv, 0..nq);
        layer.wk = part(&self.qkv, nq..nq + nk);
        layer.wv = part(&self.qkv, nq + nk..self.qkv.rows());
        layer.w_gate = part(&self.gate_up, 0..self.gate_rows);
        layer.w_up = part(&self.gate_up, self.gate_rows..self.gate_up.rows());
    }
}

/// The fixed text key means are calibrated on (part of the KV format: changing it changes the
/// stored bytes, and the engine fingerprint covers the means).
const CALIBRATION_TEXT: &str = "<|im_start|>system\nYou are a helpful assistant that remembers \
what matters.<|im_end|>\n<|im_start|>user\nThe library opened at nine in the morning, and by \
ten the reading room was full. Students checked out books on history, chemistry and music; a \
retired engineer asked for the 1987 railway timetables, and two children argued about whether \
whales are fish. The librarian, who had worked there for thirty-one years, kept a notebook of \
every question nobody could answer. Section 4(b) of the lending rules says that reference works \
may not leave the building, but maps may be copied for a fee of 0.50 per page. What would you \
add to the notebook today, and why?<|im_end|>\n<|im_start|>assistant\nI would add the question \
about whales: they are mammals, they breathe air and feed their young with milk, although they \
live in the sea like fish.<|im_end|>\n";

/// What happens to new K/V rows between the projections and the store.
#[derive(Debug, Clone, Copy, Default)]
pub struct KvTransform<'a> {
    /// Per-(layer, KV head) key means to subtract, `[layers, kv_heads, head_dim]`.
    pub key_means: Option<&'a [f32]>,
    /// Per-(layer, KV head, channel) key scales, `[layers, kv_heads, head_dim]`: a stored key is
    /// divided by them (after centering) and each query multiplied by them, so every score is
    /// unchanged (see [`Llama::key_scales`]).
    pub key_scales: Option<&'a [f32]>,
    /// A fidelity probe.
    pub probe: Option<&'a dyn KvTap>,
}

/// One sequence's part of a forward batch.
#[derive(Debug, Clone, Copy)]
pub struct SeqInput<'a> {
    /// The new tokens (a prefill chunk, or one decode token).
    pub tokens: &'a [u32],
    /// Position of `tokens[0]`; positions `0..start` are already in the blocks.
    pub start: usize,
    /// The sequence's block table, covering at least `start + tokens.len()` positions.
    pub blocks: &'a [BlockId],
    /// Which rows' logits to return.
    pub logits: LogitRows,
    /// Whether `tokens` are prompt tokens. A prompt's rows take the prefill attention kernel
    /// whatever the chunk's length, so a prompt resumed from a cached prefix with one uncached
    /// token computes the bits a whole prefill computes; a decode token (`false`) takes the
    /// single-query kernel.
    pub prompt: bool,
    /// Runs of the block table whose keys were computed at other positions (relocated
    /// segments, issue 26), in order; empty for a sequence computed where it stands. Such a
    /// sequence attends row by row with the query-side shift (CPU only).
    pub relocated: &'a [engram_kvcore::Relocated],
}

/// Where the host spent an engine step's time (ms), for `engram-bench e2e`'s step breakdown:
/// making hot room and allocating the new blocks (`room`); in the CUDA forward, its index tables
/// and plans (`prep`), its layer loop (`launch`: kernels are queued, so this is host time unless
/// the queue is full) and the attention mass folded into the blocks' metadata (`mass`: waits for
/// the middle layer, then runs while the card computes the rest); then registering the sequences'
/// blocks (`register`: touch, prefix hashes, also while the card computes) and the logits' copy
/// back (`sync`: waits for the device; zero on the CPU). Summed per thread since
/// [`take_forward_times`].
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ForwardTimes {
    /// Hot room and block allocation.
    pub room: f64,
    /// Index tables, block slots, work plans, uploads.
    pub prep: f64,
    /// The layer loop.
    pub launch: f64,
    /// The logits' copy to the host (what is left of the device's step).
    pub sync: f64,
    /// Attention mass copied and folded into the metadata.
    pub mass: f64,
    /// Registering the computed blocks.
    pub register: f64,
}

thread_local! {
    static FORWARD_TIMES: std::cell::Cell<ForwardTimes> =
        const { std::cell::Cell::new(ForwardTimes { room: 0.0, prep: 0.0, launch: 0.0, sync: 0.0, mass: 0.0, register: 0.0 }) };
}

/// Adds to this thread's [`ForwardTimes`].
pub fn add_forward_times(f: impl FnOnce(&mut ForwardTimes)) {
    FORWARD_TIMES.with(|c| {
        let mut t = c.get();
        f(&mut t);
        c.set(t);
    });
}

/// This thread's [`ForwardTimes`] since the last call, reset.
pub fn take_forward_times() -> ForwardTimes {
    FORWARD_TIMES.with(|c| c.replace(ForwardTimes::default()))
}

/// Which logits a sequence wants back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitRows {
    /// Only the last new token's (generation).
    Last,
    /// Every new token's (teacher-forced evaluation).
    All,
}

impl Llama {
    /// Loads a GGUF file (weights kept in their blocks where the kernels read them).
    pub fn from_gguf(path: &Path) -> ModelResult<Self> {
        Self::from_gguf_as(path, WeightFormat::default())
    }

    /// Loads a GGUF file with its weights held as `format`.
    pub fn from_gguf_as(path: &Path, format: WeightFormat) -> ModelResult<Self> {
        let model = Self::from_weights(Weights::from_gguf(path, format)?)?;
        Ok(model.with_activations(format.activations()))
    }

    /// The block products the CPU forward runs, multiplying `acts`: the integer panels are
    /// built once, for the matrices it reads (a layer's stacks, not the projections stacked
    /// into them).
    fn with_activations(mut self, acts: Activations) -> Self {
        if acts == Activations::F32 {
            return self;
        }
        // Byte matrices have int16 kernels only (for widths of whole 256-column blocks): with
        // int8 they stay as they are (and shared, as a tied embedding shares the output
        // projection's).
        let convert = |q: &mut Arc<engram_qmatmul::QMatrix>| {
            if q.form() == engram_qmatmul::Form::Nibbles || acts == Activations::Int16 {
                *q = Arc::new((**q).clone().with_activations(acts));
            }
        };
        let convert_linear = |w: &mut Linear| {
            if let Linear::Blocks(q) = w {
                convert(q);
            }
        };
        // A tied embedding reads the output projection's converted matrix (its rows come back
        // from the panels): the weights stay held once.
        let tied = match (&self.embed, &self.lm_head) {
            (Embedding::Blocks(e), Linear::Blocks(o)) => Arc::ptr_eq(e, o),
            _ => false,
        };
        convert_linear(&mut self.lm_head);
        match (&mut self.embed, &self.lm_head) {
            (Embedding::Blocks(e), Linear::Blocks(o)) if tied => *e = o.clone(),
            // An embedding of its own is held in the panels too, for their compact scales
            // (`Q4_K`'s bytes rather than an f32 scale and offset per 32 columns: a 1.5B
            // model's embedding 175 → 139 MB) and six-bit bytes; its rows read back the same.
            (Embedding::Blocks(e), _) => convert(e),
            _ => {}
        }
        for (layer, stacked) in self.layers.iter_mut().zip(&mut self.stacked) {
            match stacked {
                Some(s) => {
                    convert(&mut s.qkv);
                    convert(&mut s.gate_up);
                    s.point(layer);
                    convert_linear(&mut layer.wo);
                    convert_linear(&mut layer.w_down);
                }
                None => [
                    &mut layer.wq,
                    &mut layer.wk,
                    &mut layer.wv,
                    &mut layer.wo,
                    &mut layer.w_gate,
                    &mut layer.w_up,
                    &mut layer.w_down,
                ]
                .into_iter()
                .for_each(convert_linear),
            }
        }
        self
    }

    /// Loads a Hugging Face directory (`config.json` + `model.safetensors` or its index).
    pub fn from_safetensors_dir(dir: &Path) -> ModelResult<Self> {
        Self::from_weights(Weights::from_safetensors_dir(dir)?)
    }

    /// Loads a GGUF file or a safetensors directory, whichever `path` is (GGUF weights in the
    /// default [`WeightFormat`]).
    pub fn load(path: &Path) -> ModelResult<Self> {
        Self::load_as(path, WeightFormat::default())
    }

    /// [`Self::load`] with GGUF weights held as `format` (safetensors are always dense).
    pub fn load_as(path: &Path, format: WeightFormat) -> ModelResult<Self> {
        if path.is_dir() {
            Self::from_safetensors_dir(path)
        } else {
            Self::from_gguf_as(path, format)
        }
    }

    /// [`Self::load_as`] with the format named (`int16`, `int8`, `quantized`, `f32`), and the
    /// model's tokenizer: what the command-line tools load.
    pub fn load_named(path: &Path, weights: &str) -> ModelResult<(Self, TextTokenizer)> {
        let format = WeightFormat::parse(weights).ok_or_else(|| ModelError::InvalidConfig {
            field: "weights",
            reason: format!("unknown weight format `{weights}` (int16, int8, quantized, f32)"),
        })?;
        Ok((
            Self::load_as(path, format)?,
            TextTokenizer::for_model(path)?,
        ))
    }

    fn from_weights(w: Weights) -> ModelResult<Self> {
        let config = w.config;
        let (cos, sin) = rope_tables(&config, config.rope_theta)?;
        let local_rope = match config.rope_local_theta {
            Some(theta) if theta != config.rope_theta => Some(rope_tables(&config, theta)?),
            _ => None,
        };
        let mut layers = w.layers;
        let stacked = layers.iter_mut().map(Stacked::of).collect();
        Ok(Self {
            arch: w.arch,
            device: Device::Cpu,
            kernels: cuda::KernelCache::default(),
            device_stacks: Arc::default(),
            cos,
            sin,
            local_rope,
            config,
            embed: w.embed,
            layers,
            norm: w.norm,
            lm_head: w.lm_head,
            fingerprint: w.fingerprint,
            key_means: Arc::new(OnceLock::new()),
            stacked,
            threads: 1,
        })
    }

    /// A model of the given shape with random weights (normal, σ 0.02; norms 1) built on
    /// `device`: for speed work where a real checkpoint cannot travel (the fingerprint covers the
    /// shape and the seed).
    pub fn random(config: ModelConfig, device: &Device, seed: u64) -> ModelResult<Self> {
        let w = Weights::random(config, device, seed)?;
        let mut m = Self::from_weights(w)?;
        m.cos = m.cos.to_device(device)?;
        m.sin = m.sin.to_device(device)?;
        m.device = device.clone();
        Ok(m)
    }

    /// The same model with its weights on `device` (dense weights only; bf16 projections on a
    /// CUDA device). Key means already calibrated come along.
    pub fn to_device(&self, device: &Device) -> ModelResult<Self> {
        self.to_device_as(device, DeviceWeights::default())
    }

    /// [`Self::to_device`] with the projections held as `held` says on a CUDA device.
    pub fn to_device_as(&self, device: &Device, held: DeviceWeights) -> ModelResult<Self> {
        if device.is_cuda() && !self.arch.is_plain() {
            return Err(ModelError::InvalidConfig {
                field: "device",
                reason: format!(
                    "the CUDA forward runs Llama's layer only; `{}` models run on the CPU",
                    self.arch.gguf
                ),
            });
        }
        let mv = |t: &Tensor| t.to_device(device);
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok(Layer {
                    attn_norm: mv(&l.attn_norm)?,
                    wq: l.wq.to_device(device, held)?,
                    wk: l.wk.to_device(device, held)?,
                    wv: l.wv.to_device(device, held)?,
                    wo: l.wo.to_device(device, held)?,
                    ffn_norm: mv(&l.ffn_norm)?,
                    w_gate: l.w_gate.to_device(device, held)?,
                    w_up: l.w_up.to_device(device, held)?,
                    w_down: l.w_down.to_device(device, held)?,
                    extra: l.extra.clone(),
                })
            })
            .collect::<ModelResult<Vec<_>>>()?;
        let (layers, device_stacks) = if device.is_cuda() {
            cuda::stack_layers(layers)?
        } else {
            (layers, Vec::new())
        };
        Ok(Self {
            arch: self.arch,
            device: device.clone(),
            kernels: cuda::KernelCache::default(),
            device_stacks: Arc::new(device_stacks),
            config: self.config.clone(),
            embed: if device.is_cpu() {
                self.embed.clone()
            } else {
                self.embed.to_device(device)?
            },
            layers,
            norm: mv(&self.norm)?,
            lm_head: self.lm_head.to_device(device, held)?,
            cos: mv(&self.cos)?,
            sin: mv(&self.sin)?,
            local_rope: self.local_rope.clone(),
            fingerprint: self.fingerprint,
            key_means: self.key_means.clone(),
            stacked: if device.is_cpu() {
                self.stacked.clone()
            } else {
                vec![None; self.layers.len()]
            },
            threads: self.threads,
        })
    }

    /// The same model on the CPU holding and multiplying its dense projections as a CUDA
    /// device holding them as `held` does (bf16: bf16-rounded activations and products) (embedding, norms and RoPE tables stay f32, as on the device). The CPU
    /// reference of `engram check device`.
    pub fn rounded_for_device(&self, held: DeviceWeights) -> ModelResult<Self> {
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok(Layer {
                    attn_norm: l.attn_norm.clone(),
                    wq: l.wq.rounded_for_device(held)?,
                    wk: l.wk.rounded_for_device(held)?,
                    wv: l.wv.rounded_for_device(held)?,
                    wo: l.wo.rounded_for_device(held)?,
                    ffn_norm: l.ffn_norm.clone(),
                    w_gate: l.w_gate.rounded_for_device(held)?,
                    w_up: l.w_up.rounded_for_device(held)?,
                    w_down: l.w_down.rounded_for_device(held)?,
                    extra: l.extra.clone(),
                })
            })
            .collect::<ModelResult<Vec<_>>>()?;
        Ok(Self {
            layers,
            lm_head: self.lm_head.rounded_for_device(held)?,
            // Means calibrated on other weights do not carry over.
            key_means: Arc::new(OnceLock::new()),
            ..self.clone()
        })
    }

    /// The numerics of weights held in the device's dtype (hashed into the KV fingerprint:
    /// bf16 products move K/V), or `None` when every projection is f32 or in GGUF blocks.
    pub fn device_weight_numerics(&self) -> Option<&'static str> {
        let mut linears = std::iter::once(&self.lm_head).chain(
            self.layers
                .iter()
                .flat_map(|l| [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down]),
        );
        linears
            .any(Linear::is_device_dtype)
            .then_some("weights=bf16-gemm-f32-accumulate/v1")
    }

    /// The device the weights are on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Mean post-RoPE key of every (layer, KV head) over a fixed calibration text,
    /// `[layers, kv_heads, head_dim]`, computed once per loaded model.
    ///
    /// Subtracting one vector from every key of a head shifts each query's scores by the same
    /// amount, so attention is unchanged exactly; but keys carry a large common component (on
    /// SmolLM2-135M about 60 % of their energy), and removing it before quantization lowers the
    /// codec's error, which is relative to the row norm.
    pub fn key_means(&self, tokenizer: &TextTokenizer) -> ModelResult<&[f32]> {
        Ok(&self.key_basis(tokenizer)?.means)
    }

    /// Per-channel key scales of every (layer, KV head) from the same calibration text,
    /// `[layers, kv_heads, head_dim]`.
    ///
    /// A stored key divided by `s` and each query multiplied by `s` leave every score
    /// unchanged; a codec's error on the stored key is spread over its channels (TurboQuant
    /// rotates before it quantizes), so its effect on a score grows with `‖q ⊙ s‖ · ‖k ⊘ s‖`.
    /// Over the calibration text that product is smallest at `s_c² = rms(k_c) / rms(q_c)`
    /// (keys centered, queries over the head's group): channels where keys are large and
    /// queries small (Qwen's outlier key channels, Gemma's normed keys) stop taking the codec's
    /// levels from those the scores read. A channel pair that RoPE rotates together shares one
    /// scale (so the scales commute with every rotation); a head's scales are centred on a
    /// geometric mean of 1, then clamped to 1/64…64.
    pub fn key_scales(&self, tokenizer: &TextTokenizer) -> ModelResult<&[f32]> {
        Ok(&self.key_basis(tokenizer)?.scales)
    }

    fn key_basis(&self, tokenizer: &TextTokenizer) -> ModelResult<&KeyBasis> {
        if let Some(m) = self.key_means.get() {
            return Ok(m);
        }
        let m = self.calibrate_key_basis(tokenizer)?;
        Ok(self.key_means.get_or_init(|| m))
    }

    fn calibrate_key_basis(&self, tokenizer: &TextTokenizer) -> ModelResult<KeyBasis> {
        let tokens = tokenizer.encode(CALIBRATION_TEXT)?;
        let cfg = &self.config;
        let shape = self.kv_shape(engram_kvcore::DEFAULT_BLOCK_SIZE)?;
        let n = tokens.len().min(cfg.context_length);
        let blocks_needed = n.div_ceil(shape.block_size);
        let mut store = BlockStore::new(StoreConfig::new(
            shape,
            CodecKind::F32,
            blocks_needed as u32,
            0,
        ))?;
        let tags = BlockTags {
            source: engram_kvcore::SourceLayer::SystemState,
            importance: 0.0,
            tenant: engram_kvcore::TenantId(0),
            session: None,
            tokens: engram_kvcore::TokenRange::new(0, shape.block_size as u32),
        };
        let blocks = store.allocate(Tier::Hot, &vec![tags; blocks_needed])?;
        let queries = QueryEnergy::new(cfg);
        self.forward_with(
            &mut store,
            &[SeqInput {
                tokens: &tokens[..n],
                start: 0,
                blocks: &blocks,
                logits: LogitRows::Last,
                prompt: true,
                relocated: &[],
            }],
            KvTransform {
                probe: Some(&queries),
                ..KvTransform::default()
            },
        )?;
        let width = cfg.num_kv_heads * cfg.head_dim;
        let mut means = vec![0.0f32; cfg.num_layers * width];
        let mut key_energy = vec![0.0f64; cfg.num_layers * width];
        let (mut k, mut v) = (vec![0.0f32; n * width], vec![0.0f32; n * width]);
        // Position 0 (an attention sink with an unusual key) is left out of the mean.
        let counted = (n - 1).max(1) as f64;
        for (l, (mean, energy)) in means
            .chunks_exact_mut(width)
            .zip(key_energy.chunks_exact_mut(width))
            .enumerate()
        {
            store.read(l, &blocks, 0, &mut k, &mut v)?;
            let mut acc = vec![0.0f64; width];
            for row in k.chunks_exact(width).skip(1) {
                acc.iter_mut()
                    .zip(row)
                    .for_each(|(a, &x)| *a += f64::from(x));
            }
            mean.iter_mut()
                .zip(&acc)
                .for_each(|(m, a)| *m = (a / counted) as f32);
            // The centered keys' energy per channel (what a codec stores).
            for row in k.chunks_exact(width).skip(1) {
                for ((e, &x), &m) in energy.iter_mut().zip(row).zip(mean.iter()) {
                    *e += f64::from(x - m).powi(2);
                }
            }
        }
        let scales = key_scales_from(&key_energy, &queries.energy(), cfg.head_dim);
        Ok(KeyBasis { means, scales })
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The model's family.
    pub fn arch(&self) -> &'static Arch {
        self.arch
    }

    /// The model with its CPU kernels split over `threads` threads (at least 1). The split
    /// decides the summation order, so results are the same for a given value.
    pub fn with_threads(mut self, threads: usize) -> Self {
        self.threads = threads.max(1);
        self
    }

    /// How the weights are held: [`WeightFormat::Int8`] or [`WeightFormat::Int16`] when a
    /// projection multiplies with integer activations, else [`WeightFormat::Quantized`] when any
    /// is kept in its GGUF blocks (their numerics are hashed into the KV fingerprint).
    pub fn weight_format(&self) -> WeightFormat {
        let linears = || {
            std::iter::once(&self.lm_head).chain(
                self.layers
                    .iter()
                    .flat_map(|l| [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down]),
            )
        };
        let blocks = |w: &&Linear| w.blocks().is_some();
        let acts =
            |a: Activations| move |w: &&Linear| w.blocks().is_some_and(|q| q.activations() == a);
        if linears().any(|w| acts(Activations::Int8)(&w)) {
            WeightFormat::Int8
        } else if linears().any(|w| acts(Activations::Int16)(&w)) {
            WeightFormat::Int16
        } else if linears().any(|w| blocks(&w)) {
            WeightFormat::Quantized
        } else {
            WeightFormat::F32
        }
    }

    /// Threads the CPU kernels split work over.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// The model serving at most `tokens` of context (at least 1, at most the model's own):
    /// sequences longer than that are refused, and an engine's hot tier need only hold that.
    pub fn with_context_length(mut self, tokens: usize) -> ModelResult<Self> {
        if tokens == 0 || tokens > self.config.context_length {
            return Err(ModelError::InvalidConfig {
                field: "context_length",
                reason: format!("{tokens} is not in 1..={}", self.config.context_length),
            });
        }
        self.cos = self.cos.narrow(0, 0, tokens)?;
        self.sin = self.sin.narrow(0, 0, tokens)?;
        if let Some((cos, sin)) = &self.local_rope {
            self.local_rope = Some((cos.narrow(0, 0, tokens)?, sin.narrow(0, 0, tokens)?));
        }
        self.config.context_length = tokens;
        Ok(self)
    }

    /// SHA-256 of the model's files: part of every prefix-cache hash.
    pub fn fingerprint(&self) -> [u8; 32] {
        self.fingerprint
    }

    /// Bytes of weights one CPU decode step reads: each layer's projections (the stacks where
    /// the forward reads them), its norms, the output projection and one embedding row. With
    /// a decode step's time this is the weights' share of the memory bandwidth it used.
    pub fn decode_weight_bytes(&self) -> usize {
        let linear = |w: &Linear| match w {
            Linear::Dense(t) => t.elem_count() * t.dtype().size_in_bytes(),
            Linear::Blocks(q) => q.bytes(),
            // Counted once, as its stack.
            Linear::Part { .. } => 0,
        };
        let tensor = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        let layers: usize = self
            .layers
            .iter()
            .zip(&self.stacked)
            .map(|(l, s)| {
                let stacked = s.as_ref().map_or(0, |s| s.qkv.bytes() + s.gate_up.bytes());
                stacked
                    + [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down]
                        .into_iter()
                        .map(linear)
                        .sum::<usize>()
                    + tensor(&l.attn_norm)
                    + tensor(&l.ffn_norm)
            })
            .sum();
        let rows = self.embed.rows().unwrap_or(1).max(1);
        let embed_row = match &self.embed {
            Embedding::Dense(t) => tensor(t) / rows,
            Embedding::Blocks(q) => q.bytes() / rows,
        };
        layers + linear(&self.lm_head) + tensor(&self.norm) + embed_row
    }

    /// The KV geometry a store needs for this model (block size as given).
    pub fn kv_shape(&self, block_size: usize) -> ModelResult<KvShape> {
        Ok(KvShape::with_block_size(
            self.config.num_layers,
            self.config.num_kv_heads,
            self.config.head_dim,
            block_size,
        )?)
    }

    /// Runs one ragged batch; writes every new token's K/V into its blocks and returns the
    /// requested logits, `[rows, vocab]`, sequence by sequence in batch order.
    pub fn forward(&self, store: &mut BlockStore, batch: &[SeqInput<'_>]) -> ModelResult<Tensor> {
        self.forward_with(store, batch, KvTransform::default())
    }

    /// [`Self::forward`] with a transform of every new K/V row before it is stored: key
    /// centering (see [`Self::key_means`]) and, for the fidelity harness, a probe.
    pub fn forward_with(
        &self,
        store: &mut BlockStore,
        batch: &[SeqInput<'_>],
        transform: KvTransform<'_>,
    ) -> ModelResult<Tensor> {
        Ok(self
            .forward_unsynced(store, batch, transform)?
            .to_device(&Device::Cpu)?)
    }

    /// [`Self::forward_with`] whose logits may still be on the model's device, being computed:
    /// on a GPU the host can do its bookkeeping for the step (registering the blocks) while the
    /// card finishes, and then copy them (`to_device`, which waits for the card).
    pub fn forward_unsynced(
        &self,
        store: &mut BlockStore,
        batch: &[SeqInput<'_>],
        transform: KvTransform<'_>,
    ) -> ModelResult<Tensor> {
        if store.hot().cuda().is_some() {
            if transform.key_scales.is_some() {
                return Err(ModelError::InvalidConfig {
                    field: "key_scales",
                    reason: "the CUDA forward does not scale keys".into(),
                });
            }
            if batch.iter().any(|s| !s.relocated.is_empty()) {
                return Err(ModelError::InvalidConfig {
                    field: "relocated",
                    reason: "the CUDA forward does not read relocated runs".into(),
                });
            }
            return self.forward_cuda(store, batch, transform);
        }
        if !self.device.is_cpu() {
            return Err(ModelError::InvalidConfig {
                field: "device",
                reason: "the model is on a device but the KV hot tier is in host memory".into(),
            });
        }
        let (ids, positions) = self.check_batch(store, batch)?;
        self.forward_cpu_layers(store, batch, transform, ids, positions)
    }

    /// Validates a batch against the model and the store; returns the concatenated new tokens
    /// and their positions.
    fn check_batch(
        &self,
        store: &BlockStore,
        batch: &[SeqInput<'_>],
    ) -> ModelResult<(Vec<u32>, Vec<u32>)> {
        let cfg = &self.config;
        let bs = store.shape().block_size;
        let mut ids = Vec::new();
        let mut positions = Vec::new();
        for s in batch {
            let end = s.start + s.tokens.len();
            if s.tokens.is_empty() {
                return Err(ModelError::EmptyPrompt);
            }
            if end > cfg.context_length {
                return Err(ModelError::ContextOverflow {
                    requested: end,
                    context: cfg.context_length,
                });
            }
            if let Some(&id) = s.tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
                return Err(ModelError::TokenOutOfRange {
                    id,
                    vocab: cfg.vocab_size,
                });
            }
            if s.blocks.len() < end.div_ceil(bs) {
                return Err(ModelError::InvalidConfig {
                    field: "blocks",
                    reason: format!(
                        "a block table of {} blocks cannot hold {end} tokens",
                        s.blocks.len()
                    ),
                });
            }
            // Relocation turns keys by the model's one RoPE base over the whole context.
            if !s.relocated.is_empty() && !self.arch.is_plain() {
                return Err(ModelError::InvalidConfig {
                    field: "relocated",
                    reason: format!("`{}` models do not read relocated runs", self.arch.gguf),
                });
            }
            // Relocated runs cover whole blocks already computed, in order: a run over the
            // positions this batch writes would read their fresh keys shifted.
            let mut at = 0;
            for r in s.relocated {
                if r.start < at
                    || r.start >= r.end
                    || r.end > s.start
                    || r.start % bs != 0
                    || r.end % bs != 0
                {
                    return Err(ModelError::InvalidConfig {
                        field: "relocated",
                        reason: format!(
                            "run {}..{} must be whole blocks of {bs}, in order, before position {}",
                            r.start, r.end, s.start
                        ),
                    });
                }
                at = r.end;
            }
            ids.extend_from_slice(s.tokens);
            positions.extend((s.start..end).map(|p| p as u32));
        }
        Ok((ids, positions))
    }

    /// The logit rows `batch` asks for, as indices into its concatenated new tokens.
    fn logit_rows(batch: &[SeqInput<'_>]) -> Vec<u32> {
        let mut rows = Vec::new();
        let mut off = 0u32;
        for s in batch {
            let m = s.tokens.len() as u32;
            match s.logits {
                LogitRows::Last => rows.push(off + m - 1),
                LogitRows::All => rows.extend(off..off + m),
            }
            off += m;
        }
        rows
    }
}

/// The `[context, head_dim / 2]` cosine and sine tables of RoPE with base `theta`, each inverse
/// frequency divided by the model's scaling factor where it has one.
fn rope_tables(config: &ModelConfig, theta: f64) -> ModelResult<(Tensor, Tensor)> {
    let half = config.head_dim / 2;
    let factors = config.rope_freq_factors.as_deref();
    let inv: Vec<f32> = (0..half)
        .map(|i| {
            let f = 1.0 / theta.powf(2.0 * i as f64 / config.head_dim as f64) as f32;
            factors.map_or(f, |d| f / d[i])
        })
        .collect();
    let ctx = config.context_length;
    let mut angles = Vec::with_capacity(ctx * half);
    for p in 0..ctx {
        angles.extend(inv.iter().map(|f| p as f32 * f));
    }
    let angles = Tensor::from_vec(angles, (ctx, half), &Device::Cpu)?;
    Ok((angles.cos()?, angles.sin()?))
}

/// Additive causal mask `[new, start + new]`: token `i` (position `start + i`) sees positions
/// `≤ start + i`. `None` for a single token, which sees everything.
fn causal_mask(start: usize, new: usize) -> ModelResult<Option<Tensor>> {
    causal_mask_on(start, new, &Device::Cpu)
}

/// [`causal_mask`] on `dev`.
fn causal_mask_on(start: usize, new: usize, dev: &Device) -> ModelResult<Option<Tensor>> {
    if new == 1 {
        return Ok(None);
    }
    let total = start + new;
    let mut m = vec![0.0f32; new * total];
    for i in 0..new {
        m[i * total + start + i + 1..(i + 1) * total].fill(f32::NEG_INFINITY);
    }
    Ok(Some(Tensor::from_vec(m, (new, total), dev)?))
}

/// Causal attention of `q: [new, heads, d]` over positions `0..total` of the blocks, decoded
/// once from the store. Returns `[new, heads·d]`.
fn dense_attention(
    store: &BlockStore,
    layer: usize,
    blocks: &[BlockId],
    total: usize,
    q: &Tensor,
    mask: &Option<Tensor>,
    cfg: &ModelConfig,
) -> ModelResult<Tensor> {
    let (kv_heads, d) = (cfg.num_kv_heads, cfg.head_dim);
    let n = total * kv_heads * d;
    let (mut kb, mut vb) = (vec![0.0f32; n], vec![0.0f32; n]);
    store.read(layer, blocks, 0, &mut kb, &mut vb)?;
    let dev = Device::Cpu;
    let k = Tensor::from_vec(kb, (total, kv_heads, d), &dev)?;
    let v = Tensor::from_vec(vb, (total, kv_heads, d), &dev)?;
    attend_rows(&k, &v, q, mask, cfg)
}

/// Causal attention of `q: [new, heads, d]` over decoded `k`, `v`: `[total, kv_heads, d]` on
/// the same device. Returns `[new, heads·d]`.
pub(crate) fn attend_rows(
    k: &Tensor,
    v: &Tensor,
    q: &Tensor,
    mask: &Option<Tensor>,
    cfg: &ModelConfig,
) -> ModelResult<Tensor> {
    let (heads, kv_heads, d) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
    let group = heads / kv_heads;
    let new = q.dim(0)?;
    let total = k.dim(0)?;
    let k = k.transpose(0, 1)?.contiguous()?;
    let v = v.transpose(0, 1)?.contiguous()?;
    // Query head h uses KV head h / group: fold the group into the row axis.
    let q = q
        .reshape((new, kv_heads, group, d))?
        .permute((1, 2, 0, 3))?
        .reshape((kv_heads, group * new, d))?
        .contiguous()?;
    let scale = 1.0 / (d as f64).sqrt();
    let att = (q.matmul(&k.t()?)? * scale)?;
    let att = match mask {
        Some(mask) => att
            .reshape((kv_heads, group, new, total))?
            .broadcast_add(mask)?
            .reshape((kv_heads, group * new, total))?,
        None => att,
    };
    let p = candle_nn::ops::softmax_last_dim(&att)?;
    let out = p
        .matmul(&v)?
        .reshape((kv_heads, group, new, d))?
        .permute((2, 0, 1, 3))?
        .reshape((new, heads * d))?;
    Ok(out.contiguous()?)
}

/// Row-wise log-softmax of `[rows, vocab]` logits, as f32 vectors.
pub fn log_softmax_rows(logits: &Tensor) -> ModelResult<Vec<Vec<f32>>> {
    let l = logits.to_dtype(DType::F32)?;
    let max = l.max_keepdim(D::Minus1)?;
    let shifted = l.broadcast_sub(&max)?;
    let lse = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    Ok(shifted.broadcast_sub(&lse)?.to_vec2()?)
}
