//! Every SIMD path of attention over codes against the scalar reference, on the tiers this CPU
//! runs (an AVX-512 machine runs all three), and the key split across threads.

use engram_kvcore::{
    AttentionParams, BlockStore, CodecKind, Isa, KvShape, SourceLayer, StoreConfig,
};
use proptest::prelude::*;

use crate::common::{ALL_CODECS, VALUE_CODECS, filled, gauss, rel_l2};

fn store_with(kind: CodecKind, kv_heads: usize, head_dim: usize, blocks: u32) -> BlockStore {
    store_pair(kind, kind, kv_heads, head_dim, blocks)
}

/// A two-layer store whose keys are in `key` and values in `value`.
fn store_pair(
    key: CodecKind,
    value: CodecKind,
    kv_heads: usize,
    head_dim: usize,
    blocks: u32,
) -> BlockStore {
    let shape = KvShape::new(2, kv_heads, head_dim).unwrap();
    BlockStore::new(StoreConfig {
        codecs: engram_kvcore::LayerCodecs::streams(&shape, key, value),
        ..StoreConfig::new(shape, key, blocks, 0)
    })
    .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    #[test]
    fn every_tier_and_split_matches_the_scalar_path(
        // Keys and values each in any codec: TQ4 for both runs the 4-bit kernels, any other
        // pair the kernel that expands each stream by its own codec.
        key_index in 0usize..ALL_CODECS.len(),
        value_index in 0usize..VALUE_CODECS.len(),
        // 80 is not a multiple of 32: the kernels decline it and the scalar path runs.
        head_dim in prop::sample::select(vec![32usize, 64, 128, 80]),
        group in 1usize..5,
        // Up to 2,600 keys: ranges of 2,048 and more are split over `threads`.
        tokens in 1usize..2600,
        threads in 1usize..4,
        seed in any::<u64>(),
    ) {
        let (key, value) = (ALL_CODECS[key_index], VALUE_CODECS[value_index]);
        let kv_heads = 2;
        let mut store = store_pair(key, value, kv_heads, head_dim, 168);
        let ids = filled(&mut store, tokens.div_ceil(16), SourceLayer::UserTurn, seed);
        let params = AttentionParams::new(kv_heads * group, head_dim);
        let q = gauss(seed ^ 7).gaussian_vec(params.num_heads * head_dim);
        let mut reference = vec![0.0f32; q.len()];
        store.attend_on(Isa::Scalar, 1, &ids, tokens, &q, &params, &mut reference).unwrap();
        for isa in Isa::available() {
            let split = params.with_threads(threads);
            let mut got = vec![0.0f32; q.len()];
            store.attend_on(isa, 1, &ids, tokens, &q, &split, &mut got).unwrap();
            let err = rel_l2(&got, &reference);
            prop_assert!(err < 1e-5, "{key}/{value} {isa} x{threads}: {err}");
            // The same call gives the same bits.
            let mut again = vec![0.0f32; q.len()];
            store.attend_on(isa, 1, &ids, tokens, &q, &split, &mut again).unwrap();
            prop_assert_eq!(&got, &again);
        }
    }
}

#[test]
fn every_codec_pair_reads_its_own_codes_up_to_the_layers_last_row() {
    // Every block of the store is in use, so the kernel reads the layer's last row (where a
    // 16-byte read of packed codes would run past the end: it is padded instead). Keys and
    // values cover every way a stream is expanded: nibbles (TQ4, the kernels' coordinate
    // order), packed 2/3/5/6-bit codes, Q8, F16 and F32 (natural order), mixed either way.
    let tq = |bits| CodecKind::TurboQuant { bits };
    for (key, value) in [
        (CodecKind::Q8, tq(5)),
        (tq(6), tq(5)),
        (tq(6), CodecKind::TQ4),
        (CodecKind::TQ4, CodecKind::Q8),
        (tq(3), tq(2)),
        (CodecKind::F16, tq(3)),
        (tq(2), CodecKind::F32),
        (tq(5), tq(6)),
        // Outlier splits: the TurboQuant codes first, the stored-apart pairs at the row's end.
        (
            CodecKind::TurboQuantSplit {
                bits: 6,
                outliers: 1,
            },
            tq(5),
        ),
        (
            CodecKind::TurboQuantSplit {
                bits: 4,
                outliers: 3,
            },
            CodecKind::TQ4,
        ),
    ] {
        let shape = KvShape::new(2, 3, 64).unwrap();
        let blocks = 80u32;
        let mut store = BlockStore::new(StoreConfig {
            codecs: engram_kvcore::LayerCodecs::streams(&shape, key, value),
            ..StoreConfig::new(shape, key, blocks, 0)
        })
        .unwrap();
        let tokens = blocks as usize * 16;
        let ids = filled(&mut store, blocks as usize, SourceLayer::UserTurn, 3);
        let params = AttentionParams::new(9, 64);
        let q = gauss(4).gaussian_vec(9 * 64);
        let mut dense = vec![0.0f32; q.len()];
        store
            .attend_dequantized(1, &ids, tokens, &q, &params, &mut dense)
            .unwrap();
        let mut scalar = vec![0.0f32; q.len()];
        store
            .attend_on(Isa::Scalar, 1, &ids, tokens, &q, &params, &mut scalar)
            .unwrap();
        assert!(rel_l2(&scalar, &dense) < 1e-4, "{key}/{value}");
        for isa in Isa::available() {
            let mut got = vec![0.0f32; q.len()];
            store
                .attend_on(isa, 1, &ids, tokens, &q, &params, &mut got)
                .unwrap();
            let err = rel_l2(&got, &scalar);
            assert!(err < 1e-5, "{key}/{value} on {isa}: {err}");
        }
    }
}

