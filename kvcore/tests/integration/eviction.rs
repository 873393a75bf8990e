//! make_room evicts by semantic priority, never by recency alone.

use engram_kvcore::{
    BlockId, CodecKind, KvError, PinPolicy, PrefixPinManager, PriorityTable, SourceLayer, Tier,
};

use crate::common::{filled, small_store, tags};

#[test]
fn lowest_priority_goes_first_regardless_of_recency() {
    let mut store = small_store(CodecKind::TQ4, 5, 0);
    let sources = [
        SourceLayer::Axioms,
        SourceLayer::UserTurn,
        SourceLayer::Memories,
        SourceLayer::Rules,
        SourceLayer::Affect,
    ];
    let ids: Vec<_> = sources
        .iter()
        .map(|&s| filled(&mut store, 1, s, 1)[0])
        .collect();
    // The user turn is the most recently attended; it still goes first.
    store.touch(&[ids[1]]).unwrap();
    let order = store.eviction_order();
    assert_eq!(order, vec![ids[1], ids[4], ids[2], ids[3], ids[0]]);
    let ev = store.make_room(2).unwrap();
    assert_eq!(ev.removed, vec![ids[1], ids[4]]);
    assert!(ev.spilled.is_empty());
    assert_eq!(store.free_blocks(Tier::Hot), 2);
    assert_eq!(
        store.metadata().get(ids[1]).unwrap().tier(),
        Tier::Recompute
    );
    assert_eq!(store.metadata().get(ids[0]).unwrap().tier(), Tier::Hot);
}

#[test]
fn equal_priority_breaks_ties_by_last_attended_then_age() {
    let mut store = small_store(CodecKind::TQ4, 3, 0);
    let ids = filled(&mut store, 3, SourceLayer::UserTurn, 2);
    // Untouched: the oldest goes first.
    assert_eq!(store.eviction_order(), ids);
    // Attending the oldest makes it the last candidate.
    store.touch(&[ids[0]]).unwrap();
    assert_eq!(store.eviction_order(), vec![ids[1], ids[2], ids[0]]);
}

#[test]
fn cold_room_keeps_the_most_valuable_victims() {
    let mut store = small_store(CodecKind::TQ4, 3, 1);
    let turn = filled(&mut store, 1, SourceLayer::UserTurn, 1)[0];
    let memory = filled(&mut store, 1, SourceLayer::Memories, 2)[0];
    let axioms = filled(&mut store, 1, SourceLayer::Axioms, 3)[0];
    let memory_bytes = store.block_bytes_of(memory).unwrap();
    let ev = store.make_room(2).unwrap();
    assert_eq!(ev.spilled, vec![memory]);
    assert_eq!(ev.removed, vec![turn]);
    assert_eq!(ev.freed(), 2);
    assert_eq!(store.metadata().get(memory).unwrap().tier(), Tier::Cold);
    assert_eq!(store.block_bytes_of(memory).unwrap(), memory_bytes);
    assert_eq!(store.metadata().get(axioms).unwrap().tier(), Tier::Hot);
}

#[test]
fn pinned_blocks_are_touched_only_when_nothing_else_is_left() {
    let mut store = small_store(CodecKind::TQ4, 8, 0);
    let pins = PrefixPinManager::new(PinPolicy::default()).unwrap();
    let prefix = filled(&mut store, 2, SourceLayer::Identity, 1);
    assert_eq!(pins.pin(&mut store, &prefix).unwrap().pinned, prefix);
    // Old, unattended, low-priority blocks — and the pinned ones are still spared.
    let rest = filled(&mut store, 6, SourceLayer::Axioms, 2);
    store.touch(&rest).unwrap();
    let ev = store.make_room(6).unwrap();
    assert_eq!(ev.removed.len(), 6);
    assert!(ev.removed.iter().all(|id| rest.contains(id)));
    assert!(
        prefix
            .iter()
            .all(|&id| store.metadata().get(id).unwrap().tier() == Tier::Hot)
    );
    // Only when every unpinned block is gone may a pinned one go.
    let ev = store.make_room(7).unwrap();
    assert_eq!(ev.removed, vec![prefix[0]]);
}

