//! `engram eval kv --fuse` (issue 26) on SmolLM2 and real text: the harness fuses nothing at a
//! threshold of 1 (the continuations are the reference's bit for bit, also after a threshold
//! that fused everything: the fused blocks are put back), fuses every block into the first
//! session's at −1 (the compression and the cost follow), and refuses bad shapes.

use engram_engine::StreamCodecs;
use engram_engine::fusion::{FuseOptions, evaluate_fusion};
use engram_kvcore::CodecKind;

use crate::common::model;
use crate::tokenizer::tempdir;

#[test]
fn the_fusion_harness_measures_what_fusing_costs() {
    let dir = tempdir("fuse");
    let text = std::fs::read_to_string("/usr/share/common-licenses/GPL-3").unwrap();
    std::fs::write(dir.join("gpl.txt"), &text[..20_000]).unwrap();
    let opts = FuseOptions {
        corpus: dir,
        sessions: 4,
        prompt: 32,
        tail: 16,
        greedy_tokens: 4,
        thresholds: vec![1.0, -1.0, 1.0],
        codecs: vec![StreamCodecs::both(CodecKind::F32)],
        key_centering: true,
    };
    let (m, tok) = model();
    let mut lines = 0;
    let rows = evaluate_fusion(m, tok, &opts, |_| lines += 1).unwrap();
    assert_eq!(rows.len(), 3);
    assert_eq!(lines, 4 + 3);
    for r in [&rows[0], &rows[2]] {
        assert_eq!(r.fused_share, 0.0);
        assert_eq!(r.compression, 1.0);
        assert_eq!(r.kl_nats, 0.0, "{r:?}");
        assert_eq!(r.top1_agreement, 1.0);
        assert_eq!(r.greedy_agreement, 1.0);
        assert_eq!(r.tokens, 4 * 15);
        assert!(!r.meets_bar);
    }
    // At −1 every block of sessions 2–4 joins session 1's: three quarters of the (layer, block)
    // pairs, ~3.9× fewer bytes, and a cost far past the budget.
    let all = &rows[1];
    assert_eq!(all.fused_share, 0.75);
    assert!(all.compression > 3.5, "{all:?}");
    assert!(all.kl_nats > 0.01 && all.top1_agreement < 1.0, "{all:?}");
    assert!(!all.meets_bar);
    for bad in [
        FuseOptions {
            prompt: 40,
            ..opts.clone()
        },
        FuseOptions {
            sessions: 1,
            ..opts.clone()
        },
        FuseOptions {
            thresholds: vec![1.5],
            ..opts.clone()
        },
        FuseOptions { tail: 1, ..opts },
    ] {
        assert!(evaluate_fusion(m, tok, &bad, |_| {}).is_err());
    }
}
