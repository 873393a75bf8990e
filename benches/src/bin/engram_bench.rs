//! `engram-bench`: the benchmark drivers (`make bench-ttft`, `bench-memory`, `bench-conversation`,
//! `bench-shadow`, `bench-workload`). Each prints its figures (JSON lines or a table); none
//! asserts a speed.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use engram_engine::{
    EngineConfig, EngineDevice, KeyCentering, Llama, ModelConfig, StreamCodecs, TextTokenizer,
};
use engram_lab::bench::{self, TtftOptions};
use engram_lab::cli::{self, DEFAULT_MODEL, ModelArgs, load, print_json};
use engram_lab::eval;

#[derive(Debug, Parser)]
#[command(
    name = "engram-bench",
    version,
    about = "Engram's benchmarks: figures printed, compared with the server a user would pick instead"
)]
struct Cli {
    #[command(subcommand)]
    command: BenchCommand,
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// Time to first token (cold / hot / warm prefix) and decode tokens/s by batch.
    Ttft(TtftArgs),
    /// Serving speed on a model file, as a client sees it: random prompts of each length, one
    /// or a batch at a time; TTFT per sequence and time per output token from token arrival
    /// gaps (the engine in process; `benches/gpu-peer/` runs llama-server beside it).
    E2e(E2eArgs),
    /// Hybrid recall latency (p50/p99) on synthetic graphs of random unit vectors, and the
    /// embedding model's sentences per second. One JSON object per line.
    Memory(MemoryBenchArgs),
    /// A scripted 20-turn conversation over overlapping memories, with and without cold-tier
    /// reservation (same process): memories tokens served from reserved blocks, and TTFT.
    Conversation(ConversationBenchArgs),
    /// The shadow: next-turn TTFT of a recovered session vs cold recompute vs hot, load time,
    /// write throughput vs a plain write, and wall-time overhead under steady load.
    Shadow(ShadowBenchArgs),
    /// The tier bridge and the shadow's byte budget under a steady multi-session load (Zipf
    /// over sessions), every budget at half the measured working set: tier moves per block per
    /// cycle, the shadow's size against its budget, sessions archived and thawed.
    Tiers(TiersBenchArgs),
    /// Attention-aware eviction against priority-only: agents with long stable prefixes and
    /// conversations (Zipf over agents), the hot tier at a share of the working set; hot hit
    /// rate, TTFT, and whether the replies are identical across policies.
    Eviction(EvictionBenchArgs),
    /// Agent workloads against any OpenAI-compatible endpoint (Engram, llama.cpp's server, …):
    /// run a scenario, print one, or report on result files.
    #[command(subcommand)]
    Workload(WorkloadCommand),
    /// An agentic trace (a large stable system prompt with tools, tool results of hundreds to
    /// thousands of tokens, ~100:1 input to output, seeded pauses, every session live) against
    /// one OpenAI-compatible endpoint: per-turn cached share, TTFT p50/p95, wall; or, with
    /// `--report`, result files side by side.
    Agentic(AgenticArgs),
}

#[derive(Debug, Args)]
struct AgenticArgs {
    /// The endpoint's OpenAI base URL.
    #[arg(long, default_value = "http://127.0.0.1:8080/v1")]
    endpoint: String,
    /// The server's name in the results.
    #[arg(long, default_value = "engram")]
    label: String,
    /// Engram's operator key: the run gets a fresh tenant.
    #[arg(long)]
    engram_admin_key: Option<String>,
    /// Bearer key of the requests (without `--engram-admin-key`).
    #[arg(long)]
    api_key: Option<String>,
    /// The `model` of the requests.
    #[arg(long, default_value = "default")]
    model: String,
    /// Sessions, all live at once.
    #[arg(long, default_value_t = 4)]
    sessions: usize,
    /// Turns per session.
    #[arg(long, default_value_t = 30)]
    turns: usize,
    /// Filler words of the system prompt besides its tool definitions.
    #[arg(long, default_value_t = 1200)]
    system_words: usize,
    /// Smallest tool result, words (about a token each).
    #[arg(long, default_value_t = 200)]
    tool_min: usize,
    /// Largest tool result, words.
    #[arg(long, default_value_t = 2000)]
    tool_max: usize,
    /// Shortest pause between a session's turns, ms.
    #[arg(long, default_value_t = 1000)]
    pause_min_ms: u64,
    /// Longest pause, ms.
    #[arg(long, default_value_t = 60_000)]
    pause_max_ms: u64,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 8)]
    max_tokens: usize,
    /// Seed of the sizes and pauses.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Where the run's JSON goes.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Instead of running: the result files to set side by side (the first is the reference
    /// the others' TTFT is divided by).
    #[arg(long, num_args = 1..)]
    report: Vec<PathBuf>,
}

