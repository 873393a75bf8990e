//! The service with the checkpoints beyond SmolLM2 (`make models-test`): Qwen2.5-Coder-0.5B
//! (instruct, its own ChatML template) and Gemma 3 270M (a base model, Gemma's turns) each
//! answer a native turn, the OpenAI route and the SSE stream.

use std::path::PathBuf;

use serde_json::{Value, json};

use crate::harness::{Server, sqlite_url, test_config};

fn checkpoint(file: &str) -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../models")
        .join(file);
    assert!(
        p.is_file(),
        "{} is missing: run `make models-test`",
        p.display()
    );
    p
}

/// One turn of each kind against a server of `file`; returns the native turn's text.
fn serve(file: &str, question: &str) -> String {
    let mut config = test_config(&sqlite_url(), 1 << 20);
    config.model.path = checkpoint(file);
    // A turn's prompt and reply in 2K tokens: the tiers need not hold a 32K context.
    config.model.context_tokens = 2048;
    let srv = Server::start_with(config);
    let (key, _) = srv.tenant_with_bot("m", "Answer in one short sentence.");

    let (s, v) = srv.call(
        "POST",
        "/v1/agents/bot/sessions/s/turns",
        Some(&key),
        json!({"message": question, "max_tokens": 24}),
    );
    assert_eq!(s, 200, "{file}: {v}");
    let native = v["text"].as_str().unwrap().to_string();
    assert!(!native.trim().is_empty(), "{file}: empty reply {v}");

    let (s, v) = srv.call(
        "POST",
        "/v1/chat/completions",
        Some(&key),
        json!({"model": "bot", "max_tokens": 24, "user": "u1",
               "messages": [{"role": "user", "content": question}]}),
    );
    assert_eq!(s, 200, "{file}: {v}");
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(!content.trim().is_empty(), "{file}: {v}");

    let (s, body) = srv.raw(
        "POST",
        "/v1/agents/bot/sessions/s2/turns",
        Some(&key),
        json!({"message": question, "max_tokens": 8, "stream": true})
            .to_string()
            .as_bytes(),
    );
    let text = String::from_utf8_lossy(&body);
    assert_eq!(s, 200, "{file}: {text}");
    assert!(text.contains("data: {\"delta\""), "{file}: {text}");
    assert!(text.contains("\"done\":true"), "{file}: {text}");
    let (s, v) = srv.call("GET", "/v1/models", Some(&key), Value::Null);
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["data"][0]["id"], file, "the served model first: {v}");
    assert_eq!(v["data"][1]["id"], "bot", "{v}");
    assert_eq!(v["data"][1]["root"], file, "the served checkpoint: {v}");
    srv.stop();
    println!("{file}: {native:?} / {content:?}");
    native
}

#[test]
fn qwen2_5_coder_answers_every_route() {
    let text = serve(
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "What is the capital of France?",
    );
    assert!(text.contains("Paris"), "{text}");
}

#[test]
fn gemma3_answers_every_route() {
    serve("gemma-3-270m-q4_k_m.gguf", "What is the capital of France?");
}
