//! Attention-aware eviction: a block the model has not read for the window loses its priority
//! band (spilled, not dropped); priority-only eviction keeps it; pinned blocks never move; the
//! chain that runs often stays hot under the use weight, and the one busy now outranks the one
//! busy before once counts are halved; counts outlive a block; the bytes a
//! turn reads back are the same either way; the tier bridge stages copies of the blocks
//! admission evicts next, and admission spilling onto them is no pressure on the bridge.

use engram_engine::{
    EngineConfig, EngineCore, EvictionMode, EvictionPolicy, PromptSegment, SequenceSpec, TierPolicy,
};
use engram_kvcore::{BlockId, BlockMeta, SessionId, SourceLayer, TenantId, Tier};

use crate::common::license_tokens;

/// A core of 256 tokens of context with 16 hot and 16 cold blocks, ranking by `mode` block by
/// block (not whole chains: these scenarios check the order of one chain's blocks), a block
/// unread for 8 sampled steps demoted.
fn engine(mode: EvictionMode) -> EngineCore {
    engine_with(EvictionPolicy {
        mode,
        idle_steps: 8,
        whole_chains: false,
        ..EvictionPolicy::default()
    })
}

/// A core of 256 tokens of context with 16 hot and 16 cold blocks, ranking by `eviction`.
fn engine_with(eviction: EvictionPolicy) -> EngineCore {
    let (m, t) = crate::common::model();
    let model = m.clone().with_context_length(256).unwrap();
    let probe = EngineCore::new(model.clone(), t.clone(), EngineConfig::default()).unwrap();
    let block = probe.store().block_bytes() as u64;
    let core = EngineCore::new(
        model,
        t.clone(),
        EngineConfig {
            hot_bytes: 16 * block,
            cold_bytes: 16 * block,
            eviction,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    assert_eq!(core.store().capacity(Tier::Hot), 16);
    core
}

fn spec(tokens: &[u32], source: SourceLayer, session: u64) -> SequenceSpec {
    SequenceSpec {
        segments: vec![PromptSegment {
            tokens: tokens.to_vec(),
            source,
            importance: 0.5,
        }],
        session: Some(SessionId(session)),
        ..SequenceSpec::plain(Vec::new(), TenantId(3))
    }
}

/// Prefills `spec`, decodes `steps` greedy tokens, finishes; the cached blocks and the first
/// token's logits.
fn turn(core: &mut EngineCore, spec: SequenceSpec, steps: usize) -> (Vec<BlockId>, Vec<f32>) {
    let (id, _) = core.start(spec).unwrap();
    let first = core.prefill(id).unwrap();
    let mut logits = first.clone();
    let blocks = core.blocks(id).unwrap().to_vec();
    for _ in 0..steps {
        let t = engram_engine::argmax(&logits);
        logits = core.decode(&[(id, t)]).unwrap().remove(0);
    }
    core.finish(id).unwrap();
    let cached: Vec<BlockId> = blocks
        .into_iter()
        .filter(|&b| core.store().metadata().get(b).is_some())
        .collect();
    (cached, first)
}

fn tiers(core: &EngineCore, ids: &[BlockId]) -> Vec<Tier> {
    ids.iter()
        .map(|&b| {
            core.store()
                .metadata()
                .get(b)
                .map_or(Tier::Recompute, |m| m.tier())
        })
        .collect()
}

/// Memories (priority 35) never read again, then a user turn (15) the model reads for 12
/// steps, then a third prompt that needs room: what each mode evicts.
fn scenario(mode: EvictionMode) -> (Vec<Tier>, Vec<Tier>, Vec<f32>) {
    let text = license_tokens(400);
    let mut core = engine(mode);
    let (memories, _) = turn(&mut core, spec(&text[..65], SourceLayer::Memories, 1), 0);
    assert_eq!(memories.len(), 4);
    let (user, _) = turn(
        &mut core,
        spec(&text[100..165], SourceLayer::UserTurn, 2),
        12,
    );
    assert_eq!(user.len(), 4);
    // Samples: each prefill's last row, and the 12 steps.
    assert_eq!(core.store().metadata().steps(), 14);
    // The memories were read by their own prefill's last row at most, never since.
    for &b in &memories {
        assert!(core.store().metadata().get(b).unwrap().read_step() <= 1);
    }
    // 10 blocks for the third prompt: 8 are free, two must go.
    let (_, _) = turn(
        &mut core,
        spec(&text[200..360], SourceLayer::UserTurn, 3),
        0,
    );
    assert!(core.counters().admission_evictions >= 2);
    let (memories, user) = (tiers(&core, &memories), tiers(&core, &user));
    // The user turn's prompt again: its first token's logits, whatever tier it was read from.
    let (_, again) = turn(
        &mut core,
        spec(&text[100..165], SourceLayer::UserTurn, 2),
        0,
    );
    (memories, user, again)
}

/// Ranking by how often a chain runs alone (use weight 1, no idle window), or priority-only;
/// the counts halved every `use_half_life` sampled steps (0: never), chains whole or not.
fn use_policy(mode: EvictionMode, use_half_life: u64, whole_chains: bool) -> EvictionPolicy {
    EvictionPolicy {
        mode,
        mass_weight: 0.0,
        recency_weight: 0.0,
        frequency_weight: 0.0,
        use_weight: 1.0,
        idle_steps: 0,
        use_half_life,
        whole_chains,
    }
}

/// A core ranking by [`use_policy`] under `mode`, no halving, block by block.
fn use_engine(mode: EvictionMode) -> EngineCore {
    engine_with(use_policy(mode, 0, false))
}

/// Two conversations' prompts of one layer (one band): the first run four times, the second
/// once and after it; then a third prompt of 10 blocks needs room (8 free, two must go). The
/// tiers of the busy chain's and the once-run chain's blocks.
fn use_scenario(mode: EvictionMode) -> (Vec<Tier>, Vec<Tier>) {
    let text = license_tokens(400);
    let mut core = use_engine(mode);
    let (busy, _) = turn(&mut core, spec(&text[..65], SourceLayer::UserTurn, 1), 0);
    assert_eq!(busy.len(), 4);
    for _ in 0..3 {
        let (again, _) = turn(&mut core, spec(&text[..65], SourceLayer::UserTurn, 1), 0);
        assert_eq!(again, busy, "the same prompt reuses its blocks");
    }
    let (once, _) = turn(
        &mut core,
        spec(&text[100..165], SourceLayer::UserTurn, 2),
        0,
    );
    assert_eq!(once.len(), 4);
    turn(
        &mut core,
        spec(&text[200..360], SourceLayer::UserTurn, 3),
        0,
    );
    assert!(core.counters().admission_evictions >= 2);
    (tiers(&core, &busy), tiers(&core, &once))
}

/// The use weight keeps the chain that runs often hot: priority-only eviction (least recently
/// touched first) spills the busy chain's blocks because the once-run chain ran last; ranked
/// by use, the once-run chain loses its last two blocks.
#[test]
fn the_use_weight_keeps_the_chain_that_runs_often() {
    use Tier::{Cold, Hot};
    let (busy, once) = use_scenario(EvictionMode::Priority);
    assert_eq!(busy.iter().filter(|&&t| t == Cold).count(), 2, "{busy:?}");
    assert_eq!(once, vec![Hot; 4]);
    let (busy, once) = use_scenario(EvictionMode::Attention);
    assert_eq!(busy, vec![Hot; 4]);
    assert_eq!(once, vec![Hot, Hot, Cold, Cold]);
}

/// A chain run six times, then another run three times, then a third prompt of 10 blocks that
/// needs room (8 free, two must go), ranked by use alone with the counts halved every
/// `half_life` sampled steps (0: never). The tiers of the chain that was busy first and of the
/// one busy last.
fn aging_scenario(half_life: u64) -> (Vec<Tier>, Vec<Tier>) {
    let text = license_tokens(400);
    let mut core = engine_with(use_policy(EvictionMode::Attention, half_life, false));
    let (earlier, _) = turn(&mut core, spec(&text[..65], SourceLayer::UserTurn, 1), 0);
    for _ in 0..5 {
        turn(&mut core, spec(&text[..65], SourceLayer::UserTurn, 1), 0);
    }
    let (now, _) = turn(
        &mut core,
        spec(&text[100..165], SourceLayer::UserTurn, 2),
        0,
    );
    for _ in 0..2 {
        turn(
            &mut core,
            spec(&text[100..165], SourceLayer::UserTurn, 2),
            0,
        );
    }
    let (e, n) = (attended(&core, &earlier), attended(&core, &now));
    if half_life == 0 {
        assert!(e.iter().zip(&n).all(|(e, n)| e > n), "{e:?} vs {n:?}");
    } else {
        assert!(e.iter().zip(&n).all(|(e, n)| e < n), "{e:?} vs {n:?}");
    }
    turn(
        &mut core,
        spec(&text[200..360], SourceLayer::UserTurn, 3),
        0,
    );
    assert!(core.counters().admission_evictions >= 2);
    (tiers(&core, &earlier), tiers(&core, &now))
}

/// Without aging, a chain that ran often long ago keeps its place against one that runs now;
/// with the counts halved every two sampled steps, the chain busy now stays hot and the one
/// busy before loses its last two blocks.
#[test]
fn halving_the_counts_lets_the_chain_busy_now_outrank_the_one_busy_before() {
    use Tier::{Cold, Hot};
    let (earlier, now) = aging_scenario(0);
    assert_eq!(earlier, vec![Hot; 4]);
    assert_eq!(now, vec![Hot, Hot, Cold, Cold]);
    let (earlier, now) = aging_scenario(2);
    assert_eq!(earlier, vec![Hot, Hot, Cold, Cold]);
    assert_eq!(now, vec![Hot; 4]);
}

/// A prompt of an agent's prefix (memories: a higher band than the conversation's, and not
/// pinned) and a conversation (user turn).
fn agent_spec(prefix: &[u32], conversation: &[u32], session: u64) -> SequenceSpec {
    let segment = |tokens: &[u32], source| PromptSegment {
        tokens: tokens.to_vec(),
        source,
        importance: 0.5,
    };
    SequenceSpec {
        segments: vec![
            segment(prefix, SourceLayer::Memories),
            segment(conversation, SourceLayer::UserTurn),
        ],
        session: Some(SessionId(session)),
        ..SequenceSpec::plain(Vec::new(), TenantId(3))
    }
}

/// Two agents' chains of two prefix and two conversation blocks, the first run four times,
/// the second once; then a prompt of 12 blocks needs room (8 free, four must go), ranked by
/// use alone, chains whole or not. The tiers of the busy chain and of the occasional one.
fn chain_scenario(whole_chains: bool) -> (Vec<Tier>, Vec<Tier>) {
    let text = license_tokens(400);
    let mut core = engine_with(use_policy(EvictionMode::Attention, 0, whole_chains));
    let busy_spec = || agent_spec(&text[..32], &text[32..65], 1);
    let (busy, _) = turn(&mut core, busy_spec(), 0);
    assert_eq!(busy.len(), 4);
    for _ in 0..3 {
        turn(&mut core, busy_spec(), 0);
    }
    let (occasional, _) = turn(
        &mut core,
        agent_spec(&text[100..132], &text[132..165], 2),
        0,
    );
    assert_eq!(occasional.len(), 4);
    turn(
        &mut core,
        spec(&text[200..392], SourceLayer::UserTurn, 3),
        0,
    );
    assert!(core.counters().admission_evictions >= 4);
    (tiers(&core, &busy), tiers(&core, &occasional))
}

/// Ranked block by block, every conversation block (a lower band) goes before any prefix
/// block, so the busy agent loses its conversation's end too (its next turn recomputes it);
/// ranked as whole chains, the occasional agent's chain goes whole, from its end, and the busy
/// one stays hot.
#[test]
fn whole_chains_keep_the_busy_agents_conversation_and_drop_the_occasional_chain() {
    use Tier::{Cold, Hot};
    let (busy, occasional) = chain_scenario(false);
    assert_eq!(busy, vec![Hot, Hot, Cold, Cold]);
    assert_eq!(occasional, vec![Hot, Hot, Cold, Cold]);
    let (busy, occasional) = chain_scenario(true);
    assert_eq!(busy, vec![Hot; 4]);
    assert_eq!(occasional, vec![Cold; 4]);
}

#[test]
fn an_unread_block_loses_its_band_and_is_spilled_not_dropped() {
    let (memories_p, user_p, logits_p) = scenario(EvictionMode::Priority);
    let (t, user_a, logits_a) = scenario(EvictionMode::Attention);
    // Priority only: the user turn (15) goes before the memories (35), read or not.
    assert!(memories_p.iter().all(|&t| t == Tier::Hot), "{memories_p:?}");
    assert_eq!(
        user_p.iter().filter(|&&t| t == Tier::Cold).count(),
        2,
        "{user_p:?}"
    );
    // Attention-aware: the unread memories go first, from their chain's end, spilled.
    assert_eq!(t.iter().filter(|&&t| t == Tier::Cold).count(), 2, "{t:?}");
    assert_eq!(&t[..2], &[Tier::Hot, Tier::Hot], "{t:?}");
    assert!(user_a.iter().all(|&t| t == Tier::Hot), "{user_a:?}");
    // Eviction moved bytes, never changed them: the same prompt gives the same logits.
    assert_eq!(logits_p, logits_a);
}

#[test]
fn a_pinned_block_is_never_demoted_however_long_unread() {
    let text = license_tokens(400);
    let mut core = engine(EvictionMode::Attention);
    let pinned_spec = SequenceSpec {
        pin_key: Some([7; 32]),
        ..spec(&text[..65], SourceLayer::Rules, 1)
    };
    let (rules, _) = turn(&mut core, pinned_spec, 0);
    let pinned: Vec<BlockId> = rules
        .iter()
        .copied()
        .filter(|&b| {
            core.store().metadata().get(b).unwrap().pin() == engram_kvcore::PinState::Pinned
        })
        .collect();
    assert!(!pinned.is_empty());
    let (user, _) = turn(
        &mut core,
        spec(&text[100..165], SourceLayer::UserTurn, 2),
        12,
    );
    let _ = turn(
        &mut core,
        spec(&text[200..360], SourceLayer::UserTurn, 3),
        0,
    );
    assert!(tiers(&core, &pinned).iter().all(|&t| t == Tier::Hot));
    // Room came out of the unpinned blocks (the user turn, or the rules' unpinned tail).
    let unpinned_hot = user
        .iter()
        .chain(&rules)
        .filter(|b| !pinned.contains(b))
        .filter(|&&b| tiers(&core, &[b])[0] == Tier::Hot)
        .count();
    assert!(unpinned_hot < user.len() + rules.len() - pinned.len());
}

/// The cold tier's drops follow the same ranking: memories never read again (priority 35, but
/// unread for the window) and a user turn read for 12 steps (priority 15) both cold, then a
/// third prompt's 10 blocks spilled into 8 free cold slots: two blocks must leave the cache.
fn cold_scenario(mode: EvictionMode) -> (Vec<Tier>, Vec<Tier>) {
    let text = license_tokens(400);
    let mut core = engine(mode);
    let (memories, _) = turn(&mut core, spec(&text[..65], SourceLayer::Memories, 1), 0);
    let (user, _) = turn(
        &mut core,
        spec(&text[100..165], SourceLayer::UserTurn, 2),
        12,
    );
    assert_eq!(core.spill_idle().unwrap(), 8);
    turn(
        &mut core,
        spec(&text[200..360], SourceLayer::UserTurn, 3),
        0,
    );
    assert_eq!(core.spill_idle().unwrap(), 10);
    assert_eq!(core.counters().dropped.values().sum::<u64>(), 2);
    (tiers(&core, &memories), tiers(&core, &user))
}

#[test]
fn the_cold_tier_drops_what_the_model_does_not_read_first_and_priority_mode_by_priority() {
    use Tier::{Cold, Recompute};
    // Attention-aware: the unread memories go, from their chain's end.
    let (memories, user) = cold_scenario(EvictionMode::Attention);
    assert_eq!(memories, vec![Cold, Cold, Recompute, Recompute]);
    assert_eq!(user, vec![Cold; 4]);
    // Priority-only: the lower-priority user turn goes, though the model read it.
    let (memories, user) = cold_scenario(EvictionMode::Priority);
    assert_eq!(memories, vec![Cold; 4]);
    assert_eq!(user, vec![Cold, Cold, Recompute, Recompute]);
}

/// Each cached block's `count`, in order (0 for a block no longer held).
fn counts(core: &EngineCore, ids: &[BlockId], count: fn(&BlockMeta) -> u32) -> Vec<u32> {
    ids.iter()
        .map(|&b| core.store().metadata().get(b).map_or(0, count))
        .collect()
}

/// Each cached block's read count, in order.
fn reads(core: &EngineCore, ids: &[BlockId]) -> Vec<u32> {
    counts(core, ids, BlockMeta::reads)
}

/// Each cached block's count of steps that attended it, in order.
fn attended(core: &EngineCore, ids: &[BlockId]) -> Vec<u32> {
    counts(core, ids, BlockMeta::attended)
}

/// Element-wise sum.
fn sum(a: &[u32], b: &[u32]) -> Vec<u32> {
    a.iter().zip(b).map(|(x, y)| x + y).collect()
}

/// A block dropped with its conversation and computed again from the same tokens (an agent's
/// stable prefix in its next conversation) starts with the read count the model gave the
/// first, and the count of steps that attended it: frequency outlives the blocks. Another
/// tenant's identical text, the tenant after it is forgotten whole, or an engine with
/// priority-only eviction starts from nothing. The admission says where the blocks came from.
#[test]
fn a_recomputed_block_carries_the_reads_of_the_one_it_replaces() {
    let text = license_tokens(400);
    let prefix = &text[..65]; // 4 full blocks, the last token in a partial one
    // What a fresh computation of the prefix (prefill, no decode) gives each block.
    let mut fresh = engine(EvictionMode::Attention);
    let (ids, _) = turn(&mut fresh, spec(prefix, SourceLayer::Identity, 1), 0);
    let baseline = reads(&fresh, &ids);
    let baseline_attended = attended(&fresh, &ids);
    assert_eq!(baseline.len(), 4);

    let mut core = engine(EvictionMode::Attention);
    let (first, _) = turn(&mut core, spec(prefix, SourceLayer::Identity, 1), 12);
    let read = reads(&core, &first);
    assert!(
        read.iter().any(|&r| r > 0),
        "12 decode steps read the prefix: {read:?}"
    );
    // The same prompt again: every full block found hot.
    let (id, admission) = core.start(spec(prefix, SourceLayer::Identity, 1)).unwrap();
    assert_eq!(
        (
            admission.hot_blocks,
            admission.warmed_blocks,
            admission.computed_blocks
        ),
        (4, 0, 0)
    );
    core.finish(id).unwrap();
    let used = attended(&core, &first);
    assert!(
        used.iter().zip(&baseline_attended).all(|(u, b)| u > b),
        "12 decode steps and a reuse attended the prefix: {used:?} vs {baseline_attended:?}"
    );
    // The cache drops the conversation's blocks (dropped, not deleted: a deletion forgets
    // their counts too, see `prefix::tests`).
    core.clear_cache().unwrap();
    assert!(
        first
            .iter()
            .all(|&b| core.store().metadata().get(b).is_none())
    );
    // The next conversation computes the prefix again, and its blocks carry the reads.
    let (id, admission) = core.start(spec(prefix, SourceLayer::Identity, 2)).unwrap();
    assert_eq!(
        (
            admission.hot_blocks,
            admission.warmed_blocks,
            admission.computed_blocks
        ),
        (0, 0, 4)
    );
    core.prefill(id).unwrap();
    let second = core.blocks(id).unwrap()[..4].to_vec();
    core.finish(id).unwrap();
    assert_eq!(reads(&core, &second), sum(&read, &baseline));
    assert_eq!(attended(&core, &second), sum(&used, &baseline_attended));
    // Another tenant's copy of the text starts from nothing.
    let other = SequenceSpec {
        tenant: TenantId(4),
        ..spec(prefix, SourceLayer::Identity, 1)
    };
    let (theirs, _) = turn(&mut core, other, 0);
    assert_eq!(reads(&core, &theirs), baseline);
    assert_eq!(attended(&core, &theirs), baseline_attended);
    // Forgetting the tenant whole forgets its history too.
    core.forget(TenantId(3), 0, 0).unwrap();
    let (third, _) = turn(&mut core, spec(prefix, SourceLayer::Identity, 3), 0);
    assert_eq!(reads(&core, &third), baseline);
    assert_eq!(attended(&core, &third), baseline_attended);
    // Priority-only eviction carries nothing.
    let mut plain = engine(EvictionMode::Priority);
    turn(&mut plain, spec(prefix, SourceLayer::Identity, 1), 12);
    plain.forget(TenantId(3), u64::MAX, 1).unwrap();
    let (again, _) = turn(&mut plain, spec(prefix, SourceLayer::Identity, 2), 0);
    assert_eq!(attended(&plain, &again), baseline_attended);
    assert_eq!(reads(&plain, &again), baseline);
}

/// Two turns fill 8 of 16 hot blocks; a bridge cycle over 30 % stages down to 25 % (4 blocks);
/// then a prompt of 10 blocks must evict 2. Under `mode`: the staged blocks are the first of
/// admission's order, the admission's spills all take their copies, and the next review sees
/// evictions but no pressure.
fn staged_scenario(mode: EvictionMode) {
    let text = license_tokens(400);
    let mut core = engine(mode);
    turn(&mut core, spec(&text[..65], SourceLayer::Memories, 1), 0);
    turn(
        &mut core,
        spec(&text[100..165], SourceLayer::UserTurn, 2),
        12,
    );
    assert_eq!(core.occupancy().hot_used, 8, "{mode:?}");
    let next = core.admission_order();
    assert_eq!(next.len(), 8, "{mode:?}");
    let mut policy = TierPolicy {
        hot_high: 0.3,
        hot_target: 0.25,
        warm_below: 0.0,
        adapt: false,
        ..TierPolicy::default()
    };
    let r = core.tier_cycle(&mut policy, &[]).unwrap();
    assert_eq!((r.staged, r.spilled), (4, 0), "{mode:?} {r:?}");
    let mut staged: Vec<BlockId> = next
        .iter()
        .copied()
        .filter(|&id| core.store().is_staged(id))
        .collect();
    assert_eq!(staged, next[..4], "{mode:?}: staged in admission's order");
    let used = core.stage_stats().used;
    turn(
        &mut core,
        spec(&text[200..360], SourceLayer::UserTurn, 3),
        0,
    );
    let c = core.counters().clone();
    assert!(
        (2..=4).contains(&c.admission_evictions),
        "{mode:?} {}",
        c.admission_evictions
    );
    assert_eq!(c.admission_staged, c.admission_evictions, "{mode:?}");
    assert_eq!(
        core.stage_stats().used - used,
        c.admission_evictions,
        "{mode:?}"
    );
    // The evicted ones are cold now, the copies they took gone.
    staged.truncate(c.admission_evictions as usize);
    assert!(
        tiers(&core, &staged).iter().all(|&t| t == Tier::Cold),
        "{mode:?}"
    );
    let r = core.tier_cycle(&mut policy, &[]).unwrap();
    assert_eq!(r.review.admission_evictions, c.admission_evictions);
    assert_eq!(r.review.admission_staged, c.admission_evictions);
    assert!(
        !r.suggestions.iter().any(|s| s == "demote_sooner"),
        "{mode:?} {r:?}"
    );
}

#[test]
fn the_bridge_stages_what_admission_evicts_next_under_either_mode() {
    staged_scenario(EvictionMode::Attention);
    staged_scenario(EvictionMode::Priority);
}
