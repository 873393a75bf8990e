//! GPU benchmark of the fused TQ4 decode attention for an 8B shape (8 KV heads × 128 dims,
//! 32 query heads) per layer, at several contexts and batches, against the card's measured
//! device-to-device copy bandwidth. Prints JSON lines; `--out FILE` writes them to a file too.
//!
//! Bytes counted per launch: the key and value codes and norms of every attended position
//! (132 bytes per position and KV head), plus the queries and outputs. Each sequence has its
//! own blocks (no sharing through L2). Times are CUDA-event times of `--reps` launches after
//! `--warmup` launches.
//!
//! Tensor-core kernel (`tq4_decode_mma`, `--kernels mma`): the same batches in head-major
//! (kvcore's; staged through shared memory) and token-major pages (through registers; `--layouts
//! head,token`), each sequence's pages shuffled in the pool (`--page-run N`: shuffled runs of N
//! consecutive slots, 0 all in order), at the planned chunk and at every
//! chunk of `--mma-chunks 64,256,…` (a sweep), median of 5 rounds of `--reps` launches
//! (attention + combine); `--kernels mass` adds the mass variant the engine runs in its middle
//! layer (`decode_attention_mma_mass`: attention with per-page records, combine,
//! `tq4_block_mass`) at the planned chunk. The read ceiling is a read-only stream of 2 GiB with 16-byte loads
//! (`read_stream`), measured in the same process; `share_of_read_bw` divides by it.
//!
//! Prefill (`--only prefill`, or by default after attention): one layer's causal attention of a
//! whole prompt of each `--contexts` length over random codes, in chunks of `--prefill-chunk`
//! queries (1024) as the engine runs it, with `tq4_prefill_mma` at each `--prefill-tiles`
//! (16-position query tiles per CTA; 2 = the default for the 8B group of 4); causal FLOPs (4 · heads ·
//! head_dim per (query, key) pair) per second. `gpu_sdpa_baseline.py prefill` times PyTorch's
//! causal bf16 SDPA on the same shape.
//!
//! Few-row products (`--only gemv`, or by default after prefill): `gemv_bf16` over the 8B
//! shape's decode products (q/k/v, output, gate/up, down, LM head) at 1, 2 and 4 rows, median
//! of 5 rounds of `--reps` launches; weight bytes per second and their share of `read_stream`.
//!
//! Tiers (`--only tiers`, or by default after attention): warm and spill of 1,000 blocks of the
//! same shape across all 32 layers (540,672 bytes a block, 540.7 MB in all) between VRAM and the
//! page-locked cold tier, for consecutive slots (one `cuMemcpyAsync` per tensor, layer and run)
//! and scattered slots (one copy-kernel launch), against one plain pinned `cuMemcpy` of the same
//! byte count in each direction. Wall time of the whole call (it returns when the bytes have
//! landed), median of `--reps` rounds.

use std::io::Write;

