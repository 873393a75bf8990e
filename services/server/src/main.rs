//! `engram`: the command-line entry point. Today: the KV fidelity harness and the TTFT/decode
//! benchmark; the HTTP service joins as `engram serve`.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use engram_engine::bench::{self, TtftOptions};
use engram_engine::eval::{self, EvalOptions};
use engram_engine::{
    EngineConfig, EngineDevice, KeyCentering, KvProbe, Llama, ModelConfig, TextTokenizer,
    parse_codec,
};

/// The default model, as `make models` places it.
const DEFAULT_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

#[derive(Debug, Parser)]
#[command(
    name = "engram",
    version,
    about = "Agent memory with a semantic KV cache"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Runs the HTTP service.
    Serve(ServeArgs),
    /// Evaluations.
    #[command(subcommand)]
    Eval(EvalCommand),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Checks against the CPU reference.
    #[command(subcommand)]
    Check(CheckCommand),
    /// The shadow (the cache on disk).
    #[command(subcommand)]
    Shadow(ShadowCommand),
    /// Writes the model's tokenizer as a `tokenizer.json` (for machines the checkpoint cannot
    /// reach: `bench ttft --random-weights … --tokenizer FILE`).
    ExportTokenizer(ExportTokenizerArgs),
}

#[derive(Debug, Args)]
struct ExportTokenizerArgs {
    /// GGUF file or safetensors directory [env: ENGRAM_MODEL].
    #[arg(long, env = "ENGRAM_MODEL", default_value = DEFAULT_MODEL)]
    model: PathBuf,
    /// Where to write it.
    #[arg(long)]
    out: PathBuf,
}

#[derive(Debug, Subcommand)]
enum ShadowCommand {
    /// Checks every entry offline (manifest checksums, segment layout, block CRCs, chain
    /// hashes); exits 1 when any entry is damaged.
    Verify(ShadowVerifyArgs),
}

