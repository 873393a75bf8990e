//! `engram-bench workload`: an agent-workload load driver for any OpenAI-compatible endpoint
//! (Engram, llama.cpp's server, …), and the report that compares runs.
//!
//! A **workload** (JSON, see `benches/workload/README.md`) names agents — layered system
//! prompts, written or generated to a size — and sessions of user turns, with the order of turns,
//! think time, concurrency, arrival pattern and an optional server restart. The driver sends every
//! endpoint the same request bodies: `messages` = the agent's system text, the session's history
//! and the new user message; greedy sampling; the same `max_tokens`; streamed. With
//! `history: "scripted"` (the default) each earlier assistant message is the workload's scripted
//! reply, so prompts are equal token for token whatever each server generated.
//!
//! Engram gets each agent created from the same layers (`--engram-admin-key`): its prompt is the
//! same ChatML text (`## Title\n…` per stable layer), built from its layers, so its requests
//! carry no system message (Engram would add one to the agent's rules for the request). The
//! driver checks the equality: a probe request before the run records `usage.prompt_tokens` on
//! every endpoint that reports it, and the report compares the requests' prompt tokens.
//!
//! Per request it records TTFT (first non-empty content delta), inter-token latency, total
//! latency, prompt and cached tokens (when the endpoint reports usage) and errors.

pub mod http;
pub mod report;
mod spec;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use engram_kvcore::SplitMix64;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

pub use http::{Endpoint, HttpError};
pub use spec::{
    AgentSpec, Arrival, BUILTIN, History, LayerSpec, Order, Plan, PlannedAgent, PlannedSession,
    SessionGroup, Workload,
};

/// Why a workload could not run.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    /// The workload file is invalid.
    #[error("workload: {0}")]
    Invalid(String),
    /// An HTTP exchange failed outside a measured request (setup, restart).
    #[error(transparent)]
    Http(#[from] HttpError),
    /// Setup on the endpoint was refused.
    #[error("setup: {0}")]
    Setup(String),
    /// The restart command failed or the endpoint did not come back.
    #[error("restart: {0}")]
    Restart(String),
}

pub(crate) type Result<T> = std::result::Result<T, WorkloadError>;

pub(crate) fn invalid(msg: impl Into<String>) -> WorkloadError {
    WorkloadError::Invalid(msg.into())
}