#[derive(Debug, Subcommand)]
enum WorkloadCommand {
    /// Runs a workload against one endpoint; writes one JSON result file.
    Run(WorkloadRunArgs),
    /// Prints a built-in scenario as a workload file (`a`/`multi-agent`, `b`/`shared-prefix`,
    /// `c`/`restart`, `d`/`decode-4k`, `e`/`decode-4k-2`, `f`/`shared-bases`, `g`/`shared-bases-followup`).
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
    /// A built-in scenario (a to g, or its name) or a workload file.
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
    /// Restarts over shadows of this many sessions (comma-separated), with a cold tier of
    /// `recovery_cold_mib`: the peak memory each restart adds (empty: skip).
    #[arg(long, value_delimiter = ',')]
    recovery_sessions: Vec<usize>,
    /// Cold tier of the recovery-memory restarts, MiB.
    #[arg(long, default_value_t = 16)]
    recovery_cold_mib: u64,
    /// Scratch directory.
    #[arg(long, default_value = "data/bench-shadow")]
    dir: PathBuf,
}

#[derive(Debug, Args)]
struct TiersBenchArgs {
    /// GGUF file or safetensors directory [env: ENGRAM_MODEL].
    #[arg(long, env = "ENGRAM_MODEL", default_value = DEFAULT_MODEL)]
    model: PathBuf,
    /// Sessions.
    #[arg(long, default_value_t = 12)]
    sessions: usize,
    /// Warm-up turns per session (round robin) before the steady phase; a conversation ends
    /// after twice as many and a new one takes its place.
    #[arg(long, default_value_t = 3)]
    warm_turns: usize,
    /// Turns of the steady phase.
    #[arg(long, default_value_t = 200)]
    turns: usize,
    /// Milliseconds between tier cycles (the service's `tiers.interval_ms`).
    #[arg(long, default_value_t = 1000)]
    cycle_ms: u64,
    /// Mean milliseconds between the steady turns' arrivals (a Poisson process, seeded);
    /// 0: back to back, the service saturated.
    #[arg(long, default_value_t = 0)]
    gap_ms: u64,
    /// Scratch directory.
    #[arg(long, default_value = "data/bench-tiers")]
    dir: PathBuf,
}

