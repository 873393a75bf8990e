//! The block forms against candle's GGUF dequantization, and every kernel tier against an f64
//! reference and the scalar kernel.

#![allow(clippy::unwrap_used)]

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use engram_qmatmul::{GgufBlock, Isa, QError, QMatrix};
use proptest::prelude::*;

const ALL: [(GgufBlock, GgmlDType); 6] = [
    (GgufBlock::Q4_0, GgmlDType::Q4_0),
    (GgufBlock::Q4_1, GgmlDType::Q4_1),
    (GgufBlock::Q8_0, GgmlDType::Q8_0),
    (GgufBlock::Q5_0, GgmlDType::Q5_0),
    (GgufBlock::Q4K, GgmlDType::Q4K),
    (GgufBlock::Q6K, GgmlDType::Q6K),
];

/// Deterministic pseudo-random floats in about [-1, 1) (with a per-row bias, so Q4_1 offsets
/// and K-quant mins are exercised).
fn floats(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = (s >> 40) as f32 / (1u64 << 24) as f32;
            2.0 * u - 1.0 + 0.3 * ((i / 256) % 3) as f32 - 0.3
        })
        .collect()
}

/// A `rows × cols` matrix quantized by candle to `dtype`, read back by both sides.
fn quantized(
    block: GgufBlock,
    dtype: GgmlDType,
    rows: usize,
    cols: usize,
    seed: u64,
) -> (QMatrix, Vec<f32>) {
    let w = Tensor::from_vec(floats(rows * cols, seed), (rows, cols), &Device::Cpu).unwrap();
    let q = QTensor::quantize(&w, dtype).unwrap();
    let reference: Vec<f32> = q
        .dequantize(&Device::Cpu)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let m = QMatrix::from_gguf(block, rows, cols, &q.data().unwrap()).unwrap();
    (m, reference)
}

#[test]
fn every_block_type_reads_the_weights_candle_dequantizes() {
    for (block, dtype) in ALL {
        let (m, reference) = quantized(block, dtype, 24, 512, 7);
        let ours = m.dequantize();
        let scale = reference.iter().fold(0f32, |a, v| a.max(v.abs()));
        for (i, (a, b)) in ours.iter().zip(&reference).enumerate() {
            // Identical weights, up to the one rounding an FMA saves in `q·s + o`.
            assert!(
                (a - b).abs() <= 1e-6 * scale,
                "{block:?} weight {i}: {a} vs {b}"
            );
        }
        let exact = ours.iter().zip(&reference).filter(|(a, b)| a == b).count();
        assert!(
            exact * 100 >= 99 * ours.len(),
            "{block:?}: {exact} of {} exact",
            ours.len()
        );
    }
}

/// `x · Wᵀ` in f64 over the dequantized weights, and `Σ|x||w|` per output (the error scale).
fn reference(w: &[f32], rows: usize, cols: usize, x: &[f32], m: usize) -> (Vec<f64>, Vec<f64>) {
    let mut y = vec![0f64; m * rows];
    let mut mag = vec![0f64; m * rows];
    for i in 0..m {
        for r in 0..rows {
            for c in 0..cols {
                let p = f64::from(x[i * cols + c]) * f64::from(w[r * cols + c]);
                y[i * rows + r] += p;
                mag[i * rows + r] += p.abs();
            }
        }
    }
    (y, mag)
}

fn check_all_tiers(m: &QMatrix, rows_x: usize, seed: u64, threads: usize) {
    let (rows, cols) = (m.rows(), m.cols());
    let x = floats(rows_x * cols, seed);
    let (want, mag) = reference(&m.dequantize(), rows, cols, &x, rows_x);
    let mut scalar = vec![0f32; rows_x * rows];
    m.matmul_on(Isa::Scalar, &x, rows_x, &mut scalar, threads)
        .unwrap();
    for isa in Isa::available() {
        let mut y = vec![f32::NAN; rows_x * rows];
        m.matmul_on(isa, &x, rows_x, &mut y, threads).unwrap();
        for k in 0..y.len() {
            let tol = 2e-6 * mag[k] + 1e-6;
            assert!(
                (f64::from(y[k]) - want[k]).abs() <= tol,
                "{isa:?} m={rows_x} output {k}: {} vs {}",
                y[k],
                want[k]
            );
            assert!(
                (f64::from(y[k]) - f64::from(scalar[k])).abs() <= 2.0 * tol,
                "{isa:?} vs scalar, output {k}"
            );
        }
    }
}

