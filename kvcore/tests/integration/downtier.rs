//! Down-tiering: cold blocks re-encoded into a reduced pool instead of dropped, and back.

use engram_kvcore::{
    BlockId, BlockStore, BlockStream, CodecKind, KvError, LayerCodecs, Precision, SourceLayer, Tier,
};

use crate::common::{filled, rel_l2, stream_store};

const TQ3: CodecKind = CodecKind::TurboQuant { bits: 3 };
const TQ5: CodecKind = CodecKind::TurboQuant { bits: 5 };
const TQ6: CodecKind = CodecKind::TurboQuant { bits: 6 };

/// Keys TQ6 / values TQ5, with a reduced pool of `pool` slots in `keys`/`values`.
fn store(hot: u32, cold: u32, keys: CodecKind, values: CodecKind, pool: u32) -> BlockStore {
    let s = stream_store(TQ6, TQ5, hot, cold);
    let reduced = LayerCodecs::streams(s.shape(), keys, values);
    s.with_reduced_pool(reduced, pool).unwrap()
}

/// Every layer's K and V rows of `ids`, decoded.
fn rows(store: &BlockStore, ids: &[BlockId]) -> Vec<f32> {
    let shape = *store.shape();
    let n = ids.len() * shape.block_size * shape.token_width();
    let mut out = Vec::new();
    for layer in 0..shape.layers {
        let (mut k, mut v) = (vec![0.0; n], vec![0.0; n]);
        store.read(layer, ids, 0, &mut k, &mut v).unwrap();
        out.extend(k);
        out.extend(v);
    }
    out
}

fn precision(store: &BlockStore, id: BlockId) -> (Tier, Precision) {
    let m = store.metadata().get(id).unwrap();
    (m.tier(), m.precision())
}

#[test]
fn reduced_blocks_free_cold_slots_and_warm_back_into_the_layer_codec() {
    let mut s = store(8, 4, TQ3, TQ3, 4);
    assert_eq!((s.reduced_capacity(), s.free_reduced()), (4, 4));
    assert!(s.reduced_block_bytes().unwrap() < s.block_bytes());
    let ids = filled(&mut s, 4, SourceLayer::Memories, 11);
    let exact = rows(&s, &ids);
    let bytes: Vec<Vec<u8>> = ids
        .iter()
        .map(|&id| s.block_bytes_of(id).unwrap())
        .collect();
    s.spill(&ids).unwrap();
    assert_eq!(s.free_blocks(Tier::Cold), 0);

    s.reduce(&ids[..2]).unwrap();
    assert_eq!(s.free_blocks(Tier::Cold), 2);
    assert_eq!(s.free_reduced(), 2);
    for &id in &ids[..2] {
        assert_eq!(precision(&s, id), (Tier::Cold, Precision::Reduced));
    }
    for &id in &ids[2..] {
        assert_eq!(precision(&s, id), (Tier::Cold, Precision::Full));
    }
    // Reduced rows decode with the narrower codec's error: worse than the layer's, not garbage.
    let reduced = rows(&s, &ids[..2]);
    let full_err = rel_l2(&rows(&s, &ids[2..]), &rows_of_exact(&exact, 2, 4, &s));
    let reduced_err = rel_l2(&reduced, &rows_of_exact(&exact, 0, 2, &s));
    assert!(
        reduced_err > 1.5 * full_err && reduced_err < 0.3,
        "reduced {reduced_err} full {full_err}"
    );
    // What the shadow would checksum for a reduced block is what warming makes of it.
    let expanded: Vec<Vec<u8>> = ids[..2]
        .iter()
        .map(|&id| s.block_bytes_of(id).unwrap())
        .collect();
    assert_eq!(expanded[0].len(), s.block_bytes());

    s.warm(&ids).unwrap();
    assert_eq!(s.free_reduced(), 4);
    assert_eq!(s.free_blocks(Tier::Cold), 4);
    for &id in &ids[..2] {
        assert_eq!(precision(&s, id), (Tier::Hot, Precision::Restored));
    }
    for (i, &id) in ids.iter().enumerate() {
        let now = s.block_bytes_of(id).unwrap();
        if i < 2 {
            assert_eq!(now, expanded[i], "restored block {i}");
        } else {
            assert_eq!(now, bytes[i], "untouched block {i} moved byte for byte");
        }
    }
    // Back in TQ6/TQ5 the restored rows stay close to the reduced ones (one more rounding).
    let restored = rows(&s, &ids[..2]);
    assert!(rel_l2(&restored, &reduced) < 0.1);

    // The mark stays through a spill; dropping the bytes clears it.
    s.spill(&ids[..1]).unwrap();
    assert_eq!(precision(&s, ids[0]), (Tier::Cold, Precision::Restored));
    s.remove(&ids[..1]).unwrap();
    assert_eq!(precision(&s, ids[0]), (Tier::Recompute, Precision::Full));
}