#[derive(Debug, Args)]
struct EvictionBenchArgs {
    /// GGUF file or safetensors directory [env: ENGRAM_MODEL].
    #[arg(long, env = "ENGRAM_MODEL", default_value = DEFAULT_MODEL)]
    model: PathBuf,
    /// Agents (one conversation each).
    #[arg(long, default_value_t = 12)]
    agents: usize,
    /// Lines of prose per stable layer (five layers per agent; the default makes 40 % of the
    /// working set hold one full context, the smallest hot tier the engine takes).
    #[arg(long, default_value_t = 24)]
    layer_lines: usize,
    /// Warm-up turns per agent; a conversation ends after twice as many.
    #[arg(long, default_value_t = 3)]
    warm_turns: usize,
    /// Steady turns per policy.
    #[arg(long, default_value_t = 120)]
    turns: usize,
    /// Tokens generated per turn.
    #[arg(long, default_value_t = 8)]
    max_tokens: usize,
    /// Hot tier as a share of the working set.
    #[arg(long, default_value_t = 0.4)]
    hot_share: f64,
    /// Cold tier as a share of the working set (0: the default, unbounded for this load); a
    /// bounded cold tier runs without the shadow, so a block dropped from it is recomputed.
    #[arg(long, default_value_t = 0.0)]
    cold_share: f64,
    /// Exponent of the Zipf law over agents (0: uniform).
    #[arg(long, default_value_t = 1.0)]
    zipf_s: f64,
    /// Seed of the steady turns' draw over agents (the same for every policy of a run).
    #[arg(long, default_value_t = engram_benches::eviction::SEED)]
    seed: u64,
    /// Turn the tier loop off (only admissions move blocks: what stays hot is the eviction
    /// ranking's choice alone).
    #[arg(long)]
    no_tier_loop: bool,
    /// From this steady turn on, popularity shifts: Zipf rank k draws agent (k + agents/2) mod
    /// agents, so busy agents become occasional and the other way round (0: never).
    #[arg(long, default_value_t = 0)]
    shift_at: usize,
    /// An `[eviction]` setting to measure, as JSON (repeatable; the first is the reference the
    /// replies are compared with), which may also carry `"stage": false` (`[tiers] stage`: the
    /// bridge spills ahead instead of staging) and `"hot_share"` (that run's hot tier as a share
    /// of the working set: 1.0 gives the bound no eviction beats). Default: priority-only, attention-aware,
    /// attention-aware with a 64-step idle window.
    #[arg(long = "policy", value_parser = parse_json)]
    policies: Vec<serde_json::Value>,
    /// Runs of every policy: repetition `r` runs them in the given order when `r` is even,
    /// reversed when odd; TTFT is compared over all of them, paired by turn.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    repeat: u64,
    /// Run every policy in one run, each turn sent to every policy before the next (order
    /// flipping turn by turn), instead of one policy after the other: machine drift over
    /// minutes then weighs on every policy alike.
    #[arg(long)]
    interleave: bool,
    /// Scratch directory.
    #[arg(long, default_value = "data/bench-eviction")]
    dir: PathBuf,
}

/// A JSON argument.
fn parse_json(s: &str) -> std::result::Result<serde_json::Value, String> {
    serde_json::from_str(s).map_err(|e| format!("not JSON: {e}"))
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
    /// Runs per mode (alternating off, on, prefetch).
    #[arg(long, default_value_t = 1)]
    repeats: usize,
    /// Share of each question's words the prefetch mode sends ahead of its turn.
    #[arg(long, default_value_t = 0.75)]
    prefetch_share: f64,
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
    /// KV codec, or KEYS/VALUES (`q8/tq4`); empty: the device's built-in default (`tq6o1/tq5` on
    /// the CPU, `tq4` on CUDA).
    #[arg(long, default_value = "")]
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
    /// Decode steps of the constrained measurement (batches 1 and 8, each token under a JSON
    /// schema, against the same decode unconstrained); 0: not measured.
    #[arg(long, default_value_t = 128)]
    constrained_steps: usize,
}

#[derive(Debug, Args)]
struct E2eArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt lengths in tokens.
    #[arg(long, value_delimiter = ',', default_value = "4096,32768")]
    prompts: Vec<usize>,
    /// Sequences decoding together.
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    batches: Vec<usize>,
    /// Tokens generated per sequence after its first.
    #[arg(long, default_value_t = 64)]
    steps: usize,
    /// KV codec, or KEYS/VALUES; empty: the device's built-in default (`tq4` on CUDA).
    #[arg(long, default_value = "")]
    codec: String,
    /// Where the engine runs: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cuda")]
    device: String,
    /// Prefill chunk in tokens.
    #[arg(long, default_value_t = 1024)]
    prefill_chunk: usize,
    /// Hot-tier budget in MiB (VRAM on CUDA): room for the largest batch × (prompt + steps).
    #[arg(long, default_value_t = 24 << 10)]
    hot_mib: u64,
    /// Seed of the random prompts.
    #[arg(long, default_value_t = 11)]
    seed: u64,
    /// How a CUDA device holds the projections: bf16 (the default) or f32.
    #[arg(long, default_value = "bf16")]
    device_weights: String,
}

