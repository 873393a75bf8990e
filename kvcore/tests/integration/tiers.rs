//! Spill and warm move the same bytes between tiers.

use engram_kvcore::{
    BlockStore, CodecKind, KvShape, LayerCodecs, Rows, SourceLayer, StoreConfig, Tier,
};
use half::f16;
use proptest::prelude::*;

use crate::common::{
    ALL_CODECS, VALUE_CODECS, fill, filled, small_store, stream_store, tags, value_for,
};

proptest! {
    #![proptest_config(ProptestConfig::with_cases(16))]

    #[test]
    fn spill_warm_spill_is_byte_identical(
        codec_index in 0usize..ALL_CODECS.len(),
        // Keys and values in different codecs half of the time.
        value_index in 0usize..2 * VALUE_CODECS.len(),
        n in 1usize..12,
        // Occupy some slots first so the moved blocks land in scattered slots.
        holes in 0usize..6,
        seed in any::<u64>(),
    ) {
        let key = ALL_CODECS[codec_index];
        let value = value_for(key, value_index);
        let mut store = stream_store(key, value, 24, 24);
        let padding = filled(&mut store, holes, SourceLayer::Neurons, 1);
        let ids = filled(&mut store, n, SourceLayer::Memories, seed);
        store.release(&padding).unwrap();
        let cold_pad = store.allocate(Tier::Cold, &vec![tags(SourceLayer::Neurons); holes]).unwrap();
        let before: Vec<Vec<u8>> = ids.iter().map(|&id| store.block_bytes_of(id).unwrap()).collect();

        store.spill(&ids).unwrap();
        prop_assert!(ids.iter().all(|&id| store.metadata().get(id).unwrap().tier() == Tier::Cold));
        let in_cold: Vec<Vec<u8>> = ids.iter().map(|&id| store.block_bytes_of(id).unwrap()).collect();
        prop_assert_eq!(&in_cold, &before);

        store.release(&cold_pad).unwrap();
        store.warm(&ids).unwrap();
        let warmed: Vec<Vec<u8>> = ids.iter().map(|&id| store.block_bytes_of(id).unwrap()).collect();
        prop_assert_eq!(&warmed, &before);

        store.spill(&ids).unwrap();
        let again: Vec<Vec<u8>> = ids.iter().map(|&id| store.block_bytes_of(id).unwrap()).collect();
        prop_assert_eq!(&again, &before);
        prop_assert_eq!(store.free_blocks(Tier::Hot), 24);
    }
}

#[test]
fn blocks_listed_in_any_order_move_intact() {
    // Eviction lists victims by priority, not by slot; the store reorders the copies into runs.
    let mut store = small_store(CodecKind::TurboQuant { bits: 3 }, 8, 8);
    let ids = filled(&mut store, 6, SourceLayer::Memories, 4);
    let before: Vec<Vec<u8>> = ids
        .iter()
        .map(|&id| store.block_bytes_of(id).unwrap())
        .collect();
    let shuffled = [ids[3], ids[0], ids[5], ids[1], ids[4], ids[2]];
    store.spill(&shuffled).unwrap();
    store.warm(&[ids[4], ids[2], ids[0]]).unwrap();
    store.warm(&[ids[5], ids[1], ids[3]]).unwrap();
    for (id, want) in ids.iter().zip(&before) {
        assert_eq!(&store.block_bytes_of(*id).unwrap(), want);
    }
}

#[test]
fn mixed_codecs_per_layer_keep_their_own_widths() {
    let shape = KvShape::new(3, 2, 64).unwrap();
    let codecs = LayerCodecs::per_layer(
        &shape,
        vec![
            CodecKind::F16,
            CodecKind::TQ4,
            CodecKind::TurboQuant { bits: 2 },
        ],
    )
    .unwrap();
    let mut config = StoreConfig::new(shape, CodecKind::TQ4, 4, 4);
    config.codecs = codecs;
    let mut store = BlockStore::new(config).unwrap();
    // Per layer and stream pair: F16 128+0, TQ4 32+2, TQ2 16+2 bytes per row; 32 rows a block.
    assert_eq!(store.block_bytes(), 2 * 32 * (128 + 34 + 18));
    let ids = filled(&mut store, 2, SourceLayer::Identity, 3);
    let before = store.block_bytes_of(ids[1]).unwrap();
    store.spill(&ids).unwrap();
    store.warm(&ids).unwrap();
    assert_eq!(store.block_bytes_of(ids[1]).unwrap(), before);
    assert_eq!(store.key_codec(0).unwrap().kind(), CodecKind::F16);
    assert_eq!(
        store.value_codec(2).unwrap().kind(),
        CodecKind::TurboQuant { bits: 2 }
    );
}

