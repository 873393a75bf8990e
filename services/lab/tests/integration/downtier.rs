//! Down-tiering on the real model: under cold-tier pressure a session's blocks are re-encoded to
//! the profile's narrower codecs instead of dropped, its next turn reuses them, and the answer
//! stays within the looser budget of an unpressured run's.

use std::collections::{HashMap, HashSet};

use engram_engine::{
    CollectedBytes, DownTier, EngineConfig, EngineCore, LogitRows, SeqId, SequenceSpec, TierPolicy,
};
use engram_kvcore::{CodecKind, Precision, SessionId, TenantId, Tier};
use engram_lab::calibrate::{CalibrateOptions, calibrate};

use crate::common::tempdir;
use crate::common::{license_tokens, mean_kl, model};

const LOOSER_KL: f64 = 0.05;

fn spec(tokens: &[u32], session: u64) -> SequenceSpec {
    SequenceSpec {
        session: Some(SessionId(session)),
        ..SequenceSpec::plain(tokens.to_vec(), TenantId(1))
    }
}

/// Runs a whole prompt and finishes it.
fn turn(core: &mut EngineCore, tokens: &[u32], session: u64) {
    let (id, _) = core.start(spec(tokens, session)).unwrap();
    core.prefill(id).unwrap();
    core.finish(id).unwrap();
}

/// Starts a prompt and returns its admission and every uncached row's logits.
fn scored(core: &mut EngineCore, tokens: &[u32]) -> (SeqId, usize, Vec<f32>) {
    let (id, adm) = core.start(spec(tokens, 1)).unwrap();
    let out = core.prefill_chunk(id, LogitRows::All).unwrap();
    assert_eq!(out.remaining, 0);
    let rows: Vec<f32> = out.logits.flatten_all().unwrap().to_vec1().unwrap();
    (id, adm.cached_tokens, rows)
}

