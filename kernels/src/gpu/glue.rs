//! Launching the fused layer glue (`glue.cu`): residual + RMSNorm, q/k/v RoPE + key centering +
//! encode, SwiGLU. The engine's CUDA forward runs a decoder layer as these four launches around
//! its products and attention, instead of ~28 candle ops; the CPU references are in
//! [`crate::reference`] (`rms_norm`, `rope_half`, `swiglu`) and kvcore's `Codec::encode`.

use std::sync::Arc;

use cudarc::driver::{
    CudaSlice, CudaStream, CudaView, CudaViewMut, LaunchArgs, LaunchConfig, PushKernelArg,
};
use half::bf16;

use super::{Tq4Kernels, driver, int};
use crate::KernelError;
use crate::glue::GEMV_MAX_ROWS;

/// An activation the glue reads: f32, or bf16 (the products' operands when the weights are
/// bf16).
#[derive(Debug)]
pub enum Act<'a> {
    /// f32 elements.
    F32(CudaView<'a, f32>),
    /// bf16 elements.
    Bf16(CudaView<'a, bf16>),
}

/// An activation the glue writes, owned (rounded to nearest even when bf16).
#[derive(Debug)]
pub enum ActBuf {
    /// f32 elements.
    F32(CudaSlice<f32>),
    /// bf16 elements.
    Bf16(CudaSlice<bf16>),
}

impl ActBuf {
    /// A view of it, as the glue reads activations.
    pub fn view(&self) -> Act<'_> {
        match self {
            Self::F32(s) => Act::F32(s.slice(..)),
            Self::Bf16(s) => Act::Bf16(s.slice(..)),
        }
    }

    fn is_bf16(&self) -> i32 {
        i32::from(matches!(self, Self::Bf16(_)))
    }

    fn push<'a>(&'a mut self, launch: &mut LaunchArgs<'a>) {
        match self {
            Self::F32(v) => launch.arg(v),
            Self::Bf16(v) => launch.arg(v),
        };
    }
}

impl Act<'_> {
    fn len(&self) -> usize {
        match self {
            Self::F32(v) => v.len(),
            Self::Bf16(v) => v.len(),
        }
    }

    fn is_bf16(&self) -> i32 {
        i32::from(matches!(self, Self::Bf16(_)))
    }

    fn push<'a>(&'a self, launch: &mut LaunchArgs<'a>) {
        match self {
            Self::F32(v) => launch.arg(v),
            Self::Bf16(v) => launch.arg(v),
        };
    }
}

/// The inputs of one q/k/v glue launch: `n` tokens of the stacked product
/// `[n, (heads + 2·kv_heads)·head_dim]`.
#[derive(Debug)]
pub struct QkvGlue<'a> {
    /// The stacked q/k/v product.
    pub qkv: Act<'a>,
    /// Tokens.
    pub n: usize,
    /// Query heads.
    pub heads: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Each token's position `[n]`.
    pub positions: CudaView<'a, i32>,
    /// RoPE cosines `[positions, head_dim/2]`.
    pub cos: CudaView<'a, f32>,
    /// RoPE sines, as `cos`.
    pub sin: CudaView<'a, f32>,
    /// The layer's key means `[kv_heads, head_dim]`, subtracted from rotated keys.
    pub key_mean: Option<CudaView<'a, f32>>,
    /// Plane row of each (token, KV head) `[n · kv_heads]`.
    pub dst: CudaView<'a, i32>,
    /// Positions the RoPE tables hold.
    pub table_positions: usize,
}

/// Null for an absent pointer argument.
const NULL: u64 = 0;

/// `len` uninitialized elements for a glue kernel's output: every caller below launches a
/// kernel that writes all of them before the buffer is returned.
fn alloc_out<T: cudarc::driver::DeviceRepr>(
    stream: &Arc<CudaStream>,
    len: usize,
) -> Result<CudaSlice<T>, KernelError> {
    // SAFETY: the contents are written in full by the launch that follows on the same stream
    // (stream order), before any read; an error drops the buffer unread.
    unsafe { stream.alloc::<T>(len.max(1)) }.map_err(driver)
}

pub(super) fn alloc_act(
    stream: &Arc<CudaStream>,
    len: usize,
    bf16: bool,
) -> Result<ActBuf, KernelError> {
    Ok(if bf16 {
        ActBuf::Bf16(alloc_out(stream, len)?)
    } else {
        ActBuf::F32(alloc_out(stream, len)?)
    })
}

