//! Staged spills: the copy goes ahead, the block stays hot, the spill takes the copy.

use engram_kvcore::{BlockId, BlockStore, CodecKind, KvError, SourceLayer, StageStats, Tier};

use crate::common::{fill, filled, small_store, tags};

fn bytes(store: &BlockStore, ids: &[BlockId]) -> Vec<Vec<u8>> {
    ids.iter()
        .map(|&id| store.block_bytes_of(id).unwrap())
        .collect()
}

fn tier(store: &BlockStore, id: BlockId) -> Tier {
    store.metadata().get(id).unwrap().tier()
}

#[test]
fn a_staged_block_stays_hot_and_its_spill_takes_the_copy() {
    let mut store = small_store(CodecKind::TQ4, 8, 8);
    let ids = filled(&mut store, 4, SourceLayer::Memories, 1);
    let before = bytes(&store, &ids);
    let moves = store.metadata().tier_moves();

    assert_eq!(store.stage(&ids[..3]).unwrap(), ids[..3].to_vec());
    // Staging is no tier move: the blocks stay hot, in their slots.
    assert!(ids.iter().all(|&id| tier(&store, id) == Tier::Hot));
    assert!(ids[..3].iter().all(|&id| store.is_staged(id)));
    assert!(!store.is_staged(ids[3]));
    assert_eq!(store.metadata().tier_moves(), moves);
    assert_eq!(store.free_blocks(Tier::Hot), 4);
    // A copy's slot counts as free room in the cold tier.
    assert_eq!(store.free_blocks(Tier::Cold), 8);
    // Staging again skips what is staged.
    assert_eq!(store.stage(&ids).unwrap(), vec![ids[3]]);

    store.spill(&[ids[2], ids[0], ids[3], ids[1]]).unwrap();
    assert!(ids.iter().all(|&id| tier(&store, id) == Tier::Cold));
    assert_eq!(bytes(&store, &ids), before);
    assert_eq!(
        store.stage_stats(),
        StageStats {
            staged: 0,
            used: 4,
            dropped: 0
        }
    );
    assert_eq!(store.free_blocks(Tier::Hot), 8);
    assert_eq!(store.free_blocks(Tier::Cold), 4);
    // They warm back intact.
    store.warm(&ids).unwrap();
    assert_eq!(bytes(&store, &ids), before);
}

#[test]
fn a_spill_of_staged_and_unstaged_blocks_moves_both_intact() {
    let mut store = small_store(CodecKind::TurboQuant { bits: 3 }, 8, 8);
    let ids = filled(&mut store, 6, SourceLayer::Memories, 2);
    let before = bytes(&store, &ids);
    store.stage(&[ids[4], ids[1]]).unwrap();
    store.spill(&ids).unwrap();
    assert_eq!(bytes(&store, &ids), before);
    assert_eq!(store.stage_stats().used, 2);
    assert_eq!(store.free_blocks(Tier::Cold), 2);
}

#[test]
fn a_write_into_a_staged_block_drops_its_copy() {
    let mut store = small_store(CodecKind::TQ4, 8, 8);
    let ids = filled(&mut store, 2, SourceLayer::Memories, 3);
    store.stage(&ids).unwrap();
    // New bytes in the first block: its copy holds the old ones.
    fill(&mut store, &ids[..1], 99);
    let after = bytes(&store, &ids);
    assert!(!store.is_staged(ids[0]));
    assert!(store.is_staged(ids[1]));
    assert_eq!(store.stage_stats().dropped, 1);
    store.spill(&ids).unwrap();
    // The spill copied the new bytes, not the stale copy.
    assert_eq!(bytes(&store, &ids), after);
    assert_eq!(store.stage_stats().used, 1);
}

