//! The device forward's candle-tensor steps around the kernels: the end of a layer (output
//! projection, SwiGLU MLP, residuals), the final norm of the logit rows, and RoPE on tensors.

use candle_core::{Device, Tensor};

use super::super::{Llama, SeqInput};
use crate::weights::Layer;

impl Layer {
    /// The rest of a decoder layer once attention is done: output projection and residual, then
    /// the SwiGLU MLP and its residual (the device path's).
    pub(super) fn finish(
        &self,
        x: &Tensor,
        attn: &Tensor,
        eps: f32,
        threads: usize,
    ) -> candle_core::Result<Tensor> {
        let x = (x + self.wo.forward(attn, threads)?)?;
        let h = candle_nn::ops::rms_norm(&x, &self.ffn_norm, eps)?;
        let gate = candle_nn::ops::silu(&self.w_gate.forward(&h, threads)?)?;
        let up = self.w_up.forward(&h, threads)?;
        x + self.w_down.forward(&(gate * up)?, threads)?
    }
}

impl Llama {
    /// The final norm of the rows whose logits `batch` asks for (the device path's).
    pub(super) fn final_norm(
        &self,
        x: &Tensor,
        batch: &[SeqInput<'_>],
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let rows = Self::logit_rows(batch);
        // Every row asked for, in order (a decode batch): no gather (on a device, an upload
        // and a launch saved).
        let every =
            rows.len() == x.dim(0)? && rows.iter().enumerate().all(|(i, &r)| i == r as usize);
        let x = if every {
            x.clone()
        } else {
            let rows = Tensor::from_vec(rows.clone(), rows.len(), dev)?;
            x.index_select(&rows, 0)?
        };
        candle_nn::ops::rms_norm(&x, &self.norm, self.config.rms_eps as f32)
    }
}

/// Applies half-split RoPE to `x: [rows, heads·d]` at the rows' positions; returns
/// `[rows, heads, d]`, contiguous (the CPU path's own is checked against candle's too).
pub(super) fn rope(
    x: &Tensor,
    heads: usize,
    d: usize,
    cos: &Tensor,
    sin: &Tensor,
) -> candle_core::Result<Tensor> {
    let rows = x.dim(0)?;
    let x = x
        .reshape((1, rows, heads, d))?
        .transpose(1, 2)?
        .contiguous()?;
    let y = candle_nn::rotary_emb::rope(&x, cos, sin)?;
    y.squeeze(0)?.transpose(0, 1)?.contiguous()
}