#[test]
fn the_priority_table_is_configurable() {
    let mut store = small_store(CodecKind::TQ4, 2, 0);
    let turn = filled(&mut store, 1, SourceLayer::UserTurn, 1)[0];
    let affect = filled(&mut store, 1, SourceLayer::Affect, 2)[0];
    assert_eq!(store.eviction_order(), vec![turn, affect]);
    let mut table = PriorityTable::default();
    table.set(SourceLayer::UserTurn, 60).unwrap();
    assert!(table.set(SourceLayer::UserTurn, 999).is_err());
    store.metadata_mut().set_priorities(table);
    assert_eq!(store.metadata().get(turn).unwrap().priority(), 60);
    assert_eq!(store.eviction_order(), vec![affect, turn]);
}

#[test]
fn room_beyond_capacity_is_an_error_and_changes_nothing() {
    let mut store = small_store(CodecKind::TQ4, 2, 2);
    filled(&mut store, 2, SourceLayer::UserTurn, 1);
    let before = store.try_clone().unwrap();
    assert_eq!(
        store.make_room(3),
        Err(KvError::TierExhausted {
            tier: Tier::Hot,
            requested: 3,
            available: 2
        })
    );
    assert_eq!(store, before);
    // Enough free room already: nothing to do.
    store.release(&store.eviction_order()[..1]).unwrap();
    assert!(store.make_room(1).unwrap().freed() == 0);
}

#[test]
fn busy_blocks_are_never_chosen() {
    let mut store = small_store(CodecKind::TQ4, 3, 0);
    let turn = filled(&mut store, 1, SourceLayer::UserTurn, 1)[0];
    let memory = filled(&mut store, 1, SourceLayer::Memories, 2)[0];
    let axioms = filled(&mut store, 1, SourceLayer::Axioms, 3)[0];
    // The user turn would go first, but a running sequence attends it.
    let ev = store.make_room_except(1, |id| id == turn).unwrap();
    assert_eq!(ev.removed, vec![memory]);
    // Two busy blocks leave one candidate: asking for two frees nothing and says so.
    let before = store.free_blocks(Tier::Hot);
    let err = store
        .make_room_except(3, |id| id == turn || id == axioms)
        .unwrap_err();
    assert!(matches!(
        err,
        KvError::TierExhausted {
            requested: 3,
            available: 1,
            ..
        }
    ));
    assert_eq!(store.free_blocks(Tier::Hot), before);
    assert_eq!(store.metadata().get(turn).unwrap().tier(), Tier::Hot);
}

#[test]
fn only_removable_blocks_lose_their_bytes() {
    // Hot 4, cold 1: freeing 3 slots spills one block and removes two.
    let mut store = small_store(CodecKind::TQ4, 4, 1);
    let theirs = filled(&mut store, 2, SourceLayer::UserTurn, 1);
    let mine = filled(&mut store, 2, SourceLayer::Axioms, 2);
    // Unrestricted, the two low-priority user-turn blocks (another owner's) would be removed.
    let mut free_for_all = store.try_clone().unwrap();
    let ev = free_for_all.make_room(3).unwrap();
    assert_eq!(ev.removed, theirs);
    // Restricted to `mine`: both of mine are removed, the first of theirs is spilled, the
    // second stays hot, and nothing of theirs loses its bytes.
    let ev = store
        .make_room_for(3, |_| false, |id| mine.contains(&id))
        .unwrap();
    assert_eq!(ev.removed, mine);
    assert_eq!(ev.spilled, vec![theirs[0]]);
    assert_eq!(store.metadata().get(theirs[0]).unwrap().tier(), Tier::Cold);
    assert_eq!(store.metadata().get(theirs[1]).unwrap().tier(), Tier::Hot);
    assert_eq!(store.free_blocks(Tier::Hot), 3);
}

