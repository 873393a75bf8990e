//! The key basis of a model: the means and per-channel scales keys are stored relative to,
//! and the query tap their calibration reads (see [`Llama::key_scales`](super::Llama::key_scales)).

use crate::error::ModelResult;
use crate::tap::KvTap;
use crate::weights::ModelConfig;

/// What a model's keys are stored relative to: per-(layer, KV head) means (subtracted) and
/// per-channel scales (divided by), both `[layers, kv_heads, head_dim]`, calibrated once.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct KeyBasis {
    pub(crate) means: Vec<f32>,
    pub(crate) scales: Vec<f32>,
}

/// Sums of squared queries per (layer, KV head, channel) over a forward (each query head
/// added to its group's KV head), the first position left out; the calibration's tap.
#[derive(Debug)]
pub(crate) struct QueryEnergy {
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    sums: std::sync::Mutex<Vec<f64>>,
}

impl QueryEnergy {
    pub(crate) fn new(cfg: &ModelConfig) -> Self {
        Self {
            heads: cfg.num_heads,
            kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
            sums: std::sync::Mutex::new(vec![
                0.0;
                cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
            ]),
        }
    }

    pub(crate) fn energy(&self) -> Vec<f64> {
        self.sums
            .lock()
            .map(|s| s.clone())
            .unwrap_or_else(|p| p.into_inner().clone())
    }
}

impl KvTap for QueryEnergy {
    fn apply(
        &self,
        _: usize,
        _: &[usize],
        _: usize,
        _: &mut [f32],
        _: &mut [f32],
    ) -> ModelResult<()> {
        Ok(())
    }

    fn queries(&self, layer: usize, positions: &[usize], q: &[f32]) -> ModelResult<()> {
        let (d, width) = (self.head_dim, self.kv_heads * self.head_dim);
        let group = (self.heads / self.kv_heads.max(1)).max(1);
        let mut sums = self.sums.lock().unwrap_or_else(|p| p.into_inner());
        let Some(acc) = sums.get_mut(layer * width..(layer + 1) * width) else {
            return Ok(());
        };
        for (row, &pos) in q.chunks_exact(self.heads * d).zip(positions) {
            if pos == 0 {
                continue;
            }
            for (h, qh) in row.chunks_exact(d).enumerate() {
                let a = &mut acc[(h / group) * d..][..d];
                a.iter_mut()
                    .zip(qh)
                    .for_each(|(a, &x)| *a += f64::from(x) * f64::from(x));
            }
        }
        Ok(())
    }
}

/// The key scales of [`Llama::key_scales`] from the centered keys' and the queries' energies
/// per channel (`[layers, kv_heads, head_dim]` each).
pub(crate) fn key_scales_from(keys: &[f64], queries: &[f64], head_dim: usize) -> Vec<f32> {
    let half = head_dim / 2;
    let mut scales = vec![1.0f32; keys.len()];
    for ((s, k), q) in scales
        .chunks_exact_mut(head_dim)
        .zip(keys.chunks_exact(head_dim))
        .zip(queries.chunks_exact(head_dim))
    {
        // One scale per RoPE pair (j, j + half): s² = √(E_k / E_q), in logs.
        let mut logs = vec![0.0f64; half];
        for (j, l) in logs.iter_mut().enumerate() {
            let (ek, eq) = (k[j] + k[j + half], q[j] + q[j + half]);
            *l = if ek > 0.0 && eq > 0.0 && ek.is_finite() && eq.is_finite() {
                0.25 * (ek / eq).ln()
            } else {
                0.0
            };
        }
        let centre = logs.iter().sum::<f64>() / half.max(1) as f64;
        let limit = 64f64.ln();
        for (j, l) in logs.iter().enumerate() {
            let v = (l - centre).clamp(-limit, limit).exp() as f32;
            s[j] = v;
            s[j + half] = v;
        }
    }
    scales
}

#[cfg(test)]
mod tests {
    use super::key_scales_from;

    #[test]
    fn key_scales_share_a_rope_pair_balance_keys_against_queries_and_keep_a_unit_mean() {
        // One head of 4 channels (pairs (0, 2) and (1, 3)): pair 0 has 16× the key energy of
        // pair 1 at equal query energy.
        let keys = [8.0, 0.5, 8.0, 0.5];
        let queries = [1.0, 1.0, 1.0, 1.0];
        let s = key_scales_from(&keys, &queries, 4);
        assert_eq!(s[0], s[2]);
        assert_eq!(s[1], s[3]);
        // s² ∝ √(E_k / E_q): s0 / s1 = 16^(1/4) = 2, geometric mean 1.
        assert!((s[0] / s[1] - 2.0).abs() < 1e-6, "{s:?}");
        assert!((s[0] * s[1] - 1.0).abs() < 1e-6, "{s:?}");
        // Queries as unbalanced as the keys cancel them: no scaling.
        let s = key_scales_from(&keys, &keys, 4);
        assert!(s.iter().all(|&x| (x - 1.0).abs() < 1e-6), "{s:?}");
        // A dead channel pair keeps scale 1 before centering; extremes are clamped.
        let s = key_scales_from(&[0.0, 1e30, 0.0, 1e30], &[1.0, 1e-30, 1.0, 1e-30], 4);
        assert!(
            s.iter()
                .all(|x| (1.0 / 64.0 - 1e-6..=64.0 + 1e-4).contains(x)),
            "{s:?}"
        );
        assert!(s[1] > s[0], "{s:?}");
    }
}
