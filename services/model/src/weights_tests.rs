//! Tests of the weight loaders.

use super::*;
use crate::held::{DEVICE_WEIGHTS, DeviceWeights};

use candle_core::quantized::gguf_file::{self, Value};

/// A one-layer model of `arch`'s layout with f32 tensors (hidden 16, 2 heads of 8, one KV
/// head, FFN 24, vocabulary 32), its metadata plus `extra`, written to `path`; `shape`
/// may change a tensor's `[rows, cols]` (or `[len]`), `skip` leave one out.
fn tiny_gguf(
    path: &Path,
    arch: &str,
    extra: &[(&str, Value)],
    shape: &dyn Fn(&str, Vec<usize>) -> Vec<usize>,
    skip: Option<&str>,
) {
    let k = |s: &str| format!("{arch}.{s}");
    let mut md: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        (k("attention.head_count"), Value::U32(2)),
        (k("attention.head_count_kv"), Value::U32(1)),
        (k("embedding_length"), Value::U32(16)),
        (k("block_count"), Value::U32(1)),
        (k("feed_forward_length"), Value::U32(24)),
        (k("context_length"), Value::U32(64)),
        (k("attention.layer_norm_rms_epsilon"), Value::F32(1e-5)),
        (k("rope.freq_base"), Value::F32(10_000.0)),
    ];
    md.extend(extra.iter().map(|(a, v)| (a.to_string(), v.clone())));
    let mut names: Vec<(&str, Vec<usize>)> = vec![
        ("token_embd.weight", vec![32, 16]),
        ("output_norm.weight", vec![16]),
        ("blk.0.attn_norm.weight", vec![16]),
        ("blk.0.attn_q.weight", vec![16, 16]),
        ("blk.0.attn_k.weight", vec![8, 16]),
        ("blk.0.attn_v.weight", vec![8, 16]),
        ("blk.0.attn_output.weight", vec![16, 16]),
        ("blk.0.ffn_norm.weight", vec![16]),
        ("blk.0.ffn_gate.weight", vec![24, 16]),
        ("blk.0.ffn_up.weight", vec![24, 16]),
        ("blk.0.ffn_down.weight", vec![16, 24]),
    ];
    if arch == "qwen2" {
        names.extend([
            ("blk.0.attn_q.bias", vec![16]),
            ("blk.0.attn_k.bias", vec![8]),
            ("blk.0.attn_v.bias", vec![8]),
        ]);
    }
    let tensors: Vec<(String, QTensor)> = names
        .into_iter()
        .filter(|(n, _)| Some(*n) != skip)
        .enumerate()
        .map(|(i, (n, dims))| {
            let dims = shape(n, dims);
            let len: usize = dims.iter().product();
            let v: Vec<f32> = (0..len)
                .map(|j| (((i * 131 + j * 71) % 97) as f32 / 97.0 - 0.5) * 0.2 + 0.02)
                .collect();
            let t = Tensor::from_vec(v, dims.as_slice(), &Device::Cpu).unwrap();
            (
                n.to_string(),
                QTensor::quantize(&t, GgmlDType::F32).unwrap(),
            )
        })
        .collect();
    let mdr: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tr: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = File::create(path).unwrap();
    gguf_file::write(&mut f, &mdr, &tr).unwrap();
}

fn same(_: &str, d: Vec<usize>) -> Vec<usize> {
    d
}

