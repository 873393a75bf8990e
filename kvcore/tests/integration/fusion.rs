//! Block fusion: cold blocks of one tenant at the same positions share their row directions in
//! a fused pool and keep their own norms.

use engram_kvcore::{
    BlockId, BlockStore, BlockTags, CodecKind, KvError, Precision, Rows, SourceLayer, TenantId,
    Tier, TokenRange,
};

use crate::common::{fill, gauss, small_store, tags};

const TQ4: CodecKind = CodecKind::TurboQuant { bits: 4 };

fn fused_store(codec: CodecKind, pool: usize) -> BlockStore {
    small_store(codec, 8, 6).with_fused_pool(pool).unwrap()
}

fn block(store: &mut BlockStore, tags: BlockTags) -> BlockId {
    store.allocate(Tier::Hot, &[tags]).unwrap()[0]
}

/// One layer's decoded K and V rows of a block: `[block_size * token_width]` each.
fn layer_rows(store: &BlockStore, id: BlockId, layer: usize) -> (Vec<f32>, Vec<f32>) {
    let n = store.shape().block_size * store.shape().token_width();
    let (mut k, mut v) = (vec![0.0; n], vec![0.0; n]);
    store.read(layer, &[id], 0, &mut k, &mut v).unwrap();
    (k, v)
}

/// Writes `a`'s layer rows scaled row by row (same directions, other lengths) into `b`.
fn scaled_copy(store: &mut BlockStore, a: BlockId, b: BlockId, seed: u64) {
    let d = store.shape().head_dim;
    let mut g = gauss(seed);
    for layer in 0..store.shape().layers {
        let (mut k, mut v) = layer_rows(store, a, layer);
        for row in k.chunks_exact_mut(d).chain(v.chunks_exact_mut(d)) {
            let s = 0.5 + g.gaussian_vec(1)[0].abs();
            row.iter_mut().for_each(|x| *x *= s);
        }
        store
            .write(layer, &[b], 0, Rows::F32(&k), Rows::F32(&v))
            .unwrap();
    }
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x * y)).sum();
    let na: f64 = a.iter().map(|x| f64::from(x * x)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| f64::from(x * x)).sum::<f64>().sqrt();
    dot / (na * nb)
}

fn norm(a: &[f32]) -> f64 {
    a.iter().map(|x| f64::from(x * x)).sum::<f64>().sqrt()
}

fn state(s: &BlockStore, id: BlockId) -> (Tier, Precision, u16) {
    let m = s.metadata().get(id).unwrap();
    (m.tier(), m.precision(), m.fused_layers())
}

