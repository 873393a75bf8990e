//! `engram-bench agentic`: an agentic trace replayed against any OpenAI-compatible endpoint
//! (issue 67, item 8), with the shapes public traces of coding agents show: a large stable
//! system prompt holding tool definitions, sessions of many turns whose new input is a tool's
//! result (sizes drawn log-uniformly between two bounds), a few output tokens a turn (about
//! 100:1 input to output), and pauses between a session's turns (log-uniform, seeded) while all
//! sessions are live at once.
//!
//! Every endpoint gets the same request bodies, token for token: the client resends the whole
//! conversation each turn (system text, the task, then per turn the scripted call and the tool's
//! result as a user message: no `tools` field, so a server without a tool template sees the
//! same text), greedy, streamed, `user` naming the session (Engram keeps it as a session; a
//! server without sessions ignores it). Per request it records TTFT (first content delta),
//! prompt and cached tokens (`usage`); the summary gives, from turn 2 on, the per-turn cached
//! share's p50 and p10, TTFT p50 and p95, and the wall time.

use std::time::{Duration, Instant};

use engram_kvcore::SplitMix64;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::workload::{Endpoint, HttpError, RequestRecord};

/// The trace's shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Trace {
    /// Sessions, all live at once.
    pub sessions: usize,
    /// Turns per session (requests).
    pub turns: usize,
    /// Words of filler in the system prompt besides the tool definitions (about a token each).
    pub system_words: usize,
    /// Bounds of a tool result, in words (log-uniform between them).
    pub tool_words: (usize, usize),
    /// Bounds of the pause before a session's next turn, ms (log-uniform between them).
    pub pause_ms: (u64, u64),
    /// Tokens generated per request.
    pub max_tokens: usize,
    /// Seed of the sizes and pauses.
    pub seed: u64,
}

impl Default for Trace {
    fn default() -> Self {
        Self {
            sessions: 4,
            turns: 30,
            system_words: 1200,
            tool_words: (200, 2000),
            pause_ms: (1000, 60_000),
            max_tokens: 8,
            seed: 7,
        }
    }
}

/// One request of the trace as run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TurnRecord {
    /// Session index.
    pub session: usize,
    /// Turn index (0: the task).
    pub turn: usize,
    /// The measurement.
    pub request: RequestRecord,
}

/// One run of the trace against one endpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgenticRun {
    /// The server's label.
    pub label: String,
    /// The trace.
    pub trace: Trace,
    /// Wall time from the first request to the last answer, ms.
    pub wall_ms: f64,
    /// Every request.
    pub turns: Vec<TurnRecord>,
    /// The figures.
    pub summary: Summary,
}

impl AgenticRun {
    /// The run's figures in one line; with `reference`, its TTFT p50 over the reference's.
    pub fn line(&self, reference: Option<&AgenticRun>) -> String {
        let s = &self.summary;
        let share = |x: Option<f64>| x.map_or("n/a".to_string(), |v| format!("{v:.3}"));
        let ratio = reference.map_or(String::new(), |b| {
            format!(
                ", TTFT p50 {:.2}x of {}'s",
                s.ttft_ms_p50 / b.summary.ttft_ms_p50,
                b.label
            )
        });
        format!(
            "{}: {} requests ({} failed), mean prompt {:.0} tokens, input/output {:.0}:1; from turn \
             2: cached share p50 {} p10 {}, TTFT p50 {:.0} ms p95 {:.0} ms; wall {:.1} s{ratio}",
            self.label,
            s.requests,
            s.errors,
            s.prompt_tokens_mean.unwrap_or(f64::NAN),
            s.input_per_output.unwrap_or(f64::NAN),
            share(s.cached_share_p50),
            share(s.cached_share_p10),
            s.ttft_ms_p50,
            s.ttft_ms_p95,
            self.wall_ms / 1e3,
        )
    }
}

/// Runs side by side: a line each, the others' TTFT over the first's.
pub fn report(runs: &[AgenticRun]) -> Vec<String> {
    runs.iter()
        .map(|r| r.line(runs.first().filter(|b| b.label != r.label)))
        .collect()
}

