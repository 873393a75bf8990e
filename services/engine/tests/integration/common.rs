//! The model, loaded once per test binary, and helpers.

use std::path::PathBuf;
use std::sync::OnceLock;

use engram_engine::{
    ChatMessage, EngineConfig, EngineCore, Llama, Role, TextTokenizer, WeightFormat, chatml,
};
use engram_kvcore::CodecKind;

pub fn model_path() -> PathBuf {
    let p = std::env::var_os("ENGRAM_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf")
        });
    assert!(p.is_file(), "{} is missing: run `make models`", p.display());
    p
}

pub fn model() -> &'static (Llama, TextTokenizer) {
    static MODEL: OnceLock<(Llama, TextTokenizer)> = OnceLock::new();
    MODEL.get_or_init(|| {
        let p = model_path();
        (
            Llama::from_gguf(&p).unwrap(),
            TextTokenizer::from_gguf(&p).unwrap(),
        )
    })
}

/// The model with the weights held as `format` (loaded once per format and test binary).
pub fn model_as(format: WeightFormat) -> &'static Llama {
    static MODELS: [OnceLock<Llama>; 4] = [const { OnceLock::new() }; 4];
    let i = match format {
        WeightFormat::F32 => 0,
        WeightFormat::Quantized => 1,
        WeightFormat::Int16 => 2,
        WeightFormat::Int8 => 3,
    };
    MODELS[i].get_or_init(|| Llama::from_gguf_as(&model_path(), format).unwrap())
}

/// A core on the model with `format` weights.
pub fn core_as(format: WeightFormat, config: EngineConfig) -> EngineCore {
    EngineCore::new(model_as(format).clone(), model().1.clone(), config).unwrap()
}

pub fn core(codec: CodecKind) -> EngineCore {
    core_with(EngineConfig {
        codec,
        value_codec: None,
        ..EngineConfig::default()
    })
}

pub fn core_with(config: EngineConfig) -> EngineCore {
    let (m, t) = model();
    EngineCore::new(m.clone(), t.clone(), config).unwrap()
}

pub fn chat(user: &str) -> Vec<u32> {
    let text = chatml(&[ChatMessage::new(Role::User, user)], true);
    model().1.encode(&text).unwrap()
}

/// Real text: the GPL-3 from the Debian license directory.
pub fn license_tokens(n: usize) -> Vec<u32> {
    let text = std::fs::read_to_string("/usr/share/common-licenses/GPL-3").unwrap();
    let t = model().1.encode(&text).unwrap();
    assert!(t.len() >= n, "GPL-3 has {} tokens", t.len());
    t[..n].to_vec()
}

pub fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (x, y) in a.iter().zip(b) {
        num += f64::from(x - y).powi(2);
        den += f64::from(*y).powi(2);
    }
    (num / den).sqrt()
}

/// Mean KL(p ‖ q) in nats over rows of 49,152 logits.
pub fn mean_kl(p: &[f32], q: &[f32]) -> f64 {
    let log_softmax = |row: &[f32]| {
        let max = row.iter().fold(f32::MIN, |m, &x| m.max(x)) as f64;
        let lse = row
            .iter()
            .map(|&x| (x as f64 - max).exp())
            .sum::<f64>()
            .ln()
            + max;
        row.iter().map(|&x| x as f64 - lse).collect::<Vec<_>>()
    };
    let rows: Vec<f64> = p
        .chunks(49_152)
        .zip(q.chunks(49_152))
        .map(|(a, b)| {
            let (la, lb) = (log_softmax(a), log_softmax(b));
            la.iter().zip(&lb).map(|(x, y)| x.exp() * (x - y)).sum()
        })
        .collect();
    rows.iter().sum::<f64>() / rows.len() as f64
}

/// A fresh directory under the system's temp dir, named by `tag` and the process.
pub fn tempdir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("engram-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}
