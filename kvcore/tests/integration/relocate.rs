//! Relocated runs (issue 26): the query-side shift with the key-mean correction equals
//! attending over keys explicitly rotated to where they stand now.

use engram_kvcore::{
    AttentionParams, BlockStore, CodecKind, Isa, KvError, KvShape, LayerCodecs, Relocated,
    Relocation, Rope, Rows, SourceLayer, StoreConfig, Tier, attend_dense,
};
use proptest::prelude::*;

use crate::common::{ALL_CODECS, gauss, rel_l2, tags, value_for};

const ROPE: Rope = Rope { theta: 100_000.0 };

/// A layer of `tokens` positions whose stored keys are `K − μ` (K: keys as computed at their
/// original positions, μ: the key mean per KV head), the store, its blocks, and μ.
struct Case {
    store: BlockStore,
    ids: Vec<engram_kvcore::BlockId>,
    mean: Vec<f32>,
    kv_heads: usize,
    d: usize,
    tokens: usize,
}

fn case(kind: CodecKind, kv_heads: usize, d: usize, tokens: usize, seed: u64) -> Case {
    let shape = KvShape::new(2, kv_heads, d).unwrap();
    let blocks = tokens.div_ceil(shape.block_size);
    let mut store = BlockStore::new(StoreConfig {
        codecs: LayerCodecs::streams(&shape, kind, value_for(kind, usize::MAX)),
        ..StoreConfig::new(shape, kind, blocks as u32, 0)
    })
    .unwrap();
    let ids = store
        .allocate(Tier::Hot, &vec![tags(SourceLayer::Rules); blocks])
        .unwrap();
    let mut g = gauss(seed);
    // A key mean well away from zero, as real layers have: without the correction a run's
    // scores move by (q′ − q)·μ.
    let mean: Vec<f32> = g
        .gaussian_vec(kv_heads * d)
        .iter()
        .map(|x| 1.5 * x)
        .collect();
    let n = tokens * kv_heads * d;
    let raw = g.gaussian_vec(n);
    let stored: Vec<f32> = raw
        .iter()
        .enumerate()
        .map(|(i, k)| k - mean[i % (kv_heads * d)])
        .collect();
    let v = g.gaussian_vec(n);
    store
        .write(1, &ids, 0, Rows::F32(&stored), Rows::F32(&v))
        .unwrap();
    Case {
        store,
        ids,
        mean,
        kv_heads,
        d,
        tokens,
    }
}