#[test]
fn every_tier_matches_the_f64_reference_for_one_to_twenty_rows() {
    for (block, dtype) in ALL {
        let (m, _) = quantized(block, dtype, 40, 256, 3);
        for rows_x in 1..=20 {
            check_all_tiers(&m, rows_x, rows_x as u64, 2);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn any_shape_and_thread_count_matches_the_reference(
        which in 0usize..ALL.len(),
        rows in 1usize..80,
        blocks in 1usize..4,
        rows_x in 1usize..12,
        threads in 1usize..4,
        seed in 0u64..1000,
    ) {
        let (block, dtype) = ALL[which];
        let (m, _) = quantized(block, dtype, rows, 256 * blocks, seed);
        check_all_tiers(&m, rows_x, seed + 1, threads);
    }
}

#[test]
fn results_do_not_depend_on_the_thread_count() {
    // Large enough to be split (the product is shared only above a work threshold).
    let (m, _) = quantized(GgufBlock::Q4_1, GgmlDType::Q4_1, 600, 576, 11);
    for rows_x in [1, 2, 9, 33] {
        let x = floats(rows_x * 576, 5);
        for isa in Isa::available() {
            let mut one = vec![0f32; rows_x * 600];
            m.matmul_on(isa, &x, rows_x, &mut one, 1).unwrap();
            for threads in [2, 3, 4] {
                let mut many = vec![0f32; rows_x * 600];
                m.matmul_on(isa, &x, rows_x, &mut many, threads).unwrap();
                assert_eq!(one, many, "{isa:?} m={rows_x} threads={threads}");
            }
        }
    }
}

#[test]
fn permuted_rows_are_the_rows_moved() {
    let (m, _) = quantized(GgufBlock::Q4K, GgmlDType::Q4K, 6, 256, 2);
    let order = [3, 0, 5, 1, 4, 2];
    let p = m.permute_rows(&order).unwrap();
    let (a, b) = (m.dequantize(), p.dequantize());
    for (r, &from) in order.iter().enumerate() {
        assert_eq!(b[r * 256..(r + 1) * 256], a[from * 256..(from + 1) * 256]);
    }
    for bad in [&[0, 1, 2][..], &[0, 0, 1, 2, 3, 4], &[0, 1, 2, 3, 4, 6]] {
        assert_eq!(
            m.permute_rows(bad),
            Err(QError::Permutation {
                len: bad.len(),
                rows: 6
            })
        );
    }
}

#[test]
fn bad_shapes_are_errors() {
    let (m, _) = quantized(GgufBlock::Q8_0, GgmlDType::Q8_0, 4, 64, 1);
    let mut y = [0f32; 8];
    assert!(matches!(
        m.matmul(&[0.0; 63], 1, &mut y[..4], 1),
        Err(QError::Size {
            what: "activations",
            ..
        })
    ));
    assert!(matches!(
        m.matmul(&[0.0; 128], 2, &mut y[..5], 1),
        Err(QError::Size { what: "output", .. })
    ));
    assert!(matches!(
        QMatrix::from_gguf(GgufBlock::Q4_1, 2, 48, &[0; 60]),
        Err(QError::Columns {
            cols: 48,
            block: 32
        })
    ));
    assert!(matches!(
        QMatrix::from_gguf(GgufBlock::Q4_1, 2, 64, &[0; 79]),
        Err(QError::Size {
            what: "block bytes",
            expected: 80,
            got: 79
        })
    ));
    let mut row = vec![0f32; 63];
    assert!(m.dequantize_row(0, &mut row).is_err());
    assert!(m.dequantize_row(4, &mut vec![0f32; 64]).is_err());
    // Zero activation rows is an empty product, not an error.
    assert_eq!(m.matmul(&[], 0, &mut [], 2), Ok(()));
}

#[test]
fn a_stack_computes_each_part_exactly() {
    let (a, _) = quantized(GgufBlock::Q4_1, GgmlDType::Q4_1, 40, 256, 1);
    let (b, _) = quantized(GgufBlock::Q4_1, GgmlDType::Q4_1, 24, 256, 2);
    let s = QMatrix::stack(&[&a, &b]).unwrap();
    assert_eq!((s.rows(), s.cols()), (64, 256));
    for m in [1, 3, 17, 40] {
        let x = floats(m * 256, 4);
        let (mut ya, mut yb, mut ys) = (vec![0f32; m * 40], vec![0f32; m * 24], vec![0f32; m * 64]);
        a.matmul(&x, m, &mut ya, 2).unwrap();
        b.matmul(&x, m, &mut yb, 2).unwrap();
        s.matmul(&x, m, &mut ys, 2).unwrap();
        let close = |a: &[f32], b: &[f32]| a == b;
        for i in 0..m {
            let (row, a_part, b_part) = (
                &ys[i * 64..(i + 1) * 64],
                &ya[i * 40..(i + 1) * 40],
                &yb[i * 24..(i + 1) * 24],
            );
            assert!(close(&row[..40], a_part), "m={m} row {i}");
            assert!(close(&row[40..], b_part), "m={m} row {i}");
        }
    }
    let (c, _) = quantized(GgufBlock::Q8_0, GgmlDType::Q8_0, 4, 256, 3);
    let (d, _) = quantized(GgufBlock::Q4_1, GgmlDType::Q4_1, 4, 512, 3);
    assert_eq!(QMatrix::stack(&[&a, &c]), Err(QError::Stack));
    assert_eq!(QMatrix::stack(&[&a, &d]), Err(QError::Stack));
    assert_eq!(QMatrix::stack(&[]), Err(QError::Stack));
}

#[test]
fn an_output_is_the_same_bits_whatever_rows_share_the_product() {
    // The prefix cache relies on it: a row computed in a chunk of 50 or inside one of 194 (or
    // alone, in decode) gives the same bits.
    for (block, dtype) in [
        (GgufBlock::Q4_1, GgmlDType::Q4_1),
        (GgufBlock::Q8_0, GgmlDType::Q8_0),
    ] {
        let (w, _) = quantized(block, dtype, 100, 576, 8);
        let x = floats(60 * 576, 9);
        for isa in Isa::available() {
            let mut all = vec![0f32; 60 * 100];
            w.matmul_on(isa, &x, 60, &mut all, 2).unwrap();
            for (start, m) in [(0, 1), (7, 1), (10, 5), (20, 16), (3, 33), (59, 1)] {
                let mut part = vec![0f32; m * 100];
                w.matmul_on(isa, &x[start * 576..(start + m) * 576], m, &mut part, 2)
                    .unwrap();
                assert_eq!(
                    part,
                    all[start * 100..(start + m) * 100],
                    "{isa:?} {block:?} rows {start}+{m}"
                );
            }
        }
    }
}

#[test]
fn q6_k_keeps_its_block_scales_and_stacks_and_permutes_exactly() {
    let (rows, cols) = (24, 512);
    let (k, _) = quantized(GgufBlock::Q6K, GgmlDType::Q6K, rows, cols, 5);
    // A byte a weight, a scale byte per 16 and one f32 `d` per 256: not an f32 per 16.
    assert_eq!(
        k.bytes(),
        rows * cols + rows * cols / 16 + 4 * rows * cols / 256
    );
    let (k2, _) = quantized(GgufBlock::Q6K, GgmlDType::Q6K, 8, cols, 6);
    let (q8, _) = quantized(GgufBlock::Q8_0, GgmlDType::Q8_0, 8, cols, 7);
    let both = QMatrix::stack(&[&k, &k2]).unwrap();
    assert_eq!(
        both.bytes(),
        k.bytes() + k2.bytes(),
        "a stack of Q6_K keeps its bytes"
    );
    // A stack with another byte form holds f32 scales, and every output keeps its bits.
    let mixed = QMatrix::stack(&[&k, &q8]).unwrap();
    for m in [1, 3, 9] {
        let x = floats(m * cols, 8);
        let product = |w: &QMatrix| {
            let mut y = vec![0f32; m * w.rows()];
            w.matmul(&x, m, &mut y, 2).unwrap();
            y
        };
        let (yk, yk2, y8) = (product(&k), product(&k2), product(&q8));
        let (yb, ym) = (product(&both), product(&mixed));
        for i in 0..m {
            let (b, mx) = (&yb[i * 32..(i + 1) * 32], &ym[i * 32..(i + 1) * 32]);
            assert_eq!(b[..rows], yk[i * rows..(i + 1) * rows], "m={m}");
            assert_eq!(b[rows..], yk2[i * 8..(i + 1) * 8], "m={m}");
            assert_eq!(mx[..rows], yk[i * rows..(i + 1) * rows], "m={m}");
            assert_eq!(mx[rows..], y8[i * 8..(i + 1) * 8], "m={m}");
        }
    }
    assert_eq!(both.dequantize()[..rows * cols], k.dequantize()[..]);
    assert_eq!(mixed.dequantize()[rows * cols..], q8.dequantize()[..]);
    let order: Vec<usize> = (0..rows).rev().collect();
    let (a, p) = (k.dequantize(), k.permute_rows(&order).unwrap().dequantize());
    for (r, &from) in order.iter().enumerate() {
        assert_eq!(
            p[r * cols..(r + 1) * cols],
            a[from * cols..(from + 1) * cols]
        );
    }
}
