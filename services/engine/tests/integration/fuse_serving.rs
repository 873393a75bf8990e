//! Block fusion on the serving path (issue 26): under cold-tier pressure a session's cold blocks
//! share the row directions of another session's blocks at the same positions instead of being
//! dropped, the next turn warms them back, a KL witness tunes the threshold, and blocks of two
//! tenants never share anything.

use engram_engine::{EngineConfig, EngineCore, FusionPolicy, SequenceSpec};
use engram_kvcore::{
    BlockId, CodecKind, KvError, LayerCodecs, Precision, SessionId, TenantId, Tier, TokenRange,
};

use crate::common::{license_tokens, model};

const TQ4: CodecKind = CodecKind::TurboQuant { bits: 4 };

fn config(fusion: Option<FusionPolicy>, cold_blocks: u64) -> EngineConfig {
    let shape = model().0.kv_shape(16).unwrap();
    let block = 16 * LayerCodecs::uniform(&shape, TQ4).token_bytes(&shape) as u64;
    EngineConfig {
        codec: TQ4,
        value_codec: None,
        cold_bytes: cold_blocks * block,
        fusion,
        ..EngineConfig::default()
    }
}

/// Every layer may share at any similarity; the witness runs on every decision.
fn permissive(kl_budget: f64) -> FusionPolicy {
    FusionPolicy {
        kl_budget,
        start_threshold: -1.0,
        min_threshold: -1.0,
        step: 0.5,
        witness_every: 1,
        ..FusionPolicy::default()
    }
}

fn turn(core: &mut EngineCore, tokens: &[u32], tenant: u64, session: u64) -> usize {
    let spec = SequenceSpec {
        session: Some(SessionId(session)),
        ..SequenceSpec::plain(tokens.to_vec(), TenantId(tenant))
    };
    let (id, admission) = core.start(spec).unwrap();
    core.prefill(id).unwrap();
    core.finish(id).unwrap();
    admission.cached_tokens
}

/// The live block of `tenant` over `tokens` in `tier`s other than recompute.
fn block_at(core: &EngineCore, tenant: u64, tokens: TokenRange) -> Vec<BlockId> {
    core.store()
        .metadata()
        .iter()
        .filter(|m| {
            m.tenant() == TenantId(tenant) && m.tokens() == tokens && m.tier() != Tier::Recompute
        })
        .map(|m| m.id())
        .collect()
}

/// Sessions 1 and 2 (28 and 25 blocks) go cold in a 60-block cold tier; session 3's 25 blocks
/// then need 18 slots more than are free.
fn pressured(fusion: Option<FusionPolicy>) -> (EngineCore, Vec<u32>) {
    let (m, t) = model();
    let text = license_tokens(1300);
    let mut core = EngineCore::new(m.clone(), t.clone(), config(fusion, 60)).unwrap();
    turn(&mut core, &text[..450], 1, 1);
    assert_eq!(core.spill_idle().unwrap(), 28);
    turn(&mut core, &text[450..850], 1, 2);
    assert_eq!(core.spill_idle().unwrap(), 25);
    turn(&mut core, &text[850..1250], 1, 3);
    assert_eq!(core.spill_idle().unwrap(), 25);
    (core, text)
}

#[test]
fn under_cold_pressure_blocks_fuse_instead_of_dropping_and_the_next_turn_warms_them() {
    let (mut core, text) = pressured(Some(permissive(100.0)));
    let c = core.counters().clone();
    assert!(c.fused_blocks >= 9, "{c:?}");
    assert!(c.dropped.values().all(|&n| n == 0), "{c:?}");
    let status = core.fusion_status().unwrap();
    assert!(status.pool_blocks >= 18, "{status:?}");
    assert!(status.pool_bytes < status.unfused_bytes, "{status:?}");
    assert!(status.witnesses >= 1, "{status:?}");
    assert!(
        status.last_kl.is_some_and(|kl| kl.is_finite() && kl >= 0.0),
        "{status:?}"
    );
    assert_eq!(status.refused, 0);
    let fused: Vec<_> = core
        .store()
        .metadata()
        .iter()
        .filter(|m| m.precision() == Precision::Fused)
        .map(|m| (m.id(), m.tenant(), m.tokens(), m.fused_layers()))
        .collect();
    assert_eq!(fused.len(), status.pool_blocks);
    // Every fused block is tenant 1's, and some are members sharing every layer's directions.
    assert!(fused.iter().all(|f| f.1 == TenantId(1)));
    assert!(fused.iter().any(|f| usize::from(f.3) == 30), "{fused:?}");

    // Session 1's next turn reuses its first 400 tokens' blocks: the fused ones are warmed.
    let next: Vec<u32> = [&text[..400], &text[1250..1290]].concat();
    let cached = turn(&mut core, &next, 1, 1);
    assert_eq!(cached, 400 / 16 * 16);
    let c = core.counters().clone();
    assert!(c.fused_hits >= 1, "{c:?}");
    let restored = core
        .store()
        .metadata()
        .iter()
        .filter(|m| m.tier() != Tier::Cold && m.precision() == Precision::Restored)
        .filter(|m| m.fused_layers() > 0)
        .count();
    assert!(restored >= 1);

    // Fused blocks are marked in the session's chain record; their bytes are not collected.
    let chains = core
        .shadow_collect(&Default::default(), &Default::default(), None)
        .unwrap();
    let marked = chains
        .iter()
        .flat_map(|c| c.blocks.iter())
        .filter(|b| b.fused)
        .count();
    assert!(marked >= 1, "no chain block is marked fused");
}

