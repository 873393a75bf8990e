//! Relocated segment reuse on the serving path (issue 26, `EngineConfig::relocation`): a
//! segment cached after one prefix is copied behind another instead of recomputed, read with
//! the query-side shift; its copies never enter the cache, the blocks computed after it are
//! cached under the run's anchor, and nothing changes with the flag off.

use engram_engine::{EngineConfig, EngineCore, PromptSegment, RelocationPolicy, SequenceSpec};
use engram_kvcore::{SourceLayer, TenantId};

use crate::common::{core_with, license_tokens, mean_kl, rel_l2};

/// A prompt of three segments: an opener, the shared segment, a closing turn.
fn spec(opener: &[u32], shared: &[u32], turn: &[u32], tenant: u64) -> SequenceSpec {
    let seg = |tokens: &[u32], source| PromptSegment {
        tokens: tokens.to_vec(),
        source,
        importance: 0.5,
    };
    SequenceSpec {
        segments: vec![
            seg(opener, SourceLayer::Identity),
            seg(shared, SourceLayer::Rules),
            seg(turn, SourceLayer::UserTurn),
        ],
        ..SequenceSpec::plain(Vec::new(), TenantId(tenant))
    }
}

fn relocating() -> EngineConfig {
    EngineConfig {
        relocation: Some(RelocationPolicy::default()),
        ..EngineConfig::default()
    }
}

fn run(core: &mut EngineCore, s: SequenceSpec) -> (engram_engine::Admission, Vec<f32>) {
    let (id, adm) = core.start(s).unwrap();
    let logits = core.prefill(id).unwrap();
    core.finish(id).unwrap();
    (adm, logits)
}

#[test]
fn a_segment_cached_after_another_prefix_is_copied_not_recomputed() {
    let text = license_tokens(1_200);
    // Openers of 40 and 57 tokens: the shared segment moves by 17 positions, so its blocks
    // are not aligned the same way in the two prompts.
    let (a, b) = (&text[..40], &text[600..657]);
    let shared = &text[40..340];
    let (t1, t2) = (&text[900..920], &text[1_000..1_025]);

    let mut core = core_with(relocating());
    let (adm, _) = run(&mut core, spec(a, shared, t1, 1));
    assert_eq!((adm.cached_tokens, adm.relocated_tokens), (0, 0));
    // The shared segment is indexed; the opener and the turn are too short to relocate.
    assert_eq!(core.indexed_segments(), 1);

    // B's exact walk misses at once; the shared segment starts at 57, so positions 80..352 —
    // from the second block boundary after its start to the last whole block it covers — are
    // copied (17 blocks).
    let (id, adm) = core.start(spec(b, shared, t2, 1)).unwrap();
    assert_eq!((adm.cached_tokens, adm.relocated_tokens), (0, 272));
    let table = core.blocks(id).unwrap().to_vec();
    let copies = &table[5..22];
    for &c in copies {
        let m = core.store().metadata().get(c).unwrap();
        assert_eq!(m.shift(), 17, "the copies record their shift");
        assert!(!core.cache().contains_block(c), "a copy is never cached");
    }
    let relocated = core.prefill(id).unwrap();
    core.finish(id).unwrap();
    assert_eq!(core.counters().relocated_runs, 1);
    assert_eq!(core.counters().relocated_blocks, 17);
    // A's blocks holding positions 63..335 (the copied run, 17 positions earlier) count one
    // relocation each: blocks 3..=20.
    let reused: usize = core
        .store()
        .metadata()
        .iter()
        .filter(|m| m.relocations() == 1)
        .count();
    assert_eq!(reused, 18);

    // Against computing B from scratch on an engine without relocation: close, not equal.
    let mut fresh = core_with(EngineConfig::default());
    let (adm, recomputed) = run(&mut fresh, spec(b, shared, t2, 1));
    assert_eq!(adm.relocated_tokens, 0);
    let kl = mean_kl(&recomputed, &relocated);
    let argmax = |l: &[f32]| {
        l.iter()
            .enumerate()
            .max_by(|x, y| x.1.total_cmp(y.1))
            .map(|(i, _)| i)
    };
    eprintln!("relocated vs recomputed: KL {kl:.5} nats on the last row");
    assert!(kl < 0.05, "KL(recomputed ‖ relocated) = {kl:.4}");
    assert_eq!(argmax(&recomputed), argmax(&relocated));
    assert!(
        rel_l2(&relocated, &recomputed) > 0.0,
        "relocation is not free"
    );

    // B again: the blocks before the run hit exactly, the run is copied again, and the block
    // computed after it (352..368) is reused under the run's anchor; the logits are the first
    // B's.
    let (adm, again) = run(&mut core, spec(b, shared, t2, 1));
    assert_eq!((adm.cached_tokens, adm.relocated_tokens), (80, 272 + 16));
    let err = rel_l2(&again, &relocated);
    eprintln!("anchored reuse vs first relocated prefill: {err:.2e}");
    assert!(
        err < 1e-3,
        "anchored reuse vs the first relocated prefill: {err:.2e}"
    );

    // Blocks an operator marked public are computed exactly (they are cached for every tenant):
    // with the whole prompt but its last turn public, nothing is left to relocate.
    let public = SequenceSpec {
        public_tokens: 57 + 300,
        ..spec(b, shared, t2, 1)
    };
    let (adm, _) = run(&mut core, public);
    assert_eq!((adm.cached_tokens, adm.relocated_tokens), (0, 0));

    // Never across tenants.
    let (adm, _) = run(&mut core, spec(b, shared, t2, 2));
    assert_eq!((adm.cached_tokens, adm.relocated_tokens), (0, 0));

    // Forgetting the tenant forgets its segments.
    core.forget(TenantId(1), 0, 0).unwrap();
    assert_eq!(core.indexed_segments(), 1, "tenant 2's segment stays");
    let (adm, _) = run(&mut core, spec(&text[700..733], shared, t2, 1));
    assert_eq!(adm.relocated_tokens, 0);
}

#[test]
fn with_relocation_off_nothing_is_relocated_and_answers_are_unchanged() {
    let text = license_tokens(800);
    let (a, b, shared, t) = (
        &text[..40],
        &text[600..657],
        &text[40..340],
        &text[400..420],
    );
    let mut core = core_with(EngineConfig::default());
    run(&mut core, spec(a, shared, t, 1));
    let (adm, logits) = run(&mut core, spec(b, shared, t, 1));
    assert_eq!((adm.cached_tokens, adm.relocated_tokens), (0, 0));
    assert_eq!(core.counters().relocated_runs, 0);
    let mut fresh = core_with(EngineConfig::default());
    let (_, alone) = run(&mut fresh, spec(b, shared, t, 1));
    assert_eq!(
        logits, alone,
        "flag off: the prompt is computed as if alone"
    );

    // A segment shorter than the policy's minimum is computed.
    let mut core = core_with(EngineConfig {
        relocation: Some(RelocationPolicy { min_tokens: 400 }),
        ..EngineConfig::default()
    });
    run(&mut core, spec(a, shared, t, 1));
    let (adm, _) = run(&mut core, spec(b, shared, t, 1));
    assert_eq!(adm.relocated_tokens, 0);
}

#[test]
fn a_minimum_below_one_block_is_refused() {
    let (m, t) = crate::common::model();
    let err = EngineCore::new(
        m.clone(),
        t.clone(),
        EngineConfig {
            relocation: Some(RelocationPolicy { min_tokens: 8 }),
            ..EngineConfig::default()
        },
    )
    .unwrap_err();
    assert!(err.to_string().contains("relocation"), "{err}");
}
