//! kvcore micro-benchmarks on the SmolLM2-135M KV shape (30 layers, 3 KV heads, head_dim 64,
//! blocks of 16). `make bench` runs them.
//!
//! 1. `encode/<codec>`: rows → packed codes + norms; throughput in bytes of f32 input.
//! 2. `attention/<codec>/codes` vs `…/dequantize`: one decode step of 9 query heads over 4,096
//!    tokens of one layer, read from the codes vs decoded to f32 first and then attended.
//! 3. `tiers/…`: spill + warm of 1,000 blocks across all layers vs two plain memcpys of the same
//!    bytes; slots contiguous, contiguous but listed in a shuffled order (as eviction lists them,
//!    by priority), and scattered (every other slot, so no two blocks are adjacent).
//!
//! After criterion, the same pairs are timed again interleaved in this process and printed as
//! JSON lines with their ratio (`{"bench":…, "ratio":…}`): ratios from one run are what count on a
//! shared machine.

// A benchmark whose set-up fails must stop loudly, not measure something else.
#![allow(clippy::expect_used)]

use std::hint::black_box;
use std::time::Instant;

use criterion::{Criterion, Throughput};
use engram_kvcore::{
    AttentionParams, BlockId, BlockStore, BlockTags, Codec, CodecKind, KvShape, Rows, SourceLayer,
    SplitMix64, StoreConfig, TenantId, Tier, TokenRange,
};
use serde::Serialize;

const SHAPE: KvShape = KvShape::SMOLLM2_135M;
const CODECS: [CodecKind; 5] = [
    CodecKind::F16,
    CodecKind::Q8,
    CodecKind::TurboQuant { bits: 4 },
    CodecKind::TurboQuant { bits: 3 },
    CodecKind::TurboQuant { bits: 2 },
];
const ATTN_TOKENS: usize = 4096;
const HEADS: usize = 9;
const MOVE_BLOCKS: usize = 1000;

fn tags(n: usize) -> Vec<BlockTags> {
    (0..n)
        .map(|b| BlockTags {
            source: SourceLayer::Memories,
            importance: 0.5,
            tenant: TenantId(1),
            session: None,
            tokens: TokenRange::new((16 * b) as u32, (16 * b + 16) as u32),
        })
        .collect()
}

/// Rows to encode: 16,384 rows of head_dim 64 (4 MiB of f32).
struct EncodeCase {
    codec: Codec,
    rows: Vec<f32>,
    codes: Vec<u8>,
    norms: Vec<u8>,
}

impl EncodeCase {
    fn new(kind: CodecKind) -> Self {
        let codec = Codec::new(kind, SHAPE.head_dim, 1).expect("codec");
        let n = 16_384;
        Self {
            rows: SplitMix64::new(1).gaussian_vec(n * SHAPE.head_dim),
            codes: vec![0; n * codec.code_bytes()],
            norms: vec![0; n * codec.norm_bytes()],
            codec,
        }
    }

    fn run(&mut self) {
        self.codec
            .encode(Rows::F32(&self.rows), &mut self.codes, &mut self.norms)
            .expect("encode");
    }

    fn input_bytes(&self) -> u64 {
        (self.rows.len() * 4) as u64
    }
}

/// One layer's worth of blocks and a query, for the attention pair.
struct AttentionCase {
    store: BlockStore,
    ids: Vec<BlockId>,
    q: Vec<f32>,
    out: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    params: AttentionParams,
}

impl AttentionCase {
    fn new(kind: CodecKind) -> Self {
        let shape = KvShape::new(1, SHAPE.kv_heads, SHAPE.head_dim).expect("shape");
        let blocks = ATTN_TOKENS / shape.block_size;
        let mut store =
            BlockStore::new(StoreConfig::new(shape, kind, blocks as u32, 0)).expect("store");
        let ids = store.allocate(Tier::Hot, &tags(blocks)).expect("allocate");
        let mut rng = SplitMix64::new(7);
        let n = ATTN_TOKENS * shape.token_width();
        let (k, v) = (rng.gaussian_vec(n), rng.gaussian_vec(n));
        store
            .write(0, &ids, 0, Rows::F32(&k), Rows::F32(&v))
            .expect("write");
        Self {
            store,
            ids,
            q: rng.gaussian_vec(HEADS * shape.head_dim),
            out: vec![0.0; HEADS * shape.head_dim],
            k: vec![0.0; n],
            v: vec![0.0; n],
            params: AttentionParams::new(HEADS, shape.head_dim),
        }
    }