/// The exact rows of blocks `from..to` out of `rows(store, all 4)`'s layout.
fn rows_of_exact(exact: &[f32], from: usize, to: usize, s: &BlockStore) -> Vec<f32> {
    let shape = *s.shape();
    let per_block = shape.block_size * shape.token_width();
    let all = 4 * per_block;
    let mut out = Vec::new();
    for plane in exact.chunks(all) {
        out.extend_from_slice(&plane[from * per_block..to * per_block]);
    }
    out
}

#[test]
fn a_stream_kept_at_its_codec_is_copied_not_rounded_again() {
    // Keys reduced to TQ3, values kept at TQ5: the value bytes survive reduce → warm intact.
    let mut s = store(4, 2, TQ3, TQ5, 2);
    let ids = filled(&mut s, 2, SourceLayer::Memories, 5);
    let before: Vec<Vec<u8>> = ids
        .iter()
        .map(|&id| s.block_bytes_of(id).unwrap())
        .collect();
    s.spill(&ids).unwrap();
    s.reduce(&ids).unwrap();
    s.warm(&ids).unwrap();
    let parts = s.block_parts();
    for (id, was) in ids.iter().zip(&before) {
        let now = s.block_bytes_of(*id).unwrap();
        for p in &parts {
            let (a, b) = (
                &was[p.offset..p.offset + p.len()],
                &now[p.offset..p.offset + p.len()],
            );
            match p.stream {
                BlockStream::VCodes | BlockStream::VNorms => assert_eq!(a, b, "{p:?}"),
                BlockStream::KCodes => assert_ne!(a, b, "{p:?}"),
                BlockStream::KNorms => {}
            }
        }
    }
}

#[test]
fn down_tiering_refuses_what_it_cannot_do_and_changes_nothing() {
    let mut s = store(6, 4, TQ3, TQ3, 1);
    let ids = filled(&mut s, 3, SourceLayer::Memories, 3);
    // Hot blocks are not reduced.
    assert!(matches!(
        s.reduce(&ids[..1]),
        Err(KvError::WrongTier { .. })
    ));
    s.spill(&ids).unwrap();
    // The pool holds one.
    let before = s.try_clone().unwrap();
    assert!(matches!(
        s.reduce(&ids[..2]),
        Err(KvError::TierExhausted { .. })
    ));
    assert_eq!(s, before);
    s.reduce(&ids[..1]).unwrap();
    // Not twice; not written over; not restored from shadow bytes while reduced.
    let before = s.try_clone().unwrap();
    assert!(matches!(s.reduce(&ids[..1]), Err(KvError::Reduced { .. })));
    let bytes = vec![0u8; s.block_bytes()];
    assert!(matches!(
        s.write_block_bytes(ids[0], &bytes),
        Err(KvError::Reduced { .. })
    ));
    assert_eq!(s, before);
    // Not enough hot room for all: nothing moves.
    let mut tight = s.try_clone().unwrap();
    let fill = filled(&mut tight, 4, SourceLayer::Neurons, 9);
    let before = tight.try_clone().unwrap();
    assert!(matches!(
        tight.warm(&ids),
        Err(KvError::TierExhausted { .. })
    ));
    assert_eq!(tight, before);
    tight.release(&fill).unwrap();
    // Releasing a reduced block frees its pool slot.
    s.release(&ids[..1]).unwrap();
    assert_eq!(s.free_reduced(), 1);
    // Without a pool, or with one wider than the layer's codecs.
    let mut plain = stream_store(TQ6, TQ5, 2, 2);
    let one = filled(&mut plain, 1, SourceLayer::Memories, 1);
    plain.spill(&one).unwrap();
    assert!(matches!(plain.reduce(&one), Err(KvError::NoReducedPool)));
    let wider = LayerCodecs::streams(plain.shape(), CodecKind::Q8, TQ5);
    assert!(matches!(
        plain.with_reduced_pool(wider, 2),
        Err(KvError::InvalidConfig { .. })
    )); // One pool per store: a second would orphan the first one's blocks.
    let twice = store(2, 2, TQ3, TQ3, 1);
    let again = LayerCodecs::streams(twice.shape(), TQ3, TQ3);
    assert!(matches!(
        twice.with_reduced_pool(again, 1),
        Err(KvError::InvalidConfig { .. })
    ));
}
