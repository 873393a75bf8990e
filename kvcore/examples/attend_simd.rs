//! Decode attention over TQ4 codes on every SIMD tier this CPU runs, SmolLM2-135M's geometry
//! (9 query heads over 3 KV heads, head_dim 64) at 1K, 4K and 8K tokens of one layer: prints
//! one JSON line per (tier, threads, tokens) with ns per (key, KV head) and the speed-up over
//! the scalar path on one thread, measured interleaved in this run; then the causal (prefill)
//! form for a 256-token chunk after 3,840 tokens, per tier. `make bench-attention`.
//!
//! Then, on the active tier, the decode pass with the attention mass per block (issue 25): the
//! plain kernels, the kernels plus the second pass over the keys that measures the mass, and the
//! fused pass (`attend_with_mass`), interleaved; `MASS=0` skips it.
//!
//! `GEOMETRY=HEADS/KV_HEADS/HEAD_DIM` takes another model's (`12/2/128`: Qwen2.5-1.5B); the
//! causal lines then also give the multiply-adds a second (`q·k` and `p·v`).
//!
//! `CAUSAL=0` skips the causal form. `KV=tq4,q8/tq4,q8/tq5 make bench-attention` measures other
//! codecs (`KEYS/VALUES` for one per stream): layers whose keys and values are not both TQ4 take
//! the AVX-512 or AVX2 kernel that expands each stream by its own codec (the scalar tier: the
//! generic path).

// A benchmark whose set-up fails must stop loudly, not measure something else.
#![allow(clippy::expect_used)]

use std::hint::black_box;
use std::time::Instant;

use engram_kvcore::{
    AttentionParams, BlockStore, BlockTags, CodecKind, Isa, KvShape, LayerCodecs, Rows, SessionId,
    SourceLayer, SplitMix64, StoreConfig, TenantId, Tier, TokenRange,
};