#[test]
fn too_few_removable_blocks_is_an_error_and_changes_nothing() {
    let mut store = small_store(CodecKind::TQ4, 3, 1);
    let theirs = filled(&mut store, 2, SourceLayer::UserTurn, 1);
    let mine = filled(&mut store, 1, SourceLayer::Axioms, 2)[0];
    let before = store.try_clone().unwrap();
    // Three slots: one spill and two removals, but only one block may be removed.
    assert_eq!(
        store.make_room_for(3, |_| false, |id| id == mine),
        Err(KvError::TierExhausted {
            tier: Tier::Hot,
            requested: 3,
            available: 2
        })
    );
    assert_eq!(store, before);
    // Two slots fit: one of theirs spills, mine is removed.
    let ev = store.make_room_for(2, |_| false, |id| id == mine).unwrap();
    assert_eq!(ev.removed, vec![mine]);
    assert_eq!(ev.spilled, vec![theirs[0]]);
}

/// `touch` and `hot_slots` walk the table in id order, but answer as one lookup per id in the
/// caller's order: ticks follow the order given (a repeated id keeps its last tick and counts
/// twice), slots come back in the order asked, and a freed, unknown or repeated id is refused
/// with nothing touched.
#[test]
fn touch_and_slots_follow_the_callers_order() {
    let mut store = small_store(CodecKind::TQ4, 6, 0);
    let ids = filled(&mut store, 6, SourceLayer::UserTurn, 1);
    let meta = |s: &engram_kvcore::BlockStore, i: usize| {
        let m = s.metadata().get(ids[i]).unwrap();
        (m.last_attended(), m.attended())
    };
    let before: Vec<_> = (0..6).map(|i| meta(&store, i)).collect();
    // Out of order, with a repeat and a gap (ids[1] untouched).
    store
        .touch(&[ids[4], ids[0], ids[5], ids[0], ids[2]])
        .unwrap();
    let t = |i: usize| meta(&store, i).0;
    assert!(
        t(4) < t(5) && t(5) < t(0) && t(0) < t(2),
        "ticks follow the order given"
    );
    assert_eq!(
        t(0) - t(4),
        3,
        "ids[0] keeps the tick of its last occurrence"
    );
    assert_eq!(meta(&store, 0).1, before[0].1 + 2);
    assert_eq!(meta(&store, 4).1, before[4].1 + 1);
    assert_eq!(meta(&store, 1), before[1]);
    assert!(t(4) > before.iter().map(|m| m.0).max().unwrap());

    let asked = [ids[3], ids[0], ids[5]];
    let slots = store.hot_slots(&asked).unwrap();
    let one_by_one: Vec<u32> = asked
        .iter()
        .map(|&id| store.hot_slots(&[id]).unwrap()[0])
        .collect();
    assert_eq!(slots, one_by_one);
    assert!(matches!(
        store.hot_slots(&[ids[2], ids[3], ids[2]]),
        Err(KvError::DuplicateBlock { .. })
    ));

    // A freed id: refused, and nothing else touched.
    store.release(&[ids[1]]).unwrap();
    let snapshot: Vec<_> = [0, 2, 3].iter().map(|&i| meta(&store, i)).collect();
    assert!(store.touch(&[ids[0], ids[1], ids[3]]).is_err());
    assert!(store.hot_slots(&[ids[0], ids[1]]).is_err());
    let after: Vec<_> = [0, 2, 3].iter().map(|&i| meta(&store, i)).collect();
    assert_eq!(snapshot, after);
    assert!(store.touch(&[]).is_ok());
    assert_eq!(store.hot_slots(&[]).unwrap(), Vec::<u32>::new());
}