/// One measured request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestRecord {
    /// Position in the schedule.
    pub index: usize,
    /// Session id.
    pub session: String,
    /// Agent name.
    pub agent: String,
    /// Turn index within the session (0-based).
    pub turn: usize,
    /// Sent at, ms after the run started.
    pub start_ms: f64,
    /// Time to the first non-empty content delta, ms.
    pub ttft_ms: Option<f64>,
    /// Mean gap between content deltas after the first, ms.
    pub itl_ms: Option<f64>,
    /// Time to the end of the stream, ms.
    pub total_ms: f64,
    /// Content deltas received.
    pub chunks: usize,
    /// `usage.completion_tokens` (else the content deltas).
    pub completion_tokens: usize,
    /// `usage.prompt_tokens`, when reported.
    pub prompt_tokens: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens`, when reported.
    pub cached_tokens: Option<u64>,
    /// Sent after the restart.
    pub after_restart: bool,
    /// What failed (HTTP status and body, or the transport error).
    pub error: Option<String>,
    /// The answer.
    pub text: String,
}

/// One run of a workload against one endpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunResult {
    /// Workload name.
    pub workload: String,
    /// The server's label (`engram`, `llama.cpp`, …).
    pub label: String,
    /// Repetition number.
    pub rep: usize,
    /// The endpoint.
    pub endpoint: String,
    /// Unix time of the start, ms.
    pub started_unix_ms: u64,
    /// Wall time of the measured requests, ms.
    pub wall_ms: f64,
    /// The probe's `usage.prompt_tokens` (the same prompt on every endpoint).
    pub probe_prompt_tokens: Option<u64>,
    /// Restart command plus wait until the endpoint answered again, ms.
    pub restart_ms: Option<f64>,
    /// The workload as run.
    pub spec: Workload,
    /// Every request.
    pub requests: Vec<RequestRecord>,
}

/// How to run.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// The OpenAI-compatible base URL (`http://127.0.0.1:8080/v1`).
    pub endpoint: String,
    /// Label in the results.
    pub label: String,
    /// Repetition number.
    pub rep: usize,
    /// Engram's operator key: create a tenant and the agents first.
    pub engram_admin_key: Option<String>,
    /// Bearer key for the requests (overridden by the tenant Engram setup creates).
    pub api_key: Option<String>,
    /// Shell command that restarts the server (`restart_after`).
    pub restart_cmd: Option<String>,
    /// Print progress to stderr.
    pub progress: bool,
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Creates a fresh tenant with the workload's agents on Engram; returns its API key.
fn engram_setup(ep: &Endpoint, admin: &str, w: &Workload, plan: &Plan) -> Result<String> {
    let root = Endpoint {
        base: String::new(),
        ..ep.clone()
    };
    let tenant = format!("bench-{}-{}", w.name, unix_ms());
    let (s, body) = root.request(
        "POST",
        "/v1/admin/tenants",
        Some(admin),
        json!({"name": tenant}).to_string().as_bytes(),
    )?;
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let key = v["api_key"]
        .as_str()
        .filter(|_| s == 201 || s == 200)
        .ok_or_else(|| {
            WorkloadError::Setup(format!("tenant: {s} {}", String::from_utf8_lossy(&body)))
        })?
        .to_string();
    for a in &plan.agents {
        let layers: Vec<Value> = a
            .layers
            .iter()
            .map(|(k, t)| json!({"kind": k, "content": t, "budget": 65_536, "stable": true}))
            .collect();
        let (s, body) = root.request(
            "POST",
            "/v1/agents",
            Some(&key),
            json!({"name": a.name, "layers": layers})
                .to_string()
                .as_bytes(),
        )?;
        if !(200..300).contains(&s) {
            return Err(WorkloadError::Setup(format!(
                "agent {}: {s} {}",
                a.name,
                String::from_utf8_lossy(&body)
            )));
        }
    }
    Ok(key)
}

/// Leaves the system message out of every request: for an endpoint that holds the agents'
/// layers itself (Engram, set up by [`engram_setup`]).
fn without_system(plan: &mut Plan) {
    for a in &mut plan.agents {
        a.system.clear();
    }
}

fn messages(plan: &Plan, s: usize, t: usize, own: &[String]) -> Vec<Value> {
    let sess = &plan.sessions[s];
    let system = &plan.agents[sess.agent].system;
    let mut m: Vec<Value> = if system.is_empty() {
        Vec::new()
    } else {
        vec![json!({"role": "system", "content": system})]
    };
    for (i, (user, reply)) in sess.turns[..t].iter().enumerate() {
        m.push(json!({"role": "user", "content": user}));
        let reply = own.get(i).unwrap_or(reply);
        m.push(json!({"role": "assistant", "content": reply}));
    }
    m.push(json!({"role": "user", "content": sess.turns[t].0}));
    m
}

fn body(model: &str, messages: Vec<Value>, max_tokens: usize, stream: bool) -> Vec<u8> {
    let mut b = json!({
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "top_p": 1.0,
        "seed": 0,
        "stream": stream,
    });
    if stream {
        b["stream_options"] = json!({"include_usage": true});
    }
    b.to_string().into_bytes()
}

