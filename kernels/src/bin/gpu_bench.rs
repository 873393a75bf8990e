//! GPU benchmark of the fused TQ4 decode attention for an 8B shape (8 KV heads × 128 dims,
//! 32 query heads) per layer, at several contexts and batches, against the card's measured
//! device-to-device copy bandwidth. Prints JSON lines; `--out FILE` writes them to a file too.
//!
//! Bytes counted per launch: the key and value codes and norms of every attended position
//! (132 bytes per position and KV head), plus the queries and outputs. Each sequence has its
//! own blocks (no sharing through L2). Times are CUDA-event times of `--reps` launches after
//! `--warmup` launches.

use std::io::Write;

use anyhow::{Context, Result};
use cudarc::driver::CudaContext;
use cudarc::driver::sys::CUevent_flags;
use engram_kernels::DEFAULT_CHUNK;
use engram_kernels::gpu::{DecodeBatch, Tq4Kernels};
use engram_kvcore::{Codec, CodecKind, DEFAULT_ROTATION_SEED, SplitMix64};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let reps: usize = flag("--reps").map_or(Ok(20), |v| v.parse())?;
    let warmup: usize = flag("--warmup").map_or(Ok(3), |v| v.parse())?;
    let contexts: Vec<usize> = flag("--contexts")
        .unwrap_or_else(|| "4096,32768,131072".into())
        .split(',')
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    let batches: Vec<usize> = flag("--batches")
        .unwrap_or_else(|| "1,16".into())
        .split(',')
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    let mut out_file = match flag("--out") {
        Some(p) => Some(std::fs::File::create(&p).with_context(|| p.clone())?),
        None => None,
    };
    let mut emit = |line: String| -> Result<()> {
        println!("{line}");
        if let Some(f) = out_file.as_mut() {
            writeln!(f, "{line}")?;
        }
        Ok(())
    };

    let ctx = CudaContext::new(0).context("CUDA device 0")?;
    let stream = ctx.default_stream();
    let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);

    // The card's device-to-device copy bandwidth (bytes read + written per second).
    let copy_bytes = 1usize << 31;
    let src = stream.alloc_zeros::<u8>(copy_bytes)?;
    let mut dst = stream.alloc_zeros::<u8>(copy_bytes)?;
    for _ in 0..3 {
        stream.memcpy_dtod(&src, &mut dst)?;
    }
    let t0 = stream.record_event(timing)?;
    let copies = 10;
    for _ in 0..copies {
        stream.memcpy_dtod(&src, &mut dst)?;
    }
    let t1 = stream.record_event(timing)?;
    t1.synchronize()?;
    let copy_s = f64::from(t0.elapsed_ms(&t1)?) / 1e3 / copies as f64;
    let copy_bw = 2.0 * copy_bytes as f64 / copy_s;
    drop((src, dst));
    emit(format!(
        "{{\"bench\":\"d2d_copy\",\"device\":\"{}\",\"bytes\":{copy_bytes},\"seconds\":{copy_s:.6},\"bytes_per_s\":{copy_bw:.4e}}}",
        ctx.name()?
    ))?;

    let (head_dim, kv_heads, group, bs) = (128usize, 8usize, 4usize, 16usize);
    let heads = kv_heads * group;
    let codec = Codec::new(
        CodecKind::TurboQuant { bits: 4 },
        head_dim,
        DEFAULT_ROTATION_SEED,
    )?;
    let k = Tq4Kernels::new(stream.clone(), &codec, group, DEFAULT_CHUNK)?;
    let mut rng = SplitMix64::new(11);
    for &ctx_len in &contexts {
        for &batch in &batches {
            let blocks = ctx_len.div_ceil(bs);
            let slots = blocks * batch;
            let rows = slots * bs * kv_heads;
            // Random codes; norms near 1 (valid f16: 0x3C00 = 1.0 plus a small mantissa).
            let codes: Vec<u8> = (0..rows * head_dim / 2)
                .map(|i| {
                    (i as u64)
                        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                        .rotate_left(17) as u8
                })
                .collect();
            let norms: Vec<u16> = (0..rows).map(|i| 0x3C00 | (i as u16 & 0xFF)).collect();
            let kc = stream.clone_htod(&codes)?;
            let vc = stream.clone_htod(&codes)?;
            let kn = stream.clone_htod(&norms)?;
            let vn = stream.clone_htod(&norms)?;
            drop(codes);
            let mut order: Vec<i32> = (0..slots as i32).collect();
            for i in (1..slots).rev() {
                order.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
            }
            let tables = stream.clone_htod(&order)?;
            let lens = stream.clone_htod(&vec![ctx_len as i32; batch])?;
            let q = stream.clone_htod(&rng.gaussian_vec(batch * heads * head_dim))?;
            let mut out = stream.alloc_zeros::<f32>(batch * heads * head_dim)?;
            let mut work = k.workspace(batch, kv_heads, ctx_len)?;
            let a = DecodeBatch {
                q: &q,
                heads,
                kv_heads,
                k_codes: kc.as_view(),
                k_norms: kn.as_view(),
                v_codes: vc.as_view(),
                v_norms: vn.as_view(),
                block_tables: &tables,
                max_blocks: blocks,
                seq_lens: &lens,
                batch,
                max_len: ctx_len,
                block_size: bs,
                scale: 1.0 / (head_dim as f32).sqrt(),
            };
            for _ in 0..warmup {
                k.decode_attention(&a, &mut work, &mut out)?;
            }
            let t0 = stream.record_event(timing)?;
            for _ in 0..reps {
                k.decode_attention(&a, &mut work, &mut out)?;
            }
            let t1 = stream.record_event(timing)?;
            t1.synchronize()?;
            let s = f64::from(t0.elapsed_ms(&t1)?) / 1e3 / reps as f64;
            let bytes = (batch * ctx_len * kv_heads * (head_dim + 4)) as f64
                + (2 * batch * heads * head_dim * 4) as f64;
            let bw = bytes / s;
            emit(format!(
                "{{\"bench\":\"tq4_decode_attention\",\"layers\":1,\"context\":{ctx_len},\"batch\":{batch},\"heads\":{heads},\"kv_heads\":{kv_heads},\"head_dim\":{head_dim},\"seconds_per_layer\":{s:.6e},\"seconds_32_layers\":{:.6e},\"bytes\":{bytes:.0},\"bytes_per_s\":{bw:.4e},\"share_of_copy_bw\":{:.3}}}",
                s * 32.0,
                bw / copy_bw
            ))?;
        }
    }
    Ok(())
}
