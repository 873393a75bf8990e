//! `engram`: the service (`serve`), the readiness probe (`health`), the offline shadow
//! verifier (`shadow verify`) and `export-tokenizer`. The instruments (`eval kv`, `calibrate
//! kv`, `check device`) are the `engram-lab` binary (crate `engram-lab`), which `engram eval`,
//! `engram calibrate` and `engram check` run; the benchmarks are `engram-bench`.

use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, Parser, Subcommand};
use engram_engine::TextTokenizer;

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
    /// Evaluations (`eval kv`: KV fidelity), run by `engram-lab`.
    #[command(disable_help_flag = true)]
    Eval(LabArgs),
    /// Calibrations (`calibrate kv`: a KV profile), run by `engram-lab`.
    #[command(disable_help_flag = true)]
    Calibrate(LabArgs),
    /// Checks against the CPU reference (`check device`), run by `engram-lab`.
    #[command(disable_help_flag = true)]
    Check(LabArgs),
    /// The shadow (the cache on disk).
    #[command(subcommand)]
    Shadow(ShadowCommand),
    /// Writes the model's tokenizer as a `tokenizer.json` (for machines the checkpoint cannot
    /// reach: `engram-bench ttft --random-weights … --tokenizer FILE`).
    ExportTokenizer(ExportTokenizerArgs),
    /// Asks a running service whether it is ready (`GET /readyz`); exits 0 when it answers
    /// 200, 1 otherwise (a container healthcheck).
    Health(HealthArgs),
}

/// Everything after the subcommand, passed to `engram-lab` unread.
#[derive(Debug, Args)]
struct LabArgs {
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    args: Vec<String>,
}

/// Runs `engram-lab COMMAND ARGS…` and exits with its status: `$ENGRAM_LAB`, else the
/// `engram-lab` beside this binary, else the one on `PATH`.
fn lab(command: &str, args: LabArgs) -> Result<()> {
    let beside = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(|d| d.join("engram-lab")))
        .filter(|p| p.is_file());
    let program = std::env::var_os("ENGRAM_LAB")
        .map(PathBuf::from)
        .or(beside)
        .unwrap_or_else(|| PathBuf::from("engram-lab"));
    let status = std::process::Command::new(&program)
        .arg(command)
        .args(&args.args)
        .status()
        .map_err(|e| {
            anyhow::anyhow!(
                "`engram {command}` runs engram-lab, which did not start ({}: {e}); build it with \
                 `cargo build --release -p engram-lab`",
                program.display()
            )
        })?;
    std::process::exit(status.code().unwrap_or(1))
}

#[derive(Debug, Args)]
struct HealthArgs {
    /// The service's address, `http://host:port` (default: `server.bind` of the
    /// configuration, 0.0.0.0 asked as 127.0.0.1).
    #[arg(long)]
    url: Option<String>,
    /// A TOML config file [env: ENGRAM_CONFIG].
    #[arg(long, env = "ENGRAM_CONFIG")]
    config: Option<PathBuf>,
    /// Seconds to wait for the answer.
    #[arg(long, default_value_t = 5)]
    timeout: u64,
}

/// `engram health`: `GET /readyz` over plain HTTP/1.1.
fn health(args: HealthArgs) -> Result<()> {
    use std::io::{Read, Write};
    let url = match args.url {
        Some(u) => u,
        None => {
            let config = engram_server::Config::load(args.config.as_deref(), std::env::vars())?;
            let bind = config.server.bind.replace("0.0.0.0", "127.0.0.1");
            format!("http://{bind}")
        }
    };
    let hostport = url
        .strip_prefix("http://")
        .ok_or_else(|| anyhow::anyhow!("--url must be http://host:port"))?
        .trim_end_matches('/');
    let timeout = std::time::Duration::from_secs(args.timeout.max(1));
    let addr = std::net::ToSocketAddrs::to_socket_addrs(hostport)?
        .next()
        .ok_or_else(|| anyhow::anyhow!("{hostport}: no address"))?;
    let mut conn = std::net::TcpStream::connect_timeout(&addr, timeout)?;
    conn.set_read_timeout(Some(timeout))?;
    write!(
        conn,
        "GET /readyz HTTP/1.1\r\nhost: {hostport}\r\nconnection: close\r\n\r\n"
    )?;
    let mut answer = String::new();
    conn.read_to_string(&mut answer)?;
    let status = answer.split_whitespace().nth(1).unwrap_or("");
    let body = answer.split("\r\n\r\n").nth(1).unwrap_or("").trim();
    println!("{status} {body}");
    if status == "200" {
        Ok(())
    } else {
        std::process::exit(1)
    }
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

fn serve(args: ServeArgs) -> Result<()> {
    let mut env: Vec<(String, String)> = std::env::vars().collect();
    if let Some(url) = args.database_url {
        env.push(("ENGRAM__DATABASE__URL".into(), url));
    }
    if let Some(bind) = args.bind {
        env.push(("ENGRAM__SERVER__BIND".into(), bind));
    }
    let config = engram_server::Config::load(args.config.as_deref(), env)?;
    engram_server::telemetry::init(&config.log.level, &config.log.format)?;
    actix_web::rt::System::new().block_on(engram_server::serve(config))?;
    Ok(())
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Serve(args) => serve(args),
        Command::Health(args) => health(args),
        Command::Eval(args) => lab("eval", args),
        Command::Calibrate(args) => lab("calibrate", args),
        Command::Check(args) => lab("check", args),
        Command::Shadow(ShadowCommand::Verify(args)) => shadow_verify(args),
        Command::ExportTokenizer(args) => {
            TextTokenizer::for_model(&args.model)?.save_json(&args.out)?;
            Ok(())
        }
    }
}

fn shadow_verify(args: ShadowVerifyArgs) -> Result<()> {
    let store: std::sync::Arc<dyn engram_shadow::Storage> = match args.dir {
        Some(d) if !d.is_dir() => anyhow::bail!("{}: no such shadow directory", d.display()),
        Some(d) => std::sync::Arc::new(engram_shadow::LocalStorage::open(&d)?),
        None => {
            let config = engram_server::Config::load(args.config.as_deref(), std::env::vars())?;
            engram_server::shadow_storage(&config)?
        }
    };
    let r = engram_shadow::verify(store.as_ref())?;
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