fn main() -> Result<()> {
    match Cli::parse().command {
        BenchCommand::Ttft(args) => bench_ttft(args),
        BenchCommand::E2e(args) => bench_e2e(args),
        BenchCommand::Memory(args) => bench_memory(args),
        BenchCommand::Conversation(args) => bench_conversation(args),
        BenchCommand::Shadow(args) => bench_shadow(args),
        BenchCommand::Tiers(args) => bench_tiers(args),
        BenchCommand::Eviction(args) => bench_eviction(args),
        BenchCommand::Workload(cmd) => bench_workload(cmd),
        BenchCommand::Agentic(args) => bench_agentic(args),
    }
}

fn bench_ttft(args: TtftArgs) -> Result<()> {
    let device = EngineDevice::parse(&args.device)?;
    let mut key_centering = KeyCentering::parse(&args.key_centering)?;
    let (model, tok) = match &args.random_weights {
        None => load(&args.model)?,
        Some(shape) => {
            let config = ModelConfig::named(shape)?;
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
        constrained_steps: args.constrained_steps,
        codec: StreamCodecs::parse_or_default(&args.codec, device)?,
        engine: EngineConfig {
            device,
            key_centering,
            hot_bytes: args.hot_mib << 20,
            cold_bytes: args.cold_mib << 20,
            ..EngineConfig::default()
        },
    };
    let progress = cli::Progress::new("bench ttft", args.model.json);
    let ttft = bench::ttft(&model, &tok, &corpus, &opts, |m| progress.say(m))?;
    // Constrained decoding: the service's grammar for the model's vocabulary (its logits'
    // rows), compiled once as the service does.
    let grammars = (args.constrained_steps > 0)
        .then(|| engram_grammar::Grammars::new(&tok, model.config().vocab_size))
        .transpose()?;
    let schema = engram_grammar::example_schema();
    let make = |g: &engram_grammar::Grammars| -> std::result::Result<
        Box<dyn engram_engine::Constraint>,
        String,
    > {
        Ok(Box::new(g.json_schema(&schema).map_err(|e| e.to_string())?))
    };
    let constrain = grammars.as_ref().map(|g| move || make(g));
    let constrain: Option<bench::Constrain<'_>> = constrain.as_ref().map(|c| c as _);
    let decode = bench::decode(&model, &tok, &corpus, &opts, constrain, |m| progress.say(m))?;
    drop(progress);
    // Decode against the memory it must read: the weights' bytes a step, this machine's read
    // bandwidth on the engine's threads, and the share of it one sequence's decode uses.
    let threads = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    let weight_bytes = model.decode_weight_bytes();
    let read_gb_s = bench::read_bandwidth(threads);
    let bandwidth: Vec<serde_json::Value> = decode
        .iter()
        .filter(|r| r.batch == 1)
        .map(|r| {
            let gb_s = weight_bytes as f64 / (r.ms_per_token / 1e3) / 1e9;
            serde_json::json!({
                "decode_weight_bytes": weight_bytes,
                "read_gb_s": read_gb_s,
                "threads": threads,
                "context_tokens": r.context_tokens,
                "ms_per_token": r.ms_per_token,
                "weights_gb_s": gb_s,
                "share_of_read_bandwidth": gb_s / read_gb_s,
            })
        })
        .collect();
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
        print_json(bandwidth);
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
                "decode {:>13} batch {:>2} at {:>5} tokens: {:>8.1} tokens/s, {:>7.2} ms per token",
                r.mode, r.batch, r.context_tokens, r.decode_tokens_per_s, r.ms_per_token
            );
        }
        for b in [1, 8] {
            let of = |mode: &str| decode.iter().find(|r| r.batch == b && r.mode == mode);
            if let (Some(plain), Some(held)) = (of("unconstrained"), of("constrained")) {
                println!(
                    "constrained decoding (a JSON schema) at batch {b}: {:+.1} % time per output \
                     token ({:.2} ms against {:.2})",
                    100.0 * (held.ms_per_token / plain.ms_per_token - 1.0),
                    held.ms_per_token,
                    plain.ms_per_token
                );
            }
        }
        for b in &bandwidth {
            println!(
                "decode reads {:.1} MB of weights a token; this machine reads {:.1} GB/s on {} \
                 threads; batch 1 at {} tokens: {:.1} GB/s of weights, {:.0} % of it",
                weight_bytes as f64 / 1e6,
                read_gb_s,
                threads,
                b["context_tokens"],
                b["weights_gb_s"].as_f64().unwrap_or(0.0),
                100.0 * b["share_of_read_bandwidth"].as_f64().unwrap_or(0.0),
            );
        }
    }
    Ok(())
}