#[derive(Debug, Args)]
struct ShadowVerifyArgs {
    /// The shadow directory (default: the configured one).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// A TOML config file, to find the configured directory [env: ENGRAM_CONFIG].
    #[arg(long, env = "ENGRAM_CONFIG")]
    config: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
enum CheckCommand {
    /// The engine's forward pass on `--device` against the CPU engine on the same random
    /// weights (prefill and batched decode through TQ4 blocks); exits 1 above the bound.
    Device(CheckDeviceArgs),
}

#[derive(Debug, Args)]
struct CheckDeviceArgs {
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cuda")]
    device: String,
    /// smollm2-135m or llama3-8b.
    #[arg(long, default_value = "smollm2-135m")]
    shape: String,
    /// Tokens of the first sequence's prompt (the second has half + 7).
    #[arg(long, default_value_t = 600)]
    prompt: usize,
    /// Batched decode steps.
    #[arg(long, default_value_t = 8)]
    steps: usize,
    /// Largest relative L2 distance of the logits allowed.
    #[arg(long, default_value_t = 5e-3)]
    bound: f64,
}

#[derive(Debug, Args)]
struct ServeArgs {
    /// A TOML config file (defaults, then this file, then ENGRAM__SECTION__KEY variables).
    #[arg(long, env = "ENGRAM_CONFIG")]
    config: Option<PathBuf>,
    /// Overrides `database.url` (e.g. postgres://user@host/db).
    #[arg(long)]
    database_url: Option<String>,
    /// Overrides `server.bind`.
    #[arg(long)]
    bind: Option<String>,
}

#[derive(Debug, Subcommand)]
enum EvalCommand {
    /// Teacher-forced fidelity of each KV codec against exact (f32) KV.
    Kv(EvalKvArgs),
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// Time to first token (cold / hot / warm prefix) and decode tokens/s by batch.
    Ttft(TtftArgs),
    /// Hybrid recall latency (p50/p99) on synthetic graphs of random unit vectors, and the
    /// embedding model's sentences per second. One JSON object per line.
    Memory(MemoryBenchArgs),
    /// A scripted 20-turn conversation over overlapping memories, with and without cold-tier
    /// reservation (same process): memories tokens served from reserved blocks, and TTFT.
    Conversation(ConversationBenchArgs),
    /// The shadow: next-turn TTFT of a recovered session vs cold recompute vs hot, load time,
    /// write throughput vs a plain write, and wall-time overhead under steady load.
    Shadow(ShadowBenchArgs),
    /// Agent workloads against any OpenAI-compatible endpoint (Engram, llama.cpp's server, …):
    /// run a scenario, print one, or report on result files.
    #[command(subcommand)]
    Workload(WorkloadCommand),
}

#[derive(Debug, Subcommand)]
enum WorkloadCommand {
    /// Runs a workload against one endpoint; writes one JSON result file.
    Run(WorkloadRunArgs),
    /// Prints a built-in scenario as a workload file (`a`/`multi-agent`, `b`/`shared-prefix`,
    /// `c`/`restart`, `d`/`decode-4k`, `e`/`decode-4k-2`).
    Show {
        /// Scenario name or letter.
        scenario: String,
    },
    /// Summarizes result files: report.json, report.md and SVG plots.
    Report(WorkloadReportArgs),
}

#[derive(Debug, Args)]
struct WorkloadRunArgs {
    /// The endpoint's OpenAI base URL.
    #[arg(long, default_value = "http://127.0.0.1:8080/v1")]
    endpoint: String,
    /// A built-in scenario (a to e, or its name) or a workload file.
    #[arg(long, default_value = "a")]
    scenario: String,
    /// The server's label in the results.
    #[arg(long, default_value = "engram")]
    label: String,
    /// Repetition number (recorded; the report shows the spread over repetitions).
    #[arg(long, default_value_t = 1)]
    rep: usize,
    /// Engram's operator key: creates a tenant and the workload's agents first [env:
    /// ENGRAM__AUTH__ADMIN_KEY].
    #[arg(long, env = "ENGRAM__AUTH__ADMIN_KEY")]
    engram_admin_key: Option<String>,
    /// Bearer key for other endpoints.
    #[arg(long)]
    api_key: Option<String>,
    /// Shell command that restarts the server (scenarios with `restart_after`); the driver then
    /// waits until the endpoint answers.
    #[arg(long)]
    restart_cmd: Option<String>,
    /// Result file.
    #[arg(long)]
    out: PathBuf,
    /// No progress line.
    #[arg(long)]
    quiet: bool,
}

#[derive(Debug, Args)]
struct WorkloadReportArgs {
    /// Output directory.
    #[arg(long)]
    out: PathBuf,
    /// Label of Engram's runs (ratios are against it).
    #[arg(long, default_value = "engram")]
    engram_label: String,
    /// A line for the report's header (machine, date, versions).
    #[arg(long, default_value = "")]
    header: String,
    /// Result files.
    #[arg(required = true)]
    results: Vec<PathBuf>,
}

#[derive(Debug, Args)]
struct ShadowBenchArgs {
    /// GGUF file or safetensors directory [env: ENGRAM_MODEL].
    #[arg(long, env = "ENGRAM_MODEL", default_value = DEFAULT_MODEL)]
    model: PathBuf,
    /// Session sizes in tokens of history.
    #[arg(long, value_delimiter = ',', default_value = "2048,4096,8000")]
    tokens: Vec<usize>,
    /// Turns of the steady-load comparison (0: skip).
    #[arg(long, default_value_t = 24)]
    load_turns: usize,
    /// Flush interval during the steady load, ms.
    #[arg(long, default_value_t = 60_000)]
    interval_ms: u64,
    /// Scratch directory.
    #[arg(long, default_value = "data/bench-shadow")]
    dir: PathBuf,
}

#[derive(Debug, Args)]
struct ConversationBenchArgs {
    /// GGUF file or safetensors directory [env: ENGRAM_MODEL].
    #[arg(long, env = "ENGRAM_MODEL", default_value = DEFAULT_MODEL)]
    model: PathBuf,
    /// The embedding model's directory.
    #[arg(long, default_value = "models/all-MiniLM-L6-v2")]
    embedder: PathBuf,
    /// Turns per run.
    #[arg(long, default_value_t = 20)]
    turns: usize,
    /// Tokens generated per turn.
    #[arg(long, default_value_t = 16)]
    max_tokens: usize,
    /// Runs per mode (alternating off, on).
    #[arg(long, default_value_t = 1)]
    repeats: usize,
    /// Scratch directory (a fresh database and index per run).
    #[arg(long, default_value = "data/bench-conversation")]
    dir: PathBuf,
}

#[derive(Debug, Args)]
struct MemoryBenchArgs {
    /// Graph sizes.
    #[arg(long, value_delimiter = ',', default_value = "10000,100000,1000000")]
    nodes: Vec<usize>,
    /// Queries timed per size.
    #[arg(long, default_value_t = 500)]
    queries: usize,
    /// Sentences embedded for the throughput figure (0: skip).
    #[arg(long, default_value_t = 512)]
    embed: usize,
    /// Sentences per embedding call.
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// The embedding model's directory.
    #[arg(long, default_value = "models/all-MiniLM-L6-v2")]
    embedder: PathBuf,
    /// Skip the HNSW build: searches scan every vector (exact).
    #[arg(long)]
    no_index: bool,
    /// Where the indexes are built (a fresh subdirectory per size, removed after).
    #[arg(long, default_value = "data/bench-memory")]
    dir: PathBuf,
}

#[derive(Debug, Clone, Args)]
struct ModelArgs {
    /// GGUF file or safetensors directory [env: ENGRAM_MODEL].
    #[arg(long, env = "ENGRAM_MODEL", default_value = DEFAULT_MODEL)]
    model: PathBuf,
    /// How GGUF weights are held and multiplied: int16 (the default) or int8 (blocks, integer
    /// activations for the 4-bit ones), quantized (blocks, f32 activations) or f32.
    #[arg(long, default_value = "int16")]
    weights: String,
    /// One JSON object per line instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
struct EvalKvArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// A text file or a directory of them.
    #[arg(long, default_value = eval::DEFAULT_CORPUS)]
    corpus: PathBuf,
    /// Predictions scored at most.
    #[arg(long, default_value_t = 16_384)]
    tokens: usize,
    /// Window length in tokens.
    #[arg(long, default_value_t = 2_048)]
    window: usize,
    /// Codecs to compare with the f32 reference.
    #[arg(long, value_delimiter = ',', default_value = "f16,q8,tq4,tq3,tq2")]
    codecs: Vec<String>,
    /// An ablation, e.g. `k=tq4` (keys only), `v=tq4`, `k=tq4,layers=10-19`,
    /// `k=tq4,v=tq4,exact_first=16`; repeat for more.
    #[arg(long)]
    probe: Vec<String>,
    /// Subtract each head's calibrated mean key before storing: `calibrated` or `off`.
    #[arg(long, default_value = "calibrated")]
    key_centering: String,
    /// Also run the reference codec and every codec with the weights held these ways
    /// (quantized, int16, int8 or f32), scored against `--weights`' reference: rows
    /// `CODEC+WEIGHTS`.
    #[arg(long, value_delimiter = ',')]
    also_weights: Vec<String>,
}

#[derive(Debug, Args)]
struct TtftArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt sizes in tokens.
    #[arg(long, value_delimiter = ',', default_value = "1024,2048,4096,6144")]
    sizes: Vec<usize>,
    /// New suffix in tokens.
    #[arg(long, default_value_t = 128)]
    suffix: usize,
    /// Decode batch sizes.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16")]
    batches: Vec<usize>,
    /// Prompt length of each decoding sequence: the context decode attends over.
    #[arg(long, default_value_t = 128)]
    decode_context: usize,
    /// Decode steps timed per batch.
    #[arg(long, default_value_t = 16)]
    steps: usize,
    /// KV codec.
    #[arg(long, default_value = "tq4")]
    codec: String,
    /// Text the prompts are cut from.
    #[arg(long, default_value = eval::DEFAULT_CORPUS)]
    corpus: PathBuf,
    /// Where the engine runs: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Random weights of a known shape instead of `--model`: smollm2-135m or llama3-8b (speed
    /// work on a machine the checkpoint cannot reach; the tokenizer still comes from
    /// `--tokenizer`).
    #[arg(long)]
    random_weights: Option<String>,
    /// A tokenizer.json (default: the model's).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Subtract each head's calibrated mean key before storing: `calibrated` or `off` (random
    /// weights: always off).
    #[arg(long, default_value = "calibrated")]
    key_centering: String,
    /// Hot-tier budget in MiB.
    #[arg(long, default_value_t = 1024)]
    hot_mib: u64,
    /// Cold-tier budget in MiB.
    #[arg(long, default_value_t = 2048)]
    cold_mib: u64,
}