fn main() {
    let geometry = std::env::var("GEOMETRY").unwrap_or_else(|_| "9/3/64".into());
    let dims: Vec<usize> = geometry
        .split('/')
        .map(|v| v.parse().expect("GEOMETRY is HEADS/KV_HEADS/HEAD_DIM"))
        .collect();
    let [heads, kv_heads, head_dim]: [usize; 3] = dims
        .try_into()
        .expect("GEOMETRY is HEADS/KV_HEADS/HEAD_DIM");
    let shape = KvShape::new(1, kv_heads, head_dim).expect("shape");
    let rounds: usize = std::env::var("ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(31);
    println!(
        "{{\"detected\":\"{}\",\"active\":\"{}\",\"cpus\":{}}}",
        Isa::detected(),
        Isa::active(),
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    let kv = std::env::var("KV").unwrap_or_else(|_| "tq4".into());
    for spec in kv.split(',') {
        let (key, value) = match spec.split_once('/') {
            Some((k, v)) => (codec(k), codec(v)),
            None => (codec(spec), codec(spec)),
        };
        run(shape, heads, rounds, spec, key, value);
    }
}

fn codec(name: &str) -> CodecKind {
    match name.trim() {
        "f16" => CodecKind::F16,
        "q8" => CodecKind::Q8,
        tq => {
            let rest = tq
                .strip_prefix("tq")
                .expect("a codec: f16, q8, tqB or tqBoN");
            let num = |s: &str| s.parse::<u8>().expect("a codec: f16, q8, tqB or tqBoN");
            match rest.split_once('o') {
                Some((b, n)) => CodecKind::TurboQuantSplit {
                    bits: num(b),
                    outliers: num(n),
                },
                None => CodecKind::TurboQuant { bits: num(rest) },
            }
        }
    }
}

fn run(shape: KvShape, heads: usize, rounds: usize, name: &str, key: CodecKind, value: CodecKind) {
    for tokens in [1024usize, 4096, 8192] {
        let blocks = tokens / shape.block_size;
        let mut store = BlockStore::new(StoreConfig {
            codecs: LayerCodecs::streams(&shape, key, value),
            ..StoreConfig::new(shape, key, blocks as u32, 0)
        })
        .expect("store");
        let tags = BlockTags {
            source: SourceLayer::UserTurn,
            importance: 0.5,
            tenant: TenantId(1),
            session: Some(SessionId(1)),
            tokens: TokenRange::new(0, 16),
        };
        let ids = store
            .allocate(Tier::Hot, &vec![tags; blocks])
            .expect("allocate");
        let mut rng = SplitMix64::new(7);
        let n = tokens * shape.token_width();
        let (k, v) = (rng.gaussian_vec(n), rng.gaussian_vec(n));
        store
            .write(0, &ids, 0, Rows::F32(&k), Rows::F32(&v))
            .expect("write");
        let q = rng.gaussian_vec(heads * shape.head_dim);
        let mut out = vec![0.0f32; q.len()];
        let params = AttentionParams::new(heads, shape.head_dim);
        let mut time = |isa: Isa, threads: usize| {
            let p = params.with_threads(threads);
            let t = Instant::now();
            store
                .attend_on(isa, 0, &ids, tokens, &q, &p, &mut out)
                .expect("attend");
            black_box(&out);
            t.elapsed().as_secs_f64()
        };
        let mut configs = vec![(Isa::Scalar, 1)];
        for isa in Isa::available() {
            for threads in [1, 2] {
                if (isa, threads) != (Isa::Scalar, 1) {
                    configs.push((isa, threads));
                }
            }
        }
        let mut samples = vec![Vec::new(); configs.len()];
        for _ in 0..rounds {
            for (c, s) in configs.iter().zip(samples.iter_mut()) {
                s.push(time(c.0, c.1));
            }
        }
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let medians: Vec<f64> = samples.iter_mut().map(median).collect();
        let units = (tokens * shape.kv_heads) as f64;
        if tokens == 4096 && std::env::var("CAUSAL").map_or(true, |c| c != "0") {
            let (start, new) = (tokens - 256, 256);
            let qs = rng.gaussian_vec(new * heads * shape.head_dim);
            let mut outs = vec![0.0f32; qs.len()];
            for isa in Isa::available() {
                for threads in [1, 2] {
                    let p = params.with_threads(threads);
                    let mut best = f64::INFINITY;
                    for _ in 0..rounds.min(5) {
                        let t = Instant::now();
                        store
                            .attend_causal_on(isa, 0, &ids, start, new, &qs, &p, &mut outs)
                            .expect("attend_causal");
                        black_box(&outs);
                        best = best.min(t.elapsed().as_secs_f64());
                    }
                    // Row j attends start + j + 1 keys, each a q·k and a p·v of head_dim.
                    let macs = (new * start + new * (new + 1) / 2) * heads * shape.head_dim * 2;
                    println!(
                        "{{\"bench\":\"attention/{name}/causal\",\"isa\":\"{isa}\",\"threads\":{threads},\"start\":{start},\"new\":{new},\"tiled\":{},\"ms\":{:.2},\"gmac_per_s\":{:.1}}}",
                        store.causal_is_tiled(isa, 0, heads),
                        best * 1e3,
                        macs as f64 / best / 1e9
                    );
                }
            }
        }
        if std::env::var("MASS").map_or(true, |m| m != "0") {
            mass_rows(&store, &ids, tokens, &q, params, rounds, name);
        }
        for ((isa, threads), s) in configs.iter().zip(&medians) {
            println!(
                "{{\"bench\":\"attention/{name}\",\"isa\":\"{isa}\",\"threads\":{threads},\"tokens\":{tokens},\"us\":{:.1},\"ns_per_key_group\":{:.1},\"speedup_vs_scalar\":{:.2}}}",
                s * 1e6,
                s * 1e9 / units,
                medians[0] / s
            );
        }
    }
}

/// The cost of the per-block attention mass on a decode step, on the active tier: plain
/// `attend`, `attend` + `attention_mass` (a second pass), and `attend_with_mass` (fused),
/// measured interleaved; medians.
fn mass_rows(
    store: &BlockStore,
    ids: &[engram_kvcore::BlockId],
    tokens: usize,
    q: &[f32],
    params: AttentionParams,
    rounds: usize,
    name: &str,
) {
    let mut out = vec![0.0f32; q.len()];
    for threads in [1, 2] {
        let p = params.with_threads(threads);
        let mut samples = [Vec::new(), Vec::new(), Vec::new()];
        for _ in 0..rounds {
            for (form, s) in samples.iter_mut().enumerate() {
                let t = Instant::now();
                match form {
                    0 => store
                        .attend(0, ids, tokens, q, &p, &mut out)
                        .expect("attend"),
                    1 => {
                        store
                            .attend(0, ids, tokens, q, &p, &mut out)
                            .expect("attend");
                        black_box(store.attention_mass(0, ids, tokens, q, &p).expect("mass"));
                    }
                    _ => {
                        black_box(
                            store
                                .attend_with_mass(0, ids, tokens, q, &p, &mut out)
                                .expect("fused"),
                        );
                    }
                }
                black_box(&out);
                s.push(t.elapsed().as_secs_f64());
            }
        }
        let [plain, two, fused] = samples.map(|mut v| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        });
        println!(
            "{{\"bench\":\"attention/{name}/mass\",\"isa\":\"{}\",\"threads\":{threads},\"tokens\":{tokens},\"attend_us\":{:.1},\"attend_then_mass_us\":{:.1},\"fused_us\":{:.1},\"second_pass_overhead\":{:.3},\"fused_overhead\":{:.3}}}",
            Isa::active(),
            plain * 1e6,
            two * 1e6,
            fused * 1e6,
            two / plain - 1.0,
            fused / plain - 1.0
        );
    }
}
