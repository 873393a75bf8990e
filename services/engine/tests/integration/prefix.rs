//! Prefix reuse: reused blocks give the logits that recomputing them gives; tags, tenants,
//! tiers and pins.

use engram_engine::{EngineConfig, EngineCore, PUBLIC_TENANT, PromptSegment, SequenceSpec};
use engram_kvcore::{CodecKind, PinState, SessionId, SourceLayer, TenantId, Tier};

use crate::common::{core, core_with, license_tokens, mean_kl, rel_l2};

fn with_suffix(prefix: &[u32], suffix: &[u32]) -> Vec<u32> {
    let mut t = prefix.to_vec();
    t.extend_from_slice(suffix);
    t
}

#[test]
fn reused_prefix_blocks_give_the_logits_of_recomputing_them() {
    let text = license_tokens(600);
    let (prefix, s1, s2, s3) = (
        &text[..400],
        &text[400..450],
        &text[450..500],
        &text[500..550],
    );
    let mut cached = core(CodecKind::TQ4);
    let (a, adm) = cached
        .start(SequenceSpec::plain(with_suffix(prefix, s1), TenantId(1)))
        .unwrap();
    assert_eq!(adm.cached_tokens, 0);
    cached.prefill(a).unwrap();
    cached.finish(a).unwrap();

    // Hot reuse: the prefix's 25 full blocks come from the cache.
    let (b, adm) = cached
        .start(SequenceSpec::plain(with_suffix(prefix, s2), TenantId(1)))
        .unwrap();
    assert_eq!((adm.cached_tokens, adm.warmed_blocks), (400, 0));
    let hot = cached.prefill(b).unwrap();
    cached.finish(b).unwrap();

    let mut fresh = core(CodecKind::TQ4);
    let (c, adm) = fresh
        .start(SequenceSpec::plain(with_suffix(prefix, s2), TenantId(1)))
        .unwrap();
    assert_eq!(adm.cached_tokens, 0);
    let recomputed = fresh.prefill(c).unwrap();
    let err = rel_l2(&hot, &recomputed);
    assert!(err < 1e-3, "hot reuse vs recompute: {err:.2e}");

    // Warm reuse: spill everything idle, then the lookup warms the prefix back.
    let spilled = cached.spill_idle().unwrap();
    assert!(spilled >= 25, "{spilled}");
    let (d, adm) = cached
        .start(SequenceSpec::plain(with_suffix(prefix, s3), TenantId(1)))
        .unwrap();
    assert_eq!(adm.cached_tokens, 400);
    assert_eq!(adm.warmed_blocks, 25);
    for &blk in cached.blocks(d).unwrap() {
        assert_eq!(
            cached.store().metadata().get(blk).unwrap().tier(),
            Tier::Hot
        );
    }
    let warm = cached.prefill(d).unwrap();
    let (e, _) = fresh
        .start(SequenceSpec::plain(with_suffix(prefix, s3), TenantId(2)))
        .unwrap();
    let recomputed = fresh.prefill(e).unwrap();
    let err = rel_l2(&warm, &recomputed);
    assert!(err < 1e-3, "warm reuse vs recompute: {err:.2e}");
}

/// A prompt resumed from a cached prefix computes, bit for bit, the logits a whole prefill of
/// the same prompt computes: whatever number of tokens is left (one included, which is a
/// prompt row, not a decode step), for every weight format. Seeded sampling depends on it.
#[test]
fn a_resumed_prompt_computes_the_bits_of_a_whole_prefill() {
    use engram_engine::WeightFormat;
    let text = license_tokens(420);
    let prefix = &text[..400];
    for format in [WeightFormat::Quantized, WeightFormat::Int16] {
        let config = || EngineConfig {
            codec: CodecKind::TQ4,
            value_codec: None,
            ..EngineConfig::default()
        };
        let mut cached = crate::common::core_as(format, config());
        let (a, _) = cached
            .start(SequenceSpec::plain(
                with_suffix(prefix, &text[400..403]),
                TenantId(1),
            ))
            .unwrap();
        cached.prefill(a).unwrap();
        cached.finish(a).unwrap();
        for left in [1usize, 2, 5, 17] {
            let prompt = &text[..400 + left];
            let (b, adm) = cached
                .start(SequenceSpec::plain(prompt.to_vec(), TenantId(1)))
                .unwrap();
            assert_eq!(adm.cached_tokens, 400, "{format:?}, {left} left");
            let resumed = cached.prefill(b).unwrap();
            cached.finish(b).unwrap();
            let mut fresh = crate::common::core_as(format, config());
            let (c, adm) = fresh
                .start(SequenceSpec::plain(prompt.to_vec(), TenantId(1)))
                .unwrap();
            assert_eq!(adm.cached_tokens, 0);
            let whole = fresh.prefill(c).unwrap();
            let differ = resumed
                .iter()
                .zip(&whole)
                .filter(|(x, y)| x.to_bits() != y.to_bits())
                .count();
            assert_eq!(
                differ,
                0,
                "{format:?}, {left} left: {differ} logits differ, rel. L2 {:.2e}",
                rel_l2(&resumed, &whole)
            );
        }
    }
}

