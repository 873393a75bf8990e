//! What the command-line tools share: the model arguments, loading the model with its
//! tokenizer, JSON-lines output. A module of the `engram` binary, and of `engram-bench`
//! (`benches/src/bin/engram_bench.rs` includes this file), not of the library.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use engram_engine::{Llama, TextTokenizer};

/// The default model, as `make models` places it.
pub const DEFAULT_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// Which model, held how, printed how.
#[derive(Debug, Clone, Args)]
pub struct ModelArgs {
    /// GGUF file or safetensors directory [env: ENGRAM_MODEL].
    #[arg(long, env = "ENGRAM_MODEL", default_value = DEFAULT_MODEL)]
    pub model: PathBuf,
    /// How GGUF weights are held and multiplied: int16 (the default) or int8 (blocks, integer
    /// activations for the 4-bit ones), quantized (blocks, f32 activations) or f32.
    #[arg(long, default_value = "int16")]
    pub weights: String,
    /// One JSON object per line instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// The model and its tokenizer.
pub fn load(args: &ModelArgs) -> Result<(Llama, TextTokenizer)> {
    let path = args.model.as_path();
    Llama::load_named(path, &args.weights).with_context(|| {
        format!(
            "loading {} (`make models` fetches the default)",
            path.display()
        )
    })
}

/// One JSON object per line.
pub fn print_json(rows: impl IntoIterator<Item = serde_json::Value>) {
    for r in rows {
        println!("{r}");
    }
}