fn bench_e2e(args: E2eArgs) -> Result<()> {
    let device = EngineDevice::parse(&args.device)?;
    let t = std::time::Instant::now();
    let (model, tok) = load(&args.model)?;
    let device_weights = engram_engine::DeviceWeights::parse(&args.device_weights)
        .with_context(|| format!("--device-weights `{}` (bf16, f32)", args.device_weights))?;
    let config = EngineConfig {
        device,
        device_weights,
        hot_bytes: args.hot_mib << 20,
        prefill_chunk: args.prefill_chunk,
        max_running: args.batches.iter().copied().max().unwrap_or(1),
        ..EngineConfig::default()
    };
    let codec = StreamCodecs::parse_or_default(&args.codec, device)?;
    let config = EngineConfig {
        codec: codec.key,
        value_codec: codec.value_override(),
        ..config
    };
    let mut core = engram_engine::EngineCore::new(model, tok, config)?;
    eprintln!("e2e: loaded in {:.1} s", t.elapsed().as_secs_f64());
    // Warm-up (kernel compilation, first allocations), not reported.
    let warm = bench::E2eOptions {
        prompts: vec![64],
        batches: vec![1],
        steps: 4,
        seed: args.seed ^ 1,
    };
    bench::e2e(&mut core, &warm, |_| {})?;
    let opts = bench::E2eOptions {
        prompts: args.prompts,
        batches: args.batches,
        steps: args.steps,
        seed: args.seed,
    };
    let progress = cli::Progress::new("bench e2e", args.model.json);
    let rows = bench::e2e(&mut core, &opts, |m| progress.say(m))?;
    drop(progress);
    if args.model.json {
        print_json(rows.iter().map(|r| serde_json::json!(r)));
    } else {
        println!(
            "{:>7} {:>5} {:>12} {:>12} {:>12} {:>12}",
            "prompt", "batch", "TTFT p50 ms", "TTFT max ms", "TPOT p50 ms", "TPOT p90 ms"
        );
        for r in &rows {
            println!(
                "{:>7} {:>5} {:>12.1} {:>12.1} {:>12.2} {:>12.2}",
                r.prompt_tokens,
                r.batch,
                r.ttft_ms_p50,
                r.ttft_ms_max,
                r.tpot_ms_p50,
                r.tpot_ms_p90
            );
        }
    }
    Ok(())
}

