//! Launching the TurboQuant-4 kernels with cudarc (feature `cuda`).

use std::sync::Arc;

use cudarc::driver::result::memcpy_dtoh_async;
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr,
    LaunchArgs, LaunchConfig, PinnedHostSlice, PushKernelArg,
};
use cudarc::nvrtc::{CompileOptions, compile_ptx_with_opts};
use engram_kvcore::{Codec, CodecKind, CudaLayer};

use crate::{KernelError, PAGE, PageLayout, SplitPlan, TQ4_SOURCE, defines};

mod decode_mma;
mod glue;

pub use decode_mma::MmaWork;
use decode_mma::mma_stages_of;
pub use glue::{Act, ActBuf, QkvGlue};

fn driver(e: impl std::fmt::Display) -> KernelError {
    KernelError::Driver(e.to_string())
}

fn int(v: usize, what: &str) -> Result<i32, KernelError> {
    i32::try_from(v).map_err(|_| KernelError::Invalid(format!("{what} {v} is over i32")))
}

/// The compiled kernels of one (head_dim, group, chunk) and the codec's tables on the device.
#[derive(Debug)]
pub struct Tq4Kernels {
    stream: Arc<CudaStream>,
    encode: CudaFunction,
    decode_rows: CudaFunction,
    attend: CudaFunction,
    combine: CudaFunction,
    mma: CudaFunction,
    mma_mass: CudaFunction,
    /// The same on head-major pages through shared memory, in 8-warp and 16-warp CTAs.
    mma_hm: CudaFunction,
    mma_mass_hm: CudaFunction,
    mma_hm_wide: CudaFunction,
    mma_mass_hm_wide: CudaFunction,
    block_mass: CudaFunction,
    prefill: CudaFunction,
    combine_items: CudaFunction,
    read_stream: CudaFunction,
    glue_norm: CudaFunction,
    glue_qkv: CudaFunction,
    glue_swiglu: CudaFunction,
    gemv: CudaFunction,
    sms: usize,
    /// Pages staged per warp through shared memory by the head-major forms.
    mma_stages: usize,
    max_shared: usize,
    signs: CudaSlice<f32>,
    thresholds: CudaSlice<f32>,
    codebook: CudaSlice<f32>,
    rot_scale: f32,
    head_dim: usize,
    group: usize,
    chunk: usize,
    prefill_query_tiles: usize,
}

/// Page-locked host memory that a device f32 buffer is copied into in stream order.
///
/// [`PinnedF32::copy_from`] queues the copy on a stream after the work queued there so far and
/// returns at once: the copy runs without holding the host. [`PinnedF32::read`] waits for that
/// copy alone (an event recorded right after it), not for the rest of the stream, so the host
/// can use the values while the device runs later work. The buffer may be larger than what was
/// copied into it (it is reused across copies of growing sizes); only the copied prefix is read,
/// and only that many bytes are copied, never more than the source holds. Plain pinned memory,
/// not write-combined: the host reads it.
#[derive(Debug)]
pub struct PinnedF32 {
    host: PinnedHostSlice<f32>,
    len: usize,
    done: Option<CudaEvent>,
}

impl PinnedF32 {
    /// `capacity` values of page-locked host memory, zeroed.
    pub fn new(ctx: &Arc<CudaContext>, capacity: usize) -> Result<Self, KernelError> {
        // SAFETY: the memory is zeroed below before anything can read it, and f32 is valid for
        // any bit pattern.
        let mut host =
            unsafe { ctx.alloc_pinned_with_flags::<f32>(capacity, 0) }.map_err(driver)?;
        host.as_mut_slice().map_err(driver)?.fill(0.0);
        Ok(Self {
            host,
            len: 0,
            done: None,
        })
    }

    /// How many values the buffer holds.
    pub fn capacity(&self) -> usize {
        self.host.len()
    }