use anyhow::{Context, Result};
use cudarc::driver::CudaContext;
use cudarc::driver::sys::CUevent_flags;
use engram_kernels::gpu::{DecodeBatch, PrefillChunk, Tq4Kernels, plane_views};
use engram_kernels::{DEFAULT_CHUNK, PageLayout};
use engram_kvcore::{
    BlockStore, BlockTags, Codec, CodecKind, DEFAULT_ROTATION_SEED, KvShape, SourceLayer,
    SplitMix64, StoreConfig, TenantId, Tier, TokenRange,
};

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
    let only = flag("--only").unwrap_or_default();
    let kernels = flag("--kernels").unwrap_or_else(|| "fp32,mma".into());
    let layouts: Vec<PageLayout> = flag("--layouts")
        .unwrap_or_else(|| "head,token".into())
        .split(',')
        .map(|l| match l {
            "head" => Ok(PageLayout::HeadMajor),
            "token" => Ok(PageLayout::TokenMajor),
            other => Err(anyhow::anyhow!("layout {other} (token or head)")),
        })
        .collect::<Result<_>>()?;
    let mma_chunks: Vec<Option<usize>> = std::iter::once(Ok(None))
        .chain(
            flag("--mma-chunks")
                .unwrap_or_default()
                .split(',')
                .filter(|c| !c.is_empty())
                .map(|c| c.parse().map(Some)),
        )
        .collect::<Result<_, _>>()?;
    let chunk: usize = flag("--chunk").map_or(Ok(DEFAULT_CHUNK), |v| v.parse())?;
    // `--page-run N`: the decode batches' pages are runs of N consecutive slots in shuffled
    // order (1, the default: every page shuffled; 0: all slots in order).
    let page_run: usize = flag("--page-run").map_or(Ok(1), |v| v.parse())?;
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
    // `--define NAME[=V],…`: extra NVRTC defines (kernel variants, profiling switches).
    let extra: Vec<String> = flag("--define")
        .map(|v| v.split(',').map(|d| format!("-D{d}")).collect())
        .unwrap_or_default();
    let mut k = Tq4Kernels::with_defines(stream.clone(), &codec, group, chunk, &extra)?;
    // The read ceiling: a read-only stream of 2 GiB, median of 5 rounds of 10.
    let big = stream.alloc_zeros::<u8>(copy_bytes)?;
    let mut sink = stream.alloc_zeros::<u32>(4096)?;
    let read_s = time_calls(&stream, 3, 10, &mut || Ok(k.read_stream(&big, &mut sink)?))?;
    drop((big, sink));
    let read_bw = copy_bytes as f64 / read_s;
    emit(format!(
        "{{\"bench\":\"read_stream\",\"bytes\":{copy_bytes},\"seconds\":{read_s:.6},\"bytes_per_s\":{read_bw:.4e}}}"
    ))?;
    let mut rng = SplitMix64::new(11);
    let attention = only.is_empty() || only == "attention";
    for &ctx_len in contexts.iter().filter(|_| attention) {
        for &batch in &batches {
            let blocks = ctx_len.div_ceil(bs);
            let slots = blocks * batch;
            let rows = slots * bs * kv_heads;
            let (codes, norms) = synthetic_plane(rows, head_dim);
            let kc = stream.clone_htod(&codes)?;
            let vc = stream.clone_htod(&codes)?;
            let kn = stream.clone_htod(&norms)?;
            let vn = stream.clone_htod(&norms)?;
            drop(codes);
            let run = if page_run == 0 { slots } else { page_run };
            let mut runs: Vec<usize> = (0..slots.div_ceil(run)).collect();
            for i in (1..runs.len()).rev() {
                runs.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
            }
            let order: Vec<i32> = runs
                .iter()
                .flat_map(|&r| r * run..((r + 1) * run).min(slots))
                .map(|s| s as i32)
                .collect();
            let tables = stream.clone_htod(&order)?;
            let lens = stream.clone_htod(&vec![ctx_len as i32; batch])?;
            let q = stream.clone_htod(&rng.gaussian_vec(batch * heads * head_dim))?;
            let mut out = stream.alloc_zeros::<f32>(batch * heads * head_dim)?;
            let mut work = k.workspace(batch, kv_heads, ctx_len)?;
            let a = DecodeBatch {
                q: q.as_view(),
                heads,
                kv_heads,
                planes: plane_views([&kc, &kn, &vc, &vn]),
                block_tables: &tables,
                max_blocks: blocks,
                seq_lens: &lens,
                batch,
                max_len: ctx_len,
                block_size: bs,
                scale: 1.0 / (head_dim as f32).sqrt(),
            };
            let bytes = (batch * ctx_len * kv_heads * (head_dim + 4)) as f64
                + (2 * batch * heads * head_dim * 4) as f64;
            let time = |f: &mut dyn FnMut() -> Result<()>| time_calls(&stream, warmup, reps, f);
            if kernels.contains("fp32") {
                let s = time(&mut || Ok(k.decode_attention(&a, &mut work, &mut out)?))?;
                let bw = bytes / s;
                emit(format!(
                    "{{\"bench\":\"tq4_decode_attention\",\"layers\":1,\"chunk\":{chunk},\"defines\":\"{}\",\"context\":{ctx_len},\"batch\":{batch},\"heads\":{heads},\"kv_heads\":{kv_heads},\"head_dim\":{head_dim},\"seconds_per_layer\":{s:.6e},\"seconds_32_layers\":{:.6e},\"bytes\":{bytes:.0},\"bytes_per_s\":{bw:.4e},\"share_of_copy_bw\":{:.3},\"share_of_read_bw\":{:.3}}}",
                    extra.join(" "),
                    s * 32.0,
                    bw / copy_bw,
                    bw / read_bw
                ))?;
            }
            if kernels.contains("mma") {
                let lens_host = vec![ctx_len; batch];
                for &layout in &layouts {
                    for &mc in &mma_chunks {
                        let mut mw = k.mma_work(&lens_host, kv_heads, mc)?;
                        let s = time(&mut || {
                            Ok(k.decode_attention_mma(&a, layout, &mut mw, &mut out)?)
                        })?;
                        let bw = bytes / s;
                        emit(format!(
                            "{{\"bench\":\"tq4_decode_mma\",\"page_run\":{page_run},\"defines\":\"{}\",\"layers\":1,\"layout\":\"{layout:?}\",\"chunk\":{},\"items\":{},\"planned\":{},\"context\":{ctx_len},\"batch\":{batch},\"heads\":{heads},\"kv_heads\":{kv_heads},\"head_dim\":{head_dim},\"seconds_per_layer\":{s:.6e},\"bytes\":{bytes:.0},\"bytes_per_s\":{bw:.4e},\"share_of_read_bw\":{:.3}}}",
                            extra.join(" "),
                            mw.plan().chunk,
                            mw.plan().len(),
                            mc.is_none(),
                            bw / read_bw
                        ))?;
                    }
                }
            }
            if kernels.contains("mass") {
                // The mass variant as the engine runs it in its middle layer: attention,
                // combine and tq4_block_mass (the output f32, the mass left on the device).
                let lens_host = vec![ctx_len; batch];
                let mut mw = k.mma_work(&lens_host, kv_heads, None)?;
                let s = time(&mut || {
                    let (_out, _mass) =
                        k.decode_attention_mma_mass(&a, PageLayout::HeadMajor, &mut mw, false)?;
                    Ok(())
                })?;
                let bw = bytes / s;
                emit(format!(
                    "{{\"bench\":\"tq4_decode_mma_mass\",\"layers\":1,\"layout\":\"HeadMajor\",\"chunk\":{},\"items\":{},\"context\":{ctx_len},\"batch\":{batch},\"heads\":{heads},\"kv_heads\":{kv_heads},\"head_dim\":{head_dim},\"seconds_per_layer\":{s:.6e},\"bytes\":{bytes:.0},\"bytes_per_s\":{bw:.4e},\"share_of_read_bw\":{:.3}}}",
                    mw.plan().chunk,
                    mw.plan().len(),
                    bw / read_bw
                ))?;
            }
        }
    }
    if only.is_empty() || only == "prefill" {
        let chunk: usize = flag("--prefill-chunk").map_or(Ok(1024), |v| v.parse())?;
        let tiles: Vec<usize> = flag("--prefill-tiles")
            .unwrap_or_else(|| "2".into())
            .split(',')
            .map(str::parse)
            .collect::<Result<_, _>>()?;
        for (&ctx_len, &t) in contexts
            .iter()
            .flat_map(|c| tiles.iter().map(move |t| (c, t)))
        {
            k.set_prefill_query_tiles(t)?;
            let s = bench_prefill(&stream, &k, ctx_len, chunk, &mut rng)?;
            let flops = 4.0 * (heads * head_dim) as f64 * (ctx_len * (ctx_len + 1) / 2) as f64;
            emit(format!(
                "{{\"bench\":\"tq4_prefill_mma\",\"layers\":1,\"context\":{ctx_len},\"chunk\":{chunk},\"query_tiles\":{t},\"heads\":{heads},\"kv_heads\":{kv_heads},\"head_dim\":{head_dim},\"seconds_per_layer\":{s:.6e},\"seconds_32_layers\":{:.4},\"causal_flops\":{flops:.4e},\"flops_per_s\":{:.4e}}}",
                s * 32.0,
                flops / s
            ))?;
        }
    }
    if only.is_empty() || only == "gemv" {
        // The decode step's products of the 8B shape (q/k/v stacked, output, gate/up stacked,
        // down, LM head) at 1, 2 and 4 rows: each weight matrix read once per launch.
        for (name, m, kd) in [
            ("qkv", 6144usize, 4096usize),
            ("output", 4096, 4096),
            ("gate_up", 28672, 4096),
            ("down", 4096, 14336),
            ("lm_head", 128256, 4096),
        ] {
            let w: Vec<half::bf16> = (0..m * kd)
                .map(|i| half::bf16::from_bits(0x3c00 | (i as u16 & 0x7f)))
                .collect();
            let wd = stream.clone_htod(&w)?;
            drop(w);
            for n in [1usize, 2, 4] {
                let x: Vec<half::bf16> = rng
                    .gaussian_vec(n * kd)
                    .into_iter()
                    .map(half::bf16::from_f32)
                    .collect();
                let xd = stream.clone_htod(&x)?;
                let s = time_calls(&stream, 1, reps, &mut || {
                    k.gemv_bf16(&xd.slice(..), n, kd, &wd.slice(..), m)?;
                    Ok(())
                })?;
                let bytes = (m * kd * 2) as f64;
                emit(format!(
                    "{{\"bench\":\"gemv_bf16\",\"product\":\"{name}\",\"rows\":{n},\"m\":{m},\"k\":{kd},\"seconds\":{s:.6e},\"weight_bytes\":{bytes:.0},\"bytes_per_s\":{:.4e},\"share_of_read_bw\":{:.3}}}",
                    bytes / s,
                    bytes / s / read_bw
                ))?;
            }
        }
    }
    if only.is_empty() || only == "tiers" {
        bench_tiers(&stream, reps.min(7), &mut rng, &mut emit)?;
    }
    Ok(())
}