fn load(args: &ModelArgs) -> Result<(Llama, TextTokenizer)> {
    let path = args.model.as_path();
    let weights = engram_engine::WeightFormat::parse(&args.weights).with_context(|| {
        format!(
            "--weights `{}`: quantized, int16, int8 or f32",
            args.weights
        )
    })?;
    let model = Llama::load_as(path, weights).with_context(|| {
        format!(
            "loading {} (run `make models` for the default)",
            path.display()
        )
    })?;
    let tok = TextTokenizer::for_model(path)?;
    Ok((model, tok))
}

fn print_json(rows: impl IntoIterator<Item = serde_json::Value>) {
    for r in rows {
        println!("{r}");
    }
}

fn eval_kv(args: EvalKvArgs) -> Result<()> {
    let (model, tok) = load(&args.model)?;
    let opts = EvalOptions {
        corpus: args.corpus,
        max_tokens: args.tokens,
        window: args.window,
        codecs: args
            .codecs
            .iter()
            .map(|c| parse_codec(c))
            .collect::<Result<_, _>>()?,
        key_centering: parse_key_centering(&args.key_centering)?,
        probes: args
            .probe
            .iter()
            .map(|p| KvProbe::parse(p))
            .collect::<Result<_, _>>()?,
        ..EvalOptions::default()
    };
    let other = args
        .also_weights
        .iter()
        .map(|w| {
            let (m, _) = load(&ModelArgs {
                weights: w.clone(),
                ..args.model.clone()
            })?;
            Ok((w.as_str(), m))
        })
        .collect::<Result<Vec<_>>>()?;
    let others: Vec<(&str, &Llama)> = other.iter().map(|(l, m)| (*l, m)).collect();
    let rows = eval::evaluate_with(&model, &others, &tok, &opts, |m| eprintln!("eval: {m}"))?;
    if args.model.json {
        print_json(rows.iter().map(|r| serde_json::json!(r)));
    } else {
        println!(
            "{:<12} {:>8} {:>12} {:>10} {:>10} {:>8} {:>8}",
            "codec", "bits/el", "KL (nats)", "ppl", "Δppl", "top-1", "tokens"
        );
        for r in rows {
            println!(
                "{:<12} {:>8.2} {:>12.6} {:>10.4} {:>+9.3}% {:>7.2}% {:>8}",
                r.codec,
                r.bits_per_element,
                r.kl_nats,
                r.ppl,
                100.0 * r.ppl_delta_rel,
                100.0 * r.top1_agreement,
                r.tokens
            );
        }
    }
    Ok(())
}

