//! Soft-capped prefix pins.

use engram_kvcore::{
    BlockFilter, CodecKind, DEGRADED_PIN_PRIORITY, KvError, PINNED_PRIORITY, PinPolicy, PinState,
    PrefixPinManager, SourceLayer, TenantId, Tier,
};

use crate::common::{filled, small_store, tags};

#[test]
fn pins_over_the_soft_cap_degrade_to_priority_100_and_say_so() {
    // 16 hot blocks × 25 % = a cap of 4 pinned blocks.
    let mut store = small_store(CodecKind::TQ4, 16, 0);
    let pins = PrefixPinManager::new(PinPolicy::default()).unwrap();
    assert_eq!(pins.cap(&store), 4);
    let ids = filled(&mut store, 6, SourceLayer::Capabilities, 1);
    let report = pins.pin(&mut store, &ids).unwrap();
    assert_eq!(report.pinned, ids[..4]);
    assert_eq!(report.degraded, ids[4..]);
    for &id in &ids[..4] {
        let m = store.metadata().get(id).unwrap();
        assert_eq!((m.pin(), m.priority()), (PinState::Pinned, PINNED_PRIORITY));
    }
    for &id in &ids[4..] {
        let m = store.metadata().get(id).unwrap();
        assert_eq!(
            (m.pin(), m.priority()),
            (PinState::Degraded, DEGRADED_PIN_PRIORITY)
        );
    }
    // Pinning again reports, changes nothing.
    let again = pins.pin(&mut store, &ids[..1]).unwrap();
    assert_eq!(again.already_pinned, ids[..1]);
    let pinned = BlockFilter {
        pinned: Some(true),
        ..BlockFilter::default()
    };
    assert_eq!(store.metadata().count(&pinned), 4);
}

#[test]
fn only_the_configured_sources_are_pinnable() {
    let mut store = small_store(CodecKind::TQ4, 16, 0);
    let pins = PrefixPinManager::new(PinPolicy::default()).unwrap();
    let turn = filled(&mut store, 1, SourceLayer::UserTurn, 1);
    let soul = filled(&mut store, 1, SourceLayer::Soul, 2);
    let report = pins.pin(&mut store, &[turn[0], soul[0]]).unwrap();
    assert_eq!(report.not_pinnable, turn);
    assert_eq!(report.pinned, soul);
    assert_eq!(
        store.metadata().get(turn[0]).unwrap().priority(),
        store.metadata().priorities().get(SourceLayer::UserTurn)
    );
    // A custom set.
    let custom = PrefixPinManager::new(PinPolicy {
        sources: vec![SourceLayer::UserTurn],
        max_share: 1.0,
        ..PinPolicy::default()
    })
    .unwrap();
    assert_eq!(custom.pin(&mut store, &turn).unwrap().pinned, turn);
}

#[test]
fn unpinning_promotes_degraded_pins_oldest_first() {
    let mut store = small_store(CodecKind::TQ4, 8, 0);
    let pins = PrefixPinManager::new(PinPolicy::default()).unwrap(); // cap 2
    let ids = filled(&mut store, 5, SourceLayer::Axioms, 1);
    let report = pins.pin(&mut store, &ids).unwrap();
    assert_eq!(report.degraded, ids[2..]);
    let unpin = pins.unpin(&mut store, &ids[..1]).unwrap();
    assert_eq!(unpin.unpinned, ids[..1]);
    assert_eq!(unpin.promoted, ids[2..3]);
    let m = store.metadata().get(ids[0]).unwrap();
    assert_eq!((m.pin(), m.priority()), (PinState::Unpinned, 100));
    assert_eq!(
        store.metadata().get(ids[2]).unwrap().pin(),
        PinState::Pinned
    );
    assert_eq!(
        store.metadata().get(ids[3]).unwrap().pin(),
        PinState::Degraded
    );
    // Unpinning a degraded block returns it to its layer's priority, no promotion needed.
    let unpin = pins.unpin(&mut store, &ids[4..]).unwrap();
    assert_eq!(unpin.unpinned, ids[4..]);
    assert!(unpin.promoted.is_empty());
}