    /// Queues the copy of `src` (at most [`PinnedF32::capacity`] values) on `stream`, after the
    /// work queued there so far, and returns without waiting for it.
    pub fn copy_from(
        &mut self,
        stream: &Arc<CudaStream>,
        src: &CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        if src.len() > self.capacity() {
            return Err(KernelError::Invalid(format!(
                "a copy of {} values into a pinned buffer of {}",
                src.len(),
                self.capacity()
            )));
        }
        // An earlier copy still in flight writes into this memory: let it land first.
        if let Some(e) = self.done.take() {
            e.synchronize().map_err(driver)?;
        }
        let ptr = self.host.as_mut_ptr().map_err(driver)?;
        // SAFETY: `ptr` points at `capacity() >= src.len()` initialized f32 values owned by
        // `self.host`, and no other reference to them is live (`&mut self`, no copy in flight).
        let dst = unsafe { std::slice::from_raw_parts_mut(ptr, src.len()) };
        {
            let (sp, _guard) = src.device_ptr(stream);
            // SAFETY: `dst` holds exactly `src.len()` values, so the copy reads no more than the
            // device allocation holds and writes no more than the host one. The host memory
            // outlives the copy: `read`, the next `copy_from` and `drop` all wait for the event
            // recorded below before touching or freeing it.
            unsafe { memcpy_dtoh_async(dst, sp, stream.cu_stream()) }.map_err(driver)?;
        }
        self.done = Some(stream.record_event(None).map_err(driver)?);
        self.len = src.len();
        Ok(())
    }

    /// Waits for the last copy (only it) and returns its values.
    pub fn read(&self) -> Result<&[f32], KernelError> {
        if let Some(e) = &self.done {
            e.synchronize().map_err(driver)?;
        }
        self.host
            .as_slice()
            .map_err(driver)?
            .get(..self.len)
            .ok_or_else(|| KernelError::Invalid("a pinned copy longer than its buffer".into()))
    }
}

impl Drop for PinnedF32 {
    /// Waits for a copy still in flight, so the device never writes into freed memory.
    fn drop(&mut self) {
        if let Some(e) = self.done.take() {
            let _ = e.synchronize();
        }
    }
}

/// kvcore's [`CudaLayer`] over four device buffers (key codes, key norms, value codes, value
/// norms), for planes that do not live in a block store (the check and the bench).
pub fn plane_views(planes: [&CudaSlice<u8>; 4]) -> CudaLayer<'_> {
    let [k_codes, k_norms, v_codes, v_norms] = planes.map(|p| p.slice(..));
    CudaLayer {
        k_codes,
        v_codes,
        k_norms,
        v_norms,
    }
}

/// The inputs of one decode-attention launch over one layer.
#[derive(Debug)]
pub struct DecodeBatch<'a> {
    /// Queries `[batch, heads, head_dim]` (model space; the kernel rotates them).
    pub q: CudaView<'a, f32>,
    /// Query heads.
    pub heads: usize,
    /// KV heads (`heads / group`).
    pub kv_heads: usize,
    /// The layer's planes.
    pub planes: CudaLayer<'a>,
    /// Block tables `[batch, max_blocks]` (slots of the layer plane).
    pub block_tables: &'a CudaSlice<i32>,
    /// Entries per block-table row.
    pub max_blocks: usize,
    /// Positions per sequence `[batch]`.
    pub seq_lens: &'a CudaSlice<i32>,
    /// Sequences.
    pub batch: usize,
    /// The longest sequence (sizes the split).
    pub max_len: usize,
    /// Positions per block.
    pub block_size: usize,
    /// Softmax scale (usually 1/√head_dim).
    pub scale: f32,
}

/// The inputs of one prefill-attention launch: one sequence's chunk of new queries over one
/// layer, causal (query `i` at position `start + i` attends positions `0 ..= start + i`).
#[derive(Debug)]
pub struct PrefillChunk<'a> {
    /// Queries `[m, heads, head_dim]` (model space; the kernel rotates them).
    pub q: CudaView<'a, f32>,
    /// New queries.
    pub m: usize,
    /// Position of the first.
    pub start: usize,
    /// Query heads.
    pub heads: usize,
    /// KV heads (`heads / group`).
    pub kv_heads: usize,
    /// The layer's planes (16-position pages).
    pub planes: CudaLayer<'a>,
    /// The sequence's block table: the slots of its first `⌈(start + m) / 16⌉` pages at least.
    pub block_table: &'a CudaSlice<i32>,
    /// Softmax scale (usually 1/√head_dim).
    pub scale: f32,
}

/// Pushes the arguments both decode-attention kernels begin with: the queries, the head counts,
/// the four planes, the block tables and the sequence lengths.
fn push_batch<'a>(
    launch: &mut LaunchArgs<'a>,
    a: &'a DecodeBatch<'_>,
    heads: &'a i32,
    kv_heads: &'a i32,
    max_blocks: &'a i32,
) {
    launch
        .arg(&a.q)
        .arg(heads)
        .arg(kv_heads)
        .arg(&a.planes.k_codes)
        .arg(&a.planes.k_norms)
        .arg(&a.planes.v_codes)
        .arg(&a.planes.v_norms)
        .arg(a.block_tables)
        .arg(max_blocks)
        .arg(a.seq_lens);
}