fn parse_key_centering(s: &str) -> Result<KeyCentering> {
    match s {
        "calibrated" => Ok(KeyCentering::Calibrated),
        "off" => Ok(KeyCentering::Off),
        other => anyhow::bail!("--key-centering `{other}`: calibrated or off"),
    }
}

fn bench_ttft(args: TtftArgs) -> Result<()> {
    let device = EngineDevice::parse(&args.device)?;
    let mut key_centering = parse_key_centering(&args.key_centering)?;
    let (model, tok) = match &args.random_weights {
        None => load(&args.model)?,
        Some(shape) => {
            let config = crate::shape(shape)?;
            let dev = device.candle()?;
            let path = args.tokenizer.clone().unwrap_or(args.model.model.clone());
            key_centering = KeyCentering::Off;
            (
                Llama::random(config, &dev, 7)?,
                TextTokenizer::for_model(&path)?,
            )
        }
    };
    let tok = match &args.tokenizer {
        Some(p) => TextTokenizer::for_model(p)?,
        None => tok,
    };
    let text = eval::read_corpus(&args.corpus)?;
    let corpus = tok.encode(&text)?;
    let opts = TtftOptions {
        prompt_tokens: args.sizes,
        suffix_tokens: args.suffix,
        batches: args.batches,
        decode_steps: args.steps,
        decode_prompt: args.decode_context,
        codec: parse_codec(&args.codec)?,
        engine: EngineConfig {
            device,
            key_centering,
            hot_bytes: args.hot_mib << 20,
            cold_bytes: args.cold_mib << 20,
            ..EngineConfig::default()
        },
    };
    let ttft = bench::ttft(&model, &tok, &corpus, &opts, |m| eprintln!("ttft: {m}"))?;
    let decode = bench::decode(&model, &tok, &corpus, &opts, |m| eprintln!("decode: {m}"))?;
    if args.model.json {
        print_json(ttft.iter().map(|r| {
            serde_json::json!({
                "prompt_tokens": r.prompt_tokens,
                "suffix_tokens": r.suffix_tokens,
                "cold_ms": r.cold_ms,
                "hot_ms": r.hot_ms,
                "warm_ms": r.warm_ms,
                "cold_over_hot": r.cold_ms / r.hot_ms,
                "cold_over_warm": r.cold_ms / r.warm_ms,
            })
        }));
        print_json(decode.iter().map(|r| serde_json::json!(r)));
    } else {
        println!(
            "{:>8} {:>7} {:>10} {:>10} {:>10} {:>9} {:>10}",
            "prompt", "suffix", "cold ms", "hot ms", "warm ms", "cold/hot", "cold/warm"
        );
        for r in &ttft {
            println!(
                "{:>8} {:>7} {:>10.1} {:>10.1} {:>10.1} {:>8.1}x {:>9.1}x",
                r.prompt_tokens,
                r.suffix_tokens,
                r.cold_ms,
                r.hot_ms,
                r.warm_ms,
                r.cold_ms / r.hot_ms,
                r.cold_ms / r.warm_ms
            );
        }
        for r in &decode {
            println!(
                "decode {:>10} batch {:>2} at {:>5} tokens: {:>8.1} tokens/s, {:>7.1} ms per token",
                r.mode, r.batch, r.context_tokens, r.decode_tokens_per_s, r.ms_per_token
            );
        }
    }
    Ok(())
}