#[test]
fn the_partial_last_block_is_recomputed_and_tenants_never_share() {
    let text = license_tokens(100);
    let mut core = core(CodecKind::TQ4);
    let (a, _) = core
        .start(SequenceSpec::plain(text[..70].to_vec(), TenantId(1)))
        .unwrap();
    core.prefill(a).unwrap();
    core.finish(a).unwrap();
    // 70 tokens: 4 full blocks cached; the 6 tokens of block 5 are not.
    assert_eq!(core.cache().len(), 4);
    let (b, adm) = core
        .start(SequenceSpec::plain(text[..70].to_vec(), TenantId(1)))
        .unwrap();
    assert_eq!(adm.cached_tokens, 64);
    core.finish(b).unwrap();
    // Exactly 64 tokens: the last token must be computed, so only 3 blocks are reused.
    let (c, adm) = core
        .start(SequenceSpec::plain(text[..64].to_vec(), TenantId(1)))
        .unwrap();
    assert_eq!(adm.cached_tokens, 48);
    core.finish(c).unwrap();
    // Another tenant with the same text reuses nothing.
    let (d, adm) = core
        .start(SequenceSpec::plain(text[..70].to_vec(), TenantId(2)))
        .unwrap();
    assert_eq!(adm.cached_tokens, 0);
    core.finish(d).unwrap();
}

#[test]
fn blocks_carry_the_segment_tags_and_stable_layers_are_pinned() {
    let text = license_tokens(120);
    let mut core = core(CodecKind::TQ4);
    let spec = SequenceSpec {
        segments: vec![
            PromptSegment {
                tokens: text[..40].to_vec(),
                source: SourceLayer::Axioms,
                importance: 1.0,
            },
            PromptSegment {
                tokens: text[40..70].to_vec(),
                source: SourceLayer::Memories,
                importance: 0.7,
            },
            PromptSegment {
                tokens: text[70..100].to_vec(),
                source: SourceLayer::UserTurn,
                importance: 0.4,
            },
        ],
        tenant: TenantId(9),
        session: Some(SessionId(3)),
        reuse: Default::default(),
        hot_block_quota: None,
        pin_key: Some([7; 32]),
        cold_block_quota: None,
        public_tokens: 0,
        public_pin_key: None,
    };
    let (id, _) = core.start(spec).unwrap();
    core.prefill(id).unwrap();
    let blocks = core.blocks(id).unwrap().to_vec();
    assert_eq!(blocks.len(), 7); // 100 tokens in blocks of 16
    let meta = |i: usize| core.store().metadata().get(blocks[i]).unwrap().clone();
    // Block 2 (32..48) is 8 axioms + 8 memories: the earlier segment wins the tie.
    let sources: Vec<_> = (0..7).map(|i| meta(i).source()).collect();
    use SourceLayer::*;
    assert_eq!(
        sources,
        vec![
            Axioms, Axioms, Axioms, Memories, UserTurn, UserTurn, UserTurn
        ]
    );
    assert_eq!(meta(3).importance(), 0.7);
    assert_eq!(meta(0).tenant(), TenantId(9));
    assert_eq!(meta(0).session(), Some(SessionId(3)));
    assert_eq!((meta(4).tokens().start, meta(4).tokens().end), (64, 80));
    // Full axiom blocks are cached and pinned; the others are cached unpinned.
    assert_eq!(meta(0).pin(), PinState::Pinned);
    assert_eq!(meta(2).pin(), PinState::Pinned);
    assert_eq!(meta(3).pin(), PinState::Unpinned);
    // Sequence + cache own each full block; the partial last block is the sequence's alone.
    assert_eq!(meta(0).ref_count(), 2);
    assert_eq!(meta(6).ref_count(), 1);
    core.finish(id).unwrap();
    assert!(
        core.store().metadata().get(blocks[6]).is_none(),
        "uncached block freed"
    );
    assert_eq!(
        core.store().metadata().get(blocks[0]).unwrap().ref_count(),
        1
    );
}

