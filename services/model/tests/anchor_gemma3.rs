//! Gemma 3 against candle-transformers' own Gemma 3 (`models::gemma3`, the Hugging Face layout)
//! with the GGUF's weights dequantized to f32 and renamed (norm weights less the one llama.cpp's
//! converter adds): KL of the teacher-forced next-token distributions over 768 tokens of the
//! Apache License (the last 256 past the window layers' 512 positions), with Engram's default int16 activations and f16 KV, and greedy continuations
//! of five prompts (a base model: plain text after `<bos>`).
//!
//! candle's `quantized_gemma3` is not the reference: its MLP uses SiLU where Gemma 3 uses
//! GELU (tanh), and its sliding-window mask lets a query see 513 positions.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::gemma3::{Config, Model};
use common::{Ours, argmax, checkpoint, kl, report};
use engram_kvcore::CodecKind;

/// The Hugging Face name of a GGUF tensor, and whether it is a norm weight (stored plus one).
fn hf_name(gguf: &str) -> (String, bool) {
    if gguf == "token_embd.weight" {
        return ("model.embed_tokens.weight".into(), false);
    }
    if gguf == "output_norm.weight" {
        return ("model.norm.weight".into(), true);
    }
    let rest = gguf.strip_prefix("blk.").unwrap();
    let (layer, rest) = rest.split_once('.').unwrap();
    let (name, norm) = match rest.trim_end_matches(".weight") {
        "attn_norm" => ("input_layernorm", true),
        "attn_q" => ("self_attn.q_proj", false),
        "attn_k" => ("self_attn.k_proj", false),
        "attn_v" => ("self_attn.v_proj", false),
        "attn_output" => ("self_attn.o_proj", false),
        "attn_q_norm" => ("self_attn.q_norm", true),
        "attn_k_norm" => ("self_attn.k_norm", true),
        "post_attention_norm" => ("post_attention_layernorm", true),
        "ffn_norm" => ("pre_feedforward_layernorm", true),
        "post_ffw_norm" => ("post_feedforward_layernorm", true),
        "ffn_gate" => ("mlp.gate_proj", false),
        "ffn_up" => ("mlp.up_proj", false),
        "ffn_down" => ("mlp.down_proj", false),
        other => panic!("unexpected tensor {other}"),
    };
    (format!("model.layers.{layer}.{name}.weight"), norm)
}

fn reference(path: &std::path::Path) -> Model {
    let mut file = std::fs::File::open(path).unwrap();
    let ct = candle_core::quantized::gguf_file::Content::read(&mut file).unwrap();
    let mut tensors = HashMap::new();
    for name in ct.tensor_infos.keys() {
        let t = ct
            .tensor(&mut file, name, &Device::Cpu)
            .unwrap()
            .dequantize(&Device::Cpu)
            .unwrap();
        let (hf, norm) = hf_name(name);
        tensors.insert(hf, if norm { (t - 1.0).unwrap() } else { t });
    }
    let config: Config = serde_json::from_value(serde_json::json!({
        "attention_bias": false,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 640,
        "intermediate_size": 2048,
        "num_attention_heads": 4,
        "num_hidden_layers": 18,
        "num_key_value_heads": 1,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "vocab_size": 262_144,
        "final_logit_softcapping": null,
        "attn_logit_softcapping": null,
        "query_pre_attn_scalar": 256,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "max_position_embeddings": 1024
    }))
    .unwrap();
    let vb = VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu);
    Model::new(false, &config, vb).unwrap()
}

fn step(model: &mut Model, tokens: &[u32], pos: usize) -> Vec<f32> {
    let x = Tensor::new(tokens, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    model
        .forward(&x, pos)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

#[test]
fn gemma3_270m_matches_candle_transformers() {
    let path = checkpoint(common::GEMMA3_270M);
    let ours = Ours::load(&path, CodecKind::F16);
    assert_eq!(ours.model.arch().gguf, "gemma3");
    let bos = ours.tokenizer.bos().expect("Gemma adds <bos>");
    let mut theirs_model = reference(&path);

    let mut tokens = vec![bos];
    tokens.extend(ours.tokenizer.encode(&common::corpus()).unwrap());
    // Past the 512-position window: the last 256 positions read only their windows in the
    // window layers (the reference's decode steps keep the last 512 in a rotating cache).
    tokens.truncate(768);
    let theirs: Vec<Vec<f32>> = tokens
        .iter()
        .enumerate()
        .map(|(pos, &t)| step(&mut theirs_model, &[t], pos))
        .collect();
    let mine = ours.teacher_forced(&tokens, 128);
    let kls: Vec<f64> = theirs.iter().zip(&mine).map(|(p, q)| kl(p, q)).collect();
    let past = &kls[512..];
    let past_mean = past.iter().sum::<f64>() / past.len() as f64;
    println!("positions 512..768 (window layers past their window): mean KL {past_mean:.2e}");
    assert!(past_mean <= common::MEAN_KL_BOUND, "{past_mean}");

    let prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a small village,",
        "The three primary colors are",
        "Water boils at a temperature of",
    ];
    let mut equal = 0;
    for prompt in prompts {
        let mut ids = vec![bos];
        ids.extend(ours.tokenizer.encode(prompt).unwrap());
        theirs_model.clear_kv_cache();
        let mut a = vec![argmax(&step(&mut theirs_model, &ids, 0))];
        while a.len() < 32 {
            let pos = ids.len() + a.len() - 1;
            let next = argmax(&step(&mut theirs_model, &[*a.last().unwrap()], pos));
            a.push(next);
        }
        let b = ours.greedy(&ids, 32);
        println!(
            "{prompt:?}\n  candle: {:?}\n  engram: {:?}",
            ours.tokenizer.decode(&a).unwrap(),
            ours.tokenizer.decode(&b).unwrap()
        );
        equal += usize::from(a == b);
    }
    report(common::GEMMA3_270M, &kls, equal, prompts.len());
}