impl Tq4Kernels {
    /// `x[r] += delta[r]` for each of `rows` rows of `dim` (when `delta` is given), then, when
    /// `norm = (w, eps, bf16)` is given, returns `x[r] · rsqrt(mean(x[r]²) + eps) · w` (bf16 or
    /// f32).
    pub fn add_rms_norm(
        &self,
        x: &mut CudaViewMut<'_, f32>,
        rows: usize,
        dim: usize,
        delta: Option<&Act<'_>>,
        norm: Option<(&CudaView<'_, f32>, f32, bool)>,
    ) -> Result<Option<ActBuf>, KernelError> {
        let len = rows * dim;
        if x.len() < len
            || delta.is_some_and(|d| d.len() < len)
            || norm.as_ref().is_some_and(|(w, _, _)| w.len() < dim)
        {
            return Err(KernelError::Invalid(format!(
                "a residual norm of {rows} rows of {dim} got a buffer too small"
            )));
        }
        let mut out = match norm {
            Some((_, _, bf16)) => Some(alloc_act(&self.stream, len, bf16)?),
            None => None,
        };
        if rows == 0 || (delta.is_none() && norm.is_none()) {
            return Ok(out);
        }
        let dim_i = int(dim, "dim")?;
        let cfg = LaunchConfig {
            grid_dim: (
                u32::try_from(rows).map_err(|_| KernelError::Invalid("rows over u32".into()))?,
                1,
                1,
            ),
            block_dim: (1024, 1, 1),
            shared_mem_bytes: 0,
        };
        let delta_bf16 = delta.map_or(0, Act::is_bf16);
        let (w, eps) = match norm {
            Some((w, eps, _)) => (Some(w), eps),
            None => (None, 0.0),
        };
        let out_bf16 = out.as_ref().map_or(0, ActBuf::is_bf16);
        let mut launch = self.stream.launch_builder(&self.glue_norm);
        launch.arg(x);
        match delta {
            Some(d) => d.push(&mut launch),
            None => {
                launch.arg(&NULL);
            }
        }
        launch.arg(&delta_bf16);
        match w {
            Some(w) => launch.arg(w),
            None => launch.arg(&NULL),
        };
        launch.arg(&dim_i).arg(&eps);
        match out.as_mut() {
            Some(o) => o.push(&mut launch),
            None => {
                launch.arg(&NULL);
            }
        }
        launch.arg(&out_bf16);
        // SAFETY: the arguments match `glue_add_rms_norm` (absent pointers as null, which the
        // kernel tests); every buffer holds `rows × dim` elements (`w` `dim`), checked above.
        unsafe { launch.launch(cfg) }.map_err(driver)?;
        Ok(out)
    }

    /// RoPE on the query and key heads of a stacked q/k/v product, the key means subtracted,
    /// keys and values encoded into the layer's planes (`[k_codes, v_codes, k_norms, v_norms]`,
    /// as kvcore's `CudaLayer::layer_mut` hands them out); returns the rotated queries
    /// (`[n, heads, head_dim]` f32).
    pub fn qkv_rope_encode(
        &self,
        a: &QkvGlue<'_>,
        planes: [&mut CudaViewMut<'_, u8>; 4],
    ) -> Result<CudaSlice<f32>, KernelError> {
        let d = self.head_dim;
        let per = a.heads + 2 * a.kv_heads;
        if a.heads != a.kv_heads * self.group {
            return Err(KernelError::Invalid(format!(
                "{} query heads over {} KV heads, the kernels were built for groups of {}",
                a.heads, a.kv_heads, self.group
            )));
        }
        let half = d / 2;
        if a.qkv.len() < a.n * per * d
            || a.positions.len() < a.n
            || a.dst.len() < a.n * a.kv_heads
            || a.cos.len() < a.table_positions * half
            || a.sin.len() < a.table_positions * half
            || a.key_mean
                .as_ref()
                .is_some_and(|m| m.len() < a.kv_heads * d)
        {
            return Err(KernelError::Invalid(format!(
                "q/k/v glue over {} tokens got a buffer too small",
                a.n
            )));
        }
        let [kc, vc, kn, vn] = planes;
        if kn.len() % 2 != 0
            || kc.len() / (d / 2) != kn.len() / 2
            || vc.len() != kc.len()
            || vn.len() != kn.len()
        {
            return Err(KernelError::Invalid(
                "the code and norm planes hold different row counts".into(),
            ));
        }
        let rows = a.n * per;
        let mut q = alloc_out::<f32>(&self.stream, a.n * a.heads * d)?;
        if rows == 0 {
            return Ok(q);
        }
        let (n, heads, kv_heads) = (
            int(a.n, "tokens")?,
            int(a.heads, "heads")?,
            int(a.kv_heads, "kv_heads")?,
        );
        int(rows, "rows")?;
        let cfg = LaunchConfig {
            grid_dim: (
                u32::try_from(rows.div_ceil(4))
                    .map_err(|_| KernelError::Invalid("rows over u32".into()))?,
                1,
                1,
            ),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let qkv_bf16 = a.qkv.is_bf16();
        let mut launch = self.stream.launch_builder(&self.glue_qkv);
        a.qkv.push(&mut launch);
        launch
            .arg(&qkv_bf16)
            .arg(&n)
            .arg(&heads)
            .arg(&kv_heads)
            .arg(&a.positions)
            .arg(&a.cos)
            .arg(&a.sin);
        match &a.key_mean {
            Some(m) => launch.arg(m),
            None => launch.arg(&NULL),
        };
        launch
            .arg(&a.dst)
            .arg(&self.signs)
            .arg(&self.thresholds)
            .arg(&self.rot_scale)
            .arg(kc)
            .arg(kn)
            .arg(vc)
            .arg(vn)
            .arg(&mut q);
        // SAFETY: the arguments match `glue_qkv_rope_encode`; the buffers hold what `n` tokens
        // need (checked above). Every position must be below `table_positions` and every `dst`
        // entry must name a row of the planes; the engine checks positions against the model's
        // context and its block allocation hands out only such rows.
        unsafe { launch.launch(cfg) }.map_err(driver)?;
        Ok(q)
    }

    /// `act[r, i] = silu(gu[r, i]) · gu[r, ff + i]` over `rows` rows of the stacked gate/up
    /// product `[rows, 2·ff]`, bf16 or f32.
    pub fn swiglu(
        &self,
        gu: &Act<'_>,
        rows: usize,
        ff: usize,
        bf16: bool,
    ) -> Result<ActBuf, KernelError> {
        let len = rows * ff;
        let mut act = alloc_act(&self.stream, len, bf16)?;
        if gu.len() < 2 * len {
            return Err(KernelError::Invalid(format!(
                "SwiGLU over {rows} rows of {ff} got a buffer too small"
            )));
        }
        if len == 0 {
            return Ok(act);
        }
        let cfg = LaunchConfig {
            grid_dim: (
                ff.div_ceil(256) as u32,
                u32::try_from(rows).map_err(|_| KernelError::Invalid("rows over u32".into()))?,
                1,
            ),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (n, ff_i) = (int(rows, "rows")?, int(ff, "ff")?);
        let (gu_bf16, act_bf16) = (gu.is_bf16(), act.is_bf16());
        let mut launch = self.stream.launch_builder(&self.glue_swiglu);
        gu.push(&mut launch);
        launch.arg(&gu_bf16).arg(&n).arg(&ff_i);
        act.push(&mut launch);
        launch.arg(&act_bf16);
        // SAFETY: the arguments match `glue_swiglu`; `gu` holds `rows × 2·ff` elements and
        // `act` `rows × ff` (allocated above).
        unsafe { launch.launch(cfg) }.map_err(driver)?;
        Ok(act)
    }

    /// `y = x · wᵀ` for the few rows of a decode step (`gemv_bf16`): `x` `[n, k]` with
    /// `1 ≤ n ≤ GEMV_MAX_ROWS`, `w` `[m, k]`, both bf16 row-major; returns `[n, m]` bf16 (f32
    /// sums, rounded to nearest even). The weights are read once, one warp per output column.
    pub fn gemv_bf16(
        &self,
        x: &CudaView<'_, bf16>,
        n: usize,
        k: usize,
        w: &CudaView<'_, bf16>,
        m: usize,
    ) -> Result<CudaSlice<bf16>, KernelError> {
        if n == 0 || n > GEMV_MAX_ROWS {
            return Err(KernelError::Invalid(format!(
                "the few-row product takes 1 to {GEMV_MAX_ROWS} rows, not {n}"
            )));
        }
        if x.len() < n * k || w.len() < m * k {
            return Err(KernelError::Invalid(format!(
                "a [{n}, {k}] by [{m}, {k}] product got a buffer too small"
            )));
        }
        let mut y = alloc_out::<bf16>(&self.stream, n * m)?;
        if m == 0 {
            return Ok(y);
        }
        let (n_i, k_i, m_i) = (int(n, "rows")?, int(k, "k")?, int(m, "columns")?);
        let cfg = LaunchConfig {
            grid_dim: (
                u32::try_from(m.div_ceil(GEMV_WARPS))
                    .map_err(|_| KernelError::Invalid("columns over u32".into()))?,
                1,
                1,
            ),
            block_dim: (32 * GEMV_WARPS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = self.stream.launch_builder(&self.gemv);
        launch
            .arg(x)
            .arg(&n_i)
            .arg(&k_i)
            .arg(w)
            .arg(&m_i)
            .arg(&mut y);
        // SAFETY: the arguments match `gemv_bf16`; `x` holds `n × k` elements, `w` `m × k` and
        // `y` `n × m` (checked and allocated above); the kernel reads 16-byte words only when
        // `k` is a multiple of 8 and both pointers are 16-byte aligned.
        unsafe { launch.launch(cfg) }.map_err(driver)?;
        Ok(y)
    }
}

/// Warps a CTA of `gemv_bf16` (`GEMV_WARPS`), one per output column.
const GEMV_WARPS: usize = 8;