/// Runs `prompt` and 40 greedy tokens; returns the running sequence and all its tokens.
fn count_to_twenty(core: &mut EngineCore, prompt: &[u32]) -> (engram_engine::SeqId, Vec<u32>) {
    let (id, _) = core
        .start(SequenceSpec::plain(prompt.to_vec(), TenantId(1)))
        .unwrap();
    let mut logits = core.prefill(id).unwrap();
    for _ in 0..40 {
        let t = engram_engine::argmax(&logits);
        logits = core.decode(&[(id, t)]).unwrap().remove(0);
    }
    let all = core.tokens(id).unwrap().to_vec();
    (id, all)
}

#[test]
fn generated_blocks_are_cached_for_the_next_turn_when_enabled() {
    let prompt = crate::common::chat("Count from one to twenty in words.");
    let mut core = core_with(EngineConfig {
        cache_generated: true,
        ..EngineConfig::default()
    });
    let (id, all) = count_to_twenty(&mut core, &prompt);
    let blocks = core.blocks(id).unwrap().to_vec();
    core.finish(id).unwrap();
    let last_full = all.len() / 16 - 1;
    let meta = core.store().metadata().get(blocks[last_full]).unwrap();
    assert_eq!(meta.source(), SourceLayer::AssistantTurn);
    // The next turn's prompt starts with this whole conversation.
    let (next, adm) = core
        .start(SequenceSpec::plain(all.clone(), TenantId(1)))
        .unwrap();
    assert_eq!(adm.cached_tokens, (all.len() - 1) / 16 * 16);
    core.finish(next).unwrap();
}

#[test]
fn by_default_only_prompt_blocks_are_cached() {
    let prompt = crate::common::chat("Count from one to twenty in words.");
    let mut core = core(CodecKind::TQ4);
    let (id, all) = count_to_twenty(&mut core, &prompt);
    core.finish(id).unwrap();
    let (next, adm) = core
        .start(SequenceSpec::plain(all.clone(), TenantId(1)))
        .unwrap();
    // Only the prompt's full blocks; the reply is computed again by prefill.
    assert_eq!(adm.cached_tokens, prompt.len() / 16 * 16);
    assert!(adm.cached_tokens < (all.len() - 1) / 16 * 16);
    core.finish(next).unwrap();
}

#[test]
fn bad_prompts_are_rejected_without_side_effects() {
    let mut core = core_with(EngineConfig::default());
    assert!(matches!(
        core.start(SequenceSpec::plain(vec![], TenantId(1))),
        Err(engram_engine::EngineError::EmptyPrompt)
    ));
    assert!(matches!(
        core.start(SequenceSpec::plain(vec![1, 2, 999_999], TenantId(1))),
        Err(engram_engine::EngineError::TokenOutOfRange { id: 999_999, .. })
    ));
    assert!(matches!(
        core.start(SequenceSpec::plain(vec![1; 9000], TenantId(1))),
        Err(engram_engine::EngineError::ContextOverflow { .. })
    ));
    assert_eq!(core.running(), 0);
    assert!(core.store().metadata().is_empty());
}

#[test]
fn key_centering_and_key_scales_are_exact_for_attention_and_centering_lowers_codec_error() {
    use engram_engine::{KeyCentering, LogitRows};
    let text = license_tokens(256);
    // f32 activations: centering's effect alone, not int16 rounding of shifted keys.
    let logits = |codec, key_centering| {
        let mut core = crate::common::core_as(
            engram_engine::WeightFormat::Quantized,
            EngineConfig {
                codec,
                value_codec: None,
                key_centering,
                ..EngineConfig::default()
            },
        );
        let (id, _) = core
            .start(SequenceSpec::plain(text.clone(), TenantId(1)))
            .unwrap();
        let out = core.prefill_chunk(id, LogitRows::All).unwrap();
        assert_eq!(out.remaining, 0);
        out.logits.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    };
    let exact = logits(CodecKind::F32, KeyCentering::Off);
    let centered = logits(CodecKind::F32, KeyCentering::Calibrated);
    let err = rel_l2(&centered, &exact);
    assert!(err < 1e-4, "centering changed exact attention by {err:.2e}");
    // Scaled keys (the default) with the queries scaled back: the same scores.
    let scaled = logits(CodecKind::F32, KeyCentering::Scaled);
    let err = rel_l2(&scaled, &exact);
    assert!(
        err < 1e-4,
        "key scales changed exact attention by {err:.2e}"
    );
    let tq4_off = mean_kl(&exact, &logits(CodecKind::TQ4, KeyCentering::Off));
    let tq4_on = mean_kl(&exact, &logits(CodecKind::TQ4, KeyCentering::Calibrated));
    assert!(
        tq4_on < 0.95 * tq4_off,
        "KL centered {tq4_on:.4} vs plain {tq4_off:.4}"
    );
}

