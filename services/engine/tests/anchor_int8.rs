//! Correctness anchor of int8 activations ([`WeightFormat::Int8`]): the engine (F32 KV codec)
//! against candle-transformers' own quantized Llama forward on the same GGUF, which multiplies
//! the 4-bit blocks with activations quantized per 32 values (`Q8_1`, llama.cpp's numerics).
//! Quantizing the activations moves the logits by a few percent (relative L2; the f32-activation
//! engine is as far from this reference), and the two sum in other orders, so they are not the
//! same bits; the greedy tokens are the same.
//!
//! Its own test binary: `anchor.rs` sets `CANDLE_DEQUANTIZE_ALL` for the whole process, this one
//! must not.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_llama::ModelWeights;
use engram_engine::{
    ChatMessage, EngineConfig, EngineCore, Role, SequenceSpec, WeightFormat, argmax, chatml,
};
use engram_kvcore::{CodecKind, TenantId};

#[allow(dead_code)]
#[path = "integration/common.rs"]
mod common;

use common::{model_path, rel_l2};

/// Relative L2 of the logits allowed against the quantized reference and against the
/// f32-activation engine. Measured 2026-11-25: at most 1.3e-1 over these prompts, typically 2–6e-2,
/// and the f32-activation engine is as far from candle's quantized forward (at most 1.2e-1):
/// activation rounding, not a kernel error, sets the scale (a wrong scale or a swapped nibble
/// gives errors of order 1).
const TOLERANCE: f64 = 0.25;

#[test]
fn int8_greedy_tokens_and_logits_match_candles_quantized_forward() {
    let path = model_path();
    let mut file = std::fs::File::open(&path).unwrap();
    let content = candle_core::quantized::gguf_file::Content::read(&mut file).unwrap();
    let mut reference = ModelWeights::from_gguf(content, &mut file, &Device::Cpu).unwrap();
    let config = EngineConfig {
        codec: CodecKind::F32,
        value_codec: None,
        weights: WeightFormat::Int8,
        ..EngineConfig::default()
    };
    let mut core = EngineCore::load(&path, config).unwrap();
    let f32_config = EngineConfig {
        codec: CodecKind::F32,
        value_codec: None,
        ..EngineConfig::default()
    };
    let mut f32_core = EngineCore::load(&path, f32_config).unwrap();
    assert_ne!(
        core.fingerprint(),
        f32_core.fingerprint(),
        "int8 activations compute other K/V: their blocks must not be shared"
    );

    let prompts = [
        "What is the capital of France?",
        "List three prime numbers and explain why they are prime.",
    ];
    // Worst relative L2 against the reference, and against the f32-activation engine.
    let (mut worst, mut worst_f32) = (0.0f64, 0.0f64);
    for prompt in prompts {
        let text = chatml(&[ChatMessage::new(Role::User, prompt)], true);
        let tokens = core.tokenizer().encode(&text).unwrap();
        reference.clear_kv_cache();
        let input = Tensor::new(tokens.as_slice(), &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let mut ref_logits: Vec<f32> = reference
            .forward(&input, 0)
            .unwrap()
            .squeeze(0)
            .unwrap()
            .to_vec1()
            .unwrap();
        let (id, _) = core
            .start(SequenceSpec::plain(tokens.clone(), TenantId(1)))
            .unwrap();
        let (fid, _) = f32_core
            .start(SequenceSpec::plain(tokens.clone(), TenantId(1)))
            .unwrap();
        let mut ours = core.prefill(id).unwrap();
        let mut f32_ours = f32_core.prefill(fid).unwrap();
        let (mut ref_tokens, mut our_tokens) = (Vec::new(), Vec::new());
        for step in 0..24 {
            let err = rel_l2(&ours, &ref_logits);
            let err_f32 = rel_l2(&ours, &f32_ours);
            worst = worst.max(err);
            worst_f32 = worst_f32.max(err_f32);
            assert!(
                err < TOLERANCE && err_f32 < TOLERANCE,
                "{prompt:?} step {step}: logits differ by {err:.2e} from candle's quantized \
                 forward, {err_f32:.2e} from f32 activations"
            );
            let (r, o) = (argmax(&ref_logits), argmax(&ours));
            ref_tokens.push(r);
            our_tokens.push(o);
            let pos = tokens.len() + step;
            let next = Tensor::new(&[r], &Device::Cpu)
                .unwrap()
                .unsqueeze(0)
                .unwrap();
            ref_logits = reference
                .forward(&next, pos)
                .unwrap()
                .squeeze(0)
                .unwrap()
                .to_vec1()
                .unwrap();
            ours = core.decode(&[(id, r)]).unwrap().remove(0);
            f32_ours = f32_core.decode(&[(fid, r)]).unwrap().remove(0);
        }
        assert_eq!(our_tokens, ref_tokens, "{prompt:?}");
        core.finish(id).unwrap();
        f32_core.finish(fid).unwrap();
    }
    println!(
        "worst relative L2 of int8 logits: {worst:.2e} from candle's quantized forward, \
         {worst_f32:.2e} from f32 activations"
    );
}
