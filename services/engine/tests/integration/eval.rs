//! The fidelity harness on a small corpus.

use engram_engine::eval::{EvalOptions, evaluate, read_corpus};
use engram_kvcore::CodecKind;

use crate::common::model;
use crate::tokenizer::tempdir;

#[test]
fn codecs_are_ranked_by_their_error() {
    let dir = tempdir("eval");
    let text = std::fs::read_to_string("/usr/share/common-licenses/GPL-3").unwrap();
    std::fs::write(dir.join("a.txt"), &text[..6000]).unwrap();
    std::fs::write(dir.join("b.txt"), &text[6000..12000]).unwrap();
    let corpus = read_corpus(&dir).unwrap();
    assert!(corpus.starts_with(&text[..100]) && corpus.contains(&text[6000..6100]));
    let opts = EvalOptions {
        corpus: dir.clone(),
        max_tokens: 300,
        window: 160,
        chunk: 64,
        codecs: vec![
            CodecKind::F16,
            CodecKind::TQ4,
            CodecKind::TurboQuant { bits: 2 },
        ],
        ..EvalOptions::default()
    };
    let (m, t) = model();
    let mut windows = 0;
    let rows = evaluate(m, t, &opts, |_| windows += 1).unwrap();
    assert_eq!(windows, 2, "300 predictions in windows of 160 (159 each)");
    let names: Vec<_> = rows.iter().map(|r| r.codec.as_str()).collect();
    assert_eq!(names, ["f32", "f16", "tq4", "tq2"]);
    for r in &rows {
        assert_eq!(r.tokens, 300);
        assert!(r.ppl.is_finite() && r.ppl > 1.0);
    }
    let (reference, f16, tq4, tq2) = (&rows[0], &rows[1], &rows[2], &rows[3]);
    assert_eq!((reference.kl_nats, reference.top1_agreement), (0.0, 1.0));
    assert!(f16.kl_nats < 1e-3, "{}", f16.kl_nats);
    assert!(f16.kl_nats < tq4.kl_nats && tq4.kl_nats < tq2.kl_nats);
    assert!(tq2.top1_agreement < f16.top1_agreement);
    assert_eq!(tq4.bits_per_element, 4.25);
    std::fs::remove_dir_all(dir).unwrap();
}
