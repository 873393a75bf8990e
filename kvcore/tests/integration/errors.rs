//! Every bad input returns a typed error and leaves the store exactly as it was.

use engram_kvcore::{
    BlockId, BlockStore, CodecKind, HotTierKind, KvError, KvShape, LayerCodecs, Rows, SourceLayer,
    StoreConfig, Tier, TokenRange,
};

use crate::common::{filled, small_store, tags};

/// Runs `f` on the store and checks that it failed with `want` and changed nothing.
fn rejects(
    store: &mut BlockStore,
    want: fn(&KvError) -> bool,
    f: impl FnOnce(&mut BlockStore) -> Result<(), KvError>,
) {
    let before = store.try_clone().unwrap();
    let err = f(store).expect_err("the call must fail");
    assert!(want(&err), "unexpected error {err:?}");
    assert_eq!(*store, before, "a failed call changed the store ({err})");
}

#[test]
fn bad_writes_change_nothing() {
    let mut store = small_store(CodecKind::TQ4, 4, 2);
    let ids = filled(&mut store, 2, SourceLayer::Memories, 1);
    let width = store.shape().token_width();
    let rows = vec![0.25f32; 3 * width];
    rejects(
        &mut store,
        |e| matches!(e, KvError::RowWidth { .. }),
        |s| {
            s.write(
                0,
                &ids,
                0,
                Rows::F32(&rows[..width + 1]),
                Rows::F32(&rows[..width + 1]),
            )
        },
    );
    rejects(
        &mut store,
        |e| matches!(e, KvError::RowWidth { .. }),
        |s| s.write(0, &ids, 0, Rows::F32(&rows), Rows::F32(&rows[..width])),
    );
    rejects(
        &mut store,
        |e| matches!(e, KvError::UnknownLayer { layer: 2, .. }),
        |s| s.write(2, &ids, 0, Rows::F32(&rows), Rows::F32(&rows)),
    );
    rejects(
        &mut store,
        |e| matches!(e, KvError::TokenRange { end: 33, .. }),
        |s| s.write(0, &ids, 30, Rows::F32(&rows), Rows::F32(&rows)),
    );
    // A NaN in the last V row: not even the first K row may be written.
    let mut bad = rows.clone();
    *bad.last_mut().unwrap() = f32::NAN;
    rejects(
        &mut store,
        |e| matches!(e, KvError::NotEncodable { .. }),
        |s| s.write(0, &ids, 0, Rows::F32(&rows), Rows::F32(&bad)),
    );
    // The three rows from the last position of the first block on land in both blocks.
    let edge = store.shape().block_size - 1;
    rejects(
        &mut store,
        |e| matches!(e, KvError::UnknownBlock { .. }),
        |s| {
            s.write(
                0,
                &[ids[0], unknown()],
                edge,
                Rows::F32(&rows),
                Rows::F32(&rows),
            )
        },
    );
    rejects(
        &mut store,
        |e| matches!(e, KvError::DuplicateBlock { .. }),
        |s| {
            s.write(
                0,
                &[ids[0], ids[0]],
                edge,
                Rows::F32(&rows),
                Rows::F32(&rows),
            )
        },
    );
    // A write looks only at the blocks its rows land in: a bad block later in the table is
    // not its business (a decode step writes one row of a long table on every layer).
    store
        .write(
            0,
            &[ids[0], unknown()],
            0,
            Rows::F32(&rows),
            Rows::F32(&rows),
        )
        .unwrap();
}

/// An id no small test store has handed out: ids are issued in order, so the 64th id of another
/// store is beyond anything these tests allocate.
fn unknown() -> BlockId {
    let mut other = small_store(CodecKind::TQ4, 64, 0);
    *other
        .allocate(Tier::Hot, &[tags(SourceLayer::Affect); 64])
        .unwrap()
        .last()
        .unwrap()
}

#[test]
fn bad_tier_moves_change_nothing() {
    let mut store = small_store(CodecKind::TQ4, 4, 1);
    let ids = filled(&mut store, 3, SourceLayer::Neurons, 2);
    // Cold has room for one block, not two.
    rejects(
        &mut store,
        |e| {
            matches!(
                e,
                KvError::TierExhausted {
                    tier: Tier::Cold,
                    requested: 2,
                    available: 1
                }
            )
        },
        |s| s.spill(&ids[..2]),
    );
    rejects(
        &mut store,
        |e| {
            matches!(
                e,
                KvError::WrongTier {
                    expected: Tier::Cold,
                    actual: Tier::Hot,
                    ..
                }
            )
        },
        |s| s.warm(&ids[..1]),
    );
    rejects(
        &mut store,
        |e| matches!(e, KvError::DuplicateBlock { .. }),
        |s| s.spill(&[ids[0], ids[0]]),
    );
    store.spill(&ids[..1]).unwrap();
    rejects(
        &mut store,
        |e| {
            matches!(
                e,
                KvError::WrongTier {
                    expected: Tier::Hot,
                    actual: Tier::Cold,
                    ..
                }
            )
        },
        |s| s.spill(&ids[..1]),
    );
    // Fill hot, then warming has nowhere to go.
    filled(&mut store, 2, SourceLayer::Neurons, 3);
    rejects(
        &mut store,
        |e| {
            matches!(
                e,
                KvError::TierExhausted {
                    tier: Tier::Hot,
                    ..
                }
            )
        },
        |s| s.warm(&ids[..1]),
    );
    store.remove(&ids[1..2]).unwrap();
    rejects(
        &mut store,
        |e| {
            matches!(
                e,
                KvError::WrongTier {
                    actual: Tier::Recompute,
                    ..
                }
            )
        },
        |s| s.remove(&ids[1..2]),
    );
    rejects(
        &mut store,
        |e| {
            matches!(
                e,
                KvError::WrongTier {
                    actual: Tier::Recompute,
                    ..
                }
            )
        },
        |s| s.spill(&ids[1..2]),
    );
    store.release(&ids[2..3]).unwrap();
    rejects(
        &mut store,
        |e| matches!(e, KvError::AlreadyFreed { .. }),
        |s| s.spill(&ids[2..3]),
    );
    rejects(
        &mut store,
        |e| matches!(e, KvError::AlreadyFreed { .. }),
        |s| s.release(&ids[2..3]).map(drop),
    );
    rejects(
        &mut store,
        |e| matches!(e, KvError::AlreadyFreed { .. }),
        |s| s.touch(&ids[2..3]),
    );
}

