//! The shadow's engine side on the real model: chains collected with their bytes, restored into
//! a fresh engine byte for byte, refused when anything differs; and the tier bridge's cycle.

use std::collections::{HashMap, HashSet};

use engram_engine::{
    CollectedBytes, EngineConfig, EngineCore, EngineError, PromptSegment, RestoreChain,
    SequenceSpec, ShadowChain, TierPolicy, argmax,
};
use engram_kvcore::{CodecKind, PinState, SessionId, SourceLayer, TenantId, Tier};

use crate::common::{core, core_with, license_tokens};

/// Stable prefix (48 tokens) then a user turn of `n` tokens starting at `at`.
fn spec(text: &[u32], at: usize, n: usize, session: u64) -> SequenceSpec {
    SequenceSpec {
        segments: vec![
            PromptSegment {
                tokens: text[..48].to_vec(),
                source: SourceLayer::Axioms,
                importance: 1.0,
            },
            PromptSegment {
                tokens: text[at..at + n].to_vec(),
                source: SourceLayer::UserTurn,
                importance: 0.4,
            },
        ],
        session: Some(SessionId(session)),
        ..SequenceSpec::plain(Vec::new(), TenantId(9))
    }
}

/// Runs a prompt to its logits and finishes it; returns the logits.
fn run(core: &mut EngineCore, spec: SequenceSpec) -> (Vec<f32>, engram_engine::Admission) {
    let (id, admission) = core.start(spec).unwrap();
    let logits = core.prefill(id).unwrap();
    core.finish(id).unwrap();
    (logits, admission)
}

fn collect_all(core: &EngineCore) -> Vec<ShadowChain> {
    core.shadow_collect(&HashMap::new(), &HashSet::new(), None)
        .unwrap()
}

fn restore_of(chain: &ShadowChain) -> RestoreChain {
    RestoreChain {
        make_room: true,
        tenant: chain.tenant,
        session: Some(chain.session),
        stable_blocks: chain.stable_blocks,
        cold_quota: None,
        pin_key: chain.pin_key,
        public_pin_key: chain.public_pin_key,
        blocks: chain
            .blocks
            .iter()
            .cloned()
            .zip(chain.bytes.iter().map(|b| match b {
                CollectedBytes::New(bytes) => bytes.clone(),
                other => panic!("expected bytes, got {other:?}"),
            }))
            .collect(),
    }
}

#[test]
fn a_chain_restores_byte_identical_into_a_fresh_engine_and_is_reused() {
    let text = license_tokens(400);
    let mut a = core(CodecKind::TQ4);
    let (logits_a, _) = run(&mut a, spec(&text, 100, 120, 1));
    let chains = collect_all(&a);
    assert_eq!(chains.len(), 1, "one session, one chain");
    let chain = &chains[0];
    // 168 tokens; the last is computed for logits, so 167 are cached: 10 full blocks.
    assert_eq!(chain.blocks.len(), 10);
    assert_eq!(chain.stable_blocks, 3, "48 axiom tokens are 3 blocks");
    assert!(chain.blocks[..3].iter().all(|b| b.pinned));
    assert!(
        chain
            .bytes
            .iter()
            .all(|b| matches!(b, CollectedBytes::New(_)))
    );

    let mut b = core(CodecKind::TQ4);
    let report = b.shadow_restore(restore_of(chain)).unwrap();
    assert_eq!((report.loaded, report.present, report.no_room), (10, 0, 0));
    assert_eq!(report.tokens, 160);
    assert_eq!(b.occupancy().cold_used, 10);
    // Byte-identical in the restored engine.
    let again = collect_all(&b);
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].blocks, chain.blocks);
    assert_eq!(again[0].bytes, chain.bytes);
    // Pins come back for the stable blocks.
    let pinned = b
        .store()
        .metadata()
        .iter()
        .filter(|m| m.pin() == PinState::Pinned)
        .count();
    assert_eq!(pinned, 3);

    // The same prompt on the restored engine warms all ten blocks, and decides like a fresh
    // engine that computed everything.
    let (logits_b, adm) = run(&mut b, spec(&text, 100, 120, 1));
    assert_eq!((adm.cached_tokens, adm.warmed_blocks), (160, 10));
    let mut c = core(CodecKind::TQ4);
    let (logits_c, _) = run(&mut c, spec(&text, 100, 120, 1));
    assert_eq!(argmax(&logits_b), argmax(&logits_c));
    assert_eq!(argmax(&logits_a), argmax(&logits_c));
}