fn serve(args: ServeArgs) -> Result<()> {
    let mut env: Vec<(String, String)> = std::env::vars().collect();
    if let Some(url) = args.database_url {
        env.push(("ENGRAM__DATABASE__URL".into(), url));
    }
    if let Some(bind) = args.bind {
        env.push(("ENGRAM__SERVER__BIND".into(), bind));
    }
    let config = engram_server::Config::load(args.config.as_deref(), env)?;
    actix_web::rt::System::new().block_on(engram_server::serve(config))?;
    Ok(())
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Serve(args) => serve(args),
        Command::Eval(EvalCommand::Kv(args)) => eval_kv(args),
        Command::Bench(BenchCommand::Ttft(args)) => bench_ttft(args),
        Command::Bench(BenchCommand::Memory(args)) => bench_memory(args),
        Command::Bench(BenchCommand::Conversation(args)) => bench_conversation(args),
        Command::Bench(BenchCommand::Shadow(args)) => bench_shadow(args),
        Command::Bench(BenchCommand::Workload(cmd)) => bench_workload(cmd),
        Command::Check(CheckCommand::Device(args)) => check_device(args),
        Command::Shadow(ShadowCommand::Verify(args)) => shadow_verify(args),
        Command::ExportTokenizer(args) => {
            TextTokenizer::for_model(&args.model)?.save_json(&args.out)?;
            Ok(())
        }
    }
}

