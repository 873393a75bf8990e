//! The forward pass on a CUDA device (feature `cuda`): the same API and the same arithmetic as
//! the CPU path, with the KV hot tier in VRAM.
//!
//! - The four products of a layer (q/k/v and gate/up stacked) are candle matmuls (cuBLAS);
//!   with bf16 weights, a decode step of one or two tokens takes `gemv_bf16` instead (one warp
//!   per output column, the weights read once at the memory's pace; cuBLAS's small-N kernels
//!   read them at 55–85 % of it). `ENGRAM_CUDA_GEMV=off` keeps cuBLAS (a diagnostic).
//! - Around them, where every projection is dense on the device, the fused glue of
//!   `engram-kernels` (`glue.cu`): residual + RMSNorm writing the next product's operand, RoPE +
//!   key centering + the TQ4 encode of the new K and V rows into their blocks (one launch, from
//!   the q/k/v product), SwiGLU. Otherwise (or with `ENGRAM_CUDA_GLUE=candle`) norms, RoPE and
//!   the MLP are candle ops and `tq4_encode` writes K and V (one launch each per layer).
//! - Decode tokens of the whole batch attend in one launch per layer, over their block tables,
//!   from the packed codes: the tensor-core kernel (`tq4_decode_mma`, work items planned once
//!   per forward) on 16-position blocks, the FP32 kernel (`tq4_decode_attention`) otherwise;
//!   then one combine launch (writing the output product's bf16 operand when it can).
//! - A prefill chunk attends causally over its context's codes on tensor cores
//!   (`tq4_prefill_mma`: each 64-position tile dequantized once into shared memory for all of
//!   the CTA's query rows) on 16-position blocks; with other block sizes it decodes the rows of
//!   its context once per layer with `tq4_decode_rows` and attends with dense products
//!   ([`super::attend_rows`], shared with the CPU path).
//!
//! Index tables (encode destinations, block tables, decoded row sources) depend only on the
//! batch, so they are built and uploaded once per forward, not per layer.

use std::sync::{Arc, Mutex};

use candle_core::cuda::CudaDType;
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, DType, Device, Storage, Tensor};
use cudarc::driver::{CudaSlice, CudaStream, CudaView, DeviceRepr};
use engram_kernels::glue::GEMV_MAX_ROWS;
use engram_kernels::gpu::{
    Act, ActBuf, DecodeBatch, MmaWork, PinnedF32, PrefillChunk, QkvGlue, Tq4Kernels, Workspace,
};
use engram_kernels::{DEFAULT_CHUNK, KernelError, PAGE, PageLayout};
use engram_kvcore::{BlockStore, CodecKind};

use super::{KvTransform, Llama, SeqInput, attend_rows, causal_mask_on};
use crate::error::{ModelError, ModelResult};
use crate::held::Linear;
use crate::weights::Layer;

#[path = "cuda_ops.rs"]
mod ops;
use ops::rope;

fn dev_err(e: impl std::fmt::Display) -> ModelError {
    ModelError::Device(e.to_string())
}

impl From<KernelError> for ModelError {
    fn from(e: KernelError) -> Self {
        dev_err(e)
    }
}

/// The decode kernel of a forward and its scratch.
enum DecodeWork {
    /// The tensor-core kernel's plan (16-position blocks).
    Mma(Box<MmaWork>),
    /// The FP32 kernel's split-K partials.
    Fp32(Workspace),
}

/// Kernels compiled for one rotation seed.
type SeededKernels = (u64, Arc<Tq4Kernels>);

/// The TQ4 kernels compiled for a store's codec, the pinned host buffers a step's attention
/// mass is copied into (see [`Llama::stage_mass`]) and the key means last uploaded (see
/// [`Llama::device_means`]), shared by clones of the model.
#[derive(Debug, Clone, Default)]
pub(crate) struct KernelCache {
    seeded: Arc<Mutex<Option<SeededKernels>>>,
    mass_host: Arc<Mutex<Vec<PinnedF32>>>,
    means: Arc<Mutex<Option<DeviceMeans>>>,
}

/// Key means as the caller gave them, and their copy on the device.
type DeviceMeans = (Vec<f32>, Tensor);

/// Locks one of the [`KernelCache`]'s parts (`what` names it in the error).
fn lock<'m, T>(m: &'m Mutex<T>, what: &str) -> ModelResult<std::sync::MutexGuard<'m, T>> {
    m.lock()
        .map_err(|_| dev_err(format!("the lock of {what} is poisoned")))
}