    fn codes(&mut self) {
        let Self {
            store,
            ids,
            q,
            out,
            params,
            ..
        } = self;
        store
            .attend(0, ids, ATTN_TOKENS, q, params, out)
            .expect("attend");
        black_box(&self.out);
    }

    /// Decode every key and value (inverse rotation included), then f32 attention.
    fn dequantize(&mut self) {
        self.store
            .read(0, &self.ids, 0, &mut self.k, &mut self.v)
            .expect("read");
        dense_f32(&self.k, &self.v, &self.q, self.params.scale, &mut self.out);
        black_box(&self.out);
    }
}

/// Plain f32 single-query GQA attention, cache-friendly loop order (the fair baseline).
fn dense_f32(k: &[f32], v: &[f32], q: &[f32], scale: f32, out: &mut [f32]) {
    let (d, kvh) = (SHAPE.head_dim, SHAPE.kv_heads);
    let group = HEADS / kvh;
    let tokens = k.len() / (kvh * d);
    let mut p = vec![0.0f32; tokens];
    for h in 0..HEADS {
        let g = h / group;
        let qh = &q[h * d..][..d];
        for (t, s) in p.iter_mut().enumerate() {
            let kt = &k[(t * kvh + g) * d..][..d];
            *s = scale * qh.iter().zip(kt).map(|(a, b)| a * b).sum::<f32>();
        }
        let max = p.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut total = 0.0;
        for s in p.iter_mut() {
            *s = (*s - max).exp();
            total += *s;
        }
        let o = &mut out[h * d..][..d];
        o.fill(0.0);
        for (t, &w) in p.iter().enumerate() {
            for (a, &x) in o.iter_mut().zip(&v[(t * kvh + g) * d..][..d]) {
                *a += w * x;
            }
        }
        o.iter_mut().for_each(|a| *a /= total);
    }
}

/// Where the 1,000 moved blocks sit in the hot tier, and the order they are listed in.
#[derive(Clone, Copy)]
enum Slots {
    Contiguous,
    Shuffled,
    Scattered,
}

impl Slots {
    const ALL: [Self; 3] = [Self::Contiguous, Self::Shuffled, Self::Scattered];

    fn name(self) -> &'static str {
        match self {
            Self::Contiguous => "contiguous",
            Self::Shuffled => "shuffled",
            Self::Scattered => "scattered",
        }
    }
}

/// 1,000 blocks of every layer, hot and cold, for the spill/warm pair.
struct TierCase {
    store: BlockStore,
    ids: Vec<BlockId>,
    src: Vec<u8>,
    dst: Vec<u8>,
}

impl TierCase {
    fn new(slots: Slots) -> Self {
        let scattered = matches!(slots, Slots::Scattered);
        let hot = if scattered {
            2 * MOVE_BLOCKS
        } else {
            MOVE_BLOCKS
        };
        let config = StoreConfig::new(SHAPE, CodecKind::TQ4, hot as u32, MOVE_BLOCKS as u32);
        let mut store = BlockStore::new(config).expect("store");
        let all = store.allocate(Tier::Hot, &tags(hot)).expect("allocate");
        let mut ids: Vec<BlockId> = if scattered {
            let (keep, drop): (Vec<_>, Vec<_>) =
                all.iter().enumerate().partition(|(i, _)| i % 2 == 0);
            let drop: Vec<BlockId> = drop.into_iter().map(|(_, &id)| id).collect();
            store.release(&drop).expect("release");
            keep.into_iter().map(|(_, &id)| id).collect()
        } else {
            all
        };
        if matches!(slots, Slots::Shuffled) {
            let mut rng = SplitMix64::new(3);
            for i in (1..ids.len()).rev() {
                ids.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
            }
        }
        // Touch every byte once so page faults are not timed.
        store.spill(&ids).expect("spill");
        store.warm(&ids).expect("warm");
        let bytes = MOVE_BLOCKS * store.block_bytes();
        Self {
            store,
            ids,
            src: vec![1; bytes],
            dst: vec![2; bytes],
        }
    }

