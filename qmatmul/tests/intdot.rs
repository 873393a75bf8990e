//! Integer activations (W4A16, W4A8, and W8A16 for byte blocks): every tier bit-identical to the
//! scalar reference, the product equal to the weights times the quantized activations, and close
//! to the f32 product; byte matrices' repacked codes held once and read back unchanged.

#![allow(clippy::unwrap_used)]

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use engram_qmatmul::{Activations, GgufBlock, Isa, QMatrix, quantized_activations};
use proptest::prelude::*;

const INTS: [Activations; 2] = [Activations::Int16, Activations::Int8];

const NIBBLES: [(GgufBlock, GgmlDType); 3] = [
    (GgufBlock::Q4_0, GgmlDType::Q4_0),
    (GgufBlock::Q4_1, GgmlDType::Q4_1),
    (GgufBlock::Q4K, GgmlDType::Q4K),
];

fn floats(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = (s >> 40) as f32 / (1u64 << 24) as f32;
            // Outliers now and then, as activations have.
            let spike = if i % 97 == 0 { 6.0 } else { 1.0 };
            (2.0 * u - 1.0) * spike + 0.2 * ((i / 256) % 3) as f32 - 0.2
        })
        .collect()
}

fn matrix(block: GgufBlock, dtype: GgmlDType, rows: usize, cols: usize, seed: u64) -> QMatrix {
    let w = Tensor::from_vec(floats(rows * cols, seed), (rows, cols), &Device::Cpu).unwrap();
    let q = QTensor::quantize(&w, dtype).unwrap();
    QMatrix::from_gguf(block, rows, cols, &q.data().unwrap()).unwrap()
}

fn product(w: &QMatrix, isa: Isa, x: &[f32], m: usize, threads: usize) -> Vec<f32> {
    let mut y = vec![0f32; m * w.rows()];
    w.matmul_on(isa, x, m, &mut y, threads).unwrap();
    y
}

/// `x · Wᵀ` in f64 from the dequantized weights.
fn reference(w: &QMatrix, x: &[f32], m: usize) -> Vec<f64> {
    let wd = w.dequantize();
    let (rows, cols) = (w.rows(), w.cols());
    let mut y = vec![0f64; m * rows];
    for i in 0..m {
        for r in 0..rows {
            y[i * rows + r] = (0..cols)
                .map(|k| f64::from(wd[r * cols + k]) * f64::from(x[i * cols + k]))
                .sum();
        }
    }
    y
}

fn rel_l2(a: &[f32], b: &[f64]) -> f64 {
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(a, b)| (f64::from(*a) - b).powi(2))
        .sum();
    let den: f64 = b.iter().map(|b| b * b).sum();
    (num / den).sqrt()
}

fn check(w: &QMatrix, acts: Activations, m: usize, seed: u64, threads: usize) {
    let x = floats(m * w.cols(), seed);
    let scalar = product(w, Isa::Scalar, &x, m, threads);
    for isa in Isa::available() {
        assert_eq!(
            product(w, isa, &x, m, threads),
            scalar,
            "{isa:?} m={m} rows={} threads={threads}",
            w.rows()
        );
    }
    // The weights times the quantized activations, to f32 rounding.
    let xq = quantized_activations(&x, w.cols(), acts).unwrap();
    assert_ne!(xq, x, "{acts:?} rounds");
    let exact = reference(w, &xq, m);
    let err = rel_l2(&scalar, &exact);
    assert!(
        err < 1e-5,
        "{acts:?} m={m}: rel-L2 {err} against the quantized activations"
    );
    // And close to the f32 activations' product: the rounding of x is bounded (int16: 1/65,534
    // of a group's largest magnitude, int8: 1/254).
    let bound = match acts {
        Activations::Int16 => 1e-4,
        _ => 2e-2,
    };
    let err = rel_l2(&scalar, &reference(w, &x, m));
    assert!(
        err < bound,
        "{acts:?} m={m}: rel-L2 {err} against f32 activations"
    );
}

