//! How a model's weights are held and multiplied once loaded: a projection dense or in its GGUF
//! blocks (or rows of a stack of them), the token embedding likewise, and the dtype a CUDA
//! device holds them in.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use engram_qmatmul::QMatrix;
use serde::{Deserialize, Serialize};

use crate::error::{ModelError, ModelResult};

/// The dtype a CUDA device holds the projections in by default: half the bytes of f32 per
/// decode step (an 8B model reads 16 GB instead of 32), tensor-core products.
pub const DEVICE_WEIGHTS: DType = DType::BF16;

/// How a CUDA device holds and multiplies the projections.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeviceWeights {
    /// bf16 weights and matmul operands, f32 accumulation, products rounded to bf16 (cuBLAS
    /// through candle): the serving default.
    #[default]
    Bf16,
    /// f32 weights and products, the CPU engine's numerics (twice the bytes per step): the
    /// reference for checks.
    F32,
}

impl DeviceWeights {
    /// The dtype of the weights on the device.
    pub fn dtype(self) -> DType {
        match self {
            Self::Bf16 => DEVICE_WEIGHTS,
            Self::F32 => DType::F32,
        }
    }

    /// `bf16` or `f32`.
    pub fn parse(name: &str) -> Option<Self> {
        match name.trim().to_ascii_lowercase().as_str() {
            "bf16" => Some(Self::Bf16),
            "f32" => Some(Self::F32),
            _ => None,
        }
    }
}

/// A projection: a dense `[out, in]` matrix or one kept in its GGUF blocks.
#[derive(Debug, Clone)]
pub(crate) enum Linear {
    Dense(Tensor),
    Blocks(Arc<QMatrix>),
    /// Rows `rows` of a block matrix that stacks several projections reading one input (a
    /// layer's q/k/v or gate/up): the weights are held once, in the stack the forward reads.
    Part {
        stack: Arc<QMatrix>,
        rows: std::ops::Range<usize>,
    },
}

/// The token embedding: a dense `[vocab, hidden]` matrix, or kept in the file's blocks with
/// each looked-up row expanded (a 1.5B model's 151,936 × 1,536 embedding is 933 MB in f32 and
/// 131 MB in `Q4_K`). Tied to the output projection, it is the same matrix.
#[derive(Debug, Clone)]
pub(crate) enum Embedding {
    Dense(Tensor),
    Blocks(Arc<QMatrix>),
}

impl Embedding {
    /// Rows (the vocabulary).
    pub fn rows(&self) -> ModelResult<usize> {
        Ok(match self {
            Self::Dense(t) => t.dim(0)?,
            Self::Blocks(q) => q.rows(),
        })
    }

    /// The rows of `ids`, `[ids.len(), hidden]` row-major in f32, on the CPU.
    pub fn lookup(&self, ids: &[u32]) -> ModelResult<Vec<f32>> {
        match self {
            Self::Dense(t) => {
                let ids = Tensor::from_slice(ids, ids.len(), &Device::Cpu)?;
                Ok(t.index_select(&ids, 0)?.flatten_all()?.to_vec1()?)
            }
            Self::Blocks(q) => {
                let cols = q.cols();
                let mut out = vec![0f32; ids.len() * cols];
                for (&id, row) in ids.iter().zip(out.chunks_exact_mut(cols)) {
                    q.dequantize_row(id as usize, row).map_err(|_| {
                        ModelError::TokenOutOfRange {
                            id,
                            vocab: q.rows(),
                        }
                    })?;
                }
                Ok(out)
            }
        }
    }

    /// The embedding as a dense f32 matrix on `device` (a device looks rows up itself).
    pub fn to_device(&self, device: &Device) -> ModelResult<Self> {
        Ok(Self::Dense(match self {
            Self::Dense(t) => t.to_device(device)?,
            Self::Blocks(q) => {
                Tensor::from_vec(q.dequantize(), (q.rows(), q.cols()), &Device::Cpu)?
                    .to_device(device)?
            }
        }))
    }

    /// The dense matrix (a device model's form).
    #[cfg_attr(not(any(feature = "cuda", test)), allow(dead_code))]
    pub fn dense(&self) -> ModelResult<&Tensor> {
        match self {
            Self::Dense(t) => Ok(t),
            Self::Blocks(_) => Err(ModelError::InvalidConfig {
                field: "device",
                reason: "the embedding is still in blocks on this device".to_string(),
            }),
        }
    }
}