fn bench_agentic(args: AgenticArgs) -> Result<()> {
    use engram_benches::agentic::{self, AgenticOptions, AgenticRun, Trace};
    if !args.report.is_empty() {
        let read =
            |p: &PathBuf| std::fs::read_to_string(p).with_context(|| p.display().to_string());
        let runs: Vec<AgenticRun> = args
            .report
            .iter()
            .map(read)
            .map(|t| Ok(serde_json::from_str(&t?)?))
            .collect::<Result<_>>()?;
        agentic::report(&runs).iter().for_each(|l| println!("{l}"));
        return Ok(());
    }
    let trace = Trace {
        sessions: args.sessions,
        turns: args.turns,
        system_words: args.system_words,
        tool_words: (args.tool_min, args.tool_max),
        pause_ms: (args.pause_min_ms, args.pause_max_ms),
        max_tokens: args.max_tokens,
        seed: args.seed,
    };
    let opt = AgenticOptions {
        endpoint: args.endpoint,
        label: args.label,
        engram_admin_key: args.engram_admin_key,
        api_key: args.api_key,
        model: args.model,
    };
    let run = agentic::run(&trace, &opt, |m| eprintln!("{m}"))?;
    println!("{}", run.line(None));
    if let Some(out) = &args.out {
        std::fs::write(out, serde_json::to_string_pretty(&run)?)
            .with_context(|| out.display().to_string())?;
    }
    Ok(())
}

