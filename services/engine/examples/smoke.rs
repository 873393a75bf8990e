#![allow(clippy::unwrap_used, clippy::expect_used)]
use engram_engine::*;
use engram_kvcore::{CodecKind, TenantId};
fn main() -> anyhow::Result<()> {
    let path = std::path::Path::new("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let t = std::time::Instant::now();
    let mut core = EngineCore::load(
        path,
        EngineConfig {
            codec: CodecKind::F32,
            ..Default::default()
        },
    )?;
    println!("load {:?}", t.elapsed());
    let prompt = chatml(
        &[ChatMessage::new(
            Role::User,
            "What is the capital of France?",
        )],
        true,
    );
    let toks = core.tokenizer().encode(&prompt)?;
    println!("{} tokens {:?}", toks.len(), &toks[..8]);
    let (id, _) = core.start(SequenceSpec::plain(toks, TenantId(1)))?;
    let t = std::time::Instant::now();
    let mut logits = core.prefill(id)?;
    println!("prefill {:?}", t.elapsed());
    let mut out = vec![];
    let t = std::time::Instant::now();
    for _ in 0..20 {
        let tok = argmax(&logits);
        if core.tokenizer().stop_ids().contains(&tok) {
            break;
        }
        out.push(tok);
        logits = core.decode(&[(id, tok)])?.remove(0);
    }
    println!("decode {} in {:?}", out.len(), t.elapsed());
    println!("{:?}", core.tokenizer().decode(&out)?);
    Ok(())
}