/// Sends one streamed request and measures it.
pub(crate) fn measure(ep: &Endpoint, key: Option<&str>, payload: &[u8]) -> RequestRecord {
    let t0 = Instant::now();
    let mut first: Option<f64> = None;
    let mut last = 0.0;
    let mut chunks = 0usize;
    let mut text = String::new();
    let mut usage = Value::Null;
    let mut stream_error: Option<String> = None;
    let res = ep.stream("/chat/completions", key, payload, |data| {
        if data == "[DONE]" {
            return;
        }
        let Ok(v) = serde_json::from_str::<Value>(data) else {
            return;
        };
        if let Some(e) = v.get("error") {
            stream_error = Some(e.to_string());
        }
        if v.get("usage").is_some_and(|u| !u.is_null()) {
            usage = v["usage"].clone();
        }
        if let Some(c) = v["choices"][0]["delta"]["content"].as_str()
            && !c.is_empty()
        {
            let now = t0.elapsed().as_secs_f64() * 1e3;
            first.get_or_insert(now);
            last = now;
            chunks += 1;
            text.push_str(c);
        }
    });
    let total_ms = t0.elapsed().as_secs_f64() * 1e3;
    let error = match res {
        Ok((200..=299, _)) => stream_error,
        Ok((status, b)) => Some(format!("{status} {}", b.trim())),
        Err(e) => Some(e.to_string()),
    };
    let itl_ms = match first {
        Some(f) if chunks > 1 => Some((last - f) / (chunks - 1) as f64),
        _ => None,
    };
    RequestRecord {
        index: 0,
        session: String::new(),
        agent: String::new(),
        turn: 0,
        start_ms: 0.0,
        ttft_ms: first,
        itl_ms,
        total_ms,
        chunks,
        completion_tokens: usage["completion_tokens"]
            .as_u64()
            .map_or(chunks, |n| n as usize),
        prompt_tokens: usage["prompt_tokens"].as_u64(),
        cached_tokens: usage["prompt_tokens_details"]["cached_tokens"].as_u64(),
        after_restart: false,
        error,
        text,
    }
}

