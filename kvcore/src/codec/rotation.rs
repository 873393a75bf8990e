//! The seeded random rotation Π applied to every row before TurboQuant quantization.
//!
//! - head_dim a power of two: randomized Hadamard transform, Π = H·D/√d with D a diagonal of
//!   seeded random signs and H the Walsh–Hadamard matrix; applied in O(d log d) by the fast
//!   Walsh–Hadamard butterfly, no matrix stored.
//! - otherwise: a dense d×d orthogonal matrix from modified Gram–Schmidt (in f64) on seeded
//!   Gaussian rows; O(d²) per application.
//!
//! Invariant: Π is orthogonal, so ⟨Πq, Πk⟩ = ⟨q, k⟩ and `inverse(forward(x)) == x` up to
//! rounding. The same (head_dim, seed) always yields the same Π (see `rng`).

use super::rng::SplitMix64;

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Rotation {
    Hadamard { signs: Vec<f32>, scale: f32 },
    Dense { dim: usize, rows: Vec<f32> },
}

impl Rotation {
    pub(crate) fn new(dim: usize, seed: u64) -> Self {
        // Mix the dimension into the seed so different head_dims never share a stream prefix.
        let mut rng = SplitMix64::new(seed ^ (dim as u64).wrapping_mul(0xA24B_AED4_963E_E407));
        if dim.is_power_of_two() {
            let signs = (0..dim)
                .map(|_| if rng.next_u64() >> 63 == 0 { 1.0 } else { -1.0 })
                .collect();
            Self::Hadamard {
                signs,
                scale: 1.0 / (dim as f32).sqrt(),
            }
        } else {
            Self::Dense {
                dim,
                rows: gram_schmidt(dim, &mut rng),
            }
        }
    }

    /// y = Π x.
    pub(crate) fn forward(&self, x: &[f32], y: &mut [f32]) {
        match self {
            Self::Hadamard { signs, scale } => {
                for ((o, &v), &s) in y.iter_mut().zip(x).zip(signs) {
                    *o = v * s;
                }
                fwht(y);
                for o in y.iter_mut() {
                    *o *= scale;
                }
            }
            Self::Dense { dim, rows } => {
                for (o, row) in y.iter_mut().zip(rows.chunks_exact(*dim)) {
                    *o = dot(row, x);
                }
            }
        }
    }

    /// x = Πᵀ y.
    pub(crate) fn inverse(&self, y: &[f32], x: &mut [f32]) {
        match self {
            Self::Hadamard { signs, scale } => {
                x.copy_from_slice(y);
                fwht(x);
                for (o, &s) in x.iter_mut().zip(signs) {
                    *o *= s * scale;
                }
            }
            Self::Dense { dim, rows } => {
                x.fill(0.0);
                for (&c, row) in y.iter().zip(rows.chunks_exact(*dim)) {
                    for (o, &r) in x.iter_mut().zip(row) {
                        *o += c * r;
                    }
                }
            }
        }
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// In-place unnormalized fast Walsh–Hadamard transform; `v.len()` is a power of two.
fn fwht(v: &mut [f32]) {
    let n = v.len();
    let mut h = 1;
    while h < n {
        for chunk in v.chunks_exact_mut(2 * h) {
            let (lo, hi) = chunk.split_at_mut(h);
            for (a, b) in lo.iter_mut().zip(hi.iter_mut()) {
                let (x, y) = (*a, *b);
                *a = x + y;
                *b = x - y;
            }
        }
        h *= 2;
    }
}

/// Orthonormal rows from seeded Gaussian vectors (modified Gram–Schmidt, re-orthogonalized once).
fn gram_schmidt(dim: usize, rng: &mut SplitMix64) -> Vec<f32> {
    let mut basis: Vec<Vec<f64>> = Vec::with_capacity(dim);
    while basis.len() < dim {
        let mut v: Vec<f64> = (0..dim).map(|_| rng.next_gaussian()).collect();
        for _ in 0..2 {
            for b in &basis {
                let p: f64 = v.iter().zip(b).map(|(x, y)| x * y).sum();
                for (x, y) in v.iter_mut().zip(b) {
                    *x -= p * y;
                }
            }
        }
        let n = v.iter().map(|x| x * x).sum::<f64>().sqrt();
        // A degenerate draw (vanishingly rare) is simply redrawn.
        if n > 1e-6 {
            v.iter_mut().for_each(|x| *x /= n);
            basis.push(v);
        }
    }
    basis.into_iter().flatten().map(|x| x as f32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_orthogonal(dim: usize) {
        let r = Rotation::new(dim, 42);
        let mut rng = SplitMix64::new(1);
        let x: Vec<f32> = (0..dim).map(|_| rng.next_gaussian() as f32).collect();
        let q: Vec<f32> = (0..dim).map(|_| rng.next_gaussian() as f32).collect();
        let (mut y, mut z, mut back) = (vec![0.0; dim], vec![0.0; dim], vec![0.0; dim]);
        r.forward(&x, &mut y);
        r.forward(&q, &mut z);
        r.inverse(&y, &mut back);
        let err: f32 = x
            .iter()
            .zip(&back)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(err < 1e-4, "dim {dim}: round trip error {err}");
        let (d0, d1) = (dot(&x, &q), dot(&y, &z));
        assert!(
            (d0 - d1).abs() < 1e-3 * (1.0 + d0.abs()),
            "dim {dim}: {d0} vs {d1}"
        );
    }

    #[test]
    fn hadamard_and_dense_rotations_are_orthogonal() {
        for dim in [8, 64, 128, 256, 24, 80, 96] {
            check_orthogonal(dim);
        }
    }

    #[test]
    fn same_seed_same_rotation_other_seed_other_rotation() {
        assert_eq!(Rotation::new(64, 5), Rotation::new(64, 5));
        assert_ne!(Rotation::new(64, 5), Rotation::new(64, 6));
        assert_ne!(Rotation::new(80, 5), Rotation::new(80, 6));
    }
}
