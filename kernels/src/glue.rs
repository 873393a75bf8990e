//! The fused layer glue's arithmetic on the CPU (`glue.cu`): residual + RMSNorm, half-split
//! RoPE with key centering, SwiGLU, bf16 rounding, and the few-row bf16 product (`gemv_bf16`). `engram-gpu-check` compares the kernels
//! with these; the engine's tests check that these are the CPU engine's own ops.

/// Rounds to the nearest bf16, ties to even (what `cvt.rn.bf16.f32` and candle's casts do), as
/// an f32. NaN stays NaN.
pub fn round_bf16(x: f32) -> f32 {
    half::bf16::from_f32(x).to_f32()
}

/// `x[r] += delta[r]` when `delta` is given, then, when `w` is given, returns
/// `x[r] · 1/√(mean(x[r]²) + eps) · w` for every row of `dim`.
pub fn add_rms_norm(
    x: &mut [f32],
    dim: usize,
    delta: Option<&[f32]>,
    w: Option<&[f32]>,
    eps: f32,
) -> Option<Vec<f32>> {
    if let Some(d) = delta {
        for (a, b) in x.iter_mut().zip(d) {
            *a += b;
        }
    }
    let w = w?;
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(dim) {
        let ss: f64 = row.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
        let s = 1.0 / ((ss / dim as f64) as f32 + eps).sqrt();
        out.extend(row.iter().zip(w).map(|(&v, &g)| v * s * g));
    }
    Some(out)
}

/// Half-split RoPE of one head row at a position whose cosines and sines are `cos`, `sin`
/// (`head_dim / 2` each): `(x₁, x₂) → (x₁·c − x₂·s, x₁·s + x₂·c)` for `x₁ = x[i]`,
/// `x₂ = x[i + head_dim/2]`; then `mean` (the head's key mean) subtracted when given.
pub fn rope_half(x: &mut [f32], cos: &[f32], sin: &[f32], mean: Option<&[f32]>) {
    let half = x.len() / 2;
    for i in 0..half {
        let (x1, x2) = (x[i], x[i + half]);
        let (c, s) = (cos[i], sin[i]);
        x[i] = x1 * c - x2 * s;
        x[i + half] = x1 * s + x2 * c;
    }
    if let Some(m) = mean {
        for (v, m) in x.iter_mut().zip(m) {
            *v -= m;
        }
    }
}

/// `silu(gate) · up` for each row of the stacked `[rows, 2·ff]` gate/up product.
pub fn swiglu(gu: &[f32], ff: usize) -> Vec<f32> {
    gu.chunks(2 * ff)
        .flat_map(|r| {
            let (g, u) = r.split_at(ff);
            g.iter().zip(u).map(|(&g, &u)| g / (1.0 + (-g).exp()) * u)
        })
        .collect()
}

/// Rows a `gemv_bf16` launch takes (`GEMV_ROWS`): decode steps of up to this many tokens.
pub const GEMV_MAX_ROWS: usize = 4;

/// `y[r, j] = Σᵢ x[r, i] · w[j, i]` for `x` `[n, k]` and `w` `[m, k]` (bf16 values as f32),
/// summed in f64: `[n, m]`, unrounded. The kernel sums in f32 in another order and rounds to
/// bf16, so it is within one bf16 step of this (plus f32 summation error, ~k · 2⁻²⁴ of the
/// magnitudes).
pub fn gemv(x: &[f32], n: usize, k: usize, w: &[f32], m: usize) -> Vec<f64> {
    let mut y = Vec::with_capacity(n * m);
    for r in 0..n {
        let xr = &x[r * k..(r + 1) * k];
        for j in 0..m {
            let wr = &w[j * k..(j + 1) * k];
            y.push(
                xr.iter()
                    .zip(wr)
                    .map(|(&a, &b)| f64::from(a) * f64::from(b))
                    .sum(),
            );
        }
    }
    y
}