/// Waits until the endpoint answers HTTP at all.
fn wait_until_up(ep: &Endpoint, key: Option<&str>, limit: Duration) -> Result<()> {
    let started = Instant::now();
    loop {
        if ep.request("GET", "/models", key, b"").is_ok() {
            return Ok(());
        }
        if started.elapsed() > limit {
            return Err(WorkloadError::Restart(format!(
                "{}:{} did not answer within {limit:?}",
                ep.host, ep.port
            )));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[derive(Debug, Default)]
struct Sched {
    dispatched: Vec<bool>,
    busy: Vec<bool>,
    next_turn: Vec<usize>,
    ready_at: Vec<Option<Instant>>,
    done: usize,
    restart: RestartState,
    records: Vec<RequestRecord>,
    own: Vec<Vec<String>>,
}

#[derive(Debug, Default, Clone, Copy, PartialEq)]
enum RestartState {
    #[default]
    Before,
    Running,
    Done,
}

/// Runs a workload against one endpoint.
pub fn run(w: &Workload, opt: &RunOptions) -> Result<RunResult> {
    let mut plan = w.plan()?;
    let ep = Endpoint::parse(&opt.endpoint)?;
    let key = match &opt.engram_admin_key {
        Some(admin) => {
            let key = engram_setup(&ep, admin, w, &plan)?;
            // Engram builds the system text from the agent's layers.
            without_system(&mut plan);
            Some(key)
        }
        None => opt.api_key.clone(),
    };
    // The endpoint must be up already (the caller started it); a restart waits for it.
    ep.request("GET", "/models", key.as_deref(), b"")?;
    // The probe: excluded from the results; records the prompt size for the fairness check.
    let probe = {
        let agent = &plan.agents[0];
        let mut m = Vec::new();
        if !agent.system.is_empty() {
            m.push(json!({"role": "system", "content": agent.system}));
        }
        m.push(json!({"role": "user", "content": "Reply with OK."}));
        let payload = body(&agent.name, m, 1, false);
        let (s, b) = ep.request("POST", "/chat/completions", key.as_deref(), &payload)?;
        if !(200..300).contains(&s) {
            return Err(WorkloadError::Setup(format!(
                "probe: {s} {}",
                String::from_utf8_lossy(&b)
            )));
        }
        serde_json::from_slice::<Value>(&b).unwrap_or(Value::Null)["usage"]["prompt_tokens"]
            .as_u64()
    };
    let n = plan.schedule.len();
    let sessions = plan.sessions.len();
    let release: Vec<f64> = match w.arrival {
        Arrival::Closed => vec![0.0; n],
        Arrival::Poisson { per_sec, seed } => {
            let mut rng = SplitMix64::new(seed);
            let mut at = 0.0;
            (0..n)
                .map(|_| {
                    let r = at;
                    at += -rng.next_open01().ln() / per_sec * 1e3;
                    r
                })
                .collect()
        }
    };
    let state = Arc::new(Mutex::new(Sched {
        dispatched: vec![false; n],
        busy: vec![false; sessions],
        next_turn: vec![0; sessions],
        ready_at: vec![None; sessions],
        own: vec![Vec::new(); sessions],
        ..Sched::default()
    }));
    let restart_ms = Arc::new(Mutex::new(None::<Result<f64>>));
    let started = Instant::now();
    let plan = Arc::new(plan);
    std::thread::scope(|scope| {
        for _ in 0..w.concurrency.min(n) {
            let (state, plan, ep, key, restart_ms) = (
                state.clone(),
                plan.clone(),
                ep.clone(),
                key.clone(),
                restart_ms.clone(),
            );
            let release = &release;
            scope.spawn(move || {
                worker(
                    w,
                    opt,
                    &plan,
                    &ep,
                    key.as_deref(),
                    &state,
                    release,
                    started,
                    &restart_ms,
                )
            });
        }
    });
    let wall_ms = started.elapsed().as_secs_f64() * 1e3;
    if opt.progress {
        eprintln!();
    }
    let restart_ms = match restart_ms.lock().map(|mut r| r.take()) {
        Ok(Some(r)) => Some(r?),
        _ => None,
    };
    let mut records = state
        .lock()
        .map(|mut s| std::mem::take(&mut s.records))
        .unwrap_or_default();
    records.sort_by_key(|r| r.index);
    Ok(RunResult {
        workload: w.name.clone(),
        label: opt.label.clone(),
        rep: opt.rep,
        endpoint: opt.endpoint.clone(),
        started_unix_ms: unix_ms() - wall_ms as u64,
        wall_ms,
        probe_prompt_tokens: probe,
        restart_ms,
        spec: w.clone(),
        requests: records,
    })
}

/// What a worker does next.
enum Next {
    Send(usize),
    Restart,
    Wait,
    Finished,
}

#[allow(clippy::too_many_arguments)]
fn worker(
    w: &Workload,
    opt: &RunOptions,
    plan: &Plan,
    ep: &Endpoint,
    key: Option<&str>,
    state: &Mutex<Sched>,
    release: &[f64],
    started: Instant,
    restart_ms: &Mutex<Option<Result<f64>>>,
) {
    let n = plan.schedule.len();
    loop {
        let next = {
            let Ok(mut st) = state.lock() else { return };
            pick_next(w, plan, &mut st, release, started)
        };
        let k = match next {
            Next::Finished => return,
            Next::Wait => {
                std::thread::sleep(Duration::from_millis(2));
                continue;
            }
            Next::Restart => {
                let t = Instant::now();
                let r = restart(opt, ep, key).map(|()| t.elapsed().as_secs_f64() * 1e3);
                let failed = r.is_err();
                if let Ok(mut m) = restart_ms.lock() {
                    *m = Some(r);
                }
                if let Ok(mut st) = state.lock() {
                    st.restart = RestartState::Done;
                    if failed {
                        // Nothing more can be measured: mark the rest dispatched.
                        st.dispatched.iter_mut().for_each(|d| *d = true);
                    }
                }
                continue;
            }
            Next::Send(k) => k,
        };
        let (s, t) = plan.schedule[k];
        let own = state
            .lock()
            .map(|st| {
                if w.history == History::Own {
                    st.own[s].clone()
                } else {
                    Vec::new()
                }
            })
            .unwrap_or_default();
        let sess = &plan.sessions[s];
        let agent = &plan.agents[sess.agent].name;
        let payload = body(agent, messages(plan, s, t, &own), w.max_tokens, true);
        let start_ms = started.elapsed().as_secs_f64() * 1e3;
        let mut rec = measure(ep, key, &payload);
        rec.index = k;
        rec.session = sess.id.clone();
        rec.agent = agent.clone();
        rec.turn = t;
        rec.start_ms = start_ms;
        let Ok(mut st) = state.lock() else { return };
        rec.after_restart = st.restart == RestartState::Done;
        st.busy[s] = false;
        st.next_turn[s] = t + 1;
        st.ready_at[s] = Some(Instant::now() + Duration::from_millis(w.think_ms));
        st.own[s].push(rec.text.clone());
        st.done += 1;
        if opt.progress {
            let ok = st.records.iter().filter(|r| r.error.is_none()).count()
                + usize::from(rec.error.is_none());
            eprint!(
                "\r[{} {} rep {}] {}/{n} requests, {ok} ok, last TTFT {:>8.1} ms   ",
                opt.label,
                w.name,
                opt.rep,
                st.done,
                rec.ttft_ms.unwrap_or(f64::NAN)
            );
        }
        st.records.push(rec);
    }
}

fn pick_next(w: &Workload, plan: &Plan, st: &mut Sched, release: &[f64], started: Instant) -> Next {
    let n = plan.schedule.len();
    if st.dispatched.iter().all(|&d| d) {
        return Next::Finished;
    }
    let limit = match (w.restart_after, st.restart) {
        (Some(r), RestartState::Before) => {
            if st.done == r {
                st.restart = RestartState::Running;
                return Next::Restart;
            }
            r
        }
        (Some(_), RestartState::Running) => return Next::Wait,
        _ => n,
    };
    let now = Instant::now();
    let elapsed = started.elapsed().as_secs_f64() * 1e3;
    for (k, (&(s, t), &at)) in plan.schedule.iter().zip(release).enumerate().take(limit) {
        if st.dispatched[k] {
            continue;
        }
        let ready = !st.busy[s]
            && st.next_turn[s] == t
            && st.ready_at[s].is_none_or(|r| r <= now)
            && at <= elapsed;
        if ready {
            st.dispatched[k] = true;
            st.busy[s] = true;
            return Next::Send(k);
        }
    }
    Next::Wait
}

fn restart(opt: &RunOptions, ep: &Endpoint, key: Option<&str>) -> Result<()> {
    let cmd = opt.restart_cmd.as_deref().ok_or_else(|| {
        WorkloadError::Restart("the workload restarts: pass --restart-cmd".into())
    })?;
    let status = std::process::Command::new("sh")
        .args(["-c", cmd])
        .status()
        .map_err(|e| WorkloadError::Restart(format!("{cmd}: {e}")))?;
    if !status.success() {
        return Err(WorkloadError::Restart(format!("{cmd}: {status}")));
    }
    wait_until_up(ep, key, Duration::from_secs(300))
}

/// The plan in one line (agents, prompt size, sessions, requests), for the CLI.
pub fn describe(plan: &Plan) -> String {
    let words: usize = plan
        .agents
        .iter()
        .map(|a| a.system.split_whitespace().count())
        .sum::<usize>()
        / plan.agents.len().max(1);
    format!(
        "{} agents (~{words} words of system prompt each), {} sessions, {} requests",
        plan.agents.len(),
        plan.sessions.len(),
        plan.schedule.len()
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn the_system_text_is_engram_s_rendering_in_the_fixed_order() {
        let w: Workload = serde_json::from_value(json!({
            "name": "t",
            "agents": [{"name": "x", "layers": [
                {"kind": "rules", "content": "Rule one."},
                {"kind": "axioms", "content": "Be honest."}
            ]}],
            "sessions": [{"agent": "x", "turns": ["hi"]}]
        }))
        .unwrap();
        let p = w.plan().unwrap();
        assert_eq!(
            p.agents[0].system,
            "## Axioms\nBe honest.\n\n## Rules\nRule one.\n\n"
        );
        let m = messages(&p, 0, 0, &[]);
        assert_eq!(m.len(), 2);
        assert_eq!(m[1]["content"], "hi");
        // Engram holds the layers: its requests carry the conversation only.
        let mut p = p;
        without_system(&mut p);
        let m = messages(&p, 0, 0, &[]);
        assert_eq!(m.len(), 1);
        assert_eq!(m[0]["role"], "user");
    }
}
