//! Times the block products on SmolLM2-135M's projection shapes (Q4_1 with random weights):
//! ms and GFLOP/s per activation-row count and kernel tier, one and all threads, with f32
//! activations (W4A32), int16 ones (W4A16) and int8 ones (W4A8).
//!
//!     cargo run --release -p engram-qmatmul --example qmatmul_speed

use std::time::Instant;

use engram_qmatmul::{Activations, GgufBlock, Isa, QMatrix};

fn random_q4_1(rows: usize, cols: usize, seed: u64) -> QMatrix {
    let mut s = seed | 1;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let blocks = rows * cols / 32;
    let mut data = Vec::with_capacity(blocks * 20);
    for _ in 0..blocks {
        data.extend_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
        data.extend_from_slice(&half::f16::from_f32(-0.08).to_le_bytes());
        data.extend((0..16).map(|_| next() as u8));
    }
    match QMatrix::from_gguf(GgufBlock::Q4_1, rows, cols, &data) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    }
}

fn main() {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    // One layer's products: q/k/v stacked, o, gate/up stacked, down.
    let shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)];
    let f32_mats: Vec<QMatrix> = shapes
        .iter()
        .enumerate()
        .map(|(i, &(r, c))| random_q4_1(r, c, i as u64 + 1))
        .collect();
    let with = |a: Activations| -> Vec<QMatrix> {
        f32_mats
            .iter()
            .map(|m| m.clone().with_activations(a))
            .collect()
    };
    let (int16_mats, int8_mats) = (with(Activations::Int16), with(Activations::Int8));
    let macs: usize = shapes.iter().map(|(r, c)| r * c).sum();
    println!("one SmolLM2-135M layer's projections, Q4_1, {threads} threads available");
    for (acts, mats) in [
        ("f32", &f32_mats),
        ("int16", &int16_mats),
        ("int8", &int8_mats),
    ] {
        for isa in Isa::available().into_iter().rev() {
            for t in [1, threads] {
                for m in [1, 2, 4, 8, 16, 64, 128] {
                    let x: Vec<f32> = (0..m * 1536).map(|i| (i % 17) as f32 * 0.01).collect();
                    let mut ys: Vec<Vec<f32>> =
                        mats.iter().map(|w| vec![0f32; m * w.rows()]).collect();
                    let reps = (2000 / m).max(20);
                    let start = Instant::now();
                    for _ in 0..reps {
                        for (w, y) in mats.iter().zip(&mut ys) {
                            let _ = w.matmul_on(isa, &x[..m * w.cols()], m, y, t);
                        }
                    }
                    let s = start.elapsed().as_secs_f64() / reps as f64;
                    println!(
                        "{acts:>5} {isa:?} threads {t} m {m:>3}: {:>7.3} ms per layer, {:>6.1} GFLOP/s",
                        s * 1e3,
                        2.0 * (macs * m) as f64 / s / 1e9
                    );
                }
            }
        }
    }
}