#[test]
fn tiers_and_splits_agree_on_a_long_range_near_the_dense_reference() {
    // SmolLM2's geometry at 4K: every tier and split agrees with the scalar path, which agrees
    // with dequantize-then-attend.
    let (kv_heads, head_dim, group, tokens) = (3, 64, 3, 4096);
    let mut store = store_with(CodecKind::TQ4, kv_heads, head_dim, 256);
    let ids = filled(&mut store, tokens / 16, SourceLayer::Memories, 5);
    let params = AttentionParams::new(kv_heads * group, head_dim);
    let q = gauss(9).gaussian_vec(params.num_heads * head_dim);
    let mut scalar = vec![0.0f32; q.len()];
    store
        .attend_on(Isa::Scalar, 0, &ids, tokens, &q, &params, &mut scalar)
        .unwrap();
    let mut dense = vec![0.0f32; q.len()];
    store
        .attend_dequantized(0, &ids, tokens, &q, &params, &mut dense)
        .unwrap();
    assert!(rel_l2(&scalar, &dense) < 1e-4);
    for isa in Isa::available() {
        for threads in [1, 2, 4] {
            let mut got = vec![0.0f32; q.len()];
            let p = params.with_threads(threads);
            store
                .attend_on(isa, 0, &ids, tokens, &q, &p, &mut got)
                .unwrap();
            assert!(rel_l2(&got, &scalar) < 1e-5, "{isa} x{threads}");
        }
    }
}

/// Run by [`engram_simd_lowers_the_active_tier`] in a child process with `ENGRAM_SIMD` set.
#[test]
#[ignore = "run by engram_simd_lowers_the_active_tier in a child process"]
fn forced_tier_child() {
    let want = std::env::var("ENGRAM_SIMD_EXPECT").unwrap();
    assert_eq!(Isa::active().name(), want);
}

#[test]
fn engram_simd_lowers_the_active_tier() {
    let exe = std::env::current_exe().unwrap();
    for isa in Isa::available() {
        let out = std::process::Command::new(&exe)
            .args(["--exact", "simd::forced_tier_child", "--ignored"])
            .env("ENGRAM_SIMD", isa.name())
            .env("ENGRAM_SIMD_EXPECT", isa.name())
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{isa}: {text}");
        assert!(
            text.contains("1 passed"),
            "{isa}: the child ran no test: {text}"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(16))]

    #[test]
    fn causal_attention_equals_decoding_row_by_row(
        key_index in 0usize..ALL_CODECS.len(),
        value_index in 0usize..VALUE_CODECS.len(),
        head_dim in prop::sample::select(vec![64usize, 128, 80]),
        group in 1usize..4,
        start in 0usize..300,
        new in 1usize..40,
        threads in 1usize..4,
        seed in any::<u64>(),
    ) {
        let (key, value) = (ALL_CODECS[key_index], VALUE_CODECS[value_index]);
        let kv_heads = 2;
        let total = start + new;
        let mut store = store_pair(key, value, kv_heads, head_dim, 24);
        let ids = filled(&mut store, total.div_ceil(16), SourceLayer::UserTurn, seed);
        let params = AttentionParams::new(kv_heads * group, head_dim);
        let width = params.num_heads * head_dim;
        let q = gauss(seed ^ 3).gaussian_vec(new * width);
        let mut want = vec![0.0f32; q.len()];
        for r in 0..new {
            let n = start + r + 1;
            store.attend_on(Isa::Scalar, 0, &ids[..n.div_ceil(16)], n, &q[r * width..][..width], &params, &mut want[r * width..][..width]).unwrap();
        }
        for isa in Isa::available() {
            let mut got = vec![0.0f32; q.len()];
            let p = params.with_threads(threads);
            store.attend_causal_on(isa, 0, &ids, start, new, &q, &p, &mut got).unwrap();
            let err = rel_l2(&got, &want);
            prop_assert!(err < 1e-5, "{key}/{value} {isa} x{threads} tiled={}: {err}", store.causal_is_tiled(isa, 0, params.num_heads));
        }
    }
}

