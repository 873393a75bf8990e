//! Cold-tier reservations on the real model: computed ahead, held cold, claimed by a turn, or
//! expired and freed.

use std::time::{Duration, Instant};

use engram_engine::{
    EngineConfig, EngineCore, EngineError, PromptSegment, ReservationState, ReserveRequest,
    SequenceSpec,
};
use engram_kvcore::{CodecKind, SourceLayer, TenantId, Tier};

use crate::common::{core, core_with, license_tokens};

/// Stable prefix (48 tokens), memories (64 tokens), then a user turn.
fn spec(text: &[u32], with_turn: bool) -> SequenceSpec {
    let mut segments = vec![
        PromptSegment {
            tokens: text[..48].to_vec(),
            source: SourceLayer::Axioms,
            importance: 1.0,
        },
        PromptSegment {
            tokens: text[48..112].to_vec(),
            source: SourceLayer::Memories,
            importance: 0.6,
        },
    ];
    if with_turn {
        segments.push(PromptSegment {
            tokens: text[112..150].to_vec(),
            source: SourceLayer::UserTurn,
            importance: 0.4,
        });
    }
    SequenceSpec {
        segments,
        ..SequenceSpec::plain(Vec::new(), TenantId(5))
    }
}

fn request(text: &[u32], ttl: Duration) -> ReserveRequest {
    ReserveRequest {
        spec: spec(text, false),
        segment: 1,
        labels: vec![11, 12],
        ttl,
    }
}

/// Prefills a reservation's sequence and completes it, as the engine thread does.
fn make(core: &mut EngineCore, req: ReserveRequest) -> engram_engine::ReservationId {
    let (id, seq) = core.reserve(req).unwrap();
    assert_eq!(core.reservations(None)[0].state, ReservationState::Pending);
    assert_eq!(core.reservation_of(seq), Some(id));
    core.prefill(seq).unwrap();
    core.complete_reservation(id, false).unwrap();
    id
}

fn tier_of(core: &EngineCore, source: SourceLayer) -> Vec<(Tier, u32)> {
    core.store()
        .metadata()
        .iter()
        .filter(|m| m.source() == source)
        .map(|m| (m.tier(), m.ref_count()))
        .collect()
}

#[test]
fn a_reservation_is_held_cold_and_a_turn_that_uses_it_warms_it() {
    let text = license_tokens(160);
    let mut core = core(CodecKind::TQ4);
    let id = make(&mut core, request(&text, Duration::from_secs(600)));
    let info = core.reservations(None).remove(0);
    assert_eq!(info.state, ReservationState::Ready);
    assert_eq!(info.tokens, [48, 112]);
    // Memories cover tokens 48..112: blocks 3, 4, 5 and 6 of 16 tokens, all full.
    assert_eq!((info.blocks, info.held), (4, 4));
    assert_eq!(info.labels, vec![11, 12]);
    // Held in the cold tier with the reservation's reference beside the cache's.
    let mem = tier_of(&core, SourceLayer::Memories);
    assert_eq!(mem, vec![(Tier::Cold, 2); 4]);
    // Cold trimming cannot take them.
    core.spill_idle().unwrap();
    assert_eq!(tier_of(&core, SourceLayer::Memories).len(), 4);

    // The turn builds the same prompt plus the user's message: it reuses the reserved blocks.
    let (seq, adm) = core.start(spec(&text, true)).unwrap();
    assert_eq!(adm.reserved_blocks, 4);
    assert_eq!(adm.cached_tokens, 112); // blocks 0..7: the stable prefix and the memories
    let info = core.reservations(None).remove(0);
    assert_eq!(
        (info.id, info.state, info.used_blocks),
        (id, ReservationState::Warmed, 4)
    );
    // Warmed: hot, owned by the turn and the cache only.
    assert!(
        tier_of(&core, SourceLayer::Memories)
            .iter()
            .all(|&t| t == (Tier::Hot, 2))
    );
    core.finish(seq).unwrap();
    let c = core.reservation_counters();
    assert_eq!((c.made, c.warmed, c.expired, c.blocks_served), (1, 1, 0, 4));
    assert_eq!(c.hit_rate(), Some(1.0));
}