#[test]
fn an_evicted_session_keeps_its_chain_and_pins_and_is_restored_on_a_miss() {
    let text = license_tokens(400);
    let mut a = core(CodecKind::TQ4);
    run(&mut a, spec(&text, 100, 120, 1));
    let chain = collect_all(&a).remove(0);
    let restore = restore_of(&chain);
    // The same prompt again, every block hot: what the restored session must reproduce.
    let (logits_hot, adm) = run(&mut a, spec(&text, 100, 120, 1));
    assert_eq!(adm.cached_tokens, 160);
    // Another session of the same tenant, and one of another tenant, stay as they are.
    run(&mut a, spec(&text, 250, 60, 2));
    run(
        &mut a,
        SequenceSpec {
            tenant: TenantId(77),
            ..spec(&text, 200, 100, 1)
        },
    );
    let cached = |core: &EngineCore, t: u64, s: u64| {
        core.store()
            .metadata()
            .iter()
            .filter(|m| {
                m.tenant() == TenantId(t)
                    && m.session() == Some(SessionId(s))
                    && core.cache().contains_block(m.id())
            })
            .count()
    };
    let (other_session, other_tenant) = (cached(&a, 9, 2), cached(&a, 77, 1));
    assert!(other_session > 0 && other_tenant > 0);
    let report = a.evict_session(TenantId(9), SessionId(1)).unwrap();
    // Ten blocks: three pinned stable ones stay, seven go.
    assert_eq!(
        (report.dropped, report.pinned, report.busy),
        (7, 3, 0),
        "{report:?}"
    );
    assert_eq!(cached(&a, 9, 1), 3);
    assert_eq!(
        (cached(&a, 9, 2), cached(&a, 77, 1)),
        (other_session, other_tenant)
    );
    // The chain record stays (the shadow still knows the session); its bytes are gone.
    let after = collect_all(&a);
    let kept = after
        .iter()
        .find(|c| c.tenant == TenantId(9) && c.session == SessionId(1))
        .expect("the chain record survives an eviction");
    // (Hashes and tokens; an evicted block's meaning is the engine's default.)
    let hashes = |c: &ShadowChain| {
        c.blocks
            .iter()
            .map(|b| (b.hash, b.tokens.clone()))
            .collect::<Vec<_>>()
    };
    assert_eq!(hashes(kept), hashes(&chain));
    assert!(
        kept.bytes[3..]
            .iter()
            .all(|b| matches!(b, CollectedBytes::Missing))
    );
    // What a turn's miss does: the shadow's copy goes back into the cold tier (the pinned
    // blocks are present), and the next turn warms it and decides as before.
    let back = a.shadow_restore(restore).unwrap();
    assert_eq!(
        (back.loaded, back.present, back.no_room),
        (7, 3, 0),
        "{back:?}"
    );
    let (logits_b, adm) = run(&mut a, spec(&text, 100, 120, 1));
    assert_eq!(adm.cached_tokens, 160);
    assert_eq!(adm.warmed_blocks, 7);
    assert_eq!(
        logits_hot, logits_b,
        "the restored bytes are the computed ones"
    );
}

#[test]
fn a_restore_adds_at_most_the_tenants_cold_quota_and_forget_drops_only_that_tenant() {
    let text = license_tokens(400);
    let mut a = core(CodecKind::TQ4);
    run(&mut a, spec(&text, 100, 120, 1));
    let chain = &collect_all(&a)[0];
    let mut b = core(CodecKind::TQ4);
    // Another tenant's session is cached first; the quota-bound restore never touches it.
    let other = SequenceSpec {
        tenant: TenantId(77),
        ..spec(&text, 200, 100, 2)
    };
    run(&mut b, other.clone());
    let of = |core: &EngineCore, t: u64| {
        core.store()
            .metadata()
            .iter()
            .filter(|m| m.tenant() == TenantId(t))
            .count()
    };
    let others = of(&b, 77);
    assert!(others > 0);
    let report = b
        .shadow_restore(RestoreChain {
            make_room: true,
            cold_quota: Some(4),
            ..restore_of(chain)
        })
        .unwrap();
    assert_eq!((report.loaded, report.no_room), (4, 6), "{report:?}");
    assert_eq!(report.tokens, 4 * 16);
    assert_eq!(of(&b, 9), 4);
    assert_eq!(of(&b, 77), others);
    // Forgetting tenant 9's session 1 drops its blocks and its chain record, nothing of 77's.
    let gone = b.forget(TenantId(9), u64::MAX, 1).unwrap();
    assert_eq!((gone.blocks, gone.chains), (4, 1), "{gone:?}");
    assert_eq!(of(&b, 9), 0);
    assert_eq!(of(&b, 77), others);
    assert!(collect_all(&b).iter().all(|c| c.tenant == TenantId(77)));
    // A mask of 0 forgets every session of the tenant.
    let gone = b.forget(TenantId(77), 0, 0).unwrap();
    assert_eq!(gone.blocks, others);
    assert!(collect_all(&b).is_empty());
    let (_, adm) = run(&mut b, other);
    assert_eq!(
        adm.cached_tokens, 0,
        "nothing of the forgotten tenant is reused"
    );
}