/// Two sequences' tables interleaved as a batch's are (a prompt's blocks together, then decode
/// blocks allocated turn about, and far apart): `touch`, `hot_slots` and `record_mass` walk each
/// run of near ids on its own and answer exactly as one lookup per id; an unknown id in
/// `record_mass` changes nothing.
#[test]
fn walks_over_interleaved_tables_answer_as_lookups() {
    let mut store = small_store(CodecKind::TQ4, 400, 0);
    let mut a = store
        .allocate(Tier::Hot, &vec![tags(SourceLayer::UserTurn); 150])
        .unwrap();
    let mut b = store
        .allocate(Tier::Hot, &vec![tags(SourceLayer::UserTurn); 150])
        .unwrap();
    for _ in 0..3 {
        a.extend(
            store
                .allocate(Tier::Hot, &[tags(SourceLayer::UserTurn)])
                .unwrap(),
        );
        b.extend(
            store
                .allocate(Tier::Hot, &[tags(SourceLayer::UserTurn)])
                .unwrap(),
        );
        // Blocks of nobody's table between the decode blocks: gaps wider than a run.
        store
            .allocate(Tier::Hot, &vec![tags(SourceLayer::UserTurn); 20])
            .unwrap();
    }
    // Out of order too: the last decode block first.
    a.rotate_right(1);
    for table in [&a, &b] {
        let slots = store.hot_slots(table).unwrap();
        let one_by_one: Vec<u32> = table
            .iter()
            .map(|&id| store.hot_slots(&[id]).unwrap()[0])
            .collect();
        assert_eq!(slots, one_by_one);
    }
    let before = store.metadata().get(b[0]).unwrap().last_attended();
    let attended = |s: &engram_kvcore::BlockStore| -> Vec<u32> {
        a.iter()
            .map(|&id| s.metadata().get(id).unwrap().attended())
            .collect()
    };
    let counts = attended(&store);
    store.touch(&a).unwrap();
    let ticks: Vec<u64> = a
        .iter()
        .map(|&id| store.metadata().get(id).unwrap().last_attended())
        .collect();
    assert!(
        ticks.windows(2).all(|w| w[1] == w[0] + 1),
        "one tick each, in the order given"
    );
    let after = attended(&store);
    assert!(after.iter().zip(&counts).all(|(x, y)| *x == y + 1));
    assert_eq!(
        store.metadata().get(b[0]).unwrap().last_attended(),
        before,
        "b untouched"
    );

    let mass: Vec<f32> = (0..a.len()).map(|i| (i % 7) as f32 / 7.0).collect();
    store.record_mass(&a, &mass, 1.0, 0.5).unwrap();
    for (i, &id) in a.iter().enumerate() {
        let m = store.metadata().get(id).unwrap();
        assert_eq!(m.mass(), mass[i], "block {i}");
        assert_eq!(m.reads(), u32::from(mass[i] >= 0.5), "block {i}");
    }
    assert!(
        b.iter()
            .all(|&id| store.metadata().get(id).unwrap().mass() == 0.0)
    );
    // An unknown id at the end: refused before anything is folded.
    let mut bad = b.clone();
    bad.push(unknown_id(&store));
    let ones = vec![1.0f32; bad.len()];
    let steps = store.metadata().steps();
    assert!(matches!(
        store.record_mass(&bad, &ones, 1.0, 0.5),
        Err(KvError::UnknownBlock { .. })
    ));
    assert!(
        b.iter()
            .all(|&id| store.metadata().get(id).unwrap().mass() == 0.0)
    );
    assert_eq!(store.metadata().steps(), steps);
}

/// An id `store` has not handed out yet.
fn unknown_id(store: &engram_kvcore::BlockStore) -> BlockId {
    let last = store.metadata().iter().map(|m| m.id()).max().unwrap();
    serde_json::from_value(serde_json::json!(last.get() + 1000)).unwrap()
}

