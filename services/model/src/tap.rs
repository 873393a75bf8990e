//! The tap into the KV path: what an instrument does to a layer's new K/V rows between the
//! projections and the store. The model defines it and calls it; the fidelity harness
//! implements it (engram-lab's `KvProbe`); serving never sets one.

use crate::error::ModelResult;

/// Rewrites new K/V rows in place before they are stored.
pub trait KvTap: std::fmt::Debug + Send + Sync {
    /// One layer's new rows, `[rows, kv_heads, head_dim]` each (keys after RoPE and centering),
    /// at `positions` (one per row).
    fn apply(
        &self,
        layer: usize,
        positions: &[usize],
        head_dim: usize,
        k: &mut [f32],
        v: &mut [f32],
    ) -> ModelResult<()>;

    /// One layer's queries after RoPE, `[rows, heads, head_dim]`, at `positions` (read only;
    /// the key calibration measures them).
    fn queries(&self, layer: usize, positions: &[usize], q: &[f32]) -> ModelResult<()> {
        let _ = (layer, positions, q);
        Ok(())
    }
}