#[test]
fn an_unused_reservation_expires_and_frees_its_cold_blocks() {
    let text = license_tokens(160);
    let mut core = core(CodecKind::TQ4);
    let id = make(&mut core, request(&text, Duration::from_secs(30)));
    let cold_used = core.occupancy().cold_used;
    assert_eq!(cold_used, 4);
    // Not due yet.
    assert_eq!(core.expire_reservations(Instant::now()).unwrap(), 0);
    assert!(core.next_expiry().is_some());
    let later = Instant::now() + Duration::from_secs(31);
    assert_eq!(core.expire_reservations(later).unwrap(), 1);
    assert_eq!(core.occupancy().cold_used, 0);
    assert!(tier_of(&core, SourceLayer::Memories).is_empty());
    let info = core.reservations(None).remove(0);
    assert_eq!(
        (info.id, info.state, info.held),
        (id, ReservationState::Expired, 0)
    );
    assert_eq!(core.next_expiry(), None);
    // A turn after expiry computes its memories again.
    let (seq, adm) = core.start(spec(&text, true)).unwrap();
    assert_eq!(adm.reserved_blocks, 0);
    assert_eq!(adm.cached_tokens, 48); // the pinned stable prefix stays cached
    core.finish(seq).unwrap();
    let c = core.reservation_counters();
    assert_eq!((c.made, c.warmed, c.expired), (1, 0, 1));
    assert_eq!(c.hit_rate(), Some(0.0));
    // Warming an expired reservation is a clear error.
    assert!(matches!(
        core.warm_reservation(id),
        Err(EngineError::UnknownReservation { .. })
    ));
}

#[test]
fn warm_reservation_promotes_and_listing_is_per_tenant() {
    let text = license_tokens(160);
    let mut core = core(CodecKind::TQ4);
    let id = make(&mut core, request(&text, Duration::from_secs(600)));
    assert_eq!(core.warm_reservation(id).unwrap(), 4);
    assert!(
        tier_of(&core, SourceLayer::Memories)
            .iter()
            .all(|&(t, _)| t == Tier::Hot)
    );
    assert_eq!(core.reservations(Some(TenantId(5))).len(), 1);
    assert!(core.reservations(Some(TenantId(6))).is_empty());
    // Another tenant's identical prompt neither sees nor claims it (the salt differs).
    let other = SequenceSpec {
        tenant: TenantId(6),
        ..spec(&text, true)
    };
    let (seq, adm) = core.start(other).unwrap();
    assert_eq!((adm.cached_tokens, adm.reserved_blocks), (0, 0));
    core.finish(seq).unwrap();
    assert_eq!(core.reservations(None)[0].state, ReservationState::Ready);
}

#[test]
fn a_reservation_the_cold_tier_cannot_hold_is_refused_and_bad_segments_are_errors() {
    let text = license_tokens(160);
    let mut no_cold = core_with(EngineConfig {
        codec: CodecKind::TQ4,
        value_codec: None,
        cold_bytes: 0,
        ..EngineConfig::default()
    });
    assert!(matches!(
        no_cold.reserve(request(&text, Duration::from_secs(1))),
        Err(EngineError::NoColdRoom { needed: 4, .. })
    ));
    assert_eq!(no_cold.reservation_counters().refused, 1);
    let mut core = core(CodecKind::TQ4);
    let mut bad = request(&text, Duration::from_secs(1));
    bad.segment = 2;
    assert!(matches!(
        core.reserve(bad),
        Err(EngineError::InvalidConfig { .. })
    ));
    assert_eq!(core.running(), 0, "nothing admitted");
    assert!(core.reservations(None).is_empty());
}

#[test]
fn a_reservation_over_another_ones_blocks_does_not_claim_it() {
    let text = license_tokens(160);
    let mut core = core(CodecKind::TQ4);
    let first = make(&mut core, request(&text, Duration::from_secs(600)));
    // The same neighbourhood reserved again (another turn predicted it too): the second
    // computes nothing new and holds nothing twice; the first stays ready.
    let (second, seq) = core
        .reserve(request(&text, Duration::from_secs(600)))
        .unwrap();
    core.prefill(seq).unwrap();
    core.complete_reservation(second, false).unwrap();
    let list = core.reservations(None);
    let state = |id| list.iter().find(|r| r.id == id).unwrap().clone();
    assert_eq!(state(first).state, ReservationState::Ready);
    assert_eq!(state(first).held, 4);
    assert_eq!(state(second).held, 0);
    assert_eq!(core.reservation_counters().warmed, 0);
}