#[test]
fn a_tenant_over_its_hot_block_quota_is_refused_at_admission() {
    let mut core = core(CodecKind::TQ4);
    let text = license_tokens(200);
    let spec = |n: usize, tenant, quota| SequenceSpec {
        hot_block_quota: Some(quota),
        ..SequenceSpec::plain(text[..n].to_vec(), TenantId(tenant))
    };
    let (a, _) = core.start(spec(100, 1, 10)).unwrap(); // 7 blocks
    assert!(matches!(
        core.start(spec(64, 1, 10)), // 7 + 4 > 10
        Err(engram_engine::EngineError::QuotaExceeded {
            resource: "hot_blocks",
            requested: 11,
            quota: 10
        })
    ));
    // Another tenant has its own quota; the refused sequence left nothing behind.
    let (b, _) = core.start(spec(64, 2, 10)).unwrap();
    assert_eq!(core.running(), 2);
    core.finish(a).unwrap();
    core.finish(b).unwrap();
    let (c, _) = core.start(spec(64, 1, 10)).unwrap();
    core.finish(c).unwrap();
}

#[test]
fn public_blocks_are_shared_across_tenants_and_pinned_under_their_own_key() {
    let mut core = core(CodecKind::TQ4);
    let text = license_tokens(120);
    let spec = |tenant: u64, public: usize, key: u8| SequenceSpec {
        segments: vec![
            PromptSegment {
                tokens: text[..48].to_vec(),
                source: SourceLayer::Axioms,
                importance: 1.0,
            },
            PromptSegment {
                tokens: text[48..100].to_vec(),
                source: SourceLayer::Identity,
                importance: 1.0,
            },
        ],
        pin_key: Some([key; 32]),
        public_tokens: public,
        public_pin_key: Some([0xAB; 32]),
        ..SequenceSpec::plain(Vec::new(), TenantId(tenant))
    };
    let (a, adm) = core.start(spec(1, 48, 1)).unwrap();
    assert_eq!(adm.cached_tokens, 0);
    core.prefill(a).unwrap();
    let blocks = core.blocks(a).unwrap().to_vec();
    core.finish(a).unwrap();
    let meta = |core: &EngineCore, id| core.store().metadata().get(id).unwrap().clone();
    for (i, &b) in blocks.iter().enumerate().take(6) {
        let want = if i < 3 { PUBLIC_TENANT } else { TenantId(1) };
        assert_eq!(meta(&core, b).tenant(), want, "block {i}");
        assert_eq!(meta(&core, b).pin(), PinState::Pinned, "block {i}");
    }
    // Tenant 2 marks the same 48 tokens public: it reuses exactly those three blocks.
    let (b, adm) = core.start(spec(2, 48, 2)).unwrap();
    assert_eq!(adm.cached_tokens, 48);
    assert_eq!(core.blocks(b).unwrap()[..3], blocks[..3]);
    core.finish(b).unwrap();
    // Fewer public tokens: only the blocks wholly inside them are public.
    let (c, adm) = core.start(spec(3, 40, 3)).unwrap();
    assert_eq!(adm.cached_tokens, 32);
    core.finish(c).unwrap();
    // Nothing public: nothing shared.
    let (d, adm) = core.start(spec(4, 0, 4)).unwrap();
    assert_eq!(adm.cached_tokens, 0);
    core.finish(d).unwrap();
    // Tenant 1's prefix changes: its own stable blocks are unpinned, the shared ones stay.
    assert_eq!(core.unpin_prefix(&[1; 32]).unwrap(), 3);
    for (i, &b) in blocks.iter().enumerate().take(6) {
        let want = if i < 3 {
            PinState::Pinned
        } else {
            PinState::Unpinned
        };
        assert_eq!(meta(&core, b).pin(), want, "block {i}");
    }
    // Reusing an unpinned stable block pins it again under the new sequence's key.
    let (e, adm) = core.start(spec(1, 48, 5)).unwrap();
    assert_eq!(adm.cached_tokens, 96);
    core.finish(e).unwrap();
    assert!(
        blocks[3..6]
            .iter()
            .all(|&b| meta(&core, b).pin() == PinState::Pinned)
    );
    assert_eq!(core.unpin_prefix(&[5; 32]).unwrap(), 3);
    // More public tokens than the prompt holds is refused.
    assert!(matches!(
        core.start(spec(1, 101, 1)),
        Err(engram_engine::EngineError::InvalidConfig {
            field: "public_tokens",
            ..
        })
    ));
}