impl Linear {
    /// The projection on `device`. A CUDA device holds it as `held` says (bf16 by default: GGUF
    /// blocks and f32 matrices alike are dequantized and rounded once, at load), multiplied by
    /// cuBLAS with f32 accumulation; the CPU keeps blocks as they are and dense matrices in f32.
    pub fn to_device(&self, device: &Device, held: DeviceWeights) -> ModelResult<Self> {
        let dense = match self {
            Self::Blocks(_) | Self::Part { .. } if device.is_cpu() => return Ok(self.clone()),
            Self::Blocks(q) => {
                Tensor::from_vec(q.dequantize(), (q.rows(), q.cols()), &Device::Cpu)?
            }
            Self::Part { stack, rows } => {
                let cols = stack.cols();
                let mut w = vec![0f32; rows.len() * cols];
                for (r, out) in rows.clone().zip(w.chunks_exact_mut(cols)) {
                    stack
                        .dequantize_row(r, out)
                        .map_err(candle_core::Error::wrap)?;
                }
                Tensor::from_vec(w, (rows.len(), cols), &Device::Cpu)?
            }
            Self::Dense(w) => w.clone(),
        };
        let dtype = if device.is_cpu() {
            DType::F32
        } else {
            held.dtype()
        };
        // Converted where it lands: a device rounds in parallel, the CPU keeps f32 as is.
        Ok(Self::Dense(dense.to_device(device)?.to_dtype(dtype)?))
    }

    /// The projection held as a device holds it, on the CPU: dense weights in
    /// [`DEVICE_WEIGHTS`], multiplied as a device multiplies them (activations rounded to bf16,
    /// f32 accumulation, products rounded to bf16): the CPU reference of `engram check device`
    /// computes what the device computes. Blocks unchanged.
    pub fn rounded_for_device(&self, held: DeviceWeights) -> ModelResult<Self> {
        match self {
            Self::Dense(w) => Ok(Self::Dense(w.to_dtype(held.dtype())?)),
            Self::Blocks(_) | Self::Part { .. } => Ok(self.clone()),
        }
    }

    /// Whether the matrix is held in [`DEVICE_WEIGHTS`].
    pub fn is_device_dtype(&self) -> bool {
        matches!(self, Self::Dense(w) if w.dtype() == DEVICE_WEIGHTS)
    }

    /// `x · wᵀ` for `x: [m, in]` row-major on the CPU, as a row-major `[m, out]` buffer.
    pub fn apply(&self, x: &[f32], m: usize, threads: usize) -> candle_core::Result<Vec<f32>> {
        match self {
            Self::Blocks(q) => block_product(q, x, m, threads),
            Self::Part { stack, rows } => {
                let all = block_product(stack, x, m, threads)?;
                Ok(all
                    .chunks_exact(stack.rows())
                    .flat_map(|y| y[rows.clone()].iter().copied())
                    .collect())
            }
            Self::Dense(w) => {
                let x = Tensor::from_slice(x, (m, w.dim(1)?), &Device::Cpu)?;
                self.forward(&x, threads)?.flatten_all()?.to_vec1()
            }
        }
    }

    /// `x · wᵀ` for `x: [rows, in]` (f32 in and out; bf16 weights multiply bf16-rounded
    /// activations), block kernels on up to `threads` threads.
    pub fn forward(&self, x: &Tensor, threads: usize) -> candle_core::Result<Tensor> {
        match self {
            Self::Dense(w) if w.dtype() == x.dtype() => x.matmul(&w.t()?),
            // bf16 operands, f32 accumulation (candle's cuBLAS default), the product rounded to
            // bf16, f32 out.
            Self::Dense(w) if !x.device().is_cpu() => {
                x.to_dtype(w.dtype())?.matmul(&w.t()?)?.to_dtype(x.dtype())
            }
            // The same numerics on the CPU, spelled out (an f32 product of the rounded operands,
            // rounded once): the CPU's bf16 kernels round partial sums of long rows.
            Self::Dense(w) => {
                let xr = x.to_dtype(w.dtype())?.to_dtype(DType::F32)?;
                xr.matmul(&w.to_dtype(DType::F32)?.t()?)?
                    .to_dtype(w.dtype())?
                    .to_dtype(DType::F32)
            }
            Self::Blocks(q) => {
                let m = x.dim(0)?;
                let y = block_product(q, &x.flatten_all()?.to_vec1()?, m, threads)?;
                Tensor::from_vec(y, (m, q.rows()), x.device())
            }
            Self::Part { rows, .. } => {
                let m = x.dim(0)?;
                let y = self.apply(&x.flatten_all()?.to_vec1()?, m, threads)?;
                Tensor::from_vec(y, (m, rows.len()), x.device())
            }
        }
    }

    /// The block matrix the projection is read from (for a part, its stack).
    pub fn blocks(&self) -> Option<&Arc<QMatrix>> {
        match self {
            Self::Blocks(q) | Self::Part { stack: q, .. } => Some(q),
            Self::Dense(_) => None,
        }
    }
}

/// `x · wᵀ` for `x: [m, in]` through a block matrix, as a row-major `[m, out]` buffer.
pub(crate) fn block_product(
    w: &QMatrix,
    x: &[f32],
    m: usize,
    threads: usize,
) -> candle_core::Result<Vec<f32>> {
    let mut y = vec![0f32; m * w.rows()];
    w.matmul(x, m, &mut y, threads)
        .map_err(candle_core::Error::wrap)?;
    Ok(y)
}
