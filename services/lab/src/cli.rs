//! What the command-line tools share: the model arguments, loading the model with its
//! tokenizer, progress on a terminal, JSON-lines output (`engram-lab` and `engram-bench`).

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

/// Progress of a long job on stderr: a spinner with the elapsed time and the job's latest
/// message when stderr is a terminal; nothing with `--json` or when stderr is not a terminal
/// (a log file, CI), so machine-read output stays clean.
#[derive(Debug)]
pub struct Progress {
    bar: indicatif::ProgressBar,
}

impl Progress {
    /// A spinner prefixed `label`, hidden when `quiet` or stderr is not a terminal.
    pub fn new(label: &str, quiet: bool) -> Self {
        use std::io::IsTerminal;
        let shown = !quiet && std::io::stderr().is_terminal();
        let bar = if shown {
            indicatif::ProgressBar::new_spinner()
        } else {
            indicatif::ProgressBar::hidden()
        };
        if let Ok(style) = indicatif::ProgressStyle::with_template(
            "{spinner} {prefix} [{elapsed_precise}] {wide_msg}",
        ) {
            bar.set_style(style);
        }
        bar.set_prefix(label.to_string());
        bar.enable_steady_tick(std::time::Duration::from_millis(200));
        Self { bar }
    }

    /// The job's latest step.
    pub fn say(&self, message: &str) {
        self.bar.set_message(message.to_string());
    }

    /// Whether anything is drawn.
    #[cfg(test)]
    fn is_shown(&self) -> bool {
        !self.bar.is_hidden()
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.bar.finish_and_clear();
    }
}

/// One JSON object per line.
pub fn print_json(rows: impl IntoIterator<Item = serde_json::Value>) {
    for r in rows {
        println!("{r}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_is_quiet_with_json_and_when_stderr_is_not_a_terminal() {
        use std::io::IsTerminal;
        let p = Progress::new("job", true);
        p.say("step 1");
        assert!(!p.is_shown(), "--json draws nothing");
        let p = Progress::new("job", false);
        assert_eq!(p.is_shown(), std::io::stderr().is_terminal());
    }
}