#[test]
fn a_witness_over_the_budget_refuses_the_fusion_and_raises_the_threshold() {
    let (core, _) = pressured(Some(permissive(1e-12)));
    let status = core.fusion_status().unwrap();
    assert!(status.witnesses >= 1, "{status:?}");
    assert!(status.refused >= 1, "{status:?}");
    assert!(status.threshold > -1.0, "{status:?}");
    assert!(status.last_kl.is_some_and(|kl| kl > 1e-12), "{status:?}");
    assert!(
        core.counters().fused_blocks < status.decisions,
        "{status:?}"
    );
}

#[test]
fn blocks_of_two_tenants_never_fuse_even_when_identical() {
    let (m, t) = model();
    let text = license_tokens(900);
    let mut core =
        EngineCore::new(m.clone(), t.clone(), config(Some(permissive(100.0)), 60)).unwrap();
    // The same text for tenants 1 and 2: the same KV, blocks hashed apart.
    turn(&mut core, &text[..450], 1, 1);
    turn(&mut core, &text[..450], 2, 1);
    assert_eq!(core.spill_idle().unwrap(), 56);
    let range = TokenRange::new(160, 176);
    let (a, b) = (block_at(&core, 1, range), block_at(&core, 2, range));
    assert_eq!((a.len(), b.len()), (1, 1));
    let sim = core.store().fusion_similarity(a[0], b[0]).unwrap();
    assert!(
        sim.iter()
            .all(|l| l.is_some_and(|(k, v)| k > 0.999 && v > 0.999)),
        "{sim:?}"
    );
    let mut store = core.store().try_clone().unwrap();
    assert!(matches!(
        store.fuse(a[0], b[0], &[true; 30]),
        Err(KvError::NotFusable { .. })
    ));
    // Pressure: nothing fuses across the tenants; blocks are dropped as without fusion.
    turn(&mut core, &text[450..850], 2, 2);
    core.spill_idle().unwrap();
    assert_eq!(core.counters().fused_blocks, 0);
    assert!(core.counters().dropped.values().sum::<u64>() > 0);
    assert_eq!(core.fusion_status().unwrap().pool_blocks, 0);
}

#[test]
fn the_default_policy_keeps_its_threshold_in_range_and_reports_what_it_fused() {
    let (core, _) = pressured(Some(FusionPolicy::default()));
    let status = core.fusion_status().unwrap();
    let policy = FusionPolicy::default();
    assert!(
        (policy.min_threshold..=1.0).contains(&status.threshold),
        "{status:?}"
    );
    assert!(status.witnesses <= status.decisions, "{status:?}");
    let c = core.counters();
    let dropped: u64 = c.dropped.values().sum();
    // 18 cold slots were needed: each fusion freed one or two, each drop one.
    assert!(dropped + 2 * c.fused_blocks >= 18, "{c:?}");
    eprintln!(
        "default policy: {} decisions, {} fused, {} dropped, threshold {:.3}, {} witnesses \
         (last KL {:?}), nearest miss {:?}, pool {} of {} bytes unfused",
        status.decisions,
        c.fused_blocks,
        dropped,
        status.threshold,
        status.witnesses,
        status.last_kl,
        status.nearest,
        status.pool_bytes,
        status.unfused_bytes
    );
}