#[test]
fn room_made_for_one_tenant_never_drops_another_tenants_cold_blocks() {
    let text = license_tokens(400);
    let mut a = core(CodecKind::TQ4);
    run(&mut a, spec(&text, 100, 120, 1));
    let chain = &collect_all(&a)[0];
    let block = a.store().block_bytes() as u64;
    // A cold tier of 12 blocks, 9 of them another tenant's.
    let mut b = core_with(EngineConfig {
        codec: CodecKind::TQ4,
        value_codec: None,
        cold_bytes: 12 * block,
        ..EngineConfig::default()
    });
    assert_eq!(b.store().capacity(Tier::Cold), 12);
    run(
        &mut b,
        SequenceSpec {
            tenant: TenantId(77),
            ..spec(&text, 200, 100, 2)
        },
    );
    assert_eq!(b.spill_idle().unwrap(), 9);
    let cold_of = |core: &EngineCore, t: u64| {
        core.store()
            .metadata()
            .iter()
            .filter(|m| m.tenant() == TenantId(t) && m.tier() == Tier::Cold)
            .count()
    };
    assert_eq!(cold_of(&b, 77), 9);
    // Tenant 9's restore needs 10 cold blocks: it gets the 3 free ones, not 77's.
    let report = b.shadow_restore(restore_of(chain)).unwrap();
    assert_eq!((report.loaded, report.no_room), (3, 7), "{report:?}");
    assert_eq!(
        cold_of(&b, 77),
        9,
        "another tenant's cold blocks were dropped"
    );
    assert_eq!(cold_of(&b, 9), 3);
}

/// Cached blocks (hot or cold) of tenant `t`.
fn cached_of(core: &EngineCore, t: u64) -> usize {
    core.store()
        .metadata()
        .iter()
        .filter(|m| m.tenant() == TenantId(t) && matches!(m.tier(), Tier::Hot | Tier::Cold))
        .count()
}