/// The reference: the stored keys as the store decodes them, μ added back, each run's keys
/// turned by its shift, dense attention (f64 softmax).
fn explicit(c: &Case, runs: &[Relocated], q: &[f32], params: &AttentionParams) -> Vec<f32> {
    let n = c.tokens * c.kv_heads * c.d;
    let (mut k, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
    c.store.read(1, &c.ids, 0, &mut k, &mut v).unwrap();
    let width = c.kv_heads * c.d;
    for (t, row) in k.chunks_exact_mut(width).enumerate() {
        row.iter_mut().zip(&c.mean).for_each(|(x, m)| *x += m);
        if let Some(r) = runs.iter().find(|r| (r.start..r.end).contains(&t)) {
            ROPE.shift(row, c.d, r.shift);
        }
    }
    let mut out = vec![0.0f32; q.len()];
    attend_dense(&k, &v, c.kv_heads, q, params, &mut out).unwrap();
    out
}

fn runs_for(tokens: usize, pick: u8, shift: i64) -> Vec<Relocated> {
    let blocks = tokens.div_ceil(16);
    let whole = vec![Relocated {
        start: 0,
        end: tokens,
        shift,
    }];
    match pick % 3 {
        // One run in the middle.
        0 if blocks >= 3 => vec![Relocated {
            start: 16 * (blocks / 3),
            end: 16 * (2 * blocks / 3),
            shift,
        }],
        // Two runs moved by different amounts, the second to the end.
        1 if blocks >= 2 => vec![
            Relocated {
                start: 0,
                end: 16 * (blocks / 2),
                shift: -shift,
            },
            Relocated {
                start: 16 * (blocks / 2),
                end: tokens,
                shift,
            },
        ],
        _ => whole,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// The acceptance bound: within 1e-5 for F32 keys, 1e-4 for TQ4 (and every other codec),
    /// on every SIMD tier this CPU runs, on one thread and split over two.
    #[test]
    fn the_query_side_shift_equals_rotating_the_keys(
        codec_index in 0usize..ALL_CODECS.len(),
        group in 1usize..4,
        tokens in prop::sample::select(vec![1usize, 16, 40, 200, 2200]),
        pick in any::<u8>(),
        shift in prop::sample::select(vec![1i64, 7, 300, 4096, -5]),
        seed in any::<u64>(),
    ) {
        let kind = ALL_CODECS[codec_index];
        let c = case(kind, 2, 64, tokens, seed);
        let runs = runs_for(tokens, pick, shift);
        let q = gauss(seed ^ 5).gaussian_vec(2 * group * 64);
        let bound = if kind == CodecKind::F32 { 1e-5 } else { 1e-4 };
        for isa in Isa::available() {
            for threads in [1, 2] {
                let params = AttentionParams::new(2 * group, 64).with_threads(threads);
                let want = explicit(&c, &runs, &q, &params);
                let relocation = Relocation { runs: &runs, rope: ROPE, key_mean: Some(&c.mean) };
                let mut got = vec![0.0f32; q.len()];
                c.store.attend_relocated_on(isa, 1, &c.ids, tokens, &q, &relocation, &params, &mut got).unwrap();
                let e = rel_l2(&got, &want);
                prop_assert!(e <= bound, "{kind} {isa} threads {threads} runs {runs:?}: {e}");
            }
        }
    }
}

/// Both halves of the method are needed: without the key-mean correction, or without the
/// shift (plain attention), the output is far from the rotated keys'.
#[test]
fn the_correction_and_the_shift_are_both_needed() {
    let c = case(CodecKind::F32, 2, 64, 320, 11);
    let runs = [Relocated {
        start: 64,
        end: 256,
        shift: 900,
    }];
    let params = AttentionParams::new(6, 64);
    let q = gauss(3).gaussian_vec(6 * 64);
    let want = explicit(&c, &runs, &q, &params);
    let mut with = vec![0.0f32; q.len()];
    let full = Relocation {
        runs: &runs,
        rope: ROPE,
        key_mean: Some(&c.mean),
    };
    c.store
        .attend_relocated(1, &c.ids, 320, &q, &full, &params, &mut with)
        .unwrap();
    assert!(rel_l2(&with, &want) <= 1e-5);
    let mut uncorrected = vec![0.0f32; q.len()];
    let no_mean = Relocation {
        key_mean: None,
        ..full
    };
    c.store
        .attend_relocated(1, &c.ids, 320, &q, &no_mean, &params, &mut uncorrected)
        .unwrap();
    let e = rel_l2(&uncorrected, &want);
    assert!(e > 0.05, "without the correction: {e}");
    let mut plain = vec![0.0f32; q.len()];
    c.store
        .attend(1, &c.ids, 320, &q, &params, &mut plain)
        .unwrap();
    let e = rel_l2(&plain, &want);
    assert!(e > 0.05, "without the shift: {e}");
    // A run with shift 0 reads as plain attention (up to the pieces' merge order).
    let still = [Relocated {
        shift: 0,
        ..runs[0]
    }];
    let none = Relocation {
        runs: &still,
        ..full
    };
    let mut same = vec![0.0f32; q.len()];
    c.store
        .attend_relocated(1, &c.ids, 320, &q, &none, &params, &mut same)
        .unwrap();
    assert!(rel_l2(&same, &plain) <= 1e-6);
}

/// Turning by δ then by −δ gives the vector back; turns add up.
#[test]
fn rope_shifts_compose() {
    let x = gauss(9).gaussian_vec(3 * 64);
    let mut y = x.clone();
    ROPE.shift(&mut y, 64, 1234);
    assert!(rel_l2(&y, &x) > 0.1);
    ROPE.shift(&mut y, 64, -1234);
    assert!(rel_l2(&y, &x) <= 1e-6);
    let (mut a, mut b) = (x.clone(), x);
    ROPE.shift(&mut a, 64, 300);
    ROPE.shift(&mut a, 64, 45);
    ROPE.shift(&mut b, 64, 345);
    assert!(rel_l2(&a, &b) <= 1e-6);
}

/// Runs that are empty, overlapping, past the sequence or off block boundaries are refused
/// with the run named, and nothing is written.
#[test]
fn bad_runs_are_refused() {
    let c = case(CodecKind::TurboQuant { bits: 4 }, 2, 64, 100, 1);
    let params = AttentionParams::new(4, 64);
    let q = gauss(2).gaussian_vec(4 * 64);
    let cases: [(&[Relocated], usize, &str); 4] = [
        (
            &[Relocated {
                start: 16,
                end: 16,
                shift: 3,
            }],
            0,
            "is empty",
        ),
        (
            &[
                Relocated {
                    start: 0,
                    end: 48,
                    shift: 3,
                },
                Relocated {
                    start: 32,
                    end: 64,
                    shift: 3,
                },
            ],
            1,
            "overlaps or precedes the run before",
        ),
        (
            &[Relocated {
                start: 96,
                end: 112,
                shift: 3,
            }],
            0,
            "ends past the sequence",
        ),
        (
            &[Relocated {
                start: 8,
                end: 32,
                shift: 3,
            }],
            0,
            "is not on block boundaries",
        ),
    ];
    for (runs, index, why) in cases {
        let relocation = Relocation {
            runs,
            rope: ROPE,
            key_mean: Some(&c.mean),
        };
        let mut out = vec![7.0f32; q.len()];
        match c
            .store
            .attend_relocated(1, &c.ids, 100, &q, &relocation, &params, &mut out)
        {
            Err(KvError::BadRelocation { run, reason, .. }) => {
                assert_eq!((run, reason), (index, why));
            }
            other => panic!("{runs:?}: {other:?}"),
        }
        assert!(out.iter().all(|&x| x == 7.0));
    }
    // A key mean of the wrong width is refused too.
    let runs = [Relocated {
        start: 0,
        end: 32,
        shift: 3,
    }];
    let relocation = Relocation {
        runs: &runs,
        rope: ROPE,
        key_mean: Some(&c.mean[1..]),
    };
    let mut out = vec![0.0f32; q.len()];
    assert_eq!(
        c.store
            .attend_relocated(1, &c.ids, 100, &q, &relocation, &params, &mut out),
        Err(KvError::RowWidth {
            expected: 128,
            got: 127
        })
    );
}

/// `copy_tokens` moves codes between tables at any alignment, bytes as stored: the copy
/// decodes to exactly what the source decodes to, in every layer, from hot and cold sources;
/// the source blocks count the reuse, the destinations record the shift; bad calls change
/// nothing.
#[test]
fn copied_tokens_decode_as_their_source() {
    for kind in [CodecKind::F32, CodecKind::TurboQuant { bits: 4 }] {
        let shape = KvShape::new(2, 2, 32).unwrap();
        let bs = shape.block_size;
        let mut store = BlockStore::new(StoreConfig {
            codecs: LayerCodecs::streams(&shape, kind, value_for(kind, usize::MAX)),
            ..StoreConfig::new(shape, kind, 16, 16)
        })
        .unwrap();
        let src = store
            .allocate(Tier::Hot, &[tags(SourceLayer::Rules); 4])
            .unwrap();
        let dst = store
            .allocate(Tier::Hot, &[tags(SourceLayer::Rules); 3])
            .unwrap();
        let width = 2 * 32;
        let mut g = gauss(11);
        for layer in 0..2 {
            let k = g.gaussian_vec(4 * bs * width);
            let v = g.gaussian_vec(4 * bs * width);
            store
                .write(layer, &src, 0, Rows::F32(&k), Rows::F32(&v))
                .unwrap();
        }
        // The second source block goes cold: copies read either tier.
        store.spill(&src[1..2]).unwrap();
        let before = store.block_bytes_of(dst[0]).unwrap();
        // Out of range, a block on both sides, zero tokens: refused, nothing written.
        assert!(store.copy_tokens(&src, 60, &dst, 0, 5, 3).is_err());
        assert!(store.copy_tokens(&src, 0, &src, 8, 4, 8).is_err());
        assert!(store.copy_tokens(&src, 0, &dst, 0, 0, 3).is_err());
        assert_eq!(store.block_bytes_of(dst[0]).unwrap(), before);
        // 27 tokens from position 5 (inside block 0) to position 19 (inside block 1).
        let (n, from, to) = (27usize, 5usize, 19usize);
        store
            .copy_tokens(&src, from, &dst, to, n, to as i64 - from as i64)
            .unwrap();
        for layer in 0..2 {
            let (mut ks, mut vs) = (vec![0.0; n * width], vec![0.0; n * width]);
            let (mut kd, mut vd) = (vec![0.0; n * width], vec![0.0; n * width]);
            store.read(layer, &src, from, &mut ks, &mut vs).unwrap();
            store.read(layer, &dst, to, &mut kd, &mut vd).unwrap();
            assert_eq!(ks, kd, "{kind:?} layer {layer}: keys");
            assert_eq!(vs, vd, "{kind:?} layer {layer}: values");
        }
        let meta = |id| store.metadata().get(id).unwrap().clone();
        // Source blocks 0..=1 (positions 5..32) were read; blocks 2 and 3 were not.
        assert_eq!(
            src.iter()
                .map(|&b| meta(b).relocations())
                .collect::<Vec<_>>(),
            vec![1, 1, 0, 0]
        );
        assert_eq!(meta(dst[0]).shift(), 0, "untouched by the copy");
        assert_eq!(meta(dst[1]).shift(), 14);
        assert_eq!(meta(dst[2]).shift(), 14);
        assert_eq!(meta(src[0]).shift(), 0);
    }
}