fn temp(name: &str) -> PathBuf {
    // A directory per file: the tests run in parallel and each removes its own.
    let dir = std::env::temp_dir().join(format!("engram-weights-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

#[test]
fn llama3_scaling_keeps_short_wavelengths_divides_long_ones_and_ramps_between() {
    // Llama 3.1 8B's: θ 500k, head_dim 128, factor 8, low 1, high 4, original 8,192.
    let f = llama3_factors(128, 500_000.0, 8.0, 1.0, 4.0, 8192.0);
    assert_eq!(f.len(), 64);
    assert_eq!(f[0], 1.0);
    assert_eq!(f[63], 8.0);
    // i = 32: wavelength 2π·√500000 = 4,442.9, s = (8192/4442.9 − 1)/3 = 0.28128,
    // divisor 1/((1 − s)/8 + s) = 2.6945 (by hand).
    assert!((f[32] - 2.6945).abs() < 1e-3, "{}", f[32]);
    assert!(f.windows(2).all(|w| w[0] <= w[1]));
    // The ramp covers i = 29..=34 (wavelengths between 2,048 and 8,192).
    let ramp: Vec<usize> = (0..64).filter(|&i| f[i] > 1.0 && f[i] < 8.0).collect();
    assert_eq!(ramp, (29..=34).collect::<Vec<_>>());
}

#[test]
fn rope_scalings_reach_the_frequencies_or_are_refused() {
    let path = temp("rope.gguf");
    let load = |extra: &[(&str, Value)], freqs: Option<Vec<f32>>| {
        tiny_gguf(&path, "llama", extra, &same, None);
        if let Some(freqs) = freqs {
            // Rewrite with the frequency factors' tensor added.
            let mut f = File::open(&path).unwrap();
            let ct = Content::read(&mut f).unwrap();
            let mut tensors: Vec<(String, QTensor)> = ct
                .tensor_infos
                .keys()
                .map(|n| (n.clone(), ct.tensor(&mut f, n, &Device::Cpu).unwrap()))
                .collect();
            let t = Tensor::from_vec(freqs, 4, &Device::Cpu).unwrap();
            tensors.push((
                "rope_freqs.weight".into(),
                QTensor::quantize(&t, GgmlDType::F32).unwrap(),
            ));
            let md: Vec<(&str, &Value)> =
                ct.metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
            let tr: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
            let mut out = File::create(&path).unwrap();
            gguf_file::write(&mut out, &md, &tr).unwrap();
        }
        Weights::from_gguf(&path, WeightFormat::F32)
    };
    let plain = load(&[], None).unwrap();
    assert_eq!(plain.config.rope_freq_factors, None);
    let linear = load(
        &[
            ("llama.rope.scaling.type", Value::String("linear".into())),
            ("llama.rope.scaling.factor", Value::F32(4.0)),
        ],
        None,
    )
    .unwrap();
    assert_eq!(linear.config.rope_freq_factors, Some(vec![4.0; 4]));
    let freqs = load(&[], Some(vec![1.0, 1.5, 3.0, 8.0])).unwrap();
    assert_eq!(
        freqs.config.rope_freq_factors,
        Some(vec![1.0, 1.5, 3.0, 8.0])
    );
    // YaRN also scales attention: refused, naming the file.
    match load(
        &[("llama.rope.scaling.type", Value::String("yarn".into()))],
        None,
    ) {
        Err(ModelError::InFile { path: p, source }) => {
            assert_eq!(p, path);
            assert!(
                matches!(*source, ModelError::UnsupportedRopeScaling { ref kind } if kind == "yarn")
            );
        }
        other => panic!("{:?}", other.map(|_| ())),
    }
    // Qwen2 does not run Llama 3's scaling.
    tiny_gguf(
        &path,
        "qwen2",
        &[("qwen2.rope.scaling.type", Value::String("linear".into()))],
        &same,
        None,
    );
    let err = Weights::from_gguf(&path, WeightFormat::F32)
        .map(|_| ())
        .unwrap_err();
    assert!(err.to_string().contains("linear"), "{err}");

    // Hugging Face: Llama 3.1's own rope_scaling, and refusals.
    let dir = temp("hf-rope").parent().unwrap().to_path_buf();
    let config = |model: &str, scaling: &str| {
        format!(
            r#"{{"model_type": "{model}", "hidden_size": 16, "intermediate_size": 24,
            "num_hidden_layers": 1, "num_attention_heads": 2, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 64, "rope_scaling": {scaling}}}"#
        )
    };
    let llama3 = r#"{"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192, "rope_type": "llama3"}"#;
    for (model, scaling, refused) in [
        ("llama", llama3, None),
        ("llama", "null", None),
        ("llama", r#"{"rope_type": "default"}"#, None),
        ("llama", r#"{"type": "yarn", "factor": 4.0}"#, Some("yarn")),
        ("qwen2", llama3, Some("llama3")),
    ] {
        std::fs::write(dir.join("config.json"), config(model, scaling)).unwrap();
        match (Weights::from_safetensors_dir(&dir), refused) {
            (Err(ModelError::InFile { source, .. }), Some(kind)) => assert!(
                matches!(*source, ModelError::UnsupportedRopeScaling { kind: ref k } if k == kind),
                "{model} {scaling}: {source}"
            ),
            // Accepted: stops at the missing weights.
            (Err(ModelError::Io { .. }), None) => {}
            (other, _) => panic!("{model} {scaling}: {:?}", other.map(|_| ())),
        }
    }
    std::fs::remove_dir_all(path.parent().unwrap()).ok();
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_tensor_of_the_wrong_shape_or_a_missing_one_is_refused_naming_it_and_the_file() {
    let path = temp("shape.gguf");
    let wide_k = |n: &str, d: Vec<usize>| {
        if n == "blk.0.attn_k.weight" {
            vec![16, 16]
        } else {
            d
        }
    };
    tiny_gguf(&path, "llama", &[], &wide_k, None);
    let err = Weights::from_gguf(&path, WeightFormat::F32)
        .map(|_| ())
        .unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("blk.0.attn_k.weight") && text.contains(&path.display().to_string()),
        "{text}"
    );
    assert!(matches!(
        err,
        ModelError::InFile { ref source, .. } if matches!(**source, ModelError::TensorShape { .. })
    ));
    // Qwen2 without its biases.
    tiny_gguf(&path, "qwen2", &[], &same, Some("blk.0.attn_v.bias"));
    let err = Weights::from_gguf(&path, WeightFormat::F32)
        .map(|_| ())
        .unwrap_err();
    assert!(err.to_string().contains("blk.0.attn_v.bias"), "{err}");
    // With them it loads, the biases in the layer.
    tiny_gguf(&path, "qwen2", &[], &same, None);
    let w = Weights::from_gguf(&path, WeightFormat::F32).unwrap();
    assert!(w.layers[0].extra.qkv_bias.is_some());
    assert_eq!(w.arch.gguf, "qwen2");
    // A truncated file: refused with the file named, never a panic.
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 100]).unwrap();
    let err = Weights::from_gguf(&path, WeightFormat::F32)
        .map(|_| ())
        .unwrap_err();
    assert!(
        err.to_string().contains(&path.display().to_string()),
        "{err}"
    );
    // An unknown architecture.
    tiny_gguf(&path, "phi3", &[], &same, None);
    let err = Weights::from_gguf(&path, WeightFormat::F32)
        .map(|_| ())
        .unwrap_err();
    assert!(err.to_string().contains("`phi3`"), "{err}");
    std::fs::remove_dir_all(path.parent().unwrap()).ok();
}

#[test]
fn random_weights_are_the_seeds_in_every_run() {
    let c = ModelConfig {
        vocab_size: 32,
        hidden_size: 16,
        intermediate_size: 24,
        num_layers: 2,
        num_heads: 2,
        num_kv_heads: 1,
        head_dim: 8,
        ..ModelConfig::smollm2_135m()
    };
    let values = |seed: u64| -> Vec<f32> {
        let w = Weights::random(c.clone(), &Device::Cpu, seed).unwrap();
        let Linear::Dense(wq) = &w.layers[1].wq else {
            panic!("random weights are dense")
        };
        [wq, w.embed.dense().unwrap()]
            .iter()
            .flat_map(|t| t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
            .collect()
    };
    let (a, b, other) = (values(7), values(7), values(8));
    assert_eq!(a, b, "the same seed gives the same weights, bit for bit");
    assert_ne!(a, other);
    // σ 0.02: the sample's spread is near it.
    let var = a.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>() / a.len() as f64;
    assert!((var.sqrt() - 0.02).abs() < 0.004, "σ {}", var.sqrt());
}

fn randn(rows: usize, cols: usize) -> Tensor {
    Tensor::randn(0f32, 0.5, (rows, cols), &Device::Cpu).unwrap()
}

#[test]
fn device_weights_are_rounded_once_and_multiplied_with_f32_results() {
    let w = randn(24, 64);
    let dense = Linear::Dense(w.clone());
    // The CPU keeps f32: moving there changes nothing.
    let on_cpu = dense.to_device(&Device::Cpu, DeviceWeights::Bf16).unwrap();
    assert!(!on_cpu.is_device_dtype());
    let Linear::Dense(same) = &on_cpu else {
        panic!("dense stays dense")
    };
    let d = (same - &w).unwrap().abs().unwrap().max_all().unwrap();
    assert_eq!(d.to_scalar::<f32>().unwrap(), 0.0);

    // Rounded for a device: held in bf16, every value within its half-ulp.
    let rounded = dense.rounded_for_device(DeviceWeights::Bf16).unwrap();
    assert!(
        !dense
            .rounded_for_device(DeviceWeights::F32)
            .unwrap()
            .is_device_dtype()
    );
    assert_eq!(DeviceWeights::parse(" BF16"), Some(DeviceWeights::Bf16));
    assert_eq!(DeviceWeights::parse("f32"), Some(DeviceWeights::F32));
    assert_eq!(DeviceWeights::parse("f16"), None);
    assert!(rounded.is_device_dtype());
    let Linear::Dense(rb) = &rounded else {
        panic!("dense stays dense")
    };
    let r = rb.to_dtype(DType::F32).unwrap();
    let (wv, rv): (Vec<f32>, Vec<f32>) = (
        w.flatten_all().unwrap().to_vec1().unwrap(),
        r.flatten_all().unwrap().to_vec1().unwrap(),
    );
    assert!(
        wv.iter().zip(&rv).any(|(a, b)| a != b),
        "nothing was rounded"
    );
    for (a, b) in wv.iter().zip(&rv) {
        assert!((a - b).abs() <= a.abs() * 2f32.powi(-8), "{a} → {b}");
    }
    // The CPU slice path multiplies it as the tensor path does.
    let xs: Vec<f32> = randn(2, 64).flatten_all().unwrap().to_vec1().unwrap();
    let via_apply = rounded.apply(&xs, 2, 1).unwrap();
    let x2 = Tensor::from_slice(&xs, (2, 64), &Device::Cpu).unwrap();
    let via_forward: Vec<f32> = rounded
        .forward(&x2, 1)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    assert_eq!(via_apply, via_forward);

    // Held in bf16 (as on a device; candle multiplies bf16 on the CPU too): an f32 input
    // gives an f32 output close to the product with the rounded weights.
    let held = Linear::Dense(w.to_dtype(DEVICE_WEIGHTS).unwrap());
    assert!(held.is_device_dtype());
    let x = randn(3, 64);
    let y = held.forward(&x, 1).unwrap();
    assert_eq!(y.dtype(), DType::F32);
    assert_eq!(y.dims(), &[3, 24]);
    // Exactly the f32 product of the rounded operands, rounded once to bf16.
    let xr = x
        .to_dtype(DEVICE_WEIGHTS)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    let exact = xr.matmul(&r.t().unwrap()).unwrap();
    let exact = exact
        .to_dtype(DEVICE_WEIGHTS)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    let d = (&y - &exact).unwrap().abs().unwrap().max_all().unwrap();
    assert_eq!(d.to_scalar::<f32>().unwrap(), 0.0);
    let want = x.matmul(&r.t().unwrap()).unwrap();
    let err = (&y - &want).unwrap().sqr().unwrap().sum_all().unwrap();
    let norm = want.sqr().unwrap().sum_all().unwrap();
    let rel = (err.to_scalar::<f32>().unwrap() / norm.to_scalar::<f32>().unwrap()).sqrt();
    // Only the activations' rounding to bf16 is left (≤ 2^-8 per value).
    assert!(rel < 1e-2, "relative error {rel}");
    assert!(
        rel > 0.0,
        "the activations were not rounded: is the product f32?"
    );
}