#[test]
fn a_prefill_chunk_at_smollm2_geometry_takes_the_tiled_kernel_where_there_is_one() {
    // The last 256-token chunk of a 1K prompt: 3 KV heads of 64, 9 query heads; TQ4, and
    // outlier-split TQ6 keys with TQ5 values.
    let split = CodecKind::TurboQuantSplit {
        bits: 6,
        outliers: 1,
    };
    let tq5 = CodecKind::TurboQuant { bits: 5 };
    for (key, value) in [(CodecKind::TQ4, CodecKind::TQ4), (split, tq5)] {
        prefill_chunk_at_smollm2_geometry(key, value);
    }
}

fn prefill_chunk_at_smollm2_geometry(key: CodecKind, value: CodecKind) {
    let (kv_heads, head_dim, start, new) = (3, 64, 768, 256);
    let mut store = store_pair(key, value, kv_heads, head_dim, 64);
    let ids = filled(&mut store, (start + new) / 16, SourceLayer::UserTurn, 21);
    let params = AttentionParams::new(9, head_dim);
    let width = 9 * head_dim;
    let q = gauss(22).gaussian_vec(new * width);
    let mut want = vec![0.0f32; q.len()];
    store
        .attend_causal_on(Isa::Scalar, 0, &ids, start, new, &q, &params, &mut want)
        .unwrap();
    assert!(!store.causal_is_tiled(Isa::Scalar, 0, 9));
    assert_eq!(
        store.causal_is_tiled(Isa::detected(), 0, 9),
        Isa::detected() == Isa::Avx512
    );
    for threads in [1, 2] {
        let mut got = vec![0.0f32; q.len()];
        let p = params.with_threads(threads);
        store
            .attend_causal_on(Isa::detected(), 0, &ids, start, new, &q, &p, &mut got)
            .unwrap();
        assert!(rel_l2(&got, &want) < 1e-5, "{key}/{value} x{threads}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(16))]

    /// Each row's result is the same bits whether it comes alone or in a chunk, on every tier
    /// and thread count, over the prefix decoded once (AVX2, scalar) or over the codes (the
    /// AVX-512 kernels, any codec pair): a prompt resumed from a cached prefix computes what a
    /// whole prefill computes. The decoded path also gives the same bits on every tier.
    #[test]
    fn causal_rows_do_not_depend_on_their_chunk(
        key_index in 0usize..ALL_CODECS.len(),
        value_index in 0usize..VALUE_CODECS.len(),
        head_dim in prop::sample::select(vec![32usize, 64, 128]),
        group in 1usize..4,
        start in 0usize..200,
        new in 2usize..40,
        cut in 1usize..39,
        threads in 1usize..4,
        seed in any::<u64>(),
    ) {
        let (key, value) = (ALL_CODECS[key_index], VALUE_CODECS[value_index]);
        let cut = cut.min(new - 1);
        let kv_heads = 2;
        let total = start + new;
        let mut store = store_pair(key, value, kv_heads, head_dim, 24);
        let ids = filled(&mut store, total.div_ceil(16), SourceLayer::UserTurn, seed);
        let params = AttentionParams::new(kv_heads * group, head_dim);
        let width = params.num_heads * head_dim;
        let q = gauss(seed ^ 5).gaussian_vec(new * width);
        let mut decoded = vec![0.0f32; q.len()];
        store.attend_causal_on(Isa::Scalar, 0, &ids, start, new, &q, &params, &mut decoded).unwrap();
        for isa in Isa::available() {
            prop_assert!(store.causal_is_fast(isa, 0, params.num_heads));
            let p = params.with_threads(threads);
            let whole = if store.causal_is_tiled(isa, 0, params.num_heads) {
                let mut whole = vec![0.0f32; q.len()];
                store.attend_causal_on(isa, 0, &ids, start, new, &q, &params, &mut whole).unwrap();
                whole
            } else {
                decoded.clone()
            };
            // The chunk split at `cut`: rows 0..cut, then the rest over the same prefix.
            let mut split = vec![0.0f32; q.len()];
            let (a, b) = split.split_at_mut(cut * width);
            store.attend_causal_on(isa, 0, &ids[..(start + cut).div_ceil(16)], start, cut, &q[..cut * width], &p, a).unwrap();
            store.attend_causal_on(isa, 0, &ids, start + cut, new - cut, &q[cut * width..], &p, b).unwrap();
            let differ = split.iter().zip(&whole).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
            prop_assert_eq!(differ, 0, "{}/{} {} x{}: {} outputs differ", key, value, isa, threads, differ);
        }
    }
}