#[test]
fn a_tenant_over_its_cold_quota_loses_its_own_cold_blocks_only() {
    let mut core = core(CodecKind::TQ4);
    let text = license_tokens(300);
    let cold_of = |core: &EngineCore, t: u64| {
        core.store()
            .metadata()
            .iter()
            .filter(|m| m.tier() == Tier::Cold && m.tenant() == TenantId(t))
            .count()
    };
    let run = |core: &mut EngineCore, tokens: &[u32], tenant: u64, quota: Option<usize>| {
        let spec = SequenceSpec {
            cold_block_quota: quota,
            ..SequenceSpec::plain(tokens.to_vec(), TenantId(tenant))
        };
        let (id, _) = core.start(spec).unwrap();
        core.prefill(id).unwrap();
        core.finish(id).unwrap();
    };
    run(&mut core, &text[..100], 1, Some(2)); // 6 full blocks cached
    run(&mut core, &text[100..200], 2, None);
    let spilled = core.spill_idle().unwrap();
    assert_eq!(spilled, 12);
    assert_eq!(cold_of(&core, 1), 2);
    assert_eq!(cold_of(&core, 2), 6);
    assert_eq!(core.counters().cold_quota_dropped, 4);
    // Tenant 2 lost nothing: its next turn reuses its whole prompt, warmed from cold.
    let (id, adm) = core
        .start(SequenceSpec::plain(text[100..200].to_vec(), TenantId(2)))
        .unwrap();
    assert_eq!(adm.cached_tokens, 96);
    assert_eq!(adm.warmed_blocks, 6);
    core.finish(id).unwrap();
}

#[test]
fn decode_steps_fold_the_middle_layer_s_attention_mass_into_the_blocks() {
    let prompt = crate::common::license_tokens(70);
    let mut core = core(CodecKind::TQ4);
    let (id, _) = core
        .start(SequenceSpec::plain(prompt, TenantId(1)))
        .unwrap();
    let mut logits = core.prefill(id).unwrap();
    let mass_of = |core: &EngineCore, b| core.store().metadata().get(b).unwrap().mass();
    // A prefill contributes its last row's mass: one sample of weight 0.1.
    let blocks = core.blocks(id).unwrap().to_vec();
    let total: f32 = blocks.iter().map(|&b| mass_of(&core, b)).sum();
    assert!((total - 0.1).abs() < 1e-4, "{total}");
    assert_eq!(core.store().metadata().steps(), 1);
    let steps = 12;
    for _ in 0..steps {
        let t = engram_engine::argmax(&logits);
        logits = core.decode(&[(id, t)]).unwrap().remove(0);
    }
    let blocks = core.blocks(id).unwrap().to_vec();
    assert_eq!(blocks.len(), 6); // 82 tokens: the sixth block joined at token 80
    let masses: Vec<f32> = blocks.iter().map(|&b| mass_of(&core, b)).collect();
    // Each sample (the prefill's last row, then every step) spreads a mass of 1 over the
    // blocks; the decayed averages add up to 1 − (1 − w)^samples.
    let total: f32 = masses.iter().sum();
    let want = 1.0 - 0.9f32.powi(steps + 1);
    assert!((total - want).abs() < 1e-3, "{total} vs {want}: {masses:?}");
    // The model does not read every block alike, and the most read block was attended lately.
    let (lo, hi) = masses
        .iter()
        .fold((f32::MAX, 0.0f32), |(lo, hi), &m| (lo.min(m), hi.max(m)));
    assert!(hi > 1.5 * lo, "{masses:?}");
    let top = blocks[masses.iter().position(|&m| m == hi).unwrap()];
    assert!(core.store().metadata().get(top).unwrap().mass_at() > 0);
    core.finish(id).unwrap();
}