    fn spill_warm(&mut self) {
        self.store.spill(&self.ids).expect("spill");
        self.store.warm(&self.ids).expect("warm");
    }

    /// Copies there and back. The `black_box` fences matter: without them LLVM may delete the
    /// copy back (it restores bytes the first copy read) and the baseline would move half.
    fn memcpy(&mut self) {
        self.dst.copy_from_slice(black_box(&self.src));
        black_box(&mut self.dst);
        self.src.copy_from_slice(black_box(&self.dst));
        black_box(&mut self.src);
    }

    fn moved_bytes(&self) -> u64 {
        (2 * self.src.len()) as u64
    }
}

fn criterion_benches(c: &mut Criterion) {
    let mut group = c.benchmark_group("encode");
    for kind in CODECS {
        let mut case = EncodeCase::new(kind);
        group.throughput(Throughput::Bytes(case.input_bytes()));
        group.bench_function(kind.to_string(), |b| b.iter(|| case.run()));
    }
    group.finish();

    let mut group = c.benchmark_group("attention");
    for kind in CODECS {
        let mut case = AttentionCase::new(kind);
        group.bench_function(format!("{kind}/codes"), |b| b.iter(|| case.codes()));
        group.bench_function(format!("{kind}/dequantize"), |b| {
            b.iter(|| case.dequantize())
        });
    }
    group.finish();

    let mut group = c.benchmark_group("tiers");
    for slots in Slots::ALL {
        let name = slots.name();
        let mut case = TierCase::new(slots);
        group.throughput(Throughput::Bytes(case.moved_bytes()));
        group.bench_function(format!("{name}/spill_warm_1000"), |b| {
            b.iter(|| case.spill_warm())
        });
        group.bench_function(format!("{name}/memcpy"), |b| b.iter(|| case.memcpy()));
    }
    group.finish();
}

/// Median seconds of `f` over `rounds`, with the two functions of a pair interleaved.
fn paired(rounds: usize, mut a: impl FnMut(), mut b: impl FnMut()) -> (f64, f64) {
    let (mut ta, mut tb) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        let t = Instant::now();
        a();
        ta.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        b();
        tb.push(t.elapsed().as_secs_f64());
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    (median(&mut ta), median(&mut tb))
}

#[derive(Serialize)]
struct Ratio {
    bench: String,
    ours_s: f64,
    baseline_s: f64,
    /// baseline / ours for attention (speed-up), ours throughput / memcpy throughput for tiers.
    ratio: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    gb_per_s: Option<f64>,
}

fn print(r: &Ratio) {
    match serde_json::to_string(r) {
        Ok(line) => println!("{line}"),
        Err(e) => eprintln!("serialize: {e}"),
    }
}

fn ratios() {
    for kind in CODECS {
        let mut case = EncodeCase::new(kind);
        let (s, _) = paired(15, || case.run(), || {});
        print(&Ratio {
            bench: format!("encode/{kind}"),
            ours_s: s,
            baseline_s: 0.0,
            ratio: 0.0,
            gb_per_s: Some(case.input_bytes() as f64 / s / 1e9),
        });
    }
    for kind in CODECS {
        let mut a = AttentionCase::new(kind);
        let mut b = AttentionCase::new(kind);
        let (ours, base) = paired(41, || a.codes(), || b.dequantize());
        print(&Ratio {
            bench: format!("attention/{kind}/codes_vs_dequantize"),
            ours_s: ours,
            baseline_s: base,
            ratio: base / ours,
            gb_per_s: None,
        });
    }
    for slots in Slots::ALL {
        let name = slots.name();
        let mut a = TierCase::new(slots);
        let mut b = TierCase::new(slots);
        let bytes = a.moved_bytes() as f64;
        let (ours, base) = paired(21, || a.spill_warm(), || b.memcpy());
        print(&Ratio {
            bench: format!("tiers/{name}/spill_warm_1000_vs_memcpy"),
            ours_s: ours,
            baseline_s: base,
            ratio: base / ours,
            gb_per_s: Some(bytes / ours / 1e9),
        });
    }
}

fn main() {
    let mut c = Criterion::default()
        .measurement_time(std::time::Duration::from_secs(3))
        .warm_up_time(std::time::Duration::from_secs(1))
        .configure_from_args();
    criterion_benches(&mut c);
    c.final_summary();
    ratios();
}
