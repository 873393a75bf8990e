//! Attention read from codes equals the dequantize-then-attend reference.

use engram_kvcore::{
    AttentionParams, BlockStore, CodecKind, KvError, KvShape, LayerCodecs, SourceLayer,
    StoreConfig, Tier, attend_dense,
};
use proptest::prelude::*;

use crate::common::{ALL_CODECS, VALUE_CODECS, filled, gauss, rel_l2, small_store, value_for};

fn store_streams(key: CodecKind, value: CodecKind, kv_heads: usize, head_dim: usize) -> BlockStore {
    let shape = KvShape::new(2, kv_heads, head_dim).unwrap();
    BlockStore::new(StoreConfig {
        codecs: LayerCodecs::streams(&shape, key, value),
        ..StoreConfig::new(shape, key, 16, 4)
    })
    .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn codes_path_matches_the_dequantize_reference(
        codec_index in 0usize..ALL_CODECS.len(),
        // Values in another codec than the keys half of the time.
        value_index in 0usize..2 * VALUE_CODECS.len(),
        // head_dim 80 exercises the dense rotation; 64 and 128 the Hadamard one.
        head_dim in prop::sample::select(vec![64usize, 80, 128]),
        group in 1usize..4,
        tokens in 1usize..120,
        seed in any::<u64>(),
    ) {
        let kind = ALL_CODECS[codec_index];
        let value = value_for(kind, value_index);
        let kv_heads = 2;
        let mut store = store_streams(kind, value, kv_heads, head_dim);
        let n_blocks = tokens.div_ceil(16);
        let ids = filled(&mut store, n_blocks, SourceLayer::UserTurn, seed);
        let params = AttentionParams::new(kv_heads * group, head_dim);
        let q = gauss(seed ^ 1).gaussian_vec(params.num_heads * head_dim);

        let mut scores = vec![0.0f32; params.num_heads * tokens];
        store.scores(1, &ids, tokens, &q, &params, &mut scores).unwrap();
        let (mut k, mut v) = (vec![0.0f32; tokens * kv_heads * head_dim], vec![0.0f32; tokens * kv_heads * head_dim]);
        store.read(1, &ids, 0, &mut k, &mut v).unwrap();
        let mut want = vec![0.0f32; scores.len()];
        for h in 0..params.num_heads {
            let g = h / group;
            for t in 0..tokens {
                let key = &k[(t * kv_heads + g) * head_dim..][..head_dim];
                let dot: f64 = q[h * head_dim..][..head_dim].iter().zip(key).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum();
                want[h * tokens + t] = (dot * f64::from(params.scale)) as f32;
            }
        }
        prop_assert!(rel_l2(&scores, &want) < 1e-4, "{kind}: scores {}", rel_l2(&scores, &want));

        let (mut got, mut reference) = (vec![0.0f32; q.len()], vec![0.0f32; q.len()]);
        store.attend(1, &ids, tokens, &q, &params, &mut got).unwrap();
        store.attend_dequantized(1, &ids, tokens, &q, &params, &mut reference).unwrap();
        prop_assert!(rel_l2(&got, &reference) < 1e-4, "{kind}/{value}: output {}", rel_l2(&got, &reference));
        // Causal: each row of a chunk equals a decode over its own prefix.
        let new = tokens.min(5);
        let start = tokens - new;
        let qs = gauss(seed ^ 2).gaussian_vec(new * q.len());
        let mut causal = vec![0.0f32; qs.len()];
        store.attend_causal(1, &ids, start, new, &qs, &params, &mut causal).unwrap();
        for r in 0..new {
            let n = start + r + 1;
            let mut one = vec![0.0f32; q.len()];
            store.attend(1, &ids[..n.div_ceil(16)], n, &qs[r * q.len()..][..q.len()], &params, &mut one).unwrap();
            let e = rel_l2(&causal[r * q.len()..][..q.len()], &one);
            prop_assert!(e < 1e-4, "{kind}/{value}: causal row {r}: {e}");
        }
    }
}