/// A core serving 256 tokens of context with 16 hot and 2 cold blocks, where tenant 77 (cold
/// quota `quota`) holds 15 idle cached blocks (two sessions sharing a 3-block prefix).
fn crowded(text: &[u32], block: u64, quota: usize) -> EngineCore {
    let (m, t) = crate::common::model();
    let model = m.clone().with_context_length(256).unwrap();
    let mut core = EngineCore::new(
        model,
        t.clone(),
        EngineConfig {
            codec: CodecKind::TQ4,
            value_codec: None,
            hot_bytes: 16 * block,
            cold_bytes: 2 * block,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    assert_eq!(
        (
            core.store().capacity(Tier::Hot),
            core.store().capacity(Tier::Cold)
        ),
        (16, 2)
    );
    for (session, at) in [(2, 200), (3, 300)] {
        run(
            &mut core,
            SequenceSpec {
                tenant: TenantId(77),
                cold_block_quota: Some(quota),
                ..spec(text, at, 100, session)
            },
        );
    }
    assert_eq!(cached_of(&core, 77), 15);
    assert_eq!(core.store().free_blocks(Tier::Hot), 1);
    core
}

#[test]
fn hot_room_for_one_tenant_never_drops_another_tenants_blocks_within_its_quota() {
    let text = license_tokens(400);
    let block = core(CodecKind::TQ4).store().block_bytes() as u64;
    // Tenant 9 needs 11 hot blocks: 1 is free, 2 of 77's may spill, the other 8 would have to
    // be dropped, and 77 is within its quota: tenant 9 is refused and 77 keeps all 15.
    let mut b = crowded(&text, block, 100);
    let (id, _) = b.start(spec(&text, 100, 120, 1)).unwrap();
    let err = b.prefill(id).unwrap_err();
    assert!(matches!(err, EngineError::NoHotRoom { .. }), "{err:?}");
    b.finish(id).unwrap();
    assert_eq!(
        cached_of(&b, 77),
        15,
        "another tenant's blocks were dropped"
    );
    // With a quota of 3, the 12 blocks 77 holds beyond it are fair game: tenant 9 runs, 8 of
    // them are dropped and 2 spilled (the cold tier's room), and its answer is unchanged.
    let mut b = crowded(&text, block, 3);
    let (logits, _) = run(&mut b, spec(&text, 100, 120, 1));
    let mut fresh = core(CodecKind::TQ4);
    let (want, _) = run(&mut fresh, spec(&text, 100, 120, 1));
    assert_eq!(logits, want);
    assert_eq!(cached_of(&b, 77), 7);
    let cold_77 = b
        .store()
        .metadata()
        .iter()
        .filter(|m| m.tenant() == TenantId(77) && m.tier() == Tier::Cold)
        .count();
    assert_eq!(cold_77, 2);
}

#[test]
fn a_session_forgotten_while_it_runs_leaves_nothing_cached_or_recorded() {
    let text = license_tokens(400);
    let mut core = core_with(EngineConfig {
        codec: CodecKind::TQ4,
        value_codec: None,
        prefill_chunk: 64,
        ..EngineConfig::default()
    });
    let (id, _) = core.start(spec(&text, 100, 120, 5)).unwrap();
    core.prefill_chunk(id, engram_engine::LogitRows::Last)
        .unwrap();
    let report = core.forget(TenantId(9), u64::MAX, 5).unwrap();
    assert_eq!(report.running, 1);
    // The rest of the prompt is computed as usual, then the sequence ends.
    let logits = core.prefill(id).unwrap();
    assert!(!logits.is_empty());
    core.finish(id).unwrap();
    assert!(
        collect_all(&core).is_empty(),
        "a forgotten chain was recorded"
    );
    assert_eq!(cached_of(&core, 9), 0, "a forgotten session left blocks");
    // The same prompt again starts from nothing of it (public-free, so nothing is reused).
    let (_, admission) = run(&mut core, spec(&text, 100, 120, 5));
    assert_eq!(admission.cached_tokens, 0);
    // Another session of the tenant is untouched by a forget that does not match it.
    core.forget(TenantId(9), u64::MAX, 6).unwrap();
    assert_eq!(collect_all(&core).len(), 1);
}

#[test]
fn a_chain_that_differs_is_refused_and_changes_nothing() {
    let text = license_tokens(400);
    let mut a = core(CodecKind::TQ4);
    run(&mut a, spec(&text, 100, 120, 1));
    let chain = restore_of(&collect_all(&a)[0]);
    let mut b = core(CodecKind::TQ4);
    let before = (b.occupancy(), b.store().metadata().len());

    let mut tokens = chain.clone();
    tokens.blocks[4].0.tokens[3] ^= 1;
    let mut tenant = chain.clone();
    tenant.tenant = TenantId(10);
    let mut short = chain.clone();
    short.blocks[2].1.pop();
    let mut order = chain.clone();
    order.blocks.swap(5, 6);
    for (bad, index) in [(tokens, 4), (tenant, 0), (short, 2), (order, 5)] {
        match b.shadow_restore(bad) {
            Err(EngineError::ShadowMismatch { index: i, .. }) => assert_eq!(i, index),
            other => panic!("expected a mismatch, got {other:?}"),
        }
        assert_eq!((b.occupancy(), b.store().metadata().len()), before);
    }
    // Another KV format (TQ3) refuses the chain at its first block.
    let mut other = core(CodecKind::TurboQuant { bits: 3 });
    assert!(matches!(
        other.shadow_restore(chain),
        Err(EngineError::ShadowMismatch { index: 0, .. })
    ));
}

#[test]
fn collect_skips_chains_already_written_and_sends_only_new_bytes() {
    let text = license_tokens(400);
    let mut a = core(CodecKind::TQ4);
    run(&mut a, spec(&text, 100, 120, 1));
    run(&mut a, spec(&text, 230, 60, 2));
    let first = collect_all(&a);
    assert_eq!(first.len(), 2);
    let written: HashMap<_, _> = first
        .iter()
        .map(|c| ((c.tenant, c.session), c.generation))
        .collect();
    let known: HashSet<[u8; 32]> = first
        .iter()
        .flat_map(|c| c.blocks.iter().map(|b| b.hash.0))
        .collect();
    assert!(a.shadow_collect(&written, &known, None).unwrap().is_empty());
    // Session 1 grows: only its new blocks carry bytes.
    run(&mut a, spec(&text, 100, 200, 1));
    let next = a.shadow_collect(&written, &known, None).unwrap();
    assert_eq!(next.len(), 1);
    let new = next[0]
        .bytes
        .iter()
        .filter(|b| matches!(b, CollectedBytes::New(_)))
        .count();
    let old = next[0]
        .bytes
        .iter()
        .filter(|b| matches!(b, CollectedBytes::Known))
        .count();
    assert_eq!((old, new), (10, 5), "248 tokens: 15 full blocks, 10 known");
    // `only` answers one session whatever its generation.
    let one = a
        .shadow_collect(&written, &known, Some((TenantId(9), SessionId(2))))
        .unwrap();
    assert_eq!(one.len(), 1);
    assert_eq!(one[0].session, SessionId(2));
}

fn tiers_of(core: &EngineCore, session: u64) -> Vec<Tier> {
    core.store()
        .metadata()
        .iter()
        .filter(|m| m.session() == Some(SessionId(session)))
        .filter(|m| m.source() == SourceLayer::UserTurn)
        .map(|m| m.tier())
        .collect()
}

#[test]
fn the_tier_bridge_spills_under_pressure_and_warms_an_active_session() {
    let text = license_tokens(700);
    // The smallest hot tier the engine accepts: one full context (512 blocks).
    let block_bytes = core_with(EngineConfig::default()).store().block_bytes() as u64;
    let mut e = core_with(EngineConfig {
        hot_bytes: 512 * block_bytes,
        ..EngineConfig::default()
    });
    let cap = e.occupancy().hot_capacity;
    assert_eq!(cap, 512);
    for (s, at) in [(1u64, 100usize), (2, 250), (3, 400)] {
        run(&mut e, spec(&text, at, 140, s));
    }
    // Three pinned axiom blocks shared by all, and 8 turn blocks per session (188 tokens: 11
    // full blocks; the partial one is freed at finish).
    let used = e.occupancy().hot_used;
    assert_eq!(used, 3 + 3 * 8);
    let spilled_before: u64 = e.counters().spilled.values().sum();

    // Pressure: the hot tier is over 4 % of its capacity; the target is empty.
    let mut pressure = TierPolicy {
        hot_high: 0.04,
        hot_target: 0.0,
        warm_below: 0.0,
        adapt: false,
        // Spill ahead (the staging default is `the_bridge_stages_ahead_...`).
        stage: false,
        ..TierPolicy::default()
    };
    let r = e.tier_cycle(&mut pressure, &[]).unwrap();
    assert_eq!(r.spilled, 24, "every unpinned block: {r:?}");
    assert_eq!(r.warmed, 0);
    assert_eq!(r.observed.hot_used, used);
    assert_eq!(
        e.counters().spilled.values().sum::<u64>(),
        spilled_before + r.spilled as u64
    );
    // Pinned stable blocks stay hot; every session's turn blocks went cold.
    let pinned_hot = e
        .store()
        .metadata()
        .iter()
        .filter(|m| m.pin() == PinState::Pinned)
        .all(|m| m.tier() == Tier::Hot);
    assert!(pinned_hot);
    for s in 1..=3 {
        assert!(
            tiers_of(&e, s).iter().all(|&t| t == Tier::Cold),
            "session {s}"
        );
    }

    // Session 2 becomes active again: with room in the hot tier its blocks are warmed, the
    // others stay cold.
    // (No cooldown: the blocks were spilled one cycle ago.)
    let mut calm = TierPolicy {
        hot_high: 0.2,
        hot_target: 0.1,
        warm_below: 0.08,
        adapt: false,
        cooldown_cycles: 0,
        ..TierPolicy::default()
    };
    let r = e
        .tier_cycle(&mut calm, &[(TenantId(9), SessionId(2))])
        .unwrap();
    assert_eq!(r.observed.active_sessions, 1);
    assert_eq!((r.warmed, r.spilled), (8, 0), "{r:?}");
    assert!(tiers_of(&e, 2).iter().all(|&t| t == Tier::Hot));
    assert!(tiers_of(&e, 1).iter().all(|&t| t == Tier::Cold));
    // The session's next turn finds every block hot: nothing to warm.
    let (_, adm) = run(&mut e, spec(&text, 250, 140, 2));
    assert_eq!(adm.warmed_blocks, 0);
    assert!(adm.cached_tokens >= 176);
}

/// With `stage` on (the default) the bridge copies ahead instead of spilling: the blocks stay
/// hot, a turn that needs them finds them hot, and when admission wants their room their spill
/// takes the copy; the replies are the spilling bridge's.
#[test]
fn the_bridge_stages_ahead_and_admission_spills_onto_the_copies() {
    let text = license_tokens(700);
    let block_bytes = core_with(EngineConfig::default()).store().block_bytes() as u64;
    let sessions = [(1u64, 100usize), (2, 250), (3, 400)];
    // The smallest hot tier the engine accepts (512 blocks); 27 blocks used: over 4 % of it
    // (20 blocks), the bridge acts down to 3 % (15 blocks).
    let act = |stage: bool| TierPolicy {
        hot_high: 0.04,
        hot_target: 0.03,
        warm_below: 0.0,
        adapt: false,
        stage,
        ..TierPolicy::default()
    };
    let fresh = || {
        let mut e = core_with(EngineConfig {
            hot_bytes: 512 * block_bytes,
            ..EngineConfig::default()
        });
        for (s, at) in sessions {
            run(&mut e, spec(&text, at, 140, s));
        }
        e
    };
    let bridged = |stage: bool| {
        let mut e = fresh();
        let r = e.tier_cycle(&mut act(stage), &[]).unwrap();
        (e, r)
    };
    let next = fresh().admission_order();
    let (mut e, r) = bridged(true);
    let (mut spilling, spilled) = bridged(false);
    assert_eq!((r.staged, r.spilled), (12, 0), "{r:?}");
    assert_eq!((spilled.staged, spilled.spilled), (0, 12), "{spilled:?}");
    // Nothing moved: every block is still hot, 12 of them with a copy; no tier move.
    assert_eq!(e.occupancy().hot_used, 3 + 3 * 8);
    assert_eq!(e.stage_stats().staged, 12);
    for s in 1..=3 {
        assert!(
            tiers_of(&e, s).iter().all(|&t| t == Tier::Hot),
            "session {s}"
        );
    }
    // The copies are the blocks the next admission would evict first.
    let mut staged: Vec<_> = e
        .store()
        .metadata()
        .iter()
        .filter(|m| e.store().is_staged(m.id()))
        .map(|m| m.id())
        .collect();
    let mut first: Vec<_> = next[..12].to_vec();
    staged.sort();
    first.sort();
    assert_eq!(staged, first);
    assert_eq!(e.admission_order(), next, "staging changes no ranking");
    // A second cycle stages no more: the blocks not staged are at the target.
    assert_eq!(e.tier_cycle(&mut act(true), &[]).unwrap().staged, 0);

    // The sessions again: the staged blocks are hot hits, where the spilling bridge's turns
    // warm back all 12 it spilled; the logits are the same.
    let mut warmed = [0, 0];
    for (s, at) in sessions {
        let (logits, adm) = run(&mut e, spec(&text, at, 140, s));
        let (logits_s, adm_s) = run(&mut spilling, spec(&text, at, 140, s));
        warmed[0] += adm.warmed_blocks;
        warmed[1] += adm_s.warmed_blocks;
        assert_eq!(
            adm.hot_blocks + adm.warmed_blocks,
            adm_s.hot_blocks + adm_s.warmed_blocks
        );
        assert_eq!(logits, logits_s, "session {s}");
    }
    assert_eq!(warmed, [0, 12]);
    // Admission spills onto copies: empty the hot tier's idle blocks; every staged block left
    // spills with nothing copied, and its bytes are what they were.
    let left: Vec<_> = e
        .store()
        .metadata()
        .iter()
        .filter(|m| e.store().is_staged(m.id()))
        .map(|m| (m.id(), e.store().block_bytes_of(m.id()).unwrap()))
        .collect();
    assert!(!left.is_empty());
    let used = e.stage_stats().used;
    e.spill_idle().unwrap();
    assert_eq!(e.stage_stats().used, used + left.len() as u64);
    assert_eq!(e.stage_stats().staged, 0);
    for (id, bytes) in left {
        let m = e.store().metadata().get(id).unwrap();
        assert_eq!(m.tier(), Tier::Cold);
        assert_eq!(e.store().block_bytes_of(id).unwrap(), bytes);
    }

    // A hot budget still holds: over a 20-block budget, the 7 blocks above it are spilled and
    // the next 5 staged (down to 15 not staged).
    let mut e = fresh();
    let mut budget = TierPolicy {
        hot_budget_bytes: 20 * block_bytes,
        ..act(true)
    };
    budget.hot_high = 0.9;
    budget.hot_target = 0.75;
    let r = e.tier_cycle(&mut budget, &[]).unwrap();
    assert_eq!((r.spilled, r.staged), (7, 5), "{r:?}");
    assert_eq!(e.occupancy().hot_used, 20);
    assert_eq!(e.stage_stats().staged, 5);
    for s in 1..=3 {
        assert!(prefix_closed(&e, s), "session {s}: {:?}", tiers_of(&e, s));
    }
}

/// Token starts of a session's live turn blocks, and whether its hot blocks all come before its
/// cold ones (a chain the bridge demoted prefix-closed).
fn prefix_closed(core: &EngineCore, session: u64) -> bool {
    let mut blocks: Vec<_> = core
        .store()
        .metadata()
        .iter()
        .filter(|m| m.session() == Some(SessionId(session)))
        .filter(|m| m.source() == SourceLayer::UserTurn)
        .map(|m| (m.tokens().start, m.tier()))
        .collect();
    blocks.sort_by_key(|b| b.0);
    blocks
        .windows(2)
        .all(|w| !(w[0].1 == Tier::Cold && w[1].1 == Tier::Hot))
}

#[test]
fn the_bridge_demotes_prefix_closed_within_a_budget_with_a_cooldown_and_reviews_its_moves() {
    let text = license_tokens(700);
    let block_bytes = core_with(EngineConfig::default()).store().block_bytes() as u64;
    let mut e = core_with(EngineConfig {
        hot_bytes: 512 * block_bytes,
        ..EngineConfig::default()
    });
    let turns = [(1u64, 100usize), (2, 250), (3, 400)];
    for (s, at) in turns {
        run(&mut e, spec(&text, at, 140, s));
    }
    assert_eq!(e.occupancy().hot_used, 3 + 3 * 8);
    let moves_before = e.tier_moves();

    // A 20-block budget: over 90 % of it, spill down to 75 % (15 blocks), so 12 of the 24
    // unpinned blocks go, each session's from its end.
    let mut budget = TierPolicy {
        hot_budget_bytes: 20 * block_bytes,
        warm_below: 0.0,
        adapt: false,
        stage: false,
        ..TierPolicy::default()
    };
    let r = e.tier_cycle(&mut budget, &[]).unwrap();
    assert_eq!(r.observed.hot_budget, 20);
    assert_eq!(r.spilled, 12, "{r:?}");
    assert_eq!(e.occupancy().hot_used, 15);
    assert_eq!(e.tier_moves(), moves_before + 12);
    for s in 1..=3 {
        assert!(prefix_closed(&e, s), "session {s}: {:?}", tiers_of(&e, s));
    }
    // Empty the hot tier: the other 12 go, the 12 in cooldown do not move again.
    let mut empty = TierPolicy {
        hot_high: 0.01,
        hot_target: 0.0,
        warm_below: 0.0,
        adapt: false,
        stage: false,
        ..TierPolicy::default()
    };
    assert_eq!(e.tier_cycle(&mut empty, &[]).unwrap().spilled, 12);
    let r = e.tier_cycle(&mut empty, &[]).unwrap();
    assert_eq!((r.spilled, r.observed.cooling), (0, 24), "{r:?}");
    assert!(
        e.store()
            .metadata()
            .iter()
            .filter(|m| m.source() == SourceLayer::UserTurn)
            .all(|m| m.moves() == 1 && m.tier() == Tier::Cold)
    );
    // An active session's blocks in cooldown are not warmed back by the bridge...
    let mut calm = TierPolicy {
        hot_high: 0.2,
        hot_target: 0.1,
        warm_below: 0.08,
        adapt: false,
        ..TierPolicy::default()
    };
    let active = [(TenantId(9), SessionId(2))];
    let r = e.tier_cycle(&mut calm, &active).unwrap();
    assert_eq!((r.warmed, r.observed.active_cold_blocks), (0, 0), "{r:?}");
    // ... until the cooldown is over.
    calm.cooldown_cycles = 0;
    assert_eq!(e.tier_cycle(&mut calm, &active).unwrap().warmed, 8);

    // Session 1's next turn needs the blocks the bridge spilled (a regret: demote later);
    // session 2's reads the blocks it warmed (promote sooner).
    // Those blocks moved back within 100 cycles of their spill: quick moves (flips).
    let quick = e.quick_moves();
    run(&mut e, spec(&text, 100, 140, 1));
    assert_eq!(e.quick_moves(), quick + 8);
    run(&mut e, spec(&text, 250, 140, 2));
    let mut p = TierPolicy::default();
    let high = p.hot_high;
    let r = e.tier_cycle(&mut p, &[]).unwrap();
    assert_eq!(r.review.spill_regrets, 8, "{r:?}");
    assert_eq!(
        (r.review.warms_used, r.review.warms_wasted),
        (8, 0),
        "{r:?}"
    );
    assert_eq!(r.review.admission_evictions, 0);
    assert_eq!(r.suggestions, ["demote_later", "promote_sooner"]);
    assert!(p.hot_high > high);
}

#[test]
fn cold_blocks_over_the_cold_budget_leave_each_chain_from_its_end() {
    let text = license_tokens(700);
    let block_bytes = core_with(EngineConfig::default()).store().block_bytes() as u64;
    let mut e = core_with(EngineConfig {
        hot_bytes: 512 * block_bytes,
        ..EngineConfig::default()
    });
    for (s, at) in [(1u64, 100usize), (2, 250), (3, 400)] {
        run(&mut e, spec(&text, at, 140, s));
    }
    // Spill every unpinned block, then keep the cold tier at 85 % of a 10-block budget.
    let mut p = TierPolicy {
        hot_high: 0.01,
        hot_target: 0.0,
        warm_below: 0.0,
        cold_budget_bytes: 10 * block_bytes,
        cooldown_cycles: 0,
        adapt: false,
        stage: false,
        ..TierPolicy::default()
    };
    let r = e.tier_cycle(&mut p, &[]).unwrap();
    assert_eq!((r.spilled, r.removed), (24, 16), "{r:?}");
    assert_eq!(e.occupancy().cold_used, 8);
    let mut kept = 0;
    for (s, at) in [(1u64, 100u32), (2, 250), (3, 400)] {
        let mut starts: Vec<u32> = e
            .store()
            .metadata()
            .iter()
            .filter(|m| m.session() == Some(SessionId(s)))
            .filter(|m| m.source() == SourceLayer::UserTurn)
            .map(|m| m.tokens().start)
            .collect();
        starts.sort_unstable();
        // The leading blocks of the turn (48 axiom tokens first, 16 per block).
        let leading: Vec<u32> = (0..starts.len() as u32).map(|b| 48 + 16 * b).collect();
        assert_eq!(starts, leading, "session {s} (turn at {at}) kept a hole");
        kept += starts.len();
    }
    assert_eq!(kept, 8);
}

#[test]
fn threshold_suggestions_follow_cold_fill_within_bounds() {
    let mut e = core(CodecKind::TQ4);
    let mut p = TierPolicy::default();
    let start = p.warm_below;
    // An empty cold tier: promote sooner, up to the bound.
    for _ in 0..20 {
        let r = e.tier_cycle(&mut p, &[]).unwrap();
        assert_eq!(r.suggestions, ["promote_sooner"]);
    }
    assert!(p.warm_below > start);
    assert!(p.warm_below <= p.warm_below_bounds[1] + 1e-9);
    assert!(p.warm_below <= p.hot_target);
    let mut fixed = TierPolicy {
        adapt: false,
        ..TierPolicy::default()
    };
    e.tier_cycle(&mut fixed, &[]).unwrap();
    assert_eq!(
        fixed,
        TierPolicy {
            adapt: false,
            ..TierPolicy::default()
        }
    );
}

#[test]
fn chain_records_are_capped_per_tenant_so_one_tenant_never_pushes_anothers_out() {
    let text = license_tokens(400);
    let mut core = core_with(EngineConfig {
        codec: CodecKind::TQ4,
        value_codec: None,
        chains_per_tenant: 2,
        ..EngineConfig::default()
    });
    let session_of = |t: u64, s: u64, at: usize| SequenceSpec {
        tenant: TenantId(t),
        ..spec(&text, at, 20, s)
    };
    run(&mut core, session_of(77, 1, 60));
    // Tenant 9 records four sessions: only its two latest stay, tenant 77's is untouched.
    for s in 1..=4 {
        run(&mut core, session_of(9, s, 60 + 20 * s as usize));
    }
    let mut kept: Vec<(u64, u64)> = collect_all(&core)
        .iter()
        .map(|c| (c.tenant.0, c.session.0))
        .collect();
    kept.sort_unstable();
    assert_eq!(kept, [(9, 3), (9, 4), (77, 1)]);
    // A session recorded again becomes the tenant's newest.
    run(&mut core, session_of(9, 3, 200));
    run(&mut core, session_of(9, 5, 220));
    let mut kept: Vec<(u64, u64)> = collect_all(&core)
        .iter()
        .map(|c| (c.tenant.0, c.session.0))
        .collect();
    kept.sort_unstable();
    assert_eq!(kept, [(9, 3), (9, 5), (77, 1)]);
}