#[test]
fn under_cold_pressure_blocks_are_down_tiered_reused_and_stay_within_the_looser_budget() {
    let (m, t) = model();
    let (tq3, tq4, tq6) = (
        CodecKind::TurboQuant { bits: 3 },
        CodecKind::TurboQuant { bits: 4 },
        CodecKind::TurboQuant { bits: 6 },
    );
    let profile = calibrate(
        m,
        t,
        &CalibrateOptions {
            max_tokens: 64,
            window: 65,
            chunk: 64,
            candidates: vec![tq3, tq4, tq6],
            budget_kl: 0.01,
            group: 30,
            ..CalibrateOptions::default()
        },
        |_| {},
    )
    .unwrap();
    let dir = tempdir("downtier");
    let path = dir.join("profile.json");
    profile.save(&path).unwrap();
    let shape = m.kv_shape(16).unwrap();
    let (reduced, predicted) = profile.reduced_codecs(&shape, LOOSER_KL).unwrap();
    let d = shape.head_dim;
    assert!(predicted <= LOOSER_KL, "{predicted}");
    assert!(
        reduced.bits_per_element(d) < profile.codecs.bits_per_element(d),
        "{reduced} vs {}",
        profile.codecs
    );
    let full_block = 16 * profile.codecs.token_bytes(&shape) as u64;
    let reduced_block = 16 * reduced.token_bytes(&shape) as u64;
    let config = |down_tier: bool, cold_blocks: u64| EngineConfig {
        kv_profile: Some(path.clone()),
        cold_bytes: cold_blocks * full_block,
        down_tier: down_tier.then_some(DownTier {
            budget_kl: LOOSER_KL,
            bytes: 32 * reduced_block,
        }),
        ..EngineConfig::default()
    };
    let text = license_tokens(900);
    let first: Vec<u32> = text[..450].to_vec();
    let second: Vec<u32> = [&text[..400], &text[450..500]].concat();
    let other = &text[500..900];

    // Session 1's first turn (28 full blocks) goes cold; session 2's 25 then need 23 more cold
    // slots than are free, and session 1's blocks are down-tiered for them from its chain's end
    // (the order a cold trim drops in, so that a chain never loses a block before a later one).
    let pressured = |down_tier: bool| {
        let mut core = EngineCore::new(m.clone(), t.clone(), config(down_tier, 30)).unwrap();
        turn(&mut core, &first, 1);
        assert_eq!(core.spill_idle().unwrap(), 28);
        turn(&mut core, other, 2);
        assert_eq!(core.spill_idle().unwrap(), 25);
        core
    };
    let mut core = pressured(true);
    let c = core.counters().clone();
    assert_eq!(c.down_tiered, 23, "{c:?}");
    assert!(c.dropped.values().all(|&n| n == 0), "{c:?}");
    let occupancy = core.occupancy();
    assert_eq!(
        (occupancy.reduced_used, occupancy.reduced_capacity),
        (23, 32)
    );
    let reduced_blocks: Vec<_> = core
        .store()
        .metadata()
        .iter()
        .filter(|m| m.precision() == Precision::Reduced)
        .map(|m| (m.tier(), m.session()))
        .collect();
    assert_eq!(reduced_blocks, vec![(Tier::Cold, Some(SessionId(1))); 23]);
    // The shadow is never handed down-tiered bytes: session 1's chain stops after its five
    // full-precision blocks.
    let chains = core
        .shadow_collect(&HashMap::new(), &HashSet::new(), None)
        .unwrap();
    let one = chains.iter().find(|c| c.session == SessionId(1)).unwrap();
    assert!(
        one.bytes[..5]
            .iter()
            .all(|b| matches!(b, CollectedBytes::New(_))),
        "{:?}",
        one.bytes
            .iter()
            .map(std::mem::discriminant)
            .collect::<Vec<_>>()
    );
    assert_eq!(one.bytes[5], CollectedBytes::Missing);

    // The next turn reuses the whole 400-token prefix (25 blocks), the 20 after the first five
    // from the reduced pool; the three past the prefix stay down-tiered.
    let (id, cached, logits) = scored(&mut core, &second);
    assert_eq!(cached, 400);
    assert_eq!(core.counters().down_tier_hits, 20);
    let restored = core
        .blocks(id)
        .unwrap()
        .iter()
        .filter(|&&b| core.store().metadata().get(b).unwrap().precision() == Precision::Restored)
        .count();
    assert_eq!(restored, 20);
    assert_eq!(core.occupancy().reduced_used, 3);

    // Against an unpressured run of the same two turns: within the looser budget, not exact.
    let mut calm = EngineCore::new(m.clone(), t.clone(), config(true, 512)).unwrap();
    turn(&mut calm, &first, 1);
    let (_, calm_cached, reference) = scored(&mut calm, &second);
    assert_eq!(calm_cached, 400);
    assert_eq!(calm.counters().down_tiered, 0);
    let kl = mean_kl(&reference, &logits);
    eprintln!(
        "down-tiered {:.2} → {:.2} bits/element: predicted {predicted:.4}, answer KL {kl:.5} \
         over 50 rows",
        profile.codecs.bits_per_element(d),
        reduced.bits_per_element(d)
    );
    assert!(kl > 1e-6 && kl <= LOOSER_KL, "{kl}");

    // The tier bridge trims a too-full cold tier the same way: down-tiered, not removed.
    let mut bridged = EngineCore::new(m.clone(), t.clone(), config(true, 30)).unwrap();
    turn(&mut bridged, &first, 1);
    assert_eq!(bridged.spill_idle().unwrap(), 28);
    let mut trim = TierPolicy {
        cold_high: 0.5,
        cold_target: 0.2,
        adapt: false,
        // The blocks just went cold; without cooldown the bridge may move them again at once.
        cooldown_cycles: 0,
        ..TierPolicy::default()
    };
    let r = bridged.tier_cycle(&mut trim, &[]).unwrap();
    assert_eq!(r.removed, 0, "{r:?}");
    assert_eq!(bridged.counters().down_tiered, 22);
    assert_eq!(bridged.occupancy().cold_used, 6);

    // Without down-tiering the same pressure drops them from the chain's end: the next turn
    // reuses only the five-block prefix left and recomputes the rest.
    let mut plain = pressured(false);
    assert!(plain.counters().dropped.values().sum::<u64>() >= 23);
    let (_, adm) = plain.start(spec(&second, 1)).unwrap();
    assert_eq!(adm.cached_tokens, 80);
    std::fs::remove_dir_all(dir).unwrap();
}
