//! Key scales (`Llama::key_scales`, the engine's default key basis) on the real checkpoints:
//! exact for attention with exact KV, and they lower the KV codec's KL where keys carry
//! channels the queries hardly read (Qwen2.5's outlier key channels, Gemma 3's normed keys).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{GEMMA3_270M, Ours, QWEN_05B, checkpoint, corpus, kl};
use engram_kvcore::CodecKind;

/// Mean KL of `b`'s rows against `a`'s.
fn mean_kl(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    a.iter().zip(b).map(|(p, q)| kl(p, q)).sum::<f64>() / a.len() as f64
}

fn check(file: &str, tokens: usize, min_gain: f64) {
    let base = Ours::load(&checkpoint(file), CodecKind::F32);
    let text = base.tokenizer.encode(&corpus()).unwrap();
    let text = &text[..tokens];
    let exact = base.teacher_forced(text, 256);
    // Exact KV: centering and scaling leave the scores, so the logits, as they were.
    let f32 = CodecKind::F32;
    let scaled_exact = base.relative(f32, f32, true).teacher_forced(text, 256);
    let drift = mean_kl(&exact, &scaled_exact);
    assert!(
        drift < 1e-6,
        "{file}: key scales moved exact attention, KL {drift:.2e}"
    );
    // The keys in TurboQuant-6 with one outlier per row (the default key codec), the values
    // exact: the keys' share of the error.
    let codec = CodecKind::TurboQuantSplit {
        bits: 6,
        outliers: 1,
    };
    let run = |scaled| {
        mean_kl(
            &exact,
            &base.relative(codec, f32, scaled).teacher_forced(text, 256),
        )
    };
    let (centered, scaled) = (run(false), run(true));
    eprintln!("{file}: tq6o1 keys KL centered {centered:.5}, centered and scaled {scaled:.5}");
    assert!(
        scaled * min_gain < centered,
        "{file}: key scales lowered KL {centered:.5} → {scaled:.5}, less than {min_gain}×"
    );
}

#[test]
fn key_scales_are_exact_and_lower_the_codec_error_on_qwen2() {
    check(QWEN_05B, 256, 2.0);
}

#[test]
fn key_scales_are_exact_and_lower_the_codec_error_on_gemma3() {
    // Past the 512-token window: the window layers read their blocks through the scales too.
    check(GEMMA3_270M, 640, 2.0);
}