#[test]
fn every_tier_is_the_scalar_bits_and_the_quantized_product() {
    for acts in INTS {
        for (block, dtype) in NIBBLES {
            let w = matrix(block, dtype, 40, 512, 3).with_activations(acts);
            assert_eq!(w.activations(), acts);
            for m in [1, 2, 3, 5, 8, 9, 17, 20] {
                check(&w, acts, m, 11 + m as u64, 2);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    #[test]
    fn any_shape_and_thread_count_is_the_scalar_bits(
        rows in 1usize..70,
        groups in 1usize..10,
        m in 1usize..24,
        threads in 1usize..4,
        seed in 0u64..1000,
        int16 in any::<bool>(),
    ) {
        let acts = if int16 { Activations::Int16 } else { Activations::Int8 };
        let w = matrix(GgufBlock::Q4_1, GgmlDType::Q4_1, rows, 32 * groups, seed)
            .with_activations(acts);
        let x = floats(m * w.cols(), seed + 1);
        let scalar = product(&w, Isa::Scalar, &x, m, 1);
        for isa in Isa::available() {
            prop_assert_eq!(product(&w, isa, &x, m, threads), scalar.clone());
        }
    }
}

#[test]
fn an_output_is_the_same_bits_whatever_rows_or_threads_share_the_product() {
    for acts in INTS {
        let w = matrix(GgufBlock::Q4_1, GgmlDType::Q4_1, 200, 576, 8).with_activations(acts);
        let x = floats(60 * 576, 9);
        for isa in Isa::available() {
            let all = product(&w, isa, &x, 60, 2);
            for threads in [1, 3] {
                assert_eq!(product(&w, isa, &x, 60, threads), all, "{isa:?} {threads}");
            }
            for (start, m) in [(0, 1), (7, 1), (10, 5), (20, 16), (3, 33), (59, 1)] {
                let part = product(&w, isa, &x[start * 576..(start + m) * 576], m, 2);
                assert_eq!(
                    part,
                    all[start * 200..(start + m) * 200],
                    "{isa:?} {start}+{m}"
                );
            }
        }
    }
}

#[test]
fn stacks_and_permutations_keep_the_activations_and_compute_each_part_alike() {
    let int16 = Activations::Int16;
    let a = matrix(GgufBlock::Q4_1, GgmlDType::Q4_1, 24, 256, 1).with_activations(int16);
    let b = matrix(GgufBlock::Q4_1, GgmlDType::Q4_1, 40, 256, 2).with_activations(int16);
    let s = QMatrix::stack(&[&a, &b]).unwrap();
    assert_eq!(s.activations(), int16);
    let x = floats(3 * 256, 4);
    let (ya, yb, ys) = (
        product(&a, Isa::active(), &x, 3, 2),
        product(&b, Isa::active(), &x, 3, 2),
        product(&s, Isa::active(), &x, 3, 2),
    );
    for i in 0..3 {
        assert_eq!(ys[i * 64..i * 64 + 24], ya[i * 24..(i + 1) * 24]);
        assert_eq!(ys[i * 64 + 24..(i + 1) * 64], yb[i * 40..(i + 1) * 40]);
    }
    let order: Vec<usize> = (0..24).rev().collect();
    let p = a.permute_rows(&order).unwrap();
    assert_eq!(p.activations(), int16);
    let yp = product(&p, Isa::active(), &x, 3, 2);
    for i in 0..3 {
        for r in 0..24 {
            assert_eq!(yp[i * 24 + r], ya[i * 24 + 23 - r]);
        }
    }
    // A byte matrix has int16 kernels only (the byte tests below); a stack of mixed activations is
    // f32.
    let c = matrix(GgufBlock::Q8_0, GgmlDType::Q8_0, 8, 256, 5);
    assert_eq!(c.clone().with_activations(int16).activations(), int16);
    assert_eq!(
        c.with_activations(Activations::Int8).activations(),
        Activations::F32
    );
    let d = matrix(GgufBlock::Q4_1, GgmlDType::Q4_1, 8, 256, 6).with_activations(Activations::Int8);
    assert_eq!(
        QMatrix::stack(&[&a, &d]).unwrap().activations(),
        Activations::F32
    );
}

#[test]
fn zero_rows_and_huge_values_quantize_without_nan() {
    for acts in INTS {
        let w = matrix(GgufBlock::Q4_0, GgmlDType::Q4_0, 16, 64, 2).with_activations(acts);
        let mut x = vec![0f32; 2 * 64];
        x[64..]
            .iter_mut()
            .enumerate()
            .for_each(|(i, v)| *v = 1e30 * (i as f32 - 31.5));
        let y = product(&w, Isa::active(), &x, 2, 1);
        assert!(y[..16].iter().all(|&v| v == 0.0));
        assert!(y[16..].iter().all(|v| v.is_finite()));
        assert!(quantized_activations(&x, 48, acts).is_err());
    }
}

#[test]
fn integer_panels_are_the_only_copy_and_give_the_weights_back() {
    for (block, dtype) in NIBBLES {
        // 40 rows: the last panel is partly empty.
        let rows_form = matrix(block, dtype, 40, 512, 9);
        for acts in INTS {
            let panels = rows_form.clone().with_activations(acts);
            // Codes, scales and offsets once (the panels pad rows to 16), not twice.
            assert!(
                panels.bytes() <= rows_form.bytes() * 49 / 40,
                "{block:?}: {} bytes in panels for {} in rows",
                panels.bytes(),
                rows_form.bytes()
            );
            // Every weight read back from the panels, row by row and whole.
            assert_eq!(panels.dequantize(), rows_form.dequantize(), "{block:?}");
            let mut row = vec![0f32; 512];
            panels.dequantize_row(39, &mut row).unwrap();
            assert_eq!(row[..], rows_form.dequantize()[39 * 512..]);
            // Back to f32 activations: the rows again, the same matrix.
            assert_eq!(
                panels.with_activations(Activations::F32),
                rows_form,
                "{block:?}"
            );
        }
    }
}

#[test]
fn q4_k_panels_keep_the_blocks_own_scales_and_compute_the_same_bits() {
    // 64 rows (whole panels) of 1,024 columns: per weight half a byte of codes, per 32 the
    // bytes `sc` and `m`, per 256 the f32 `d` and `−dmin`: 0.59375 bytes.
    let (rows, cols) = (64, 1024);
    let q4k = matrix(GgufBlock::Q4K, GgmlDType::Q4K, rows, cols, 21);
    let q41 = matrix(GgufBlock::Q4_1, GgmlDType::Q4_1, rows, cols, 21);
    for acts in INTS {
        let k = q4k.clone().with_activations(acts);
        assert_eq!(k.bytes() * 32, rows * cols * 19, "Q4_K panels");
        assert_eq!(
            q41.clone().with_activations(acts).bytes() * 4,
            rows * cols * 3
        );
        // A stack of Q4_K parts keeps the form; a stack with another block type falls back to
        // f32 scales, and computes each part alike either way.
        let half = matrix(GgufBlock::Q4K, GgmlDType::Q4K, 16, cols, 22).with_activations(acts);
        let other = matrix(GgufBlock::Q4_1, GgmlDType::Q4_1, 16, cols, 23).with_activations(acts);
        let same = QMatrix::stack(&[&k, &half]).unwrap();
        assert_eq!(same.bytes() * 32, (rows + 16) * cols * 19);
        let mixed = QMatrix::stack(&[&k, &other]).unwrap();
        assert!(mixed.bytes() * 4 >= (rows + 16) * cols * 3, "f32 scales");
        let x = floats(3 * cols, 24);
        for isa in Isa::available() {
            let yk = product(&k, isa, &x, 3, 2);
            let yh = product(&half, isa, &x, 3, 2);
            let yo = product(&other, isa, &x, 3, 2);
            for (s, tail) in [(&same, &yh), (&mixed, &yo)] {
                let ys = product(s, isa, &x, 3, 2);
                for i in 0..3 {
                    let at = i * (rows + 16);
                    assert_eq!(ys[at..at + rows], yk[i * rows..(i + 1) * rows], "{isa:?}");
                    assert_eq!(ys[at + rows..at + rows + 16], tail[i * 16..(i + 1) * 16]);
                }
            }
            // Permuted rows keep the form and move the outputs.
            let order: Vec<usize> = (0..rows).rev().collect();
            let p = k.permute_rows(&order).unwrap();
            assert_eq!(p.bytes(), k.bytes());
            let yp = product(&p, isa, &x, 3, 2);
            for i in 0..3 {
                for r in 0..rows {
                    assert_eq!(yp[i * rows + r], yk[i * rows + rows - 1 - r], "{isa:?}");
                }
            }
        }
        // The rows read back are the rows read from the blocks.
        assert_eq!(k.dequantize(), q4k.dequantize());
        assert_eq!(k.with_activations(Activations::F32), q4k);
    }
}

/// Byte blocks: int16 activations only (W8A16), for widths of whole 256-column blocks.
const BYTES: [(GgufBlock, GgmlDType); 3] = [
    (GgufBlock::Q6K, GgmlDType::Q6K),
    (GgufBlock::Q8_0, GgmlDType::Q8_0),
    (GgufBlock::Q5_0, GgmlDType::Q5_0),
];

#[test]
fn every_tier_and_any_rows_or_threads_give_the_scalar_bits_of_the_quantized_product() {
    for (block, dtype) in BYTES {
        let rows_f32 = matrix(block, dtype, 37, 512, 5);
        let w = rows_f32.clone().with_activations(Activations::Int16);
        assert_eq!(w.activations(), Activations::Int16, "{block:?}");
        let x = floats(40 * 512, 9);
        // All 40 rows at once (more than a thread's chunk of activation rows), on one thread, on the scalar tier: the reference bits.
        let all = product(&w, Isa::Scalar, &x, 40, 1);
        for isa in Isa::available() {
            for threads in [1, 2, 3] {
                for m in [1, 2, 3, 4, 5, 8, 20, 33, 40] {
                    let y = product(&w, isa, &x[..m * 512], m, threads);
                    assert_eq!(
                        y[..],
                        all[..m * 37],
                        "{block:?} {isa:?} m={m} threads={threads}"
                    );
                }
            }
        }
        // Row 7 alone is row 7 of the batch.
        let one = product(&w, Isa::active(), &x[7 * 512..8 * 512], 1, 2);
        assert_eq!(one[..], all[7 * 37..8 * 37], "{block:?}");
        // The weights times the quantized activations, to f32 rounding; close to the f32 product.
        let xq = quantized_activations(&x, 512, Activations::Int16).unwrap();
        let err = rel_l2(&all, &reference(&rows_f32, &xq, 40));
        assert!(
            err < 1e-5,
            "{block:?}: rel-L2 {err} against the quantized activations"
        );
        let err = rel_l2(&all, &reference(&rows_f32, &x, 40));
        assert!(
            err < 1e-4,
            "{block:?}: rel-L2 {err} against f32 activations"
        );
        // The f32 activations' product is another computation of the same thing.
        let f32_y = product(&rows_f32, Isa::active(), &x, 40, 2);
        assert!(rel_l2(&f32_y, &reference(&rows_f32, &x, 40)) < 1e-5);
    }
}

#[test]
fn the_repacked_codes_are_the_only_copy_and_give_the_weights_back() {
    for (block, dtype) in BYTES {
        let rows_f32 = matrix(block, dtype, 24, 768, 3);
        let w = rows_f32.clone().with_activations(Activations::Int16);
        // Codes and scales once (the panels pad 24 rows to 32), not twice: Q6_K and Q5_0 (every
        // weight in -32..32) in six bits a weight, Q8_0 in eight; Q6_K's scale bytes with an f32
        // `d` per block, else an f32 per 16 columns.
        let (code_bits, scale_bytes) = match block {
            GgufBlock::Q6K => (6, 768 / 16 + 4 * 768 / 256),
            GgufBlock::Q5_0 => (6, 4 * 768 / 16),
            _ => (8, 4 * 768 / 16),
        };
        assert_eq!(
            w.bytes(),
            32 * (768 * code_bits / 8 + scale_bytes),
            "{block:?}: the weights held twice, or not in their bits"
        );
        assert_eq!(
            rows_f32.bytes(),
            24 * (768 + scale_bytes),
            "{block:?}: the rows' form"
        );
        assert_eq!(w.dequantize(), rows_f32.dequantize(), "{block:?}");
        let back = w.clone().with_activations(Activations::F32);
        assert_eq!(back, rows_f32, "{block:?}");
        // Stacking and permuting keep the activations and the bits of each part.
        let s = QMatrix::stack(&[&w, &w]).unwrap();
        assert_eq!(s.activations(), Activations::Int16);
        let x = floats(3 * 768, 4);
        let (y, ys) = (
            product(&w, Isa::active(), &x, 3, 2),
            product(&s, Isa::active(), &x, 3, 2),
        );
        for i in 0..3 {
            assert_eq!(ys[i * 48..i * 48 + 24], y[i * 24..(i + 1) * 24]);
            assert_eq!(ys[i * 48 + 24..(i + 1) * 48], y[i * 24..(i + 1) * 24]);
        }
    }
}

#[test]
fn widths_of_part_of_a_block_and_int8_stay_on_f32_activations() {
    // 96 columns: not whole 256-column blocks.
    let w = matrix(GgufBlock::Q8_0, GgmlDType::Q8_0, 8, 96, 1);
    assert_eq!(
        w.clone().with_activations(Activations::Int16).activations(),
        Activations::F32
    );
    let w = matrix(GgufBlock::Q6K, GgmlDType::Q6K, 8, 256, 1);
    assert_eq!(
        w.with_activations(Activations::Int8).activations(),
        Activations::F32
    );
}

#[test]
fn huge_and_zero_activations_give_no_nan() {
    let w = matrix(GgufBlock::Q6K, GgmlDType::Q6K, 16, 256, 2).with_activations(Activations::Int16);
    let mut x = vec![0f32; 2 * 256];
    x[256..]
        .iter_mut()
        .enumerate()
        .for_each(|(i, v)| *v = if i % 3 == 0 { 3e4 } else { -2e4 });
    for isa in Isa::available() {
        let y = product(&w, isa, &x, 2, 1);
        assert!(y[..16].iter().all(|v| *v == 0.0), "{isa:?}");
        assert!(y.iter().all(|v| v.is_finite()), "{isa:?}");
    }
}