#[test]
fn bad_allocations_change_nothing() {
    let mut store = small_store(CodecKind::TQ4, 2, 0);
    rejects(
        &mut store,
        |e| {
            matches!(
                e,
                KvError::TierExhausted {
                    tier: Tier::Hot,
                    requested: 3,
                    available: 2
                }
            )
        },
        |s| {
            s.allocate(Tier::Hot, &[tags(SourceLayer::Axioms); 3])
                .map(drop)
        },
    );
    rejects(
        &mut store,
        |e| {
            matches!(
                e,
                KvError::TierExhausted {
                    tier: Tier::Cold,
                    ..
                }
            )
        },
        |s| {
            s.allocate(Tier::Cold, &[tags(SourceLayer::Axioms)])
                .map(drop)
        },
    );
    for importance in [-0.1, 1.1, f32::NAN] {
        let mut t = tags(SourceLayer::Axioms);
        t.importance = importance;
        rejects(
            &mut store,
            |e| matches!(e, KvError::InvalidImportance { .. }),
            |s| s.allocate(Tier::Hot, &[t]).map(drop),
        );
    }
    let mut t = tags(SourceLayer::Axioms);
    t.tokens = TokenRange::new(0, 17);
    rejects(
        &mut store,
        |e| matches!(e, KvError::TokenRange { .. }),
        |s| s.allocate(Tier::Hot, &[t]).map(drop),
    );
    let id = store
        .allocate(Tier::Hot, &[tags(SourceLayer::Axioms)])
        .unwrap()[0];
    rejects(
        &mut store,
        |e| matches!(e, KvError::InvalidImportance { .. }),
        |s| s.set_importance(id, 2.0),
    );
    store.set_importance(id, 0.9).unwrap();
    assert_eq!(store.metadata().get(id).unwrap().importance(), 0.9);
}

#[test]
fn bad_configurations_are_typed_errors() {
    assert!(matches!(
        KvShape::new(0, 3, 64),
        Err(KvError::InvalidConfig {
            field: "layers",
            ..
        })
    ));
    assert!(matches!(
        KvShape::new(30, 3, 60),
        Err(KvError::InvalidConfig {
            field: "head_dim",
            ..
        })
    ));
    assert!(matches!(
        KvShape::with_block_size(30, 3, 64, 0),
        Err(KvError::InvalidConfig {
            field: "block_size",
            ..
        })
    ));
    let shape = KvShape::SMOLLM2_135M;
    // The outlier split is a key codec: a store whose values take it is refused.
    let split = CodecKind::TurboQuantSplit {
        bits: 6,
        outliers: 1,
    };
    assert!(matches!(
        BlockStore::new(StoreConfig {
            codecs: LayerCodecs::streams(&shape, CodecKind::TQ4, split),
            ..StoreConfig::new(shape, CodecKind::TQ4, 4, 4)
        }),
        Err(KvError::InvalidConfig {
            field: "value_codec",
            ..
        })
    ));
    assert!(
        BlockStore::new(StoreConfig {
            codecs: LayerCodecs::streams(&shape, split, CodecKind::TQ4),
            ..StoreConfig::new(shape, CodecKind::TQ4, 4, 4)
        })
        .is_ok()
    );
    assert_eq!(
        LayerCodecs::per_layer(&shape, vec![CodecKind::TQ4; 3]),
        Err(KvError::CodecCount {
            expected: 30,
            got: 3
        })
    );
    assert_eq!(
        BlockStore::new(StoreConfig::new(
            shape,
            CodecKind::TurboQuant { bits: 7 },
            4,
            4
        )),
        Err(KvError::UnsupportedBits { bits: 7 })
    );
    assert_eq!(
        LayerCodecs::per_stream(&shape, vec![CodecKind::Q8; 30], vec![CodecKind::TQ4; 29]),
        Err(KvError::CodecCount {
            expected: 30,
            got: 29
        })
    );
    let mut cuda = StoreConfig::new(shape, CodecKind::TQ4, 4, 4);
    cuda.hot_kind = HotTierKind::Cuda { device: 0 };
    assert_eq!(BlockStore::new(cuda), Err(KvError::CudaNotCompiled));
}