/// One layer's causal prefill attention of a `ctx_len`-token prompt in chunks of `chunk`
/// queries (the engine's prefill: chunk `c` attends positions `0 ..` its own end), 8B shape,
/// over random codes in shuffled pages; seconds for the whole prompt, median of 3 rounds.
fn bench_prefill(
    stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    k: &Tq4Kernels,
    ctx_len: usize,
    chunk: usize,
    rng: &mut SplitMix64,
) -> Result<f64> {
    let (head_dim, kv_heads, heads) = (128usize, 8usize, 32usize);
    let slots = ctx_len.div_ceil(16);
    let rows = slots * 16 * kv_heads;
    let (codes, norms) = synthetic_plane(rows, head_dim);
    let (kc, vc) = (stream.clone_htod(&codes)?, stream.clone_htod(&codes)?);
    let (kn, vn) = (stream.clone_htod(&norms)?, stream.clone_htod(&norms)?);
    let mut order: Vec<i32> = (0..slots as i32).collect();
    for i in (1..slots).rev() {
        order.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }
    let table = stream.clone_htod(&order)?;
    let q = stream.clone_htod(&rng.gaussian_vec(chunk.min(ctx_len) * heads * head_dim))?;
    let mut out = stream.alloc_zeros::<f32>(chunk.min(ctx_len) * heads * head_dim)?;
    let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let mut run = || -> Result<()> {
        for start in (0..ctx_len).step_by(chunk) {
            let a = PrefillChunk {
                q: q.as_view(),
                m: chunk.min(ctx_len - start),
                start,
                heads,
                kv_heads,
                planes: plane_views([&kc, &kn, &vc, &vn]),
                block_table: &table,
                scale: 1.0 / (head_dim as f32).sqrt(),
            };
            k.prefill_attention(&a, PageLayout::HeadMajor, &mut out)?;
        }
        Ok(())
    };
    run()?;
    let mut rounds = Vec::new();
    for _ in 0..3 {
        let t0 = stream.record_event(timing)?;
        run()?;
        let t1 = stream.record_event(timing)?;
        t1.synchronize()?;
        rounds.push(f64::from(t0.elapsed_ms(&t1)?) / 1e3);
    }
    Ok(median(rounds))
}