fn bench_workload(cmd: WorkloadCommand) -> Result<()> {
    use engram_benches::workload::{RunOptions, RunResult, Workload, describe, report, run};
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

fn bench_tiers(args: TiersBenchArgs) -> Result<()> {
    let _ = std::fs::remove_dir_all(&args.dir);
    let load = engram_benches::tiers::Load {
        sessions: args.sessions,
        warm_turns: args.warm_turns,
        turns: args.turns,
        cycle_ms: args.cycle_ms,
        gap_ms: args.gap_ms,
    };
    let f = actix_web::rt::System::new().block_on(engram_benches::tiers::steady(
        &args.model,
        &args.dir,
        load,
    ))?;
    println!(
        "{}",
        serde_json::json!({"bench": "tiers_steady_load", "figures": f})
    );
    let _ = std::fs::remove_dir_all(&args.dir);
    Ok(())
}

fn bench_eviction(args: EvictionBenchArgs) -> Result<()> {
    let _ = std::fs::remove_dir_all(&args.dir);
    let load = engram_benches::eviction::Load {
        agents: args.agents,
        layer_lines: args.layer_lines,
        warm_turns: args.warm_turns,
        turns: args.turns,
        max_tokens: args.max_tokens,
        hot_share: args.hot_share,
        cold_share: args.cold_share,
        zipf_s: args.zipf_s,
        seed: args.seed,
        tier_loop: !args.no_tier_loop,
        shift_at: args.shift_at,
    };
    let policies = if args.policies.is_empty() {
        engram_benches::eviction::policies()
    } else {
        args.policies
    };
    let f = actix_web::rt::System::new().block_on(engram_benches::eviction::compare(
        &args.model,
        &args.dir,
        load,
        &policies,
        usize::try_from(args.repeat)?,
        args.interleave,
    ))?;
    println!("{}", serde_json::json!({"bench": "eviction", "figures": f}));
    let _ = std::fs::remove_dir_all(&args.dir);
    Ok(())
}

fn bench_shadow(args: ShadowBenchArgs) -> Result<()> {
    let _ = std::fs::remove_dir_all(&args.dir);
    actix_web::rt::System::new().block_on(async {
        for &n in &args.tokens {
            let f =
                engram_benches::shadow::size(&args.model, &args.dir.join(format!("size-{n}")), n)
                    .await?;
            println!(
                "{}",
                serde_json::json!({"bench": "shadow_restart", "tokens": n, "figures": f})
            );
        }
        if !args.recovery_sessions.is_empty() {
            let runs = engram_benches::shadow::recovery_memory(
                &args.model,
                &args.dir,
                args.recovery_cold_mib,
                1024,
                &args.recovery_sessions,
            )
            .await?;
            for f in runs {
                println!(
                    "{}",
                    serde_json::json!({"bench": "shadow_recovery_memory", "figures": f})
                );
            }
        }
        if args.load_turns > 0 {
            let f = engram_benches::shadow::steady(
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
            for (mode, reserve, prefetch) in [
                ("off", false, None),
                ("on", true, None),
                ("prefetch", true, Some(args.prefetch_share)),
            ] {
                let dir = args.dir.join(format!("run{r}-{mode}"));
                let _ = std::fs::remove_dir_all(&dir);
                std::fs::create_dir_all(&dir)?;
                let mut config = engram_server::Config::default();
                config.database.url = format!("sqlite://{}/engram.db?mode=rwc", dir.display());
                config.model.path = args.model.clone();
                config.memory.embedder_path = args.embedder.clone();
                config.memory.vector_dir = dir.join("vectors");
                let (turns, summary) = engram_benches::conversation::run(
                    config,
                    reserve,
                    prefetch,
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
        // Mode 0: off; 1: reservation; 2: reservation and prefetch.
        let mean_of = |mode: u8, f: fn(&engram_benches::conversation::RunSummary) -> f64| {
            let v: Vec<f64> = summaries
                .iter()
                .filter(|s| u8::from(s.reserve) + u8::from(s.prefetch.is_some()) == mode)
                .map(f)
                .collect();
            v.iter().sum::<f64>() / v.len().max(1) as f64
        };
        let mean = |on: bool, f: fn(&engram_benches::conversation::RunSummary) -> f64| {
            mean_of(u8::from(on), f)
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
                "prompt_cached_share_off": mean(false, |s| s.prompt_cached_share),
                "prompt_cached_share_on": mean(true, |s| s.prompt_cached_share),
                "mean_ttft_ms_prefetch": mean_of(2, |s| s.mean_ttft_ms),
                "median_ttft_ms_on": mean(true, |s| s.median_ttft_ms),
                "median_ttft_ms_prefetch": mean_of(2, |s| s.median_ttft_ms),
                "ttft_prefetch_over_on": mean_of(2, |s| s.mean_ttft_ms) / mean(true, |s| s.mean_ttft_ms).max(1e-9),
                "cached_share_prefetch": mean_of(2, |s| s.cached_share),
                "cached_share_prefetch_minus_on": mean_of(2, |s| s.cached_share) - mean(true, |s| s.cached_share),
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
    use engram_benches::memory::{embed_rate, scale};
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

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::{BenchCommand, Cli};

    #[test]
    fn eviction_policies_are_taken_as_json_in_order_and_bad_json_is_refused() {
        let cli = Cli::try_parse_from([
            "engram-bench",
            "eviction",
            "--policy",
            r#"{"mode":"priority"}"#,
            "--policy",
            r#"{"mode":"attention","idle_steps":64}"#,
        ])
        .unwrap();
        let BenchCommand::Eviction(args) = cli.command else {
            panic!("not the eviction bench");
        };
        assert_eq!(
            args.policies,
            [
                serde_json::json!({"mode": "priority"}),
                serde_json::json!({"mode": "attention", "idle_steps": 64}),
            ]
        );
        // None given: the bench's own list is used (see `bench_eviction`).
        let cli = Cli::try_parse_from(["engram-bench", "eviction"]).unwrap();
        let BenchCommand::Eviction(args) = cli.command else {
            panic!("not the eviction bench");
        };
        assert!(args.policies.is_empty());
        assert_eq!(args.repeat, 1);
        assert!(!args.interleave);
        let err =
            Cli::try_parse_from(["engram-bench", "eviction", "--policy", "{mode"]).unwrap_err();
        assert!(err.to_string().contains("not JSON"), "{err}");
    }

    #[test]
    fn eviction_repetitions_are_at_least_one_and_interleaving_is_a_flag() {
        let cli =
            Cli::try_parse_from(["engram-bench", "eviction", "--repeat", "4", "--interleave"])
                .unwrap();
        let BenchCommand::Eviction(args) = cli.command else {
            panic!("not the eviction bench");
        };
        assert_eq!(args.repeat, 4);
        assert!(args.interleave);
        assert!(Cli::try_parse_from(["engram-bench", "eviction", "--repeat", "0"]).is_err());
    }
}
