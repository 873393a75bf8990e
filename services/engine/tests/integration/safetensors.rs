//! A Hugging Face safetensors directory loads into the same model as the GGUF file.

use std::collections::HashMap;

use candle_core::quantized::gguf_file::Content;
use candle_core::{Device, Tensor};
use engram_engine::{EngineConfig, EngineCore, EngineError, Llama, SequenceSpec, TextTokenizer};
use engram_kvcore::{CodecKind, TenantId};

use crate::common::tempdir;
use crate::common::{chat, model, model_path, rel_l2};

/// Writes the GGUF as a Hugging Face directory: dequantized weights under HF names with q/k
/// rows in HF order (llama.cpp interleaves each head's RoPE pairs), config.json, tokenizer.json.
fn export_hf(dir: &std::path::Path) {
    let path = model_path();
    let mut f = std::fs::File::open(&path).unwrap();
    let ct = Content::read(&mut f).unwrap();
    let dev = Device::Cpu;
    let cfg = model().0.config().clone();
    let mut get = |name: &str| {
        ct.tensor(&mut f, name, &dev)
            .unwrap()
            .dequantize(&dev)
            .unwrap()
    };
    let hf_order = |w: Tensor, heads: usize| -> Tensor {
        let (out, inp) = w.dims2().unwrap();
        // GGUF row (h, i, j) with i < d/2, j ∈ {0,1} is HF row (h, j, i).
        w.reshape((heads, cfg.head_dim / 2, 2, inp))
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .reshape((out, inp))
            .unwrap()
            .contiguous()
            .unwrap()
    };
    let mut t: HashMap<String, Tensor> = HashMap::new();
    t.insert("model.embed_tokens.weight".into(), get("token_embd.weight"));
    t.insert("model.norm.weight".into(), get("output_norm.weight"));
    for i in 0..cfg.num_layers {
        let mut put = |hf: &str, gg: &str| {
            let w = get(&format!("blk.{i}.{gg}.weight"));
            let w = match gg {
                "attn_q" => hf_order(w, cfg.num_heads),
                "attn_k" => hf_order(w, cfg.num_kv_heads),
                _ => w,
            };
            t.insert(format!("model.layers.{i}.{hf}.weight"), w);
        };
        put("input_layernorm", "attn_norm");
        put("self_attn.q_proj", "attn_q");
        put("self_attn.k_proj", "attn_k");
        put("self_attn.v_proj", "attn_v");
        put("self_attn.o_proj", "attn_output");
        put("post_attention_layernorm", "ffn_norm");
        put("mlp.gate_proj", "ffn_gate");
        put("mlp.up_proj", "ffn_up");
        put("mlp.down_proj", "ffn_down");
    }
    candle_core::safetensors::save(&t, dir.join("model.safetensors")).unwrap();
    let config = serde_json::json!({
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "rms_norm_eps": cfg.rms_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.context_length,
        "tie_word_embeddings": true,
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    model().1.save_json(&dir.join("tokenizer.json")).unwrap();
}

#[test]
fn a_safetensors_directory_runs_like_the_gguf() {
    let dir = tempdir("hf");
    export_hf(&dir);
    let loaded = Llama::load(&dir).unwrap();
    assert_eq!(loaded.config(), model().0.config());
    assert_ne!(loaded.fingerprint(), model().0.fingerprint());
    let tok = TextTokenizer::for_model(&dir).unwrap();
    let config = EngineConfig {
        codec: CodecKind::F32,
        value_codec: None,
        ..EngineConfig::default()
    };
    let mut from_dir = EngineCore::new(loaded, tok, config.clone()).unwrap();
    // The GGUF's blocks with f32 activations: the directory's dense f32 weights to f32 rounding.
    let gguf = crate::common::model_as(engram_engine::WeightFormat::Quantized).clone();
    let mut from_gguf = EngineCore::new(gguf, model().1.clone(), config).unwrap();
    let prompt = chat("What is the capital of France?");
    assert_eq!(
        from_dir.tokenizer().encode("Paris, 2026").unwrap(),
        model().1.encode("Paris, 2026").unwrap()
    );
    let (a, _) = from_dir
        .start(SequenceSpec::plain(prompt.clone(), TenantId(1)))
        .unwrap();
    let (b, _) = from_gguf
        .start(SequenceSpec::plain(prompt, TenantId(1)))
        .unwrap();
    let la = from_dir.prefill(a).unwrap();
    let lb = from_gguf.prefill(b).unwrap();
    let err = rel_l2(&la, &lb);
    assert!(err < 1e-5, "{err:.2e}");

    // A directory without weights is a clear error, not a panic.
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    assert!(matches!(
        Llama::load(&dir),
        Err(engram_engine::ModelError::Io { .. })
    ));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn block_weights_compute_the_f32_weights_and_per_layer_codecs_are_options() {
    let mut keys = vec![CodecKind::TQ4; 30];
    keys[..2].fill(CodecKind::Q8);
    let mut values = keys.clone();
    values[29] = CodecKind::TurboQuant { bits: 5 };
    let shape = engram_kvcore::KvShape::SMOLLM2_135M;
    let config = EngineConfig {
        weights: engram_engine::WeightFormat::Quantized,
        layer_codecs: Some(engram_kvcore::LayerCodecs::per_stream(&shape, keys, values).unwrap()),
        ..EngineConfig::default()
    };
    let mut core = EngineCore::load(&model_path(), config).unwrap();
    let store = core.store();
    assert_eq!(store.key_codec(0).unwrap().kind(), CodecKind::Q8);
    assert_eq!(store.key_codec(2).unwrap().kind(), CodecKind::TQ4);
    assert_eq!(store.key_codec(29).unwrap().kind(), CodecKind::TQ4);
    assert_eq!(
        store.value_codec(29).unwrap().kind(),
        CodecKind::TurboQuant { bits: 5 }
    );
    let fingerprint = core.fingerprint();
    // Keys and values apart, the same in every layer: another KV format.
    let streams = EngineCore::new(
        model().0.clone(),
        model().1.clone(),
        EngineConfig {
            weights: engram_engine::WeightFormat::Quantized,
            codec: CodecKind::Q8,
            value_codec: Some(CodecKind::TQ4),
            ..EngineConfig::default()
        },
    )
    .unwrap();
    assert_eq!(streams.store().codec_kinds().to_string(), "q8/tq4");
    assert_ne!(streams.fingerprint(), fingerprint);
    let (id, _) = core
        .start(SequenceSpec::plain(chat("Hello!"), TenantId(1)))
        .unwrap();
    let logits = core.prefill(id).unwrap();
    assert_eq!(logits.len(), model().0.config().vocab_size);
    assert!(logits.iter().all(|l| l.is_finite()));

    // The blocks hold the weights f32 dequantizes, summed in another order: with exact KV the
    // logits agree to rounding, and so does the next token.
    let logits_of = |weights| {
        let mut core = EngineCore::load(
            &model_path(),
            EngineConfig {
                weights,
                codec: CodecKind::F32,
                value_codec: None,
                ..EngineConfig::default()
            },
        )
        .unwrap();
        let (id, _) = core
            .start(SequenceSpec::plain(
                chat("What is the capital of France?"),
                TenantId(1),
            ))
            .unwrap();
        (core.prefill(id).unwrap(), core.fingerprint())
    };
    let (blocks, fp_blocks) = logits_of(engram_engine::WeightFormat::Quantized);
    let (dense, fp_dense) = logits_of(engram_engine::WeightFormat::F32);
    let err = rel_l2(&blocks, &dense);
    assert!(err < 1e-4, "{err:.2e}");
    let argmax = |l: &[f32]| (0..l.len()).max_by(|&a, &b| l[a].total_cmp(&l[b]));
    assert_eq!(argmax(&blocks), argmax(&dense));
    // The two numerics store different KV: their fingerprints differ.
    assert_ne!(fp_blocks, fp_dense);

    // A per-layer list of the wrong length is refused.
    let three = engram_kvcore::KvShape::new(3, 3, 64).unwrap();
    let bad = EngineConfig {
        layer_codecs: Some(engram_kvcore::LayerCodecs::uniform(&three, CodecKind::TQ4)),
        ..EngineConfig::default()
    };
    assert!(matches!(
        EngineCore::new(model().0.clone(), model().1.clone(), bad),
        Err(EngineError::Kv(_))
    ));
}