#[test]
fn fused_blocks_free_cold_slots_and_decode_as_the_groups_directions_times_their_norms() {
    let mut s = fused_store(TQ4, 1 << 20);
    let d = s.shape().head_dim;
    let (a, c) = (
        block(&mut s, tags(SourceLayer::Memories)),
        block(&mut s, tags(SourceLayer::Memories)),
    );
    fill(&mut s, &[a], 3);
    fill(&mut s, &[c], 4);
    let a_bytes = s.block_bytes_of(a).unwrap();
    let c_layer1 = layer_rows(&s, c, 1);
    let c_layer0 = layer_rows(&s, c, 0);
    let a_layer0 = layer_rows(&s, a, 0);
    s.spill(&[a, c]).unwrap();
    let free = s.free_blocks(Tier::Cold);

    // C shares A's directions in layer 0 only; A founds the group.
    assert_eq!(s.fuse(c, a, &[true, false]).unwrap(), 2);
    assert_eq!(s.free_blocks(Tier::Cold), free + 2);
    assert_eq!(state(&s, a), (Tier::Cold, Precision::Fused, 0));
    assert_eq!(state(&s, c), (Tier::Cold, Precision::Fused, 1));
    let stats = s.fused_stats().unwrap();
    assert_eq!((stats.blocks, stats.groups), (2, 1));
    assert_eq!(stats.unfused_bytes, 2 * s.block_bytes());
    assert!(stats.bytes < stats.unfused_bytes, "{stats:?}");
    // The founder's bytes are its own, bit for bit.
    assert_eq!(s.block_bytes_of(a).unwrap(), a_bytes);
    assert!(matches!(
        s.read(
            0,
            &[c],
            0,
            &mut vec![0.0; 16 * 128],
            &mut vec![0.0; 16 * 128]
        ),
        Err(KvError::Fused { .. })
    ));

    s.warm(&[a, c]).unwrap();
    assert_eq!(state(&s, a), (Tier::Hot, Precision::Full, 0));
    assert_eq!(state(&s, c), (Tier::Hot, Precision::Restored, 1));
    assert_eq!(s.block_bytes_of(a).unwrap(), a_bytes);
    // Layer 1: C's own codes; layer 0: A's directions at C's lengths.
    assert_eq!(layer_rows(&s, c, 1), c_layer1);
    let (k, v) = layer_rows(&s, c, 0);
    for (got, (dir, own)) in k.chunks_exact(d).chain(v.chunks_exact(d)).zip(
        a_layer0
            .0
            .chunks_exact(d)
            .chain(a_layer0.1.chunks_exact(d))
            .zip(c_layer0.0.chunks_exact(d).chain(c_layer0.1.chunks_exact(d))),
    ) {
        assert!(cosine(got, dir) > 0.99999, "{}", cosine(got, dir));
        let ratio = norm(got) / norm(own);
        assert!((0.9..1.1).contains(&ratio), "{ratio}");
    }
    let stats = s.fused_stats().unwrap();
    assert_eq!((stats.blocks, stats.groups, stats.bytes), (0, 0, 0));
}

#[test]
fn a_group_outlives_its_founder_and_a_member_joins_through_a_fused_partner() {
    let mut s = fused_store(TQ4, 1 << 20);
    let ids: Vec<BlockId> = (0..3)
        .map(|_| block(&mut s, tags(SourceLayer::Memories)))
        .collect();
    fill(&mut s, &ids[..1], 5);
    scaled_copy(&mut s, ids[0], ids[1], 6);
    fill(&mut s, &ids[2..], 7);
    s.spill(&ids).unwrap();
    let before: Vec<Vec<u8>> = ids.iter().map(|&i| s.block_bytes_of(i).unwrap()).collect();

    // Same directions: the member's codes equal the founder's, so fusing changes nothing.
    let sim = s.fusion_similarity(ids[1], ids[0]).unwrap();
    assert!(
        sim.iter()
            .all(|l| l.is_some_and(|(k, v)| k > 0.9999 && v > 0.9999)),
        "{sim:?}"
    );
    let other = s.fusion_similarity(ids[2], ids[0]).unwrap();
    assert!(
        other
            .iter()
            .all(|l| l.is_some_and(|(k, v)| k < 0.5 && v < 0.5)),
        "{other:?}"
    );
    assert_eq!(s.fuse(ids[1], ids[0], &[true, true]).unwrap(), 2);
    // Joining through a fused partner shares the group's directions; frees one slot.
    assert_eq!(s.fuse(ids[2], ids[1], &[false, true]).unwrap(), 1);
    assert_eq!(s.fused_stats().unwrap().groups, 1);
    assert_eq!(s.block_bytes_of(ids[0]).unwrap(), before[0]);
    assert_eq!(s.block_bytes_of(ids[1]).unwrap(), before[1]);
    let member = s.block_bytes_of(ids[2]).unwrap();
    assert_ne!(member, before[2]);

    // The founder leaves; the members still decode as they did.
    assert_eq!(s.release(&ids[..1]).unwrap(), vec![ids[0]]);
    assert_eq!(s.block_bytes_of(ids[1]).unwrap(), before[1]);
    assert_eq!(s.block_bytes_of(ids[2]).unwrap(), member);
    assert_eq!(s.fused_stats().unwrap().groups, 1);
    // Dropping to recompute and releasing frees the entries and, with the last, the group.
    s.remove(&ids[1..2]).unwrap();
    assert_eq!(state(&s, ids[1]), (Tier::Recompute, Precision::Full, 0));
    s.release(&ids[2..]).unwrap();
    let stats = s.fused_stats().unwrap();
    assert_eq!((stats.blocks, stats.groups, stats.bytes), (0, 0, 0));
}