/// Runs `f` over the device memory of `t` (f32, made contiguous first).
fn with_view<R>(t: &Tensor, f: impl FnOnce(CudaView<'_, f32>) -> ModelResult<R>) -> ModelResult<R> {
    with_view_of::<f32, R>(t, f)
}

/// Runs `f` over the device memory of `t` as `T` (made contiguous first).
fn with_view_of<T: CudaDType + DeviceRepr, R>(
    t: &Tensor,
    f: impl FnOnce(CudaView<'_, T>) -> ModelResult<R>,
) -> ModelResult<R> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(cs) = &*storage else {
        return Err(dev_err("a tensor of the CUDA forward is not on the device"));
    };
    let slice = cs.as_cuda_slice::<T>()?;
    let off = layout.start_offset();
    f(slice.slice(off..off + t.elem_count()))
}

/// Wraps device memory as a tensor of `shape`.
fn tensor<T: CudaDType>(slice: CudaSlice<T>, dev: &CudaDevice, shape: (usize, usize)) -> Tensor {
    let storage = CudaStorage::wrap_cuda_slice(slice, dev.clone());
    Tensor::from_storage(Storage::Cuda(storage), shape, BackpropOp::none(), false)
}

/// A glue output as a tensor of `shape`.
fn act_tensor(buf: ActBuf, dev: &CudaDevice, shape: (usize, usize)) -> Tensor {
    match buf {
        ActBuf::F32(s) => tensor(s, dev, shape),
        ActBuf::Bf16(s) => tensor(s, dev, shape),
    }
}

/// Rows up to which the forward's products take `gemv_bf16` (the kernel takes up to
/// [`GEMV_MAX_ROWS`]): end to end on an H100 (8B shape, 4K context) it beat cuBLAS at one row
/// (6.92 vs 7.64 ms a step) and two (7.74 vs 8.05), and lost at four (9.19 vs 8.53), where its
/// per-row bf16 widening makes it ALU-bound.
const GEMV_ROWS: usize = 2;
const _: () = assert!(
    GEMV_ROWS <= GEMV_MAX_ROWS,
    "gemv_bf16 takes at most GEMV_MAX_ROWS rows"
);

/// `x · wᵀ` (`x` `[n, k]`, `w` `[m, k]`): a decode step of at most [`GEMV_ROWS`] rows with bf16
/// operands takes the few-row kernel, anything else candle's matmul (cuBLAS).
fn product(kernels: &Tq4Kernels, cuda: &CudaDevice, x: &Tensor, w: &Tensor) -> ModelResult<Tensor> {
    // `ENGRAM_CUDA_GEMV=off`: cuBLAS for every product (a diagnostic switch, read once).
    static GEMV_OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let off = *GEMV_OFF.get_or_init(|| std::env::var("ENGRAM_CUDA_GEMV").is_ok_and(|v| v == "off"));
    let (n, k) = x.dims2()?;
    let (m, kw) = w.dims2()?;
    if !off
        && (1..=GEMV_ROWS).contains(&n)
        && k == kw
        && x.dtype() == DType::BF16
        && w.dtype() == DType::BF16
        && x.is_contiguous()
        && w.is_contiguous()
    {
        let (xh, wh) = (hold(x)?, hold(w)?);
        let y = kernels.gemv_bf16(&xh.view()?, n, k, &wh.view()?, m)?;
        return Ok(tensor(y, cuda, (n, m)));
    }
    Ok(x.matmul(&w.t()?)?)
}

/// The dense weight of a projection, if it is one.
fn dense(w: &Linear) -> Option<&Tensor> {
    match w {
        Linear::Dense(t) => Some(t),
        Linear::Blocks(_) | Linear::Part { .. } => None,
    }
}

/// The state of the fused layer glue over one forward: the residual stream as one f32 buffer
/// updated in place, the tokens' positions on the device, and the next product operand.
struct Glue {
    /// The products' operand type (the weights').
    dtype: DType,
    /// `[n, hidden]` f32, the residual stream.
    x: CudaSlice<f32>,
    /// Each token's position.
    positions: CudaSlice<i32>,
    /// The current layer's normed input `[n, hidden]` as a product operand.
    h: Option<Tensor>,
}

/// A layer's projections that read the same input, stacked on the device: one product for
/// q, k and v and one for gate and up (the layer's own weights are views of these, so nothing
/// is held twice).
#[derive(Debug, Clone)]
pub(crate) struct DeviceStack {
    /// `[wq; wk; wv]`.
    qkv: Tensor,
    /// `[w_gate; w_up]`.
    gate_up: Tensor,
}

/// A contiguous tensor's storage held for reading (the glue's launches take views of it).
struct Held<'t> {
    storage: Box<dyn std::ops::Deref<Target = Storage> + 't>,
    off: usize,
    len: usize,
    dtype: DType,
}

/// Holds `t`'s storage; `t` must be contiguous (every tensor the glue reads is: products,
/// tables and its own outputs).
fn hold(t: &Tensor) -> ModelResult<Held<'_>> {
    if !t.is_contiguous() {
        return Err(dev_err("the CUDA glue reads contiguous tensors only"));
    }
    let (storage, layout) = t.storage_and_layout();
    Ok(Held {
        storage: Box::new(storage),
        off: layout.start_offset(),
        len: t.elem_count(),
        dtype: t.dtype(),
    })
}

impl Held<'_> {
    fn view<T: CudaDType + DeviceRepr>(&self) -> ModelResult<CudaView<'_, T>> {
        let Storage::Cuda(cs) = &**self.storage else {
            return Err(dev_err("a tensor of the CUDA forward is not on the device"));
        };
        Ok(cs
            .as_cuda_slice::<T>()?
            .slice(self.off..self.off + self.len))
    }

    fn act(&self) -> ModelResult<Act<'_>> {
        match self.dtype {
            DType::BF16 => Ok(Act::Bf16(self.view()?)),
            DType::F32 => Ok(Act::F32(self.view()?)),
            other => Err(dev_err(format!("a {other:?} activation in the CUDA glue"))),
        }
    }
}