/// A plane of `rows` rows for timing: pseudo-random codes and norms near 1 (valid f16: 0x3C00 =
/// 1.0 plus a small mantissa).
fn synthetic_plane(rows: usize, head_dim: usize) -> (Vec<u8>, Vec<u8>) {
    let codes = (0..rows * head_dim / 2)
        .map(|i| {
            (i as u64)
                .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                .rotate_left(17) as u8
        })
        .collect();
    let norms = (0..rows)
        .flat_map(|i| (0x3C00 | (i as u16 & 0xFF)).to_le_bytes())
        .collect();
    (codes, norms)
}

/// Seconds a call of `f` (launches on `stream`), timed by CUDA events: `warmup` calls, then the
/// median of 5 rounds of `reps` calls.
fn time_calls(
    stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    warmup: usize,
    reps: usize,
    f: &mut dyn FnMut() -> Result<()>,
) -> Result<f64> {
    let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
    for _ in 0..warmup {
        f()?;
    }
    let mut rounds = Vec::new();
    for _ in 0..5 {
        let t0 = stream.record_event(timing)?;
        for _ in 0..reps {
            f()?;
        }
        let t1 = stream.record_event(timing)?;
        t1.synchronize()?;
        rounds.push(f64::from(t0.elapsed_ms(&t1)?) / 1e3 / reps as f64);
    }
    Ok(median(rounds))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn bench_tiers(
    stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    reps: usize,
    rng: &mut SplitMix64,
    emit: &mut impl FnMut(String) -> Result<()>,
) -> Result<()> {
    use std::time::Instant;
    let shape = KvShape::with_block_size(32, 8, 128, 16)?;
    let n = 1000usize;
    let capacity = 2 * n as u32 + 64;
    let config = StoreConfig::new(shape, CodecKind::TurboQuant { bits: 4 }, capacity, capacity);
    let mut store = BlockStore::on_cuda_stream(config, stream.clone())?;
    let bytes = n * store.block_bytes();
    let tags = vec![
        BlockTags {
            source: SourceLayer::Memories,
            importance: 0.5,
            tenant: TenantId(1),
            session: None,
            tokens: TokenRange::new(0, 16),
        };
        2 * n
    ];

    // Baseline: one pinned memcpy of the same bytes each way.
    let ctx = stream.context();
    // Same flags as the cold tier (portable, mapped, not write-combined).
    let flags = cudarc::driver::sys::CU_MEMHOSTALLOC_PORTABLE
        | cudarc::driver::sys::CU_MEMHOSTALLOC_DEVICEMAP;
    // SAFETY: the bytes are only copied, never interpreted; their value does not matter.
    let mut host = unsafe { ctx.alloc_pinned_with_flags::<u8>(bytes, flags) }?;
    let mut dev = stream.alloc_zeros::<u8>(bytes)?;
    stream.memcpy_htod(&host, &mut dev)?;
    stream.synchronize()?;
    let (mut h2d, mut d2h) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        let t = Instant::now();
        stream.memcpy_htod(&host, &mut dev)?;
        stream.synchronize()?;
        h2d.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        stream.memcpy_dtoh(&dev, &mut host)?;
        stream.synchronize()?;
        d2h.push(t.elapsed().as_secs_f64());
    }
    drop((host, dev));
    let (h2d, d2h) = (median(h2d), median(d2h));
    emit(format!(
        "{{\"bench\":\"pinned_memcpy\",\"bytes\":{bytes},\"h2d_seconds\":{h2d:.6},\"h2d_bytes_per_s\":{:.4e},\"d2h_seconds\":{d2h:.6},\"d2h_bytes_per_s\":{:.4e}}}",
        bytes as f64 / h2d,
        bytes as f64 / d2h
    ))?;

    for layout in ["consecutive", "scattered"] {
        let ids = if layout == "consecutive" {
            store.allocate(Tier::Hot, &tags[..n])?
        } else {
            let all = store.allocate(Tier::Hot, &tags)?;
            let mut order: Vec<usize> = (0..all.len()).collect();
            for i in (1..order.len()).rev() {
                order.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
            }
            let (keep, drop_idx) = order.split_at(n);
            let gone: Vec<_> = drop_idx.iter().map(|&i| all[i]).collect();
            store.release(&gone)?;
            keep.iter().map(|&i| all[i]).collect()
        };
        let (mut spill, mut warm) = (Vec::new(), Vec::new());
        for _ in 0..reps + 1 {
            let t = Instant::now();
            store.spill(&ids)?;
            spill.push(t.elapsed().as_secs_f64());
            let t = Instant::now();
            store.warm(&ids)?;
            warm.push(t.elapsed().as_secs_f64());
        }
        // The first round includes first-touch costs (module load, page mapping).
        let (spill, warm) = (median(spill[1..].to_vec()), median(warm[1..].to_vec()));
        let hot = store.hot_slots(&ids)?;
        let runs = 1 + hot.windows(2).filter(|w| w[1] != w[0] + 1).count();
        emit(format!(
            "{{\"bench\":\"tier_transfer\",\"slots\":\"{layout}\",\"blocks\":{n},\"layers\":32,\"bytes\":{bytes},\"hot_runs\":{runs},\"spill_seconds\":{spill:.6},\"spill_bytes_per_s\":{:.4e},\"spill_vs_pinned_memcpy\":{:.3},\"warm_seconds\":{warm:.6},\"warm_bytes_per_s\":{:.4e},\"warm_vs_pinned_memcpy\":{:.3}}}",
            bytes as f64 / spill,
            d2h / spill,
            bytes as f64 / warm,
            h2d / warm
        ))?;
        store.release(&ids)?;
    }
    Ok(())
}
