//! Times one decoded token's weight products (m = 1) on Qwen2.5-1.5B's shapes and block types
//! (Q4_K_M: Q4_K projections, Q6_K `ffn_down` on half the layers and the output matrix), random
//! weights, every matrix distinct so nothing stays in cache: ms per token and GB/s of weights
//! read, per kernel tier and thread count, with the int16 activations the model uses (`f32`: the
//! byte matrices with f32 activations, as before they had integer kernels).
//!
//! `m=N` times N activation rows at once instead (a prefill chunk: the engine's is 256), printed
//! per row and in multiply-adds a second.
//!
//!     cargo run --release -p engram-qmatmul --example decode_speed [-- LAYERS [f32|int16] [scalar] [m=N]]

use std::time::Instant;

use engram_qmatmul::{Activations, Form, GgufBlock, Isa, QMatrix};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

fn f16(v: f32) -> [u8; 2] {
    half::f16::from_f32(v).to_le_bytes()
}

fn random(
    block: GgufBlock,
    rows: usize,
    cols: usize,
    rng: &mut Rng,
    bytes: Activations,
) -> QMatrix {
    let blocks = rows * cols / block.weights();
    let mut data = Vec::with_capacity(blocks * block.bytes());
    for _ in 0..blocks {
        match block {
            GgufBlock::Q4K => {
                data.extend(f16(0.002));
                data.extend(f16(0.001));
                data.extend((0..12).map(|_| rng.next() as u8 & 0x3F));
                data.extend((0..128).map(|_| rng.next() as u8));
            }
            GgufBlock::Q6K => {
                data.extend((0..192).map(|_| rng.next() as u8));
                data.extend((0..16).map(|_| (rng.next() as u8 % 64) as i8 as u8));
                data.extend(f16(0.001));
            }
            _ => unreachable!("the example builds Q4_K and Q6_K only"),
        }
    }
    match QMatrix::from_gguf(block, rows, cols, &data) {
        Ok(m) if m.form() == Form::Bytes => m.with_activations(bytes),
        Ok(m) => m.with_activations(Activations::Int16),
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    }
}

fn main() {
    let layers: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(28);
    let bytes_acts = if std::env::args().nth(2).as_deref() == Some("f32") {
        Activations::F32
    } else {
        Activations::Int16
    };
    let rows: usize = std::env::args()
        .find_map(|a| a.strip_prefix("m=").and_then(|n| n.parse().ok()))
        .unwrap_or(1)
        .max(1);
    let (hidden, ffn, vocab) = (1536, 8960, 151_936);
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut mats = Vec::new();
    for l in 0..layers {
        mats.push(random(GgufBlock::Q4K, 2048, hidden, &mut rng, bytes_acts));
        mats.push(random(GgufBlock::Q4K, hidden, hidden, &mut rng, bytes_acts));
        mats.push(random(
            GgufBlock::Q4K,
            2 * ffn,
            hidden,
            &mut rng,
            bytes_acts,
        ));
        let down = if l % 2 == 0 {
            GgufBlock::Q6K
        } else {
            GgufBlock::Q4K
        };
        mats.push(random(down, hidden, ffn, &mut rng, bytes_acts));
    }
    // A prefill chunk projects only its last row to logits.
    if rows == 1 {
        mats.push(random(GgufBlock::Q6K, vocab, hidden, &mut rng, bytes_acts));
    }
    let bytes: usize = mats.iter().map(QMatrix::bytes).sum();
    let macs: usize = mats.iter().map(|m| m.rows() * m.cols() * rows).sum();
    let nib_macs: usize = mats
        .iter()
        .filter(|m| m.form() == Form::Nibbles)
        .map(|m| m.rows() * m.cols() * rows)
        .sum();
    let nib: usize = mats
        .iter()
        .filter(|m| m.form() == Form::Nibbles)
        .map(QMatrix::bytes)
        .sum();
    let xs: Vec<Vec<f32>> = mats
        .iter()
        .map(|m| {
            (0..m.cols() * rows)
                .map(|_| (rng.next() % 2001) as f32 * 1e-3 - 1.0)
                .collect()
        })
        .collect();
    let mut ys: Vec<Vec<f32>> = mats.iter().map(|m| vec![0f32; m.rows() * rows]).collect();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "{layers} layers + output: {:.1} MB of weights ({:.1} MB in nibble panels), byte matrices on {bytes_acts:?} activations, {threads} CPUs",
        bytes as f64 / 1e6,
        nib as f64 / 1e6
    );
    let buf: Vec<u64> = (0..bytes / 8).map(|i| i as u64).collect();
    for t in [1, threads] {
        let mut best = f64::MAX;
        for _ in 0..3 {
            let start = Instant::now();
            let sum: u64 = std::thread::scope(|s| {
                let parts: Vec<_> = buf
                    .chunks(buf.len().div_ceil(t))
                    .map(|c| s.spawn(move || c.iter().fold(0u64, |a, &v| a.wrapping_add(v))))
                    .collect();
                parts
                    .into_iter()
                    .map(|h| h.join().unwrap_or(0))
                    .fold(0, u64::wrapping_add)
            });
            best = best.min(start.elapsed().as_secs_f64());
            std::hint::black_box(sum);
        }
        println!(
            "read bandwidth, {t} threads: {:.1} GB/s",
            bytes as f64 / best / 1e9
        );
    }
    drop(buf);
    // The scalar tier takes seconds a token: it is timed only when asked (`scalar`).
    let scalar = std::env::args().any(|a| a == "scalar");
    for isa in Isa::available().into_iter().rev() {
        if isa == Isa::Scalar && !scalar {
            continue;
        }
        for t in [1, threads] {
            let mut best = f64::MAX;
            let mut split = (0.0, 0.0);
            for _ in 0..5 {
                let (mut tn, mut tb) = (0.0, 0.0);
                for ((m, x), y) in mats.iter().zip(&xs).zip(&mut ys) {
                    let start = Instant::now();
                    if let Err(e) = m.matmul_on(isa, x, rows, y, t) {
                        eprintln!("{e}");
                        std::process::exit(1);
                    }
                    let s = start.elapsed().as_secs_f64();
                    if m.form() == Form::Nibbles {
                        tn += s;
                    } else {
                        tb += s;
                    }
                }
                if tn + tb < best {
                    best = tn + tb;
                    split = (tn, tb);
                }
            }
            if rows > 1 {
                println!(
                    "{isa:?} threads {t}, m = {rows}: {:.3} ms a row, {:.1} GMAC/s (nibbles {:.1} GMAC/s; bytes {:.1} GMAC/s)",
                    best * 1e3 / rows as f64,
                    macs as f64 / best / 1e9,
                    nib_macs as f64 / split.0 / 1e9,
                    (macs - nib_macs) as f64 / split.1 / 1e9,
                );
                continue;
            }
            println!(
                "{isa:?} threads {t}: {:.2} ms a token, {:.1} GB/s (nibbles {:.2} ms, {:.1} GB/s; bytes {:.2} ms, {:.1} GB/s)",
                best * 1e3,
                bytes as f64 / best / 1e9,
                split.0 * 1e3,
                nib as f64 / split.0 / 1e9,
                split.1 * 1e3,
                (bytes - nib) as f64 / split.1 / 1e9,
            );
        }
    }
}