/// The glue's residual and norm: `x += delta` (when given), then the rows normed by `w` (when
/// given) as the next product's operand `[n, hidden]`.
#[allow(clippy::too_many_arguments)]
fn glue_norm(
    kernels: &Tq4Kernels,
    g: &mut Glue,
    cuda: &CudaDevice,
    n: usize,
    hidden: usize,
    delta: Option<&Tensor>,
    w: Option<&Tensor>,
    eps: f32,
) -> ModelResult<Option<Tensor>> {
    let delta_h = delta.map(hold).transpose()?;
    let delta_a = delta_h.as_ref().map(Held::act).transpose()?;
    let w_h = w.map(hold).transpose()?;
    let w_v = w_h.as_ref().map(Held::view::<f32>).transpose()?;
    let out = kernels.add_rms_norm(
        &mut g.x.slice_mut(..),
        n,
        hidden,
        delta_a.as_ref(),
        w_v.as_ref().map(|w| (w, eps, g.dtype == DType::BF16)),
    )?;
    Ok(out.map(|o| act_tensor(o, cuda, (n, hidden))))
}

/// Stacks every layer's q/k/v and gate/up weights (dense on the device); the layers' weights
/// become views of the stacks. Layers whose weights are not all dense are left as they are, and
/// then no layer is stacked.
pub(crate) fn stack_layers(layers: Vec<Layer>) -> ModelResult<(Vec<Layer>, Vec<DeviceStack>)> {
    if !layers.iter().all(|l| {
        [&l.wq, &l.wk, &l.wv, &l.w_gate, &l.w_up]
            .into_iter()
            .all(|w| dense(w).is_some())
    }) {
        return Ok((layers, Vec::new()));
    }
    let mut out = Vec::with_capacity(layers.len());
    let mut stacks = Vec::with_capacity(layers.len());
    for l in layers {
        let (Some(q), Some(k), Some(v), Some(g), Some(u)) = (
            dense(&l.wq),
            dense(&l.wk),
            dense(&l.wv),
            dense(&l.w_gate),
            dense(&l.w_up),
        ) else {
            return Err(dev_err("a projection left the device's dense form"));
        };
        let (nq, nk, nv, ff) = (q.dim(0)?, k.dim(0)?, v.dim(0)?, g.dim(0)?);
        let qkv = Tensor::cat(&[q, k, v], 0)?;
        let gate_up = Tensor::cat(&[g, u], 0)?;
        out.push(Layer {
            wq: Linear::Dense(qkv.narrow(0, 0, nq)?),
            wk: Linear::Dense(qkv.narrow(0, nq, nk)?),
            wv: Linear::Dense(qkv.narrow(0, nq + nk, nv)?),
            w_gate: Linear::Dense(gate_up.narrow(0, 0, ff)?),
            w_up: Linear::Dense(gate_up.narrow(0, ff, u.dim(0)?)?),
            ..l
        });
        stacks.push(DeviceStack { qkv, gate_up });
    }
    Ok((out, stacks))
}

/// `x · wᵀ` for a stacked matrix, as [`Linear::forward`] multiplies (bf16 operands, f32 out).
fn stacked_product(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    x.to_dtype(w.dtype())?.matmul(&w.t()?)?.to_dtype(DType::F32)
}

/// The rest of a decoder layer through the stacked gate/up product: output projection and
/// residual, then the SwiGLU MLP (silu and product in f32, as the CPU) and its residual.
fn finish_stacked(
    layer: &Layer,
    st: &DeviceStack,
    x: &Tensor,
    attn: &Tensor,
    eps: f32,
) -> candle_core::Result<Tensor> {
    let x = (x + layer.wo.forward(attn, 1)?)?;
    let h = candle_nn::ops::rms_norm(&x, &layer.ffn_norm, eps)?;
    let gu = stacked_product(&h, &st.gate_up)?;
    let ff = gu.dim(1)? / 2;
    let act = (candle_nn::ops::silu(&gu.narrow(1, 0, ff)?)? * gu.narrow(1, ff, ff)?)?;
    x + layer.w_down.forward(&act, 1)?
}

/// How a prefill chunk reads its context.
enum PrefillKeys {
    /// The sequence's page slots: the tensor-core kernel attends over the codes
    /// (16-position blocks).
    Pages(CudaSlice<i32>),
    /// Plane rows of positions `0..total` (`[total, kv_heads]` flattened), decoded to f32 for
    /// dense products, and the causal mask (other block sizes, or a card whose shared memory
    /// does not hold the tensor-core kernel's CTA).
    Rows(CudaSlice<i32>, Option<Tensor>),
}

/// One prefill sequence's part of the batch.
struct Prefill {
    /// Row offset of its new tokens in the batch.
    off: usize,
    /// New tokens.
    m: usize,
    /// Position of the first.
    start: usize,
    /// Context positions (start + m).
    total: usize,
    keys: PrefillKeys,
}