#[test]
fn tq4_attention_is_close_to_f32_attention_on_the_original_data() {
    // Large-magnitude scores make softmax peaky; the codec error must still stay small.
    let mut store = small_store(CodecKind::TQ4, 8, 2);
    let shape = *store.shape();
    let ids = store
        .allocate(Tier::Hot, &[crate::common::tags(SourceLayer::Memories); 4])
        .unwrap();
    let tokens = 64;
    let mut g = gauss(11);
    let (k, v) = (
        g.gaussian_vec(tokens * shape.token_width()),
        g.gaussian_vec(tokens * shape.token_width()),
    );
    store
        .write(
            0,
            &ids,
            0,
            engram_kvcore::Rows::F32(&k),
            engram_kvcore::Rows::F32(&v),
        )
        .unwrap();
    let params = AttentionParams::new(6, 64);
    let q = g.gaussian_vec(6 * 64);
    let (mut got, mut exact) = (vec![0.0f32; q.len()], vec![0.0f32; q.len()]);
    store
        .attend(0, &ids, tokens, &q, &params, &mut got)
        .unwrap();
    attend_dense(&k, &v, shape.kv_heads, &q, &params, &mut exact).unwrap();
    let err = rel_l2(&got, &exact);
    assert!(err < 0.15, "TQ4 vs f32 attention relative error {err}");
    assert!(err > 0.0, "a 4-bit codec cannot be exact");
}