#[test]
fn pin_matching_pins_one_tenants_prefix() {
    let mut store = small_store(CodecKind::TQ4, 16, 0);
    let pins = PrefixPinManager::new(PinPolicy::default()).unwrap();
    let mut other = tags(SourceLayer::Rules);
    other.tenant = TenantId(2);
    let theirs = store.allocate(Tier::Hot, &[other, other]).unwrap();
    let ours = filled(&mut store, 2, SourceLayer::Rules, 1);
    let filter = BlockFilter {
        tenant: Some(TenantId(1)),
        ..BlockFilter::default()
    };
    let report = pins.pin_matching(&mut store, &filter).unwrap();
    assert_eq!(report.pinned, ours);
    assert!(
        theirs
            .iter()
            .all(|&id| store.metadata().get(id).unwrap().pin() == PinState::Unpinned)
    );
}

#[test]
fn policy_is_validated_and_bad_ids_change_nothing() {
    for share in [0.0, -0.1, 1.5, f64::NAN] {
        assert!(matches!(
            PrefixPinManager::new(PinPolicy {
                max_share: share,
                ..PinPolicy::default()
            }),
            Err(KvError::InvalidConfig {
                field: "max_share",
                ..
            })
        ));
    }
    let mut store = small_store(CodecKind::TQ4, 16, 0);
    let pins = PrefixPinManager::new(PinPolicy::default()).unwrap();
    let ids = filled(&mut store, 2, SourceLayer::Axioms, 1);
    store.release(&ids[1..]).unwrap();
    let before = store.try_clone().unwrap();
    assert!(matches!(
        pins.pin(&mut store, &ids),
        Err(KvError::AlreadyFreed { .. })
    ));
    assert!(matches!(
        pins.pin(&mut store, &[ids[0], ids[0]]),
        Err(KvError::DuplicateBlock { .. })
    ));
    assert_eq!(store, before);
}

#[test]
fn one_tenant_holds_at_most_its_share_of_the_pin_cap() {
    // 16 hot blocks × 50 % = a cap of 8; each tenant may hold half of it.
    let mut store = small_store(CodecKind::TQ4, 16, 0);
    let pins = PrefixPinManager::new(PinPolicy {
        max_share: 0.5,
        tenant_share: 0.5,
        ..PinPolicy::default()
    })
    .unwrap();
    assert_eq!((pins.cap(&store), pins.tenant_cap(&store)), (8, 4));
    let of = |store: &mut engram_kvcore::BlockStore, n: usize, tenant: u64| {
        let ids = store
            .allocate(
                Tier::Hot,
                &vec![
                    engram_kvcore::BlockTags {
                        tenant: TenantId(tenant),
                        ..tags(SourceLayer::Axioms)
                    };
                    n
                ],
            )
            .unwrap();
        crate::common::fill(store, &ids, tenant);
        ids
    };
    let a = of(&mut store, 6, 1);
    let r = pins.pin(&mut store, &a).unwrap();
    assert_eq!((r.pinned.len(), r.degraded.len()), (4, 2), "{r:?}");
    // Another tenant still finds room under the global cap.
    let b = of(&mut store, 3, 2);
    let r = pins.pin(&mut store, &b).unwrap();
    assert_eq!(r.pinned, b);
    // Freed room is promoted within the tenant's share: a's degraded pins take a's freed slot.
    let r = pins.unpin(&mut store, &a[..1]).unwrap();
    assert_eq!((r.unpinned.len(), r.promoted.len()), (1, 1), "{r:?}");
    assert_eq!(r.promoted[0], a[4]);
    // b releasing its pins does not let a exceed its share.
    let r = pins.unpin(&mut store, &b).unwrap();
    assert_eq!(r.promoted, vec![], "{r:?}");
    assert!(matches!(
        PrefixPinManager::new(PinPolicy {
            tenant_share: 0.0,
            ..PinPolicy::default()
        }),
        Err(KvError::InvalidConfig {
            field: "tenant_share",
            ..
        })
    ));
}