#[test]
fn make_room_ordered_takes_the_callers_order_and_skips_what_is_not_hot() {
    let mut store = small_store(CodecKind::TQ4, 4, 1);
    let ids = filled(&mut store, 4, SourceLayer::UserTurn, 1);
    // Spill one first: a cold id in the order is skipped, not counted.
    store.spill(&[ids[0]]).unwrap();
    assert_eq!(store.free_blocks(Tier::Cold), 0);
    // Newest first: not the order kvcore would choose (oldest first).
    let ev = store
        .make_room_ordered(2, vec![ids[0], ids[3], ids[3], ids[1], ids[2]], |_| true)
        .unwrap();
    // One slot was free already (the spilled block's): one more, the caller's first hot id.
    assert_eq!(ev.removed, vec![ids[3]]);
    assert!(ev.spilled.is_empty());
    assert_eq!(store.metadata().get(ids[1]).unwrap().tier(), Tier::Hot);
    // Not removable and no cold room: refused, nothing changed.
    let err = store
        .make_room_ordered(4, vec![ids[1], ids[2]], |_| false)
        .unwrap_err();
    assert!(matches!(err, KvError::TierExhausted { .. }), "{err:?}");
    assert_eq!(store.free_blocks(Tier::Hot), 2);
}

#[test]
fn read_steps_count_sampled_steps_and_move_only_above_the_threshold() {
    let mut store = small_store(CodecKind::TQ4, 4, 0);
    let ids = filled(&mut store, 3, SourceLayer::UserTurn, 1);
    assert_eq!(store.metadata().steps(), 0);
    for &id in &ids {
        assert_eq!(store.metadata().get(id).unwrap().read_step(), 0);
    }
    store
        .record_mass(&ids, &[0.7, 0.2, 0.1], 0.5, 0.25)
        .unwrap();
    store
        .record_mass(&ids, &[0.1, 0.6, 0.3], 0.5, 0.25)
        .unwrap();
    assert_eq!(store.metadata().steps(), 2);
    let read = |id| store.metadata().get(id).unwrap().read_step();
    assert_eq!([read(ids[0]), read(ids[1]), read(ids[2])], [1, 2, 2]);
    let reads = |id| store.metadata().get(id).unwrap().reads();
    assert_eq!([reads(ids[0]), reads(ids[1]), reads(ids[2])], [1, 1, 1]);
    // A block allocated now starts at the current step.
    let late = filled(&mut store, 1, SourceLayer::UserTurn, 2)[0];
    assert_eq!(store.metadata().get(late).unwrap().read_step(), 2);
}

/// Halving ages both counts of every live block (rounding down) and nothing else: the blocks'
/// order by count stays, and a use after it weighs as much as two before it.
#[test]
fn halving_ages_the_counts_and_keeps_everything_else() {
    let mut store = small_store(CodecKind::TQ4, 3, 0);
    let ids = filled(&mut store, 3, SourceLayer::UserTurn, 1);
    for _ in 0..6 {
        store.touch(&ids[..1]).unwrap();
    }
    store.touch(&ids[1..2]).unwrap();
    store.carry_counts(ids[0], 9, 0).unwrap();
    let count = |s: &engram_kvcore::BlockStore, id: BlockId| {
        let m = s.metadata().get(id).unwrap();
        (m.attended(), m.reads())
    };
    // Allocation counts one use.
    assert_eq!(count(&store, ids[0]), (7, 9));
    assert_eq!(count(&store, ids[1]), (2, 0));
    assert_eq!(count(&store, ids[2]), (1, 0));
    // Everything but the counts.
    let rest = |s: &engram_kvcore::BlockStore| -> Vec<_> {
        ids.iter()
            .map(|&id| {
                let m = s.metadata().get(id).unwrap();
                (m.last_attended(), m.mass(), m.read_step(), m.tier())
            })
            .collect()
    };
    let before = rest(&store);
    store.halve_counts();
    assert_eq!(count(&store, ids[0]), (3, 4));
    assert_eq!(count(&store, ids[1]), (1, 0));
    assert_eq!(count(&store, ids[2]), (0, 0));
    assert_eq!(before, rest(&store));
    // Uses after it weigh double: the second block's two before and three after now outweigh
    // the first block's seven before.
    store.touch(&ids[1..2]).unwrap();
    store.touch(&ids[1..2]).unwrap();
    store.touch(&ids[1..2]).unwrap();
    assert!(count(&store, ids[1]).0 > count(&store, ids[0]).0);
}