fn shadow_verify(args: ShadowVerifyArgs) -> Result<()> {
    let store: std::sync::Arc<dyn engram_server::shadow::Storage> = match args.dir {
        Some(d) if !d.is_dir() => anyhow::bail!("{}: no such shadow directory", d.display()),
        Some(d) => std::sync::Arc::new(engram_server::shadow::LocalStorage::open(&d)?),
        None => {
            let config = engram_server::Config::load(args.config.as_deref(), std::env::vars())?;
            engram_server::shadow_storage(&config)?
        }
    };
    let r = engram_server::shadow::verify(store.as_ref())?;
    println!(
        "shadow {}: {} entries, {} ok, {} damaged; {} blocks, {} bytes checked",
        store.location(),
        r.entries,
        r.ok,
        r.damaged.len(),
        r.blocks,
        r.bytes
    );
    for (id, reason) in &r.damaged {
        println!("  damaged {id}: {reason}");
    }
    if !r.damaged.is_empty() {
        std::process::exit(1);
    }
    Ok(())
}

fn bench_workload(cmd: WorkloadCommand) -> Result<()> {
    use engram_server::bench_workload::{RunOptions, RunResult, Workload, describe, report, run};
    match cmd {
        WorkloadCommand::Show { scenario } => {
            let w = Workload::load(&scenario)?;
            println!("{}", serde_json::to_string_pretty(&w)?);
        }
        WorkloadCommand::Run(a) => {
            let w = Workload::load(&a.scenario)?;
            if !a.quiet {
                eprintln!(
                    "workload {} on {} ({}): {}",
                    w.name,
                    a.endpoint,
                    a.label,
                    describe(&w.plan()?)
                );
            }
            let r = run(
                &w,
                &RunOptions {
                    endpoint: a.endpoint,
                    label: a.label,
                    rep: a.rep,
                    engram_admin_key: a.engram_admin_key,
                    api_key: a.api_key,
                    restart_cmd: a.restart_cmd,
                    progress: !a.quiet,
                },
            )?;
            if let Some(dir) = a.out.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir)?;
            }
            std::fs::write(&a.out, serde_json::to_vec_pretty(&r)?)?;
            let errors = r.requests.iter().filter(|q| q.error.is_some()).count();
            println!(
                "{}",
                serde_json::json!({
                    "bench": "workload", "workload": r.workload, "label": r.label, "rep": r.rep,
                    "requests": r.requests.len(), "errors": errors, "wall_ms": r.wall_ms,
                    "out": a.out,
                })
            );
        }
        WorkloadCommand::Report(a) => {
            let mut runs: Vec<RunResult> = Vec::new();
            for f in &a.results {
                let bytes = std::fs::read(f).with_context(|| f.display().to_string())?;
                runs.push(serde_json::from_slice(&bytes).with_context(|| f.display().to_string())?);
            }
            report::write(&runs, &a.engram_label, &a.header, &a.out)?;
            println!("{}", a.out.join("report.md").display());
        }
    }
    Ok(())
}

fn bench_shadow(args: ShadowBenchArgs) -> Result<()> {
    let _ = std::fs::remove_dir_all(&args.dir);
    actix_web::rt::System::new().block_on(async {
        for &n in &args.tokens {
            let f = engram_server::bench_shadow::size(
                &args.model,
                &args.dir.join(format!("size-{n}")),
                n,
            )
            .await?;
            println!(
                "{}",
                serde_json::json!({"bench": "shadow_restart", "tokens": n, "figures": f})
            );
        }
        if args.load_turns > 0 {
            let f = engram_server::bench_shadow::steady(
                &args.model,
                &args.dir,
                args.load_turns,
                args.interval_ms,
            )
            .await?;
            println!(
                "{}",
                serde_json::json!({"bench": "shadow_steady_load", "figures": f})
            );
        }
        anyhow::Ok(())
    })?;
    let _ = std::fs::remove_dir_all(&args.dir);
    Ok(())
}

