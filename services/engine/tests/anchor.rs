//! Correctness anchor: the engine (F32 KV codec) against candle-transformers' own quantized
//! Llama forward on the same GGUF with `CANDLE_DEQUANTIZE_ALL=1` (f32 weights), with the block
//! weights multiplied by f32 activations and by int16 ones (which round below this tolerance).
//!
//! Its own test binary: the variable must be set before candle reads it, with no other test
//! thread running.

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

#[test]
fn greedy_tokens_and_teacher_forced_logits_match_candle_transformers() {
    // SAFETY: this binary holds this one test; no other thread reads the environment yet.
    unsafe { std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1") };
    let path = model_path();
    let mut file = std::fs::File::open(&path).unwrap();
    let content = candle_core::quantized::gguf_file::Content::read(&mut file).unwrap();
    let mut reference = ModelWeights::from_gguf(content, &mut file, &Device::Cpu).unwrap();
    for weights in [WeightFormat::Quantized, WeightFormat::Int16] {
        anchor(&path, &mut reference, weights);
    }
}

fn anchor(path: &std::path::Path, reference: &mut ModelWeights, weights: WeightFormat) {
    let config = EngineConfig {
        codec: CodecKind::F32,
        value_codec: None,
        weights,
        ..EngineConfig::default()
    };
    let mut core = EngineCore::load(path, config).unwrap();

    let prompts = [
        "What is the capital of France?",
        "Write a haiku about memory.",
        "List three prime numbers and explain why they are prime.",
    ];
    let mut worst = 0.0f64;
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
        let mut ours = core.prefill(id).unwrap();
        let (mut ref_tokens, mut our_tokens) = (Vec::new(), Vec::new());
        for step in 0..32 {
            let err = rel_l2(&ours, &ref_logits);
            worst = worst.max(err);
            assert!(
                err < 1e-3,
                "{weights:?} {prompt:?} step {step}: logits differ by {err:.2e}"
            );
            let (r, o) = (argmax(&ref_logits), argmax(&ours));
            ref_tokens.push(r);
            our_tokens.push(o);
            // Teacher forcing: both continue with the reference's token.
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
        }
        assert_eq!(our_tokens, ref_tokens, "{weights:?} {prompt:?}");
        core.finish(id).unwrap();
        println!(
            "{prompt:?} -> {:?}",
            core.tokenizer().decode(&ref_tokens).unwrap()
        );
    }
    println!("{weights:?}: worst relative L2 of logits: {worst:.2e}");
}
