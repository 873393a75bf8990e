//! One chat turn through the engine thread, streamed to stdout:
//! `cargo run --release -p engram-engine --example chat -- "What is the capital of France?"`

use std::io::Write;

use engram_engine::{
    ChatMessage, Engine, EngineConfig, EngineCore, GenerateRequest, Role, SamplingParams,
    SequenceSpec, StreamEvent, chatml,
};
use engram_kvcore::TenantId;

fn main() -> anyhow::Result<()> {
    let question = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "What is the capital of France?".into());
    let model = std::env::var("ENGRAM_MODEL")
        .unwrap_or_else(|_| "models/SmolLM2-135M-Instruct.Q4_1.gguf".into());
    let engine = Engine::spawn(EngineCore::load(model.as_ref(), EngineConfig::default())?)?;
    let prompt = chatml(&[ChatMessage::new(Role::User, question)], true);
    let tokens = engine.tokenizer().encode(&prompt)?;
    let rx = engine.submit(GenerateRequest {
        spec: SequenceSpec::plain(tokens, TenantId(1)),
        sampling: SamplingParams::greedy(128),
    })?;
    for event in rx.iter() {
        match event {
            StreamEvent::Started(a) => eprintln!("[{} prompt tokens]", a.prompt_tokens),
            StreamEvent::Delta { text, .. } => {
                print!("{text}");
                std::io::stdout().flush()?;
            }
            StreamEvent::Done { reason, usage, .. } => {
                println!();
                eprintln!("[{reason:?}, {} tokens]", usage.completion_tokens);
            }
            StreamEvent::Failed(e) => return Err(e.into()),
        }
    }
    Ok(())
}
