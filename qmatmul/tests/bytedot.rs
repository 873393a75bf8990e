//! Byte blocks with int16 activations (W8A16): every tier bit-identical to the scalar
//! reference, whatever the rows and threads sharing a product, the product equal to the weights
//! times the quantized activations and close to the f32 one; the weights held once and read back
//! unchanged.

#![allow(clippy::unwrap_used)]

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use engram_qmatmul::{Activations, GgufBlock, Isa, QMatrix, quantized_activations};

const BYTES: [(GgufBlock, GgmlDType); 3] = [
    (GgufBlock::Q6K, GgmlDType::Q6K),
    (GgufBlock::Q8_0, GgmlDType::Q8_0),
    (GgufBlock::Q5_0, GgmlDType::Q5_0),
];

fn floats(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = (s >> 40) as f32 / (1u64 << 24) as f32;
            let spike = if i % 89 == 0 { 7.0 } else { 1.0 };
            (2.0 * u - 1.0) * spike
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

#[test]
fn every_tier_and_any_rows_or_threads_give_the_scalar_bits_of_the_quantized_product() {
    for (block, dtype) in BYTES {
        let rows_f32 = matrix(block, dtype, 37, 512, 5);
        let w = rows_f32.clone().with_activations(Activations::Int16);
        assert_eq!(w.activations(), Activations::Int16, "{block:?}");
        let x = floats(20 * 512, 9);
        // All 20 rows at once, on one thread, on the scalar tier: the reference bits.
        let all = product(&w, Isa::Scalar, &x, 20, 1);
        for isa in Isa::available() {
            for threads in [1, 2, 3] {
                for m in [1, 2, 3, 4, 5, 8, 20] {
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
        let err = rel_l2(&all, &reference(&rows_f32, &xq, 20));
        assert!(
            err < 1e-5,
            "{block:?}: rel-L2 {err} against the quantized activations"
        );
        let err = rel_l2(&all, &reference(&rows_f32, &x, 20));
        assert!(
            err < 1e-4,
            "{block:?}: rel-L2 {err} against f32 activations"
        );
        // The f32 activations' product is another computation of the same thing.
        let f32_y = product(&rows_f32, Isa::active(), &x, 20, 2);
        assert!(rel_l2(&f32_y, &reference(&rows_f32, &x, 20)) < 1e-5);
    }
}

#[test]
fn the_repacked_codes_are_the_only_copy_and_give_the_weights_back() {
    for (block, dtype) in BYTES {
        let rows_f32 = matrix(block, dtype, 24, 768, 3);
        let w = rows_f32.clone().with_activations(Activations::Int16);
        assert_eq!(
            w.bytes(),
            rows_f32.bytes(),
            "{block:?}: the codes held twice"
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
