//! Reference counts of shared blocks.

use std::collections::BTreeMap;

use engram_kvcore::{BlockId, CodecKind, KvError, SourceLayer, Tier};
use proptest::prelude::*;

use crate::common::{filled, small_store, tags};

#[test]
fn a_shared_block_outlives_all_but_its_last_owner() {
    let mut store = small_store(CodecKind::TQ4, 4, 0);
    let id = filled(&mut store, 1, SourceLayer::Axioms, 1)[0];
    store.retain(&[id]).unwrap();
    store.retain(&[id]).unwrap();
    assert_eq!(store.metadata().get(id).unwrap().ref_count(), 3);
    let bytes = store.block_bytes_of(id).unwrap();
    assert!(store.release(&[id]).unwrap().is_empty());
    assert!(store.release(&[id]).unwrap().is_empty());
    assert_eq!(store.block_bytes_of(id).unwrap(), bytes);
    assert_eq!(store.free_blocks(Tier::Hot), 3);
    assert_eq!(store.release(&[id]).unwrap(), vec![id]);
    assert_eq!(store.free_blocks(Tier::Hot), 4);
    // No underflow: a fourth release is a double free, and changes nothing.
    let before = store.try_clone().unwrap();
    assert_eq!(store.release(&[id]), Err(KvError::AlreadyFreed { id }));
    assert_eq!(store.retain(&[id]), Err(KvError::AlreadyFreed { id }));
    assert_eq!(store, before);
}

#[derive(Debug, Clone)]
enum Op {
    Allocate(usize),
    Retain(usize),
    Release(usize),
    Spill(usize),
    Warm(usize),
    Remove(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (1usize..4).prop_map(Op::Allocate),
        any::<usize>().prop_map(Op::Retain),
        any::<usize>().prop_map(Op::Release),
        any::<usize>().prop_map(Op::Spill),
        any::<usize>().prop_map(Op::Warm),
        any::<usize>().prop_map(Op::Remove),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Random operations against a model of the reference counts: counts match, slots are
    /// conserved, and every failed call leaves the store unchanged.
    #[test]
    fn reference_counts_and_slots_follow_a_model(ops in prop::collection::vec(op(), 1..60)) {
        let (hot, cold) = (6u32, 4u32);
        let mut store = small_store(CodecKind::TurboQuant { bits: 2 }, hot, cold);
        let mut model: BTreeMap<BlockId, u32> = BTreeMap::new();
        let mut ever: Vec<BlockId> = Vec::new();
        for op in ops {
            let before = store.try_clone().unwrap();
            let pick = |i: usize| ever.get(i % ever.len().max(1)).copied();
            let result = match op {
                Op::Allocate(n) => store.allocate(Tier::Hot, &vec![tags(SourceLayer::Memories); n]).map(|ids| {
                    for id in ids {
                        model.insert(id, 1);
                        ever.push(id);
                    }
                }),
                Op::Retain(i) => match pick(i) {
                    Some(id) => store.retain(&[id]).map(|()| *model.get_mut(&id).unwrap() += 1),
                    None => Ok(()),
                },
                Op::Release(i) => match pick(i) {
                    Some(id) => store.release(&[id]).map(|freed| {
                        let c = model.get_mut(&id).unwrap();
                        *c -= 1;
                        if *c == 0 {
                            model.remove(&id);
                            assert_eq!(freed, vec![id]);
                        }
                    }),
                    None => Ok(()),
                },
                Op::Spill(i) => pick(i).map_or(Ok(()), |id| store.spill(&[id])),
                Op::Warm(i) => pick(i).map_or(Ok(()), |id| store.warm(&[id])),
                Op::Remove(i) => pick(i).map_or(Ok(()), |id| store.remove(&[id])),
            };
            if result.is_err() {
                prop_assert_eq!(&store, &before);
            }
            for (&id, &count) in &model {
                prop_assert_eq!(store.metadata().get(id).map(|m| m.ref_count()), Some(count));
            }
            prop_assert_eq!(store.metadata().len(), model.len());
            let in_tier = |t| store.metadata().iter().filter(|m| m.tier() == t).count();
            prop_assert_eq!(in_tier(Tier::Hot) + store.free_blocks(Tier::Hot), hot as usize);
            prop_assert_eq!(in_tier(Tier::Cold) + store.free_blocks(Tier::Cold), cold as usize);
        }
    }
}