#[test]
fn attention_rejects_bad_geometry() {
    let mut store = small_store(CodecKind::TQ4, 8, 2);
    let ids = filled(&mut store, 2, SourceLayer::Rules, 1);
    let q = vec![0.5f32; 4 * 64];
    let mut out = vec![0.0f32; 4 * 64];
    let p = AttentionParams::new(4, 64);
    // 3 query heads cannot share 2 KV heads.
    assert!(matches!(
        store.attend(
            0,
            &ids,
            20,
            &q[..192],
            &AttentionParams::new(3, 64),
            &mut out[..192]
        ),
        Err(KvError::HeadGrouping { .. })
    ));
    // Token count that needs one block, given two.
    assert!(matches!(
        store.attend(0, &ids, 16, &q, &p, &mut out),
        Err(KvError::TokenRange { .. })
    ));
    // Query of the wrong width.
    assert!(matches!(
        store.attend(0, &ids, 20, &q[..200], &p, &mut out),
        Err(KvError::RowWidth { .. })
    ));
    // Unknown layer.
    assert!(matches!(
        store.attend(2, &ids, 20, &q, &p, &mut out),
        Err(KvError::UnknownLayer { .. })
    ));
    // A cold block cannot be attended.
    store.spill(&ids[1..]).unwrap();
    assert!(matches!(
        store.attend(0, &ids, 20, &q, &p, &mut out),
        Err(KvError::WrongTier { .. })
    ));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(16))]

    /// The softmax mass per block the decode kernels export equals the mass computed from the
    /// dense attention weights (keys decoded to f32, softmax in f64), within 1e-3 relative.
    #[test]
    fn attention_mass_per_block_matches_the_dense_weights(
        codec_index in 0usize..ALL_CODECS.len(),
        head_dim in prop::sample::select(vec![64usize, 128]),
        group in 1usize..4,
        tokens in 1usize..150,
        seed in any::<u64>(),
    ) {
        let kind = ALL_CODECS[codec_index];
        let kv_heads = 2;
        // Values in the keys' codec (the SIMD kernels take TQ4 keys with TQ4 values).
        let mut store = store_streams(kind, value_for(kind, usize::MAX), kv_heads, head_dim);
        let n_blocks = tokens.div_ceil(16);
        let ids = filled(&mut store, n_blocks, SourceLayer::Memories, seed);
        let params = AttentionParams::new(kv_heads * group, head_dim);
        // Peaky queries: some blocks get most of the mass, others almost none.
        let q: Vec<f32> = gauss(seed ^ 7).gaussian_vec(params.num_heads * head_dim).iter().map(|x| 3.0 * x).collect();
        let got = store.attention_mass(1, &ids, tokens, &q, &params).unwrap();
        let scalar = store.attention_mass_on(engram_kvcore::Isa::Scalar, 1, &ids, tokens, &q, &params).unwrap();
        let n = tokens * kv_heads * head_dim;
        let (mut k, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
        store.read(1, &ids, 0, &mut k, &mut v).unwrap();
        let mut want = vec![0.0f64; n_blocks];
        for h in 0..params.num_heads {
            let g = h / group;
            let s: Vec<f64> = (0..tokens).map(|t| {
                let key = &k[(t * kv_heads + g) * head_dim..][..head_dim];
                q[h * head_dim..][..head_dim].iter().zip(key).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum::<f64>() * f64::from(params.scale)
            }).collect();
            let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
            for (t, x) in s.iter().enumerate() {
                want[t / 16] += (x - m).exp() / z / params.num_heads as f64;
            }
        }
        let want: Vec<f32> = want.iter().map(|&x| x as f32).collect();
        prop_assert_eq!(got.len(), n_blocks);
        let total: f32 = got.iter().sum();
        prop_assert!((total - 1.0).abs() < 1e-4, "{kind}: masses sum to {total}");
        let e = rel_l2(&got, &want);
        prop_assert!(e <= 1e-3, "{kind}: mass vs dense weights {e}: {got:?} vs {want:?}");
        prop_assert!(rel_l2(&scalar, &got) <= 1e-4, "{kind}: scalar vs active ISA");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    /// The fused decode pass: the output is the plain kernels' bit for bit and the masses,
    /// from the kernels' own tile states, are the second pass's up to rounding — on every SIMD
    /// tier this CPU runs, on one thread and split over two (past 2,048 keys), with blocks of
    /// 16 and 32 keys (tiles of 16) and of 8 (tiles straddle them: a second pass).
    #[test]
    fn attend_with_mass_gives_attend_s_output_and_the_blocks_masses(
        codec_index in 0usize..ALL_CODECS.len(),
        group in 1usize..4,
        tokens in prop::sample::select(vec![1usize, 17, 300, 2100, 2600]),
        block_size in prop::sample::select(vec![8usize, 16, 32]),
        seed in any::<u64>(),
    ) {
        let kind = ALL_CODECS[codec_index];
        let (kv_heads, head_dim) = (2, 64);
        let shape = KvShape::with_block_size(2, kv_heads, head_dim, block_size).unwrap();
        let value = value_for(kind, usize::MAX);
        let n_blocks = tokens.div_ceil(block_size);
        let mut store = BlockStore::new(StoreConfig {
            codecs: LayerCodecs::streams(&shape, kind, value),
            ..StoreConfig::new(shape, kind, n_blocks as u32, 0)
        })
        .unwrap();
        let tags = engram_kvcore::BlockTags {
            tokens: engram_kvcore::TokenRange::new(0, block_size as u32),
            ..crate::common::tags(SourceLayer::Memories)
        };
        let ids = store.allocate(Tier::Hot, &vec![tags; n_blocks]).unwrap();
        crate::common::fill(&mut store, &ids, seed);
        let q: Vec<f32> = gauss(seed ^ 3).gaussian_vec(kv_heads * group * head_dim).iter().map(|x| 2.0 * x).collect();
        for isa in engram_kvcore::Isa::available() {
            for threads in [1, 2] {
                let params = AttentionParams::new(kv_heads * group, head_dim).with_threads(threads);
                let mut plain = vec![0.0f32; q.len()];
                store.attend_on(isa, 1, &ids, tokens, &q, &params, &mut plain).unwrap();
                let mut fused = vec![0.0f32; q.len()];
                let mass = store.attend_with_mass_on(isa, 1, &ids, tokens, &q, &params, &mut fused).unwrap();
                let second = store.attention_mass_on(isa, 1, &ids, tokens, &q, &params).unwrap();
                prop_assert_eq!(&fused, &plain, "{} {} threads {}: output", kind, isa, threads);
                let e = rel_l2(&mass, &second);
                prop_assert!(e <= 1e-5, "{kind} {isa} threads {threads}: masses {e}: {mass:?} vs {second:?}");
                let total: f32 = mass.iter().sum();
                prop_assert!((total - 1.0).abs() < 1e-4, "{kind}: masses sum to {total}");
            }
        }
        // A wrong output length is refused, not written past.
        let params = AttentionParams::new(kv_heads * group, head_dim);
        let mut short = vec![0.0f32; q.len() - 1];
        prop_assert!(store.attend_with_mass(1, &ids, tokens, &q, &params, &mut short).is_err());
    }
}
