//! The candle BERT embedder against sentence-transformers' own vectors for the same model
//! (`tests/fixtures/minilm_reference.json`, generated as its `generator` field says).

use std::path::Path;

use candle_core::Device;
use engram_engine::embed::{Embedder, cosine};

fn embedder() -> Embedder {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/all-MiniLM-L6-v2");
    Embedder::load(&dir, &Device::Cpu).expect("run `make models` first")
}

#[derive(serde::Deserialize)]
struct Reference {
    texts: Vec<String>,
    embeddings: Vec<Vec<f32>>,
}

fn reference() -> Reference {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/minilm_reference.json");
    serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
}

#[test]
fn embeddings_match_sentence_transformers() {
    let (e, r) = (embedder(), reference());
    assert_eq!(e.dim(), 384);
    let texts: Vec<&str> = r.texts.iter().map(String::as_str).collect();
    // One batch (padded to the longest text) and one text at a time.
    let batched = e.embed(&texts).unwrap();
    assert_eq!(batched.len(), texts.len());
    for (i, (got, want)) in batched.iter().zip(&r.embeddings).enumerate() {
        let norm: f32 = got.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-4, "text {i}: norm {norm}");
        let c = cosine(got, want);
        println!("text {i}: cosine {c:.7} to sentence-transformers");
        assert!(c >= 0.999, "text {i} ({:?}): cosine {c}", texts[i]);
        let alone = e.embed(&[texts[i]]).unwrap().remove(0);
        assert!(cosine(&alone, want) >= 0.999, "text {i} alone");
    }
    // Meaning shows: the Berlin sentence is nearer a paraphrase than an unrelated question.
    let v = e
        .embed(&[
            "Alice lives in Berlin.",
            "Alice's home is in Berlin.",
            "What is the capital of France?",
        ])
        .unwrap();
    assert!(cosine(&v[0], &v[1]) > cosine(&v[0], &v[2]) + 0.2);
    assert!(e.embed(&[]).unwrap().is_empty());
}

#[test]
fn a_missing_model_directory_is_a_typed_error() {
    let err = Embedder::load(Path::new("/nonexistent/minilm"), &Device::Cpu).unwrap_err();
    assert!(matches!(err, engram_engine::ModelError::Io { .. }), "{err}");
}