#[test]
fn keys_and_values_keep_their_own_widths() {
    // Keys Q8 (64 + 2 bytes a row), values TQ4 (32 + 2); 2 layers × 2 heads × 16 positions.
    let mut store = stream_store(CodecKind::Q8, CodecKind::TQ4, 4, 4);
    assert_eq!(store.block_bytes(), 2 * 32 * (66 + 34));
    assert_eq!(store.codec_kinds().to_string(), "q8/tq4");
    assert!((store.codec_kinds().bits_per_element(64) - 6.25).abs() < 1e-12);
    let parts = store.block_parts();
    let width = |stream| {
        parts
            .iter()
            .find(|p| p.stream == stream && p.layer == 1)
            .unwrap()
            .shape[2]
    };
    assert_eq!(width(engram_kvcore::BlockStream::KCodes), 64);
    assert_eq!(width(engram_kvcore::BlockStream::VCodes), 32);
    // Each stream decodes with its own codec: keys within Q8's error, values within TQ4's.
    let shape = *store.shape();
    let ids = store
        .allocate(Tier::Hot, &[tags(SourceLayer::Identity)])
        .unwrap();
    let n = shape.block_size * shape.token_width();
    let mut g = crate::common::gauss(11);
    let (k, v) = (g.gaussian_vec(n), g.gaussian_vec(n));
    store
        .write(
            1,
            &ids,
            0,
            engram_kvcore::Rows::F32(&k),
            engram_kvcore::Rows::F32(&v),
        )
        .unwrap();
    let (mut k2, mut v2) = (vec![0.0f32; n], vec![0.0f32; n]);
    store.read(1, &ids, 0, &mut k2, &mut v2).unwrap();
    let (ek, ev) = (
        crate::common::rel_l2(&k2, &k),
        crate::common::rel_l2(&v2, &v),
    );
    assert!(ek < 0.01, "q8 keys: {ek}");
    assert!(ev > 0.05 && ev < 0.15, "tq4 values: {ev}");
    let before = store.block_bytes_of(ids[0]).unwrap();
    store.spill(&ids).unwrap();
    store.warm(&ids).unwrap();
    assert_eq!(store.block_bytes_of(ids[0]).unwrap(), before);
}

#[test]
fn remove_drops_bytes_and_readmit_gives_a_fresh_hot_slot() {
    let mut store = small_store(CodecKind::TQ4, 4, 4);
    let ids = filled(&mut store, 2, SourceLayer::UserTurn, 5);
    store.remove(&ids[..1]).unwrap();
    let meta = store.metadata().get(ids[0]).unwrap();
    assert_eq!(meta.tier(), Tier::Recompute);
    assert_eq!(store.free_blocks(Tier::Hot), 3);
    assert!(store.block_bytes_of(ids[0]).is_err());
    store.readmit(&ids[..1]).unwrap();
    assert_eq!(store.metadata().get(ids[0]).unwrap().tier(), Tier::Hot);
    fill(&mut store, &ids[..1], 6);
    assert_eq!(store.free_blocks(Tier::Hot), 2);
}

#[test]
fn tier_bytes_follow_the_5d_layout() {
    // [layer, block, kv_head, pos, packed]: layer 1 of slot 0 starts after all of layer 0.
    let mut store = small_store(CodecKind::TQ4, 3, 1);
    let ids = filled(&mut store, 1, SourceLayer::Axioms, 8);
    let per_block_layer = 16 * 2 * 32;
    let hot = store.hot();
    let host = engram_kvcore::HotStorage::host(hot).unwrap();
    assert_eq!(host.k_codes().len(), 2 * 3 * per_block_layer);
    assert_eq!(host.k_norms().len(), 2 * 3 * 16 * 2 * 2);
    let block = store.block_bytes_of(ids[0]).unwrap();
    assert_eq!(
        &block[..per_block_layer],
        &host.k_codes()[..per_block_layer]
    );
    let layer1 = 3 * per_block_layer;
    assert_eq!(
        &block[per_block_layer..2 * per_block_layer],
        &host.k_codes()[layer1..layer1 + per_block_layer]
    );
}