/// The figures of a run, over the turns after each session's first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Requests measured (all turns).
    pub requests: usize,
    /// Requests that failed.
    pub errors: usize,
    /// Per-turn `cached_tokens / prompt_tokens`, median (None: the endpoint reports no usage).
    pub cached_share_p50: Option<f64>,
    /// Its 10th percentile.
    pub cached_share_p10: Option<f64>,
    /// TTFT median, ms.
    pub ttft_ms_p50: f64,
    /// TTFT 95th percentile, ms.
    pub ttft_ms_p95: f64,
    /// Mean prompt tokens of a request (the endpoints must agree for a comparison).
    pub prompt_tokens_mean: Option<f64>,
    /// Input to output tokens, over all requests.
    pub input_per_output: Option<f64>,
}

/// Why the trace could not run.
#[derive(Debug, thiserror::Error)]
pub enum AgenticError {
    /// A setup request failed.
    #[error("setup: {0}")]
    Setup(String),
    /// HTTP.
    #[error(transparent)]
    Http(#[from] HttpError),
}

const WORDS: [&str; 32] = [
    "value", "index", "return", "error", "buffer", "config", "request", "session", "token",
    "result", "parse", "field", "struct", "match", "write", "read", "cache", "block", "layer",
    "tenant", "string", "number", "option", "handle", "stream", "thread", "memory", "record",
    "update", "delete", "insert", "select",
];

fn words(rng: &mut SplitMix64, n: usize) -> String {
    let mut out = String::with_capacity(n * 7);
    for i in 0..n {
        out.push_str(WORDS[(rng.next_u64() % WORDS.len() as u64) as usize]);
        out.push(if i % 12 == 11 { '\n' } else { ' ' });
    }
    out
}

fn log_uniform(rng: &mut SplitMix64, (lo, hi): (f64, f64)) -> f64 {
    let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
    (lo.max(1.0).ln() + u * (hi.max(lo).max(1.0).ln() - lo.max(1.0).ln())).exp()
}

const TOOLS: [(&str, &str); 6] = [
    ("read_file", r#"{"path": {"type": "string"}}"#),
    (
        "write_file",
        r#"{"path": {"type": "string"}, "content": {"type": "string"}}"#,
    ),
    ("run_tests", r#"{"filter": {"type": "string"}}"#),
    (
        "search",
        r#"{"query": {"type": "string"}, "max_results": {"type": "integer"}}"#,
    ),
    ("list_dir", r#"{"path": {"type": "string"}}"#),
    ("shell", r#"{"command": {"type": "string"}}"#),
];

/// A turn after a session's first: the scripted call, the tool's result, and the pause before
/// the turn (ms).
pub type Step = (String, String, u64);

/// The planned trace: the system text, and per session its task, calls, results and pauses.
#[derive(Debug, Clone)]
pub struct Planned {
    /// The stable system prompt.
    pub system: String,
    /// Per session: the task, then its later turns.
    pub sessions: Vec<(String, Vec<Step>)>,
}

/// Plans the trace (the same for every endpoint).
pub fn plan(t: &Trace) -> Planned {
    let mut rng = SplitMix64::new(t.seed);
    let defs: Vec<String> = TOOLS
        .iter()
        .map(|(name, props)| {
            format!(
                "{{\"type\": \"function\", \"function\": {{\"name\": \"{name}\", \"parameters\": \
                 {{\"type\": \"object\", \"properties\": {props}}}}}}}"
            )
        })
        .collect();
    let system = format!(
        "You are a coding agent working in a repository. Call one tool per turn by answering \
         with a JSON object {{\"name\": …, \"arguments\": …}}.\n\n# Tools\n{}\n\n# Project \
         notes\n{}",
        defs.join("\n"),
        words(&mut rng, t.system_words)
    );
    let sessions = (0..t.sessions)
        .map(|s| {
            let task = format!(
                "Session {s}: fix the failing test in module {} and explain the cause briefly.",
                rng.next_u64() % 100
            );
            let later = (1..t.turns)
                .map(|i| {
                    let (name, _) = TOOLS[(rng.next_u64() % TOOLS.len() as u64) as usize];
                    let call = format!(
                        "{{\"name\": \"{name}\", \"arguments\": {{\"path\": \"src/m{s}_{i}.rs\"}}}}"
                    );
                    let n = log_uniform(&mut rng, (t.tool_words.0 as f64, t.tool_words.1 as f64));
                    let result = format!("Tool result of {name}:\n{}", words(&mut rng, n as usize));
                    let pause = log_uniform(&mut rng, (t.pause_ms.0 as f64, t.pause_ms.1 as f64));
                    (call, result, pause as u64)
                })
                .collect();
            (task, later)
        })
        .collect();
    Planned { system, sessions }
}

/// The messages of session `s`'s turn `t`.
pub fn messages(p: &Planned, s: usize, t: usize) -> Vec<Value> {
    let (task, later) = &p.sessions[s];
    let mut m = vec![
        json!({"role": "system", "content": p.system}),
        json!({"role": "user", "content": task}),
    ];
    for (call, result, _) in &later[..t] {
        m.push(json!({"role": "assistant", "content": call}));
        m.push(json!({"role": "user", "content": result}));
    }
    m
}

/// How to run.
#[derive(Debug, Clone)]
pub struct AgenticOptions {
    /// The OpenAI-compatible base URL (`http://127.0.0.1:8080/v1`).
    pub endpoint: String,
    /// Label in the results.
    pub label: String,
    /// Engram's operator key: a fresh tenant is made and its key used.
    pub engram_admin_key: Option<String>,
    /// Bearer key (when not set up on Engram).
    pub api_key: Option<String>,
    /// The `model` sent.
    pub model: String,
}

fn percentile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let i = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
    v[i]
}

/// The figures of `turns` (see [`Summary`]).
pub fn summarize(turns: &[TurnRecord]) -> Summary {
    let later: Vec<&TurnRecord> = turns.iter().filter(|t| t.turn > 0).collect();
    let mut shares: Vec<f64> = later
        .iter()
        .filter_map(|t| {
            let r = &t.request;
            Some(r.cached_tokens? as f64 / r.prompt_tokens.filter(|&p| p > 0)? as f64)
        })
        .collect();
    let mut ttft: Vec<f64> = later.iter().filter_map(|t| t.request.ttft_ms).collect();
    let prompts: Vec<f64> = turns
        .iter()
        .filter_map(|t| t.request.prompt_tokens.map(|p| p as f64))
        .collect();
    let out: usize = turns.iter().map(|t| t.request.completion_tokens).sum();
    let have_shares = !shares.is_empty();
    Summary {
        requests: turns.len(),
        errors: turns.iter().filter(|t| t.request.error.is_some()).count(),
        cached_share_p50: have_shares.then(|| percentile(&mut shares, 0.5)),
        cached_share_p10: have_shares.then(|| percentile(&mut shares, 0.1)),
        ttft_ms_p50: percentile(&mut ttft, 0.5),
        ttft_ms_p95: percentile(&mut ttft, 0.95),
        prompt_tokens_mean: (!prompts.is_empty())
            .then(|| prompts.iter().sum::<f64>() / prompts.len() as f64),
        input_per_output: (out > 0 && !prompts.is_empty())
            .then(|| prompts.iter().sum::<f64>() / out as f64),
    }
}

fn setup(ep: &Endpoint, admin: &str) -> Result<String, AgenticError> {
    let root = Endpoint {
        base: String::new(),
        ..ep.clone()
    };
    let name = format!(
        "agentic-{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis())
    );
    let (s, body) = root.request(
        "POST",
        "/v1/admin/tenants",
        Some(admin),
        json!({"name": name}).to_string().as_bytes(),
    )?;
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    v["api_key"]
        .as_str()
        .filter(|_| (200..300).contains(&s))
        .map(str::to_string)
        .ok_or_else(|| AgenticError::Setup(format!("{s} {}", String::from_utf8_lossy(&body))))
}

/// Runs the trace: one thread per session, each sending its turns in order with its pauses.
pub fn run(
    trace: &Trace,
    opt: &AgenticOptions,
    progress: impl Fn(&str) + Sync,
) -> Result<AgenticRun, AgenticError> {
    let ep = Endpoint::parse(&opt.endpoint)?;
    let key = match &opt.engram_admin_key {
        Some(admin) => Some(setup(&ep, admin)?),
        None => opt.api_key.clone(),
    };
    let planned = plan(trace);
    let started = Instant::now();
    let mut turns: Vec<TurnRecord> = std::thread::scope(|sc| {
        let handles: Vec<_> = (0..trace.sessions)
            .map(|s| {
                let (ep, key, planned, progress) = (&ep, key.as_deref(), &planned, &progress);
                sc.spawn(move || {
                    let mut out = Vec::new();
                    for t in 0..trace.turns {
                        if t > 0 {
                            let pause = planned.sessions[s].1[t - 1].2;
                            std::thread::sleep(Duration::from_millis(pause));
                        }
                        let body = json!({
                            "model": opt.model,
                            "messages": messages(planned, s, t),
                            "max_tokens": trace.max_tokens,
                            "temperature": 0.0,
                            "top_p": 1.0,
                            "seed": 0,
                            "stream": true,
                            "stream_options": {"include_usage": true},
                            "user": format!("agentic-{s}"),
                        });
                        let mut r = crate::workload::measure(ep, key, body.to_string().as_bytes());
                        r.start_ms = started.elapsed().as_secs_f64() * 1e3 - r.total_ms;
                        progress(&format!(
                            "session {s} turn {t}: prompt {:?}, cached {:?}, ttft {:?} ms{}",
                            r.prompt_tokens,
                            r.cached_tokens,
                            r.ttft_ms.map(|x| x.round()),
                            r.error
                                .as_deref()
                                .map_or(String::new(), |e| format!(", {e}"))
                        ));
                        out.push(TurnRecord {
                            session: s,
                            turn: t,
                            request: r,
                        });
                    }
                    out
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_default())
            .collect()
    });
    let wall_ms = started.elapsed().as_secs_f64() * 1e3;
    turns.sort_by(|a, b| a.request.start_ms.total_cmp(&b.request.start_ms));
    let summary = summarize(&turns);
    Ok(AgenticRun {
        label: opt.label.clone(),
        trace: trace.clone(),
        wall_ms,
        turns,
        summary,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn the_trace_is_seeded_and_has_its_shape() {
        let t = Trace {
            sessions: 3,
            turns: 31,
            ..Trace::default()
        };
        let (a, b) = (plan(&t), plan(&t));
        assert_eq!(a.system, b.system);
        assert_eq!(a.sessions.len(), 3);
        for ((task, later), (task2, later2)) in a.sessions.iter().zip(&b.sessions) {
            assert_eq!((task, later), (task2, later2));
            assert_eq!(later.len(), 30);
            for (_, result, pause) in later {
                let n = result.split_whitespace().count();
                assert!((200..=2010).contains(&n), "{n} words");
                assert!((1000..=60_000).contains(pause), "{pause} ms");
            }
        }
        // Each turn resends the last turn's messages and adds a call and its result.
        let m1 = messages(&a, 1, 1);
        let m2 = messages(&a, 1, 2);
        assert_eq!(m2[..m1.len()], m1[..]);
        assert_eq!(m2.len(), m1.len() + 2);
        // Another seed, other sizes.
        let c = plan(&Trace { seed: 8, ..t });
        assert_ne!(c.sessions[0].1, a.sessions[0].1);
    }

    #[test]
    fn shares_and_percentiles_skip_the_first_turn() {
        let rec = |turn, prompt, cached, ttft| TurnRecord {
            session: 0,
            turn,
            request: RequestRecord {
                index: 0,
                session: String::new(),
                agent: String::new(),
                turn,
                start_ms: 0.0,
                ttft_ms: Some(ttft),
                itl_ms: None,
                total_ms: ttft,
                chunks: 1,
                completion_tokens: 2,
                prompt_tokens: Some(prompt),
                cached_tokens: Some(cached),
                after_restart: false,
                error: None,
                text: String::new(),
            },
        };
        let turns = [
            rec(0, 1000, 0, 900.0),
            rec(1, 1000, 950, 50.0),
            rec(2, 1000, 990, 40.0),
            rec(3, 1000, 500, 400.0),
        ];
        let s = summarize(&turns);
        assert_eq!(s.cached_share_p50, Some(0.95));
        assert_eq!(s.cached_share_p10, Some(0.5));
        assert_eq!((s.ttft_ms_p50, s.ttft_ms_p95), (50.0, 400.0));
        assert_eq!(s.input_per_output, Some(500.0));
    }
}