impl Llama {
    fn kernels(
        &self,
        store: &BlockStore,
        stream: &Arc<CudaStream>,
    ) -> ModelResult<Arc<Tq4Kernels>> {
        if store.codec_kinds().single() != Some(CodecKind::TurboQuant { bits: 4 }) {
            return Err(ModelError::InvalidConfig {
                field: "codec",
                reason: "the CUDA engine stores KV as TurboQuant-4 (codec tq4) in every layer, \
                         keys and values alike"
                    .into(),
            });
        }
        let seed = store.rotation_seed();
        let mut cache = lock(&self.kernels.seeded, "the kernel cache")?;
        if let Some((s, k)) = cache.as_ref()
            && *s == seed
        {
            return Ok(k.clone());
        }
        let group = self.config.num_heads / self.config.num_kv_heads;
        let k = Arc::new(Tq4Kernels::new(
            stream.clone(),
            store.key_codec(0)?,
            group,
            DEFAULT_CHUNK,
        )?);
        *cache = Some((seed, k.clone()));
        Ok(k)
    }

    /// Queues the copy of a step's attention mass (written by the middle layer's decode kernel)
    /// into pinned host memory, in stream order, so the host can fold it while the card runs the
    /// later layers instead of after the logits. Buffers are reused across steps (a pinned
    /// buffer's free would wait for the device); a new one is sized with headroom for the
    /// tables' growth.
    fn stage_mass(
        &self,
        stream: &Arc<CudaStream>,
        mass: &CudaSlice<f32>,
    ) -> ModelResult<PinnedF32> {
        let len = mass.len();
        let pooled = lock(&self.kernels.mass_host, "the mass buffers")?
            .pop()
            .filter(|h| h.capacity() >= len);
        let mut host = match pooled {
            Some(h) => h,
            None => PinnedF32::new(stream.context(), len.next_power_of_two().max(1024))?,
        };
        host.copy_from(stream, mass)?;
        Ok(host)
    }