fn bench_conversation(args: ConversationBenchArgs) -> Result<()> {
    let scratch = args.dir.clone();
    actix_web::rt::System::new().block_on(async move {
        let mut summaries = Vec::new();
        for r in 0..args.repeats {
            for reserve in [false, true] {
                let dir = args.dir.join(format!("run{r}-{reserve}"));
                let _ = std::fs::remove_dir_all(&dir);
                std::fs::create_dir_all(&dir)?;
                let mut config = engram_server::Config::default();
                config.database.url = format!("sqlite://{}/engram.db?mode=rwc", dir.display());
                config.model.path = args.model.clone();
                config.memory.embedder_path = args.embedder.clone();
                config.memory.vector_dir = dir.join("vectors");
                let (turns, summary) = engram_server::bench_conversation::run(
                    config,
                    reserve,
                    args.turns,
                    args.max_tokens,
                )
                .await?;
                for t in &turns {
                    println!("{}", serde_json::json!({"bench": "conversation_turn", "run": r, "figures": t}));
                }
                println!("{}", serde_json::json!({"bench": "conversation", "run": r, "summary": summary}));
                summaries.push(summary);
            }
        }
        let mean = |on: bool, f: fn(&engram_server::bench_conversation::RunSummary) -> f64| {
            let v: Vec<f64> = summaries.iter().filter(|s| s.reserve == on).map(f).collect();
            v.iter().sum::<f64>() / v.len().max(1) as f64
        };
        println!(
            "{}",
            serde_json::json!({
                "bench": "conversation_ratio",
                "mean_ttft_ms_off": mean(false, |s| s.mean_ttft_ms),
                "mean_ttft_ms_on": mean(true, |s| s.mean_ttft_ms),
                "ttft_on_over_off": mean(true, |s| s.mean_ttft_ms) / mean(false, |s| s.mean_ttft_ms).max(1e-9),
                "reserved_share_on": mean(true, |s| s.reserved_share),
                "cached_share_off": mean(false, |s| s.cached_share),
                "cached_share_on": mean(true, |s| s.cached_share),
            })
        );
        anyhow::Ok(())
    })?;
    // Only now: background tasks of the runs still held their vector indexes until the runtime
    // stopped.
    let _ = std::fs::remove_dir_all(&scratch);
    Ok(())
}

fn bench_memory(args: MemoryBenchArgs) -> Result<()> {
    use engram_server::bench_memory::{embed_rate, scale};
    if args.embed > 0 {
        let e = engram_engine::embed::Embedder::load(&args.embedder, &candle_core::Device::Cpu)
            .with_context(|| format!("embedding model at {}", args.embedder.display()))?;
        let r = embed_rate(&e, args.embed, args.batch)?;
        println!(
            "{}",
            serde_json::json!({"bench": "embed", "model": args.embedder, "report": r})
        );
    }
    for &n in &args.nodes {
        let dir = args.dir.join(format!("n{n}"));
        let _ = std::fs::remove_dir_all(&dir);
        let r = scale(n, args.queries, &dir, 42, !args.no_index)?;
        let _ = std::fs::remove_dir_all(&dir);
        println!(
            "{}",
            serde_json::json!({"bench": "hybrid_query", "report": r})
        );
    }
    Ok(())
}

fn shape(name: &str) -> Result<ModelConfig> {
    Ok(match name {
        "smollm2-135m" => ModelConfig::smollm2_135m(),
        "llama3-8b" => ModelConfig::llama3_8b(),
        other => anyhow::bail!("unknown shape `{other}`: smollm2-135m or llama3-8b"),
    })
}

fn check_device(args: CheckDeviceArgs) -> Result<()> {
    let device = EngineDevice::parse(&args.device)?;
    let rows = bench::device_parity(device, shape(&args.shape)?, args.prompt, args.steps)?;
    let mut worst = 0.0f64;
    for r in &rows {
        println!("{}", serde_json::json!(r));
        worst = worst.max(r.rel_l2);
    }
    let pass = worst <= args.bound;
    println!(
        "{}",
        serde_json::json!({"device": args.device, "shape": args.shape, "worst_rel_l2": worst, "bound": args.bound, "pass": pass})
    );
    if !pass {
        std::process::exit(1);
    }
    Ok(())
}