#[test]
fn fusion_refuses_other_tenants_positions_codecs_and_a_full_pool_changing_nothing() {
    let mut s = fused_store(TQ4, 1 << 20);
    let a = block(&mut s, tags(SourceLayer::Memories));
    let other_tenant = block(
        &mut s,
        BlockTags {
            tenant: TenantId(2),
            ..tags(SourceLayer::Memories)
        },
    );
    let elsewhere = block(
        &mut s,
        BlockTags {
            tokens: TokenRange::new(16, 32),
            ..tags(SourceLayer::Memories)
        },
    );
    let hot = block(&mut s, tags(SourceLayer::Memories));
    let b = block(&mut s, tags(SourceLayer::Memories));
    fill(&mut s, &[a, other_tenant, elsewhere, hot, b], 9);
    s.spill(&[a, other_tenant, elsewhere, b]).unwrap();
    let snapshot = s.try_clone().unwrap();
    let not = |r: Result<usize, KvError>| matches!(r, Err(KvError::NotFusable { .. }));
    assert!(not(s.fuse(other_tenant, a, &[true, true])));
    assert!(not(s.fuse(elsewhere, a, &[true, true])));
    assert!(not(s.fuse(a, a, &[true, true])));
    assert!(not(s.fuse(b, a, &[false, false])));
    assert!(not(s.fuse(b, a, &[true])));
    assert!(matches!(
        s.fuse(hot, a, &[true, true]),
        Err(KvError::WrongTier { .. })
    ));
    assert_eq!(s, snapshot);

    // A pool too small for the founder's codes.
    let mut tight = small_store(TQ4, 8, 6).with_fused_pool(64).unwrap();
    let ids = tight
        .allocate(Tier::Hot, &[tags(SourceLayer::Memories); 2])
        .unwrap();
    fill(&mut tight, &ids, 10);
    tight.spill(&ids).unwrap();
    let snapshot = tight.try_clone().unwrap();
    assert!(matches!(
        tight.fuse(ids[1], ids[0], &[true, true]),
        Err(KvError::FusedPoolFull { .. })
    ));
    assert_eq!(tight, snapshot);

    // Q8's scale is not a length: no layer fuses. No pool: nothing fuses.
    let mut q8 = fused_store(CodecKind::Q8, 1 << 20);
    let ids = q8
        .allocate(Tier::Hot, &[tags(SourceLayer::Memories); 2])
        .unwrap();
    fill(&mut q8, &ids, 11);
    q8.spill(&ids).unwrap();
    assert_eq!(q8.fusable_layers(), vec![false, false]);
    assert!(
        q8.fusion_similarity(ids[1], ids[0])
            .unwrap()
            .iter()
            .all(Option::is_none)
    );
    assert!(not(q8.fuse(ids[1], ids[0], &[true, false])));
    let mut plain = small_store(TQ4, 8, 6);
    let ids = plain
        .allocate(Tier::Hot, &[tags(SourceLayer::Memories); 2])
        .unwrap();
    plain.spill(&ids).unwrap();
    assert!(matches!(
        plain.fuse(ids[1], ids[0], &[true, true]),
        Err(KvError::NoFusedPool)
    ));

    // A fused block is neither re-fused, down-tiered, nor overwritten in place.
    s.fuse(b, a, &[true, false]).unwrap();
    assert!(matches!(
        s.fuse(b, a, &[true, true]),
        Err(KvError::Fused { .. })
    ));
    let len = s.block_bytes();
    assert!(matches!(
        s.write_block_bytes(b, &vec![0; len]),
        Err(KvError::Fused { .. })
    ));
}