    /// The key means `[layers, kv_heads, head_dim]` on the device: uploaded once and reused
    /// while the caller passes the same values (a step compares them on the host instead of
    /// copying them again).
    fn device_means(&self, means: &[f32]) -> ModelResult<Tensor> {
        let cfg = &self.config;
        let shape = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim);
        let mut cache = lock(&self.kernels.means, "the key means")?;
        if let Some((host, dev)) = cache.as_ref()
            && host.as_slice() == means
        {
            return Ok(dev.clone());
        }
        let dev = Tensor::from_slice(means, shape, &self.device)?;
        *cache = Some((means.to_vec(), dev.clone()));
        Ok(dev)
    }

    /// Waits for a staged mass copy (not for the rest of the stream), folds row `k` of
    /// `stride` values into the blocks of `tables[k]`, and returns the buffer to the pool.
    fn fold_staged<'t>(
        &self,
        store: &mut BlockStore,
        host: PinnedF32,
        stride: usize,
        tables: impl Iterator<Item = &'t [engram_kvcore::BlockId]>,
    ) -> ModelResult<()> {
        let mass = host.read()?;
        for (k, blocks) in tables.enumerate() {
            let row = mass
                .get(k * stride..k * stride + blocks.len())
                .ok_or_else(|| dev_err("the mass rows are shorter than the batch"))?;
            super::cpu::fold_mass(store, blocks, row)?;
        }
        let mut pool = lock(&self.kernels.mass_host, "the mass buffers")?;
        if pool.len() < 2 {
            pool.push(host);
        }
        Ok(())
    }

    /// The products' operand type when the fused glue can run this model: every layer's
    /// projections dense on the device (q/k/v and gate/up stacked) and of one type, f32 or bf16.
    /// `ENGRAM_CUDA_GLUE=candle` keeps the candle ops (a diagnostic switch, read once).
    fn glue_dtype(&self) -> Option<DType> {
        static CANDLE_GLUE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        if *CANDLE_GLUE
            .get_or_init(|| std::env::var("ENGRAM_CUDA_GLUE").is_ok_and(|v| v == "candle"))
        {
            return None;
        }
        let dtype = self.device_stacks.first()?.qkv.dtype();
        let same = |t: Option<&Tensor>| t.is_some_and(|t| t.dtype() == dtype);
        let all = self.device_stacks.len() == self.layers.len()
            && self
                .device_stacks
                .iter()
                .all(|st| st.gate_up.dtype() == dtype)
            && self
                .layers
                .iter()
                .all(|l| same(dense(&l.wo)) && same(dense(&l.w_down)));
        (all && matches!(dtype, DType::F32 | DType::BF16)).then_some(dtype)
    }

    /// A layer's queries through candle ops (models the glue does not cover): norm, q/k/v
    /// products, RoPE, key centering, then K and V encoded into the layer's planes.
    #[allow(clippy::too_many_arguments)]
    fn qkv_candle(
        &self,
        store: &mut BlockStore,
        kernels: &Tq4Kernels,
        (x, layer, stack, l): (&Tensor, &Layer, Option<&DeviceStack>, usize),
        (cos, sin): (&Tensor, &Tensor),
        means: Option<&Tensor>,
        dst: &CudaSlice<i32>,
        n: usize,
    ) -> ModelResult<Tensor> {
        let cfg = &self.config;
        let (heads, kv_heads, d) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let h = candle_nn::ops::rms_norm(x, &layer.attn_norm, cfg.rms_eps as f32)?;
        let (q, mut k, v) = match stack {
            Some(st) => {
                let qkv = stacked_product(&h, &st.qkv)?;
                let w = (heads + kv_heads) * d;
                let qk = qkv
                    .narrow(1, 0, w)?
                    .contiguous()?
                    .reshape((1, n, heads + kv_heads, d))?;
                let qk = candle_nn::rotary_emb::rope_thd(&qk, cos, sin)?.reshape((
                    n,
                    heads + kv_heads,
                    d,
                ))?;
                (
                    qk.narrow(1, 0, heads)?.contiguous()?,
                    qk.narrow(1, heads, kv_heads)?,
                    qkv.narrow(1, w, kv_heads * d)?,
                )
            }
            None => (
                rope(&layer.wq.forward(&h, 1)?, heads, d, cos, sin)?,
                rope(&layer.wk.forward(&h, 1)?, kv_heads, d, cos, sin)?,
                layer.wv.forward(&h, 1)?,
            ),
        };

        if let Some(m) = means {
            k = k.broadcast_sub(&m.get(l)?)?;
        }
        let tier = store
            .hot_mut()
            .cuda_mut()
            .ok_or_else(|| dev_err("the hot tier left the device"))?;
        let [mut kc, mut vc, mut kn, mut vn] = tier.layer_mut(l)?;
        with_view(&k, |kv| {
            Ok(kernels.encode(&kv, n * kv_heads, dst, &mut kc, &mut kn)?)
        })?;
        with_view(&v, |vv| {
            Ok(kernels.encode(&vv, n * kv_heads, dst, &mut vc, &mut vn)?)
        })?;
        Ok(q)
    }

    /// [`Llama::forward_with`] when the store's hot tier is in VRAM.
    pub(super) fn forward_cuda(
        &self,
        store: &mut BlockStore,
        batch: &[SeqInput<'_>],
        transform: KvTransform<'_>,
    ) -> ModelResult<Tensor> {
        if transform.probe.is_some() {
            return Err(ModelError::InvalidConfig {
                field: "probe",
                reason: "the fidelity probe runs on the CPU engine".into(),
            });
        }
        let Device::Cuda(cuda) = &self.device else {
            return Err(ModelError::InvalidConfig {
                field: "device",
                reason: "the KV hot tier is in VRAM but the model is on the CPU".into(),
            });
        };
        let started = std::time::Instant::now();
        let ms = |t: std::time::Instant| t.elapsed().as_secs_f64() * 1e3;
        let stream = cuda.cuda_stream();
        let kernels = self.kernels(store, &stream)?;
        let cfg = &self.config;
        let (heads, kv_heads, d) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let (ids, positions) = self.check_batch(store, batch)?;
        let n = ids.len();
        let bs = store.shape().block_size;
        let dev = &self.device;
        let up_i32 = |v: &[i32]| stream.clone_htod(v).map_err(dev_err);

        // `ENGRAM_CUDA_PREFILL=dense`: prefill attention through decoded f32 rows even on
        // 16-position blocks (a diagnostic switch: the tensor-core kernel's f16 operands
        // against the f32 reference path, e.g. under `engram check device`).
        // Read once per process, not per forward.
        static DENSE_PREFILL: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let dense_prefill = *DENSE_PREFILL
            .get_or_init(|| std::env::var("ENGRAM_CUDA_PREFILL").is_ok_and(|v| v == "dense"));
        // Index tables, once per forward.
        let mut dst = Vec::with_capacity(n * kv_heads);
        let (mut dec_rows, mut dec_tables, mut dec_lens) = (Vec::new(), Vec::new(), Vec::new());
        let mut dec_slots: Vec<Vec<u32>> = Vec::new();
        // The decode rows' blocks, for the attention mass the middle layer measures; and each
        // prompt chunk's last row (row, length, slots, blocks): prefill contributes its mass
        // from that row only, as on the CPU.
        let mut dec_blocks: Vec<&[engram_kvcore::BlockId]> = Vec::new();
        let mut last_rows: Vec<(u32, usize, Vec<u32>, &[engram_kvcore::BlockId])> = Vec::new();
        let mut prefills = Vec::new();
        let mut off = 0usize;
        for s in batch {
            let m = s.tokens.len();
            let total = s.start + m;
            let slots = store.hot_slots(&s.blocks[..total.div_ceil(bs)])?;
            // kvcore's head-major blocks: row (slot, head, pos).
            let row = |p: usize, h: usize| (slots[p / bs] as usize * kv_heads + h) * bs + p % bs;
            for p in s.start..total {
                dst.extend((0..kv_heads).map(|h| row(p, h) as i32));
            }
            if m == 1 && !s.prompt {
                dec_rows.push(off as u32);
                dec_lens.push(total as i32);
                dec_slots.push(slots);
                dec_blocks.push(&s.blocks[..total.div_ceil(bs)]);
            } else {
                if s.prompt && bs == PAGE {
                    let blocks = &s.blocks[..total.div_ceil(bs)];
                    last_rows.push(((off + m - 1) as u32, total, slots.clone(), blocks));
                }
                let keys = if bs == PAGE && !dense_prefill && kernels.prefill_fits() {
                    let pages: Vec<i32> = slots.iter().map(|&s| s as i32).collect();
                    PrefillKeys::Pages(up_i32(&pages)?)
                } else {
                    let src: Vec<i32> = (0..total)
                        .flat_map(|p| (0..kv_heads).map(move |h| row(p, h) as i32))
                        .collect();
                    PrefillKeys::Rows(up_i32(&src)?, causal_mask_on(s.start, m, dev)?)
                };
                prefills.push(Prefill {
                    off,
                    m,
                    start: s.start,
                    total,
                    keys,
                });
            }
            off += m;
        }
        let dst = up_i32(&dst)?;
        let max_blocks = dec_slots.iter().map(Vec::len).max().unwrap_or(0);
        for slots in &dec_slots {
            dec_tables.extend(slots.iter().map(|&s| s as i32));
            dec_tables.extend(std::iter::repeat_n(0, max_blocks - slots.len()));
        }
        let nd = dec_rows.len();
        let max_len = dec_lens.iter().copied().max().unwrap_or(1).max(1) as usize;
        let decode = if nd > 0 {
            let work = if bs == PAGE {
                let lens: Vec<usize> = dec_lens.iter().map(|&l| l as usize).collect();
                DecodeWork::Mma(Box::new(kernels.mma_work(&lens, kv_heads, None)?))
            } else {
                DecodeWork::Fp32(kernels.workspace(nd, kv_heads, max_len)?)
            };
            Some((
                up_i32(&dec_tables)?,
                up_i32(&dec_lens)?,
                Tensor::from_vec(dec_rows, nd, dev)?,
                work,
            ))
        } else {
            None
        };
        // The prompt chunks' last rows as a decode batch of their own (its output unused).
        let mut last_batch = if last_rows.is_empty() {
            None
        } else {
            let lmax = last_rows.iter().map(|r| r.2.len()).max().unwrap_or(0);
            let mut table = Vec::with_capacity(last_rows.len() * lmax);
            for (_, _, slots, _) in &last_rows {
                table.extend(slots.iter().map(|&s| s as i32));
                table.extend(std::iter::repeat_n(0, lmax - slots.len()));
            }
            let lens: Vec<usize> = last_rows.iter().map(|r| r.1).collect();
            let lens_i: Vec<i32> = lens.iter().map(|&l| l as i32).collect();
            let rows: Vec<u32> = last_rows.iter().map(|r| r.0).collect();
            Some((
                up_i32(&table)?,
                up_i32(&lens_i)?,
                Tensor::from_vec(rows, last_rows.len(), dev)?,
                kernels.mma_work(&lens, kv_heads, None)?,
                lmax,
                lens.iter().copied().max().unwrap_or(1),
            ))
        };
        let mut last_mass: Option<PinnedF32> = None;
        let means = match transform.key_means {
            Some(m) => Some(self.device_means(m)?),
            None => None,
        };

        let eps = cfg.rms_eps as f32;
        let scale = 1.0 / (d as f32).sqrt();
        let hidden = cfg.hidden_size;
        let mut decode = decode;
        let ids = Tensor::from_vec(ids, n, dev)?;
        let mut x = self.embed.dense()?.index_select(&ids, 0)?;

        // The fused glue (four launches a layer around the products and attention) where every
        // projection is dense on the device; candle ops otherwise.
        let mut glue = match self.glue_dtype() {
            Some(dtype) => {
                if positions
                    .iter()
                    .any(|&p| p as usize >= self.cos.dim(0).unwrap_or(0))
                {
                    return Err(dev_err("a position beyond the RoPE tables"));
                }
                let pos: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
                let x0 = x.to_dtype(DType::F32)?;
                let mut g = Glue {
                    dtype,
                    x: with_view_of::<f32, _>(&x0, |v| stream.clone_dtod(&v).map_err(dev_err))?,
                    positions: up_i32(&pos)?,
                    h: None,
                };
                let first = self.layers.first().map(|l| &l.attn_norm);
                g.h = glue_norm(&kernels, &mut g, cuda, n, hidden, None, first, eps)?;
                Some(g)
            }
            None => None,
        };
        // What the layers read besides their weights: for the glue, the RoPE tables and the
        // key means held once for every layer; for candle ops, the batch's cos/sin rows.
        let (held, rows) = if glue.is_some() {
            let means_h = means.as_ref().map(hold).transpose()?;
            (Some((hold(&self.cos)?, hold(&self.sin)?, means_h)), None)
        } else {
            let pos = Tensor::from_vec(positions, n, dev)?;
            let rows = (
                self.cos.index_select(&pos, 0)?,
                self.sin.index_select(&pos, 0)?,
            );
            (None, Some(rows))
        };

        // A batch of decode rows only, with bf16 products: the combine writes the output
        // projection's bf16 operand itself.
        let bf16_attn =
            prefills.is_empty() && glue.as_ref().is_some_and(|g| g.dtype == DType::BF16);
        // The middle layer's decode attention also measures each block's attention mass
        // (`tq4_decode_mma_mass`), copied to the host right after it and folded into the blocks'
        // metadata while the card runs the later layers (`stage_mass`, `fold_staged`).
        let mass_layer = self.layers.len() / 2;
        let mut mass_dev: Option<PinnedF32> = None;
        let layers_at = std::time::Instant::now();
        super::add_forward_times(|t| {
            t.prep += layers_at.duration_since(started).as_secs_f64() * 1e3
        });
        for (l, layer) in self.layers.iter().enumerate() {
            let stack = self.device_stacks.get(l);
            let q = match (glue.as_mut(), stack) {
                (Some(g), Some(st)) => {
                    let h =
                        g.h.take()
                            .ok_or_else(|| dev_err("the glue lost its layer input"))?;
                    let qkv = product(&kernels, cuda, &h, &st.qkv)?;
                    let tier = store
                        .hot_mut()
                        .cuda_mut()
                        .ok_or_else(|| dev_err("the hot tier left the device"))?;
                    let [mut kc, mut vc, mut kn, mut vn] = tier.layer_mut(l)?;
                    let (cos_h, sin_h, means_h) = held
                        .as_ref()
                        .ok_or_else(|| dev_err("the glue's tables are not held"))?;
                    let qkv_h = hold(&qkv)?;
                    let key_mean = match means_h {
                        Some(m) => {
                            let w = kv_heads * d;
                            Some(m.view::<f32>()?.slice(l * w..(l + 1) * w))
                        }
                        None => None,
                    };
                    let a = QkvGlue {
                        qkv: qkv_h.act()?,
                        n,
                        heads,
                        kv_heads,
                        positions: g.positions.slice(..),
                        cos: cos_h.view()?,
                        sin: sin_h.view()?,
                        key_mean,
                        dst: dst.slice(..),
                        table_positions: self.cos.dim(0)?,
                    };
                    let qb = kernels.qkv_rope_encode(&a, [&mut kc, &mut vc, &mut kn, &mut vn])?;
                    tensor(qb, cuda, (n, heads * d)).reshape((n, heads, d))?
                }
                _ => {
                    let (cos, sin) = rows
                        .as_ref()
                        .ok_or_else(|| dev_err("the batch's RoPE rows are missing"))?;
                    self.qkv_candle(
                        store,
                        &kernels,
                        (&x, layer, stack, l),
                        (cos, sin),
                        means.as_ref(),
                        &dst,
                        n,
                    )?
                }
            };
            let tier = store
                .hot()
                .cuda()
                .ok_or_else(|| dev_err("the hot tier left the device"))?;
            let planes = tier.layer(l)?;

            // One product for q, k and v; RoPE on q and k at once, in place of layout.

            let dec_out = match decode.as_mut() {
                Some((tables, lens, rows, work)) => {
                    // Every row a decode row, in order: the queries as they are.
                    let q_dec = if nd == n {
                        q.clone()
                    } else {
                        q.index_select(rows, 0)?
                    };
                    let out = with_view(&q_dec, |qv| {
                        let a = DecodeBatch {
                            q: qv,
                            heads,
                            kv_heads,
                            planes: tier.layer(l)?,
                            block_tables: tables,
                            max_blocks,
                            seq_lens: lens,
                            batch: nd,
                            max_len,
                            block_size: bs,
                            scale,
                        };
                        Ok(match work {
                            DecodeWork::Mma(w) if l == mass_layer => {
                                let (out, mass) = kernels.decode_attention_mma_mass(
                                    &a,
                                    PageLayout::HeadMajor,
                                    w,
                                    bf16_attn,
                                )?;
                                mass_dev = Some(self.stage_mass(&stream, &mass)?);
                                out
                            }
                            DecodeWork::Mma(w) => kernels.decode_attention_mma_out(
                                &a,
                                PageLayout::HeadMajor,
                                w,
                                bf16_attn,
                            )?,
                            DecodeWork::Fp32(w) => {
                                let mut out =
                                    stream.alloc_zeros::<f32>(nd * heads * d).map_err(dev_err)?;
                                kernels.decode_attention(&a, w, &mut out)?;
                                ActBuf::F32(out)
                            }
                        })
                    })?;
                    Some(act_tensor(out, cuda, (nd, heads * d)))
                }
                None => None,
            };

            if l == mass_layer
                && let Some((tables, lens, rows, work, lmax, lmax_len)) = last_batch.as_mut()
            {
                let q_last = q.index_select(rows, 0)?;
                let mass = with_view(&q_last, |qv| {
                    let a = DecodeBatch {
                        q: qv,
                        heads,
                        kv_heads,
                        planes: tier.layer(l)?,
                        block_tables: tables,
                        max_blocks: *lmax,
                        seq_lens: lens,
                        batch: last_rows.len(),
                        max_len: *lmax_len,
                        block_size: bs,
                        scale,
                    };
                    let (_, mass) = kernels.decode_attention_mma_mass(
                        &a,
                        PageLayout::HeadMajor,
                        work,
                        false,
                    )?;
                    Ok(mass)
                })?;
                last_mass = Some(self.stage_mass(&stream, &mass)?);
            }

            let mut outs = Vec::with_capacity(batch.len());
            let (mut next_dec, mut next_pre) = (0usize, 0usize);
            for s in batch {
                // As classified above: a one-token prompt chunk is a prefill.
                if s.tokens.len() == 1 && !s.prompt {
                    let o = dec_out
                        .as_ref()
                        .ok_or_else(|| dev_err("a decode row without its output"))?;
                    outs.push(o.narrow(0, next_dec, 1)?);
                    next_dec += 1;
                } else {
                    let p = &prefills[next_pre];
                    next_pre += 1;
                    let q_seq = q.narrow(0, p.off, p.m)?;
                    match &p.keys {
                        PrefillKeys::Pages(table) => {
                            let mut o = stream
                                .alloc_zeros::<f32>(p.m * heads * d)
                                .map_err(dev_err)?;
                            with_view(&q_seq, |qv| {
                                let a = PrefillChunk {
                                    q: qv,
                                    m: p.m,
                                    start: p.start,
                                    heads,
                                    kv_heads,
                                    planes: tier.layer(l)?,
                                    block_table: table,
                                    scale,
                                };
                                Ok(kernels.prefill_attention(&a, PageLayout::HeadMajor, &mut o)?)
                            })?;
                            outs.push(tensor(o, cuda, (p.m, heads * d)));
                        }
                        PrefillKeys::Rows(src, mask) => {
                            let rows = p.total * kv_heads;
                            let mut kb = stream.alloc_zeros::<f32>(rows * d).map_err(dev_err)?;
                            let mut vb = stream.alloc_zeros::<f32>(rows * d).map_err(dev_err)?;
                            kernels.decode_rows(
                                &planes.k_codes,
                                &planes.k_norms,
                                src,
                                rows,
                                &mut kb.slice_mut(..),
                            )?;
                            kernels.decode_rows(
                                &planes.v_codes,
                                &planes.v_norms,
                                src,
                                rows,
                                &mut vb.slice_mut(..),
                            )?;
                            let kt = tensor(kb, cuda, (rows, d)).reshape((p.total, kv_heads, d))?;
                            let vt = tensor(vb, cuda, (rows, d)).reshape((p.total, kv_heads, d))?;
                            outs.push(attend_rows(&kt, &vt, &q_seq, mask, cfg)?);
                        }
                    }
                }
            }
            let attn = if prefills.is_empty() {
                dec_out.ok_or_else(|| dev_err("a decode batch without its output"))?
            } else {
                Tensor::cat(&outs, 0)?
            };
            match (glue.as_mut(), stack) {
                (Some(g), Some(st)) => {
                    let (Some(wo), Some(wd)) = (dense(&layer.wo), dense(&layer.w_down)) else {
                        return Err(dev_err("a projection left the device's dense form"));
                    };
                    let o = product(&kernels, cuda, &attn.to_dtype(g.dtype)?, wo)?;
                    let h2 = glue_norm(
                        &kernels,
                        g,
                        cuda,
                        n,
                        hidden,
                        Some(&o),
                        Some(&layer.ffn_norm),
                        eps,
                    )?
                    .ok_or_else(|| dev_err("the glue's norm gave no output"))?;
                    let gu = product(&kernels, cuda, &h2, &st.gate_up)?;
                    let ff = gu.dim(1)? / 2;
                    let act = {
                        let gu_h = hold(&gu)?;
                        kernels.swiglu(&gu_h.act()?, n, ff, g.dtype == DType::BF16)?
                    };
                    let down = product(&kernels, cuda, &act_tensor(act, cuda, (n, ff)), wd)?;
                    // The residual, and the next layer's normed input (none after the last).
                    let next = self.layers.get(l + 1).map(|nl| &nl.attn_norm);
                    g.h = glue_norm(&kernels, g, cuda, n, hidden, Some(&down), next, eps)?;
                }
                (_, Some(st)) => x = finish_stacked(layer, st, &x, &attn, eps)?,
                (_, None) => x = layer.finish(&x, &attn, eps, 1)?,
            }
        }
        let head_at = std::time::Instant::now();
        super::add_forward_times(|t| {
            t.launch += head_at.duration_since(layers_at).as_secs_f64() * 1e3
        });
        if let Some(g) = glue {
            x = tensor(g.x, cuda, (n, hidden));
        }
        let x = self.final_norm(&x, batch, dev)?;
        // Queued, not waited for: the caller copies the logits to the host once it has done its
        // own bookkeeping (see `Llama::forward_unsynced`).
        let logits = self.lm_head.forward(&x, 1)?;
        // The mass was copied after the middle layer: folding it waits for that copy only, so
        // it overlaps the card's later layers.
        let mass_at = std::time::Instant::now();
        if let Some(staged) = mass_dev {
            self.fold_staged(store, staged, max_blocks, dec_blocks.iter().copied())?;
        }
        if let (Some(staged), Some((.., lmax, _))) = (last_mass, last_batch.as_ref()) {
            self.fold_staged(store, staged, *lmax, last_rows.iter().map(|r| r.3))?;
        }
        super::add_forward_times(|t| t.mass += ms(mass_at));
        Ok(logits)
    }
}