/// The distance from `exact` to the next bf16 value away from zero (one bf16 step at that
/// magnitude): the bound on `gemv_bf16`'s rounding.
pub fn bf16_step(exact: f64) -> f64 {
    let a = exact.abs() as f32;
    if a == 0.0 || !a.is_finite() {
        return f64::from(f32::MIN_POSITIVE);
    }
    let e = a.log2().floor();
    f64::from(2f32.powf(e - 7.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemv_is_the_row_by_row_dot_product() {
        // x = [[1, 2], [3, -1]], w = [[1, 0], [0.5, 4], [2, 2]]
        let y = gemv(
            &[1.0, 2.0, 3.0, -1.0],
            2,
            2,
            &[1.0, 0.0, 0.5, 4.0, 2.0, 2.0],
            3,
        );
        assert_eq!(y, vec![1.0, 8.5, 6.0, 3.0, -2.5, 4.0]);
        // bf16 keeps 8 significant bits: one step at 1.0 is 2^-7, at 6.0 it is 2^-5.
        assert_eq!(bf16_step(1.0), 1.0 / 128.0);
        assert_eq!(bf16_step(-6.0), 1.0 / 32.0);
        assert_eq!(round_bf16(6.0 + 1.0 / 32.0), 6.0 + 1.0 / 32.0);
        assert_eq!(round_bf16(6.0 + 1.0 / 128.0), 6.0);
    }

    #[test]
    fn bf16_rounding_is_to_nearest_even() {
        // 1 + 2⁻⁸ is halfway between 1 and 1 + 2⁻⁷: ties go to the even mantissa (1).
        assert_eq!(round_bf16(1.0 + 1.0 / 256.0), 1.0);
        // 1 + 3·2⁻⁸ is halfway between 1 + 2⁻⁷ and 1 + 2⁻⁶: to 1 + 2⁻⁶.
        assert_eq!(round_bf16(1.0 + 3.0 / 256.0), 1.0 + 1.0 / 64.0);
        assert_eq!(round_bf16(1.0 + 1.1 / 256.0), 1.0 + 1.0 / 128.0);
        assert!(round_bf16(f32::NAN).is_nan());
    }

    #[test]
    fn the_norm_adds_the_residual_and_gives_rows_unit_rms() {
        let mut x = vec![1.0, -2.0, 3.0, 0.5, 0.0, 0.0, 0.0, 4.0];
        let delta = vec![1.0; 8];
        let w = vec![1.0; 4];
        let out = add_rms_norm(&mut x, 4, Some(&delta), Some(&w), 0.0).unwrap_or_default();
        assert_eq!(x[..4], [2.0, -1.0, 4.0, 1.5]);
        for row in out.chunks(4) {
            let ms: f32 = row.iter().map(|v| v * v).sum::<f32>() / 4.0;
            assert!((ms - 1.0).abs() < 1e-5, "{ms}");
        }
        // Without weights only the residual is applied.
        let mut y = vec![1.0; 4];
        assert!(add_rms_norm(&mut y, 4, Some(&[2.0; 4]), None, 1e-5).is_none());
        assert_eq!(y, [3.0; 4]);
    }

    #[test]
    fn rope_rotates_each_pair_by_its_angle_and_keeps_the_norm() {
        let angles = [0.3f32, -1.2];
        let (cos, sin): (Vec<f32>, Vec<f32>) = angles.iter().map(|a| (a.cos(), a.sin())).unzip();
        let mut x = vec![1.0, 2.0, -0.5, 0.25];
        let before: f32 = x.iter().map(|v| v * v).sum();
        rope_half(&mut x, &cos, &sin, None);
        let after: f32 = x.iter().map(|v| v * v).sum();
        assert!((before - after).abs() < 1e-5);
        // Pair 0 is (x[0], x[2]) = (1, -0.5) rotated by 0.3.
        let (c, s) = (0.3f32.cos(), 0.3f32.sin());
        assert!((x[0] - (c + 0.5 * s)).abs() < 1e-6 && (x[2] - (s - 0.5 * c)).abs() < 1e-6);
        let mut k = vec![1.0, 2.0, -0.5, 0.25];
        rope_half(&mut k, &cos, &sin, Some(&[1.0, 1.0, 1.0, 1.0]));
        for (a, b) in k.iter().zip(&x) {
            assert!((a - (b - 1.0)).abs() < 1e-6);
        }
    }

    #[test]
    fn swiglu_gates_the_up_half() {
        let out = swiglu(&[0.0, 2.0, 5.0, 3.0], 2);
        assert_eq!(out[0], 0.0);
        let silu2 = 2.0 / (1.0 + (-2.0f32).exp());
        assert!((out[1] - silu2 * 3.0).abs() < 1e-6);
    }
}