#[test]
fn blocks_are_head_major_in_every_tier_and_in_block_bytes() {
    // F16 rows are their values' bits: row (pos, head) of layer 0 holds 16 · head + pos + 1 in
    // every element, so the bytes say where each row went.
    let mut store = small_store(CodecKind::F16, 2, 2);
    let ids = store
        .allocate(Tier::Hot, &[tags(SourceLayer::Axioms)])
        .unwrap();
    let shape = *store.shape();
    let (d, heads, bs) = (shape.head_dim, shape.kv_heads, shape.block_size);
    let rows: Vec<f32> = (0..bs)
        .flat_map(|pos| (0..heads).flat_map(move |h| vec![(16 * h + pos + 1) as f32; d]))
        .collect();
    for layer in 0..shape.layers {
        store
            .write(layer, &ids, 0, Rows::F32(&rows), Rows::F32(&rows))
            .unwrap();
    }
    assert_eq!(engram_kvcore::LAYOUT.split(':').next(), Some("kv-layout/2"));
    let value_at = |bytes: &[u8], row: usize| {
        f16::from_le_bytes([bytes[row * 2 * d], bytes[row * 2 * d + 1]]).to_f32()
    };
    let check = |bytes: &[u8], what: &str| {
        for h in 0..heads {
            for pos in 0..bs {
                let row = shape.row_in_block(pos, h);
                assert_eq!(row, h * bs + pos, "{what}: a head's rows are contiguous");
                assert_eq!(
                    value_at(bytes, row),
                    (16 * h + pos + 1) as f32,
                    "{what}: row of position {pos}, head {h}"
                );
            }
        }
    };
    let host = engram_kvcore::HotStorage::host(store.hot()).unwrap();
    check(host.k_codes(), "hot tier");
    check(&store.block_bytes_of(ids[0]).unwrap(), "block bytes");
    let parts = store.block_parts();
    assert_eq!(parts[0].shape, [heads, bs, 2 * d]);
    store.spill(&ids).unwrap();
    check(&store.block_bytes_of(ids[0]).unwrap(), "cold tier");
    // Reading back gives token-major rows again, [tokens, kv_heads, head_dim].
    store.warm(&ids).unwrap();
    let (mut k, mut v) = (vec![0.0f32; rows.len()], vec![0.0f32; rows.len()]);
    store.read(0, &ids, 0, &mut k, &mut v).unwrap();
    assert_eq!(k, rows);
    assert_eq!(v, rows);
}

#[test]
fn tier_moves_are_stamped_with_the_epoch_and_counted() {
    let mut store = small_store(CodecKind::TQ4, 8, 8);
    store.set_epoch(3);
    store.set_move_window(5);
    let ids = filled(&mut store, 4, SourceLayer::Memories, 9);
    let meta = |s: &BlockStore, id| s.metadata().get(id).unwrap().clone();
    // Allocation is stamped, not counted.
    assert_eq!(meta(&store, ids[0]).moved_epoch(), 3);
    assert_eq!(meta(&store, ids[0]).moves(), 0);
    assert_eq!(store.metadata().tier_moves(), 0);

    store.set_epoch(7);
    store.spill(&ids[..2]).unwrap();
    assert_eq!(meta(&store, ids[0]).moved_epoch(), 7);
    assert_eq!(meta(&store, ids[0]).moves(), 1);
    assert_eq!(
        meta(&store, ids[2]).moved_epoch(),
        3,
        "an unmoved block keeps its stamp"
    );
    assert_eq!(store.metadata().tier_moves(), 2);

    store.set_epoch(9);
    store.warm(&ids[..1]).unwrap();
    store.remove(&ids[2..3]).unwrap();
    store.readmit(&ids[2..3]).unwrap();
    assert_eq!(meta(&store, ids[0]).moves(), 2);
    assert_eq!(meta(&store, ids[0]).moved_epoch(), 9);
    assert_eq!(meta(&store, ids[2]).moves(), 2);
    assert_eq!(meta(&store, ids[1]).moved_epoch(), 7);
    assert_eq!(store.metadata().tier_moves(), 5);
    // A block's second move within 5 epochs of its first is a quick one (the warm 2 epochs
    // after the spill, the readmission right after the removal); first moves never are.
    assert_eq!(store.metadata().quick_moves(), 2);
    store.set_epoch(20);
    store.spill(&ids[..1]).unwrap();
    assert_eq!(
        store.metadata().quick_moves(),
        2,
        "11 epochs after its last move"
    );
    // Freed blocks' moves stay in the total.
    store.release(&ids).unwrap();
    assert_eq!(store.metadata().tier_moves(), 6);
}