pub use crate::mma::{
    MMA_CTAS_PER_SM, MMA_STAGES, MMA_WARPS, MMA_WIDE_WARPS, MmaShape, mma_cta, mma_shape,
    mma_shared_bytes,
};

/// Scratch for the split-K partials, reusable across launches of the same or smaller size.
#[derive(Debug)]
pub struct Workspace {
    acc: CudaSlice<f32>,
    m: CudaSlice<f32>,
    l: CudaSlice<f32>,
}

impl Tq4Kernels {
    /// Compiles the kernels for `codec` (TurboQuant 4-bit, head_dim 64 or 128) with `group`
    /// query heads per KV head and `chunk` positions per attention CTA.
    pub fn new(
        stream: Arc<CudaStream>,
        codec: &Codec,
        group: usize,
        chunk: usize,
    ) -> Result<Self, KernelError> {
        Self::with_defines(stream, codec, group, chunk, &[])
    }

    /// [`Self::new`] with extra NVRTC options (`-DNAME=VALUE`), for kernel experiments and
    /// profiling variants (e.g. `-DPROFILE_SKIP_VALUES`).
    pub fn with_defines(
        stream: Arc<CudaStream>,
        codec: &Codec,
        group: usize,
        chunk: usize,
        extra: &[String],
    ) -> Result<Self, KernelError> {
        if codec.kind() != (CodecKind::TurboQuant { bits: 4 }) {
            return Err(KernelError::Unsupported(format!(
                "codec {:?} (the kernels are TurboQuant 4-bit)",
                codec.kind()
            )));
        }
        let tables = codec.turboquant_tables().ok_or_else(|| {
            KernelError::Unsupported("a head_dim without a Hadamard rotation".into())
        })?;
        let head_dim = codec.head_dim();
        let ctx: &Arc<CudaContext> = stream.context();
        let (major, minor) = ctx.compute_capability().map_err(driver)?;
        let arch: &'static str = match (major, minor) {
            (9, 0) => "sm_90",
            (8, 9) => "sm_89",
            (8, 6) => "sm_86",
            (8, 0) => "sm_80",
            _ => "compute_80",
        };
        let ptx = compile_ptx_with_opts(
            TQ4_SOURCE,
            CompileOptions {
                options: defines(head_dim, group, chunk)?
                    .into_iter()
                    .chain(extra.iter().cloned())
                    .collect(),
                arch: Some(arch),
                ..Default::default()
            },
        )
        .map_err(|e| KernelError::Compile(e.to_string()))?;
        let module = ctx.load_module(ptx).map_err(driver)?;
        let f = |name: &str| module.load_function(name).map_err(driver);
        let mma = f("tq4_decode_mma")?;
        let mma_mass = f("tq4_decode_mma_mass")?;
        let mma_hm = f("tq4_decode_mma_hm")?;
        let mma_mass_hm = f("tq4_decode_mma_mass_hm")?;
        let mma_hm_wide = f("tq4_decode_mma_hm_wide")?;
        let mma_mass_hm_wide = f("tq4_decode_mma_mass_hm_wide")?;
        let prefill = f("tq4_prefill_mma")?;
        use cudarc::driver::sys::CUdevice_attribute as Dev;
        let optin = ctx
            .attribute(Dev::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(driver)?;
        for k in [
            &mma,
            &mma_mass,
            &mma_hm,
            &mma_mass_hm,
            &mma_hm_wide,
            &mma_mass_hm_wide,
            &prefill,
        ] {
            k.set_attribute(
                cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                optin,
            )
            .map_err(driver)?;
        }
        let sms = ctx
            .attribute(Dev::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(driver)?;
        Ok(Self {
            encode: f("tq4_encode")?,
            decode_rows: f("tq4_decode_rows")?,
            attend: f("tq4_decode_attention")?,
            combine: f("tq4_combine")?,
            combine_items: f("tq4_combine_items")?,
            read_stream: f("read_stream")?,
            glue_norm: f("glue_add_rms_norm")?,
            glue_qkv: f("glue_qkv_rope_encode")?,
            glue_swiglu: f("glue_swiglu")?,
            gemv: f("gemv_bf16")?,
            mma,
            mma_mass,
            mma_hm,
            mma_mass_hm,
            mma_hm_wide,
            mma_mass_hm_wide,
            block_mass: f("tq4_block_mass")?,
            prefill,
            sms: usize::try_from(sms).unwrap_or(1).max(1),
            mma_stages: mma_stages_of(extra)?,
            max_shared: usize::try_from(optin).unwrap_or(0),
            signs: stream.clone_htod(&tables.signs).map_err(driver)?,
            thresholds: stream.clone_htod(&tables.thresholds).map_err(driver)?,
            codebook: stream.clone_htod(&tables.codebook).map_err(driver)?,
            rot_scale: tables.scale,
            head_dim,
            group,
            chunk,
            prefill_query_tiles: crate::prefill::default_query_tiles(group),
            stream,
        })
    }

    /// The stream the kernels run on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Encodes `rows` rows of `x` (`[rows, head_dim]` f32); row `r` lands in row `dst[r]` of
    /// `codes` (`head_dim/2` bytes a row) and `norms` (2 bytes a row, f16 little-endian).
    pub fn encode(
        &self,
        x: &CudaView<'_, f32>,
        rows: usize,
        dst: &CudaSlice<i32>,
        codes: &mut CudaViewMut<'_, u8>,
        norms: &mut CudaViewMut<'_, u8>,
    ) -> Result<(), KernelError> {
        if x.len() < rows * self.head_dim || dst.len() < rows {
            return Err(KernelError::Invalid(format!(
                "{rows} rows need {} input floats and {rows} destinations",
                rows * self.head_dim
            )));
        }
        if norms.len() % 2 != 0 || codes.len() / (self.head_dim / 2) != norms.len() / 2 {
            return Err(KernelError::Invalid(
                "the code and norm planes hold different row counts".into(),
            ));
        }
        if rows == 0 {
            return Ok(());
        }
        let n = int(rows, "rows")?;
        let warps = 4;
        let cfg = LaunchConfig {
            grid_dim: (rows.div_ceil(warps) as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = self.stream.launch_builder(&self.encode);
        launch
            .arg(x)
            .arg(&n)
            .arg(dst)
            .arg(&self.signs)
            .arg(&self.thresholds)
            .arg(&self.rot_scale)
            .arg(codes)
            .arg(norms);
        // SAFETY: the argument list matches `tq4_encode`'s signature; `x` holds `rows` rows and
        // `dst` `rows` entries (checked above); each `dst` entry must name a row inside `codes`
        // and `norms`, which the caller's block allocation guarantees.
        unsafe { launch.launch(cfg) }.map_err(driver)?;
        Ok(())
    }

    /// Decodes plane rows `src[r]` of `codes`/`norms` into row `r` of `out`
    /// (`[rows, head_dim]` f32, model space): the dequantize path of prefill attention.
    pub fn decode_rows(
        &self,
        codes: &CudaView<'_, u8>,
        norms: &CudaView<'_, u8>,
        src: &CudaSlice<i32>,
        rows: usize,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), KernelError> {
        if out.len() < rows * self.head_dim || src.len() < rows {
            return Err(KernelError::Invalid(format!(
                "{rows} rows need {} output floats and {rows} sources",
                rows * self.head_dim
            )));
        }
        if rows == 0 {
            return Ok(());
        }
        let n = int(rows, "rows")?;
        let cfg = LaunchConfig {
            grid_dim: (rows.div_ceil(4) as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = self.stream.launch_builder(&self.decode_rows);
        launch
            .arg(codes)
            .arg(norms)
            .arg(src)
            .arg(&n)
            .arg(&self.signs)
            .arg(&self.rot_scale)
            .arg(&self.codebook)
            .arg(out);
        // SAFETY: the arguments match `tq4_decode_rows`; `out` and `src` hold `rows` rows
        // (checked above) and every `src` entry must name a row of the planes, which the
        // caller's block table guarantees.
        unsafe { launch.launch(cfg) }.map_err(driver)?;
        Ok(())
    }

    /// Sets the prefill kernel's 16-position query tiles per CTA (`group × tiles` warps, at
    /// most 8; the default is [`crate::prefill::default_query_tiles`]): a tuning knob of the
    /// benches.
    pub fn set_prefill_query_tiles(&mut self, tiles: usize) -> Result<(), KernelError> {
        // At least 4 warps: the first 128 threads stage a tile's 128 norms, one each.
        if tiles == 0 || self.group * tiles > 8 || self.group * tiles < 4 {
            return Err(KernelError::Invalid(format!(
                "{tiles} query tiles of {} warps each (4 to 8 warps a CTA)",
                self.group
            )));
        }
        self.prefill_query_tiles = tiles;
        Ok(())
    }

    /// The head dimension the kernels were compiled for.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.group
    }

    /// A workspace for `batch` sequences of up to `max_len` positions and `kv_heads` KV heads.
    pub fn workspace(
        &self,
        batch: usize,
        kv_heads: usize,
        max_len: usize,
    ) -> Result<Workspace, KernelError> {
        let plan = SplitPlan::new(max_len, self.chunk)?;
        let parts = batch * kv_heads * plan.splits * self.group;
        Ok(Workspace {
            acc: self
                .stream
                .alloc_zeros(parts * self.head_dim)
                .map_err(driver)?,
            m: self.stream.alloc_zeros(parts).map_err(driver)?,
            l: self.stream.alloc_zeros(parts).map_err(driver)?,
        })
    }

    /// What both decode-attention launches check: the heads form groups of the compiled size,
    /// and the queries, output, block tables and lengths hold the batch.
    fn check_batch(&self, a: &DecodeBatch<'_>, out_len: usize) -> Result<(), KernelError> {
        if a.heads != a.kv_heads * self.group {
            return Err(KernelError::Invalid(format!(
                "{} heads over {} KV heads is not a group of {}",
                a.heads, a.kv_heads, self.group
            )));
        }
        if out_len < a.batch * a.heads * self.head_dim
            || a.q.len() < a.batch * a.heads * self.head_dim
            || a.block_tables.len() < a.batch * a.max_blocks
            || a.seq_lens.len() < a.batch
            || a.max_blocks * a.block_size < a.max_len
        {
            return Err(KernelError::Invalid(
                "a buffer is smaller than the batch it is given for".into(),
            ));
        }
        Ok(())
    }

    /// Whether this card's shared memory holds the prefill kernel's CTA (149 KB at head_dim 128:
    /// H100, H200 and A100 do; a card with less attends prefill through decoded rows).
    pub fn prefill_fits(&self) -> bool {
        crate::prefill::prefill_shared_bytes(self.group, self.prefill_query_tiles, self.head_dim)
            <= self.max_shared
    }

    /// Causal prefill attention of one sequence's chunk on tensor cores (`tq4_prefill_mma`):
    /// writes `out` (`[m, heads, head_dim]`, model space). 16-position pages in `layout`.
    pub fn prefill_attention(
        &self,
        a: &PrefillChunk<'_>,
        layout: PageLayout,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        if a.heads != a.kv_heads * self.group {
            return Err(KernelError::Invalid(format!(
                "{} heads over {} KV heads is not a group of {}",
                a.heads, a.kv_heads, self.group
            )));
        }
        let n = a.m * a.heads * self.head_dim;
        if a.q.len() < n || out.len() < n || a.block_table.len() * PAGE < a.start + a.m {
            return Err(KernelError::Invalid(
                "a buffer is smaller than the chunk it is given for".into(),
            ));
        }
        let tiles = self.prefill_query_tiles;
        let shared = crate::prefill::prefill_shared_bytes(self.group, tiles, self.head_dim);
        if shared > self.max_shared {
            return Err(KernelError::Unsupported(format!(
                "the prefill kernel needs {shared} bytes of shared memory; the card has {}",
                self.max_shared
            )));
        }
        if a.m == 0 {
            return Ok(());
        }
        let (m, start) = (int(a.m, "queries")?, int(a.start, "start")?);
        let (heads, kv_heads) = (int(a.heads, "heads")?, int(a.kv_heads, "kv_heads")?);
        let (ps, hs) = layout.strides(a.kv_heads);
        let (ps, hs) = (int(ps, "pos stride")?, int(hs, "head stride")?);
        let qscale = self.rot_scale * a.scale * std::f32::consts::LOG2_E;
        let cfg = LaunchConfig {
            grid_dim: (
                u32::try_from(a.m.div_ceil(16 * tiles))
                    .map_err(|_| KernelError::Invalid("query tiles over u32".into()))?,
                a.kv_heads as u32,
                1,
            ),
            block_dim: (
                32 * crate::prefill::prefill_warps(self.group, tiles) as u32,
                1,
                1,
            ),
            shared_mem_bytes: shared as u32,
        };
        let qtiles = int(tiles, "query tiles")?;
        let mut launch = self.stream.launch_builder(&self.prefill);
        launch
            .arg(&a.q)
            .arg(&m)
            .arg(&start)
            .arg(&heads)
            .arg(&kv_heads)
            .arg(&a.planes.k_codes)
            .arg(&a.planes.k_norms)
            .arg(&a.planes.v_codes)
            .arg(&a.planes.v_norms)
            .arg(a.block_table)
            .arg(&ps)
            .arg(&hs)
            .arg(&qtiles)
            .arg(&self.signs)
            .arg(&self.codebook)
            .arg(&qscale)
            .arg(&self.rot_scale)
            .arg(out);
        // SAFETY: the arguments match `tq4_prefill_mma`; the sizes were checked above, and the
        // block table's first ⌈(start + m)/16⌉ entries must name slots of the planes (the block
        // store hands out only such slots).
        unsafe { launch.launch(cfg) }.map_err(driver)?;
        Ok(())
    }

    /// Reads `bytes` of `src` once with 16-byte loads (the read-bandwidth ceiling the benches
    /// compare with); `sink` takes one word per CTA.
    pub fn read_stream(
        &self,
        src: &CudaSlice<u8>,
        sink: &mut CudaSlice<u32>,
    ) -> Result<(), KernelError> {
        let n = src.len() / 16;
        let blocks = (self.sms * 4).min(sink.len());
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (512, 1, 1),
            shared_mem_bytes: 0,
        };
        let n = u64::try_from(n).map_err(|_| KernelError::Invalid("size over u64".into()))?;
        let mut launch = self.stream.launch_builder(&self.read_stream);
        launch.arg(src).arg(&n).arg(sink);
        // SAFETY: `read_stream` reads `n` 16-byte words of `src` and writes one word per CTA of
        // `sink`, which holds at least `blocks`.
        unsafe { launch.launch(cfg) }.map_err(driver)?;
        Ok(())
    }

    /// Decode attention of one query token per sequence over one layer; writes `out`
    /// (`[batch, heads, head_dim]`, model space).
    pub fn decode_attention(
        &self,
        a: &DecodeBatch<'_>,
        work: &mut Workspace,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        self.check_batch(a, out.len())?;
        let plan = SplitPlan::new(a.max_len, self.chunk)?;
        let parts = a.batch * a.kv_heads * plan.splits * self.group;
        if work.m.len() < parts || work.acc.len() < parts * self.head_dim {
            return Err(KernelError::Invalid(
                "the workspace is smaller than the batch it is given for".into(),
            ));
        }
        let (heads, kv_heads) = (int(a.heads, "heads")?, int(a.kv_heads, "kv_heads")?);
        let (max_blocks, block_size) = (
            int(a.max_blocks, "max_blocks")?,
            int(a.block_size, "block_size")?,
        );
        let splits = int(plan.splits, "splits")?;
        let cfg = LaunchConfig {
            grid_dim: (plan.splits as u32, a.kv_heads as u32, a.batch as u32),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = self.stream.launch_builder(&self.attend);
        push_batch(&mut launch, a, &heads, &kv_heads, &max_blocks);
        launch
            .arg(&block_size)
            .arg(&splits)
            .arg(&self.signs)
            .arg(&self.rot_scale)
            .arg(&self.codebook)
            .arg(&a.scale)
            .arg(&mut work.acc)
            .arg(&mut work.m)
            .arg(&mut work.l);
        // SAFETY: the arguments match `tq4_decode_attention`; the sizes were checked above, and
        // every block-table entry of a sequence's first ⌈len/block_size⌉ blocks must name a slot
        // of the code planes (the block store hands out only such slots).
        unsafe { launch.launch(cfg) }.map_err(driver)?;
        let cfg = LaunchConfig {
            grid_dim: (a.heads.div_ceil(4) as u32, a.batch as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = self.stream.launch_builder(&self.combine);
        launch
            .arg(&work.acc)
            .arg(&work.m)
            .arg(&work.l)
            .arg(&heads)
            .arg(&kv_heads)
            .arg(&splits)
            .arg(&self.signs)
            .arg(&self.rot_scale)
            .arg(out);
        // SAFETY: the arguments match `tq4_combine`; the partials were sized for this plan.
        unsafe { launch.launch(cfg) }.map_err(driver)?;
        Ok(())
    }
}
