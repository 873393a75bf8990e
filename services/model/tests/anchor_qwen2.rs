//! Qwen2.5 against candle-transformers' own `quantized_qwen2` forward on the same GGUF, with
//! `CANDLE_DEQUANTIZE_ALL=1` (f32 weights; the Q5_0/Q8_0/Q4_K/Q6_K blocks expanded exactly): KL of
//! the teacher-forced next-token distributions over 512 tokens of the Apache License, with
//! Engram's default int16 activations and f16 KV, and greedy continuations of five chat prompts.
//!
//! Its own test binary: the variable must be set before candle reads it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_qwen2::ModelWeights;
use common::{Ours, argmax, checkpoint, kl, report};
use engram_kvcore::CodecKind;

struct Reference(ModelWeights);

impl Reference {
    fn load(path: &std::path::Path) -> Self {
        let mut file = std::fs::File::open(path).unwrap();
        let content = candle_core::quantized::gguf_file::Content::read(&mut file).unwrap();
        Self(ModelWeights::from_gguf(content, &mut file, &Device::Cpu).unwrap())
    }

    /// The last position's logits after `tokens` at `pos`.
    fn step(&mut self, tokens: &[u32], pos: usize) -> Vec<f32> {
        let x = Tensor::new(tokens, &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        self.0
            .forward(&x, pos)
            .unwrap()
            .squeeze(0)
            .unwrap()
            .to_vec1()
            .unwrap()
    }

    fn greedy(&mut self, prompt: &[u32], n: usize) -> Vec<u32> {
        self.0.clear_kv_cache();
        let mut out = vec![argmax(&self.step(prompt, 0))];
        while out.len() < n {
            let pos = prompt.len() + out.len() - 1;
            let next = argmax(&self.step(&[*out.last().unwrap()], pos));
            out.push(next);
        }
        out
    }
}

fn anchor(file: &str) {
    // SAFETY: this binary's tests run one at a time (`serial` below) and set the same value
    // before candle first reads it.
    unsafe { std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1") };
    let path = checkpoint(file);
    let ours = Ours::load(&path, CodecKind::F16);
    assert_eq!(ours.model.arch().gguf, "qwen2");
    let mut reference = Reference::load(&path);

    // Teacher-forced: the reference one token at a time, Engram in prefill chunks of 128.
    let tokens: Vec<u32> = ours.tokenizer.encode(&common::corpus()).unwrap()[..512].to_vec();
    let theirs: Vec<Vec<f32>> = tokens
        .iter()
        .enumerate()
        .map(|(pos, &t)| reference.step(&[t], pos))
        .collect();
    let mine = ours.teacher_forced(&tokens, 128);
    let kls: Vec<f64> = theirs.iter().zip(&mine).map(|(p, q)| kl(p, q)).collect();

    let prompts = [
        "What is the capital of France?",
        "Write a Python function that reverses a string.",
        "Explain what a hash map is in two sentences.",
        "List three prime numbers.",
        "How do I read a file line by line in Rust?",
    ];
    let mut equal = 0;
    for prompt in prompts {
        let text = ours
            .tokenizer
            .chat_format()
            .render(&[(engram_context::FrameRole::User, prompt)], true);
        let ids = ours.tokenizer.encode(&text).unwrap();
        let (a, b) = (reference.greedy(&ids, 32), ours.greedy(&ids, 32));
        println!(
            "{prompt:?}\n  candle: {:?}\n  engram: {:?}",
            ours.tokenizer.decode(&a).unwrap(),
            ours.tokenizer.decode(&b).unwrap()
        );
        equal += usize::from(a == b);
    }
    report(file, &kls, equal, prompts.len());
}

#[test]
fn qwen2_5_0_5b_matches_candle_transformers() {
    anchor(common::QWEN_05B);
}

/// The 1.5B (1.1 GB): `make test-models`.
#[test]
#[ignore = "1.5B checkpoint: run by `make test-models`"]
fn qwen2_5_1_5b_matches_candle_transformers() {
    anchor(common::QWEN_15B);
}