#[test]
fn a_copy_into_a_staged_block_drops_its_copy() {
    let mut store = small_store(CodecKind::TQ4, 8, 8);
    let src = filled(&mut store, 1, SourceLayer::Memories, 4);
    let dst = filled(&mut store, 1, SourceLayer::Memories, 5);
    store.stage(&dst).unwrap();
    store.copy_tokens(&src, 0, &dst, 0, 16, 0).unwrap();
    assert!(!store.is_staged(dst[0]));
    store.spill(&dst).unwrap();
    assert_eq!(bytes(&store, &dst), bytes(&store, &src));
}

#[test]
fn copies_give_way_to_cold_blocks_oldest_first() {
    let mut store = small_store(CodecKind::TQ4, 8, 4);
    let ids = filled(&mut store, 4, SourceLayer::Memories, 6);
    store.stage(&ids[..2]).unwrap();
    store.stage(&ids[2..]).unwrap();
    assert_eq!(store.free_blocks(Tier::Cold), 4);
    // Two cold blocks want room: the two oldest copies go.
    let cold = store
        .allocate(
            Tier::Cold,
            &[tags(SourceLayer::Neurons), tags(SourceLayer::Neurons)],
        )
        .unwrap();
    assert_eq!(cold.len(), 2);
    assert!(!store.is_staged(ids[0]) && !store.is_staged(ids[1]));
    assert!(store.is_staged(ids[2]) && store.is_staged(ids[3]));
    assert_eq!(store.stage_stats().dropped, 2);
    assert_eq!(store.free_blocks(Tier::Cold), 2);
    // Spilling an unstaged block takes the next copy's slot; the staged one keeps its own.
    let before = bytes(&store, &ids);
    store.spill(&[ids[0], ids[3]]).unwrap();
    assert_eq!(bytes(&store, &ids), before);
    assert!(!store.is_staged(ids[2]));
    assert_eq!(store.free_blocks(Tier::Cold), 0);
    // Nothing left to give way: a third cold block finds no room, and nothing changed.
    let snapshot = store.try_clone().unwrap();
    assert!(matches!(
        store.allocate(Tier::Cold, &[tags(SourceLayer::Neurons)]),
        Err(KvError::TierExhausted { .. })
    ));
    assert_eq!(store, snapshot);
}

#[test]
fn staging_takes_only_truly_free_cold_slots() {
    let mut store = small_store(CodecKind::TQ4, 8, 4);
    store
        .allocate(
            Tier::Cold,
            &[tags(SourceLayer::Neurons), tags(SourceLayer::Neurons)],
        )
        .unwrap();
    let ids = filled(&mut store, 4, SourceLayer::Memories, 7);
    assert_eq!(store.stage(&ids[..2]).unwrap(), ids[..2].to_vec());
    // No free slot left: staging drops no copy for another.
    assert_eq!(store.stage(&ids[2..]).unwrap(), Vec::<BlockId>::new());
    assert_eq!(store.stage_stats().dropped, 0);
}

#[test]
fn release_and_removal_free_the_copy() {
    let mut store = small_store(CodecKind::TQ4, 8, 4);
    let ids = filled(&mut store, 2, SourceLayer::Memories, 8);
    store.stage(&ids).unwrap();
    store.release(&ids[..1]).unwrap();
    store.remove(&ids[1..]).unwrap();
    assert_eq!(
        store.stage_stats(),
        StageStats {
            staged: 0,
            used: 0,
            dropped: 2
        }
    );
    // Every cold slot truly free again: four cold blocks fit.
    store
        .allocate(Tier::Cold, &[tags(SourceLayer::Neurons); 4])
        .unwrap();
}

#[test]
fn staging_a_block_that_is_not_hot_changes_nothing() {
    let mut store = small_store(CodecKind::TQ4, 8, 4);
    let ids = filled(&mut store, 2, SourceLayer::Memories, 9);
    store.spill(&ids[1..]).unwrap();
    let snapshot = store.try_clone().unwrap();
    assert!(matches!(store.stage(&ids), Err(KvError::WrongTier { .. })));
    assert!(matches!(
        store.stage(&[ids[0], ids[0]]),
        Err(KvError::DuplicateBlock { .. })
    ));
    assert_eq!(store, snapshot);
}
