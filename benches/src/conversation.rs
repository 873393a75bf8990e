//! `engram-bench conversation`: a scripted 20-turn conversation whose questions revisit
//! overlapping memories, run through the real app (routes, handlers, store, memory graph,
//! engine) in one process: without cold-tier reservation, with it, and with it plus a query-time
//! prefetch of each question's first words before its turn. Reported per turn:
//! TTFT, the memories layer's tokens, how many of them were served from reserved blocks, and
//! how many were reused from the cache by any route.
//!
//! Between turns the driver waits until the engine has no pending reservation (an agent's
//! user takes longer to type than the reservation takes to compute); the wait is reported.

use std::time::{Duration, Instant};

use actix_web::{App, test, web};
use serde::Serialize;
use serde_json::{Value, json};

use engram_server::Config;
use engram_server::{build_state, configure_app};

/// The agent's memories: (kind, text) and edges (from, to, kind) by index.
pub const FACTS: [(&str, &str); 26] = [
    ("entity", "Alice, the user's younger sister."),
    ("fact", "Alice moved to Berlin in October."),
    ("fact", "Alice works as a nurse at the Charité hospital."),
    ("fact", "Alice's flat in Berlin is near the Spree river."),
    ("fact", "Alice has a grey cat called Miso."),
    ("entity", "Tom, the user's manager at Northwind."),
    ("fact", "The user works at Northwind as a data engineer."),
    ("fact", "The quarterly report is due on December 5."),
    ("fact", "Tom prefers short written status updates."),
    ("fact", "The team migrates the billing database in January."),
    ("entity", "Berlin, the capital of Germany."),
    ("fact", "The user plans to visit Berlin for Christmas."),
    ("fact", "The train to Berlin leaves Munich at 08:15."),
    ("fact", "The user booked a hotel near Alexanderplatz."),
    ("fact", "The user is afraid of flying."),
    ("concept", "Health and appointments."),
    (
        "fact",
        "The user has a dentist appointment next Tuesday at 10:00.",
    ),
    ("fact", "The user is allergic to penicillin."),
    ("fact", "The user runs 5 km three times a week."),
    ("entity", "The Isar amateur orchestra."),
    (
        "fact",
        "The user plays the violin in the Isar amateur orchestra.",
    ),
    ("fact", "The orchestra rehearses on Thursday evenings."),
    ("fact", "The user is learning Bach's second violin partita."),
    ("concept", "Christmas plans."),
    ("fact", "The user will bring Alice a scarf for Christmas."),
    ("fact", "Tom approved the user's leave from December 22."),
];

/// Edges between [`FACTS`] by index.
pub const EDGES: [(usize, usize, &str); 24] = [
    (1, 0, "mentions"),
    (2, 0, "mentions"),
    (3, 0, "mentions"),
    (4, 0, "mentions"),
    (1, 10, "mentions"),
    (3, 10, "mentions"),
    (6, 5, "mentions"),
    (7, 5, "mentions"),
    (8, 5, "mentions"),
    (9, 5, "mentions"),
    (11, 10, "mentions"),
    (12, 10, "mentions"),
    (13, 10, "mentions"),
    (14, 12, "relates_to"),
    (16, 15, "relates_to"),
    (17, 15, "relates_to"),
    (18, 15, "relates_to"),
    (20, 19, "mentions"),
    (21, 19, "mentions"),
    (22, 20, "relates_to"),
    (11, 23, "relates_to"),
    (24, 23, "relates_to"),
    (24, 0, "mentions"),
    (25, 5, "mentions"),
];

/// The user's questions, revisiting topics.
pub const QUESTIONS: [&str; 20] = [
    "How is my sister Alice doing in Berlin?",
    "What does Alice do for work?",
    "When is my quarterly report due?",
    "What does Tom like in status updates?",
    "When does my train to Berlin leave?",
    "Where is Alice's flat?",
    "Which hotel did I book in Berlin?",
    "When is my dentist appointment?",
    "What am I allergic to?",
    "What piece am I learning on the violin?",
    "When does the orchestra rehearse?",
    "Remind me what my manager prefers.",
    "What is the team migrating in January?",
    "Does Alice have any pets?",
    "Am I visiting Alice for Christmas?",
    "How do I get to Berlin, given that I hate flying?",
    "How often do I run?",
    "When does my leave start?",
    "What is the name of Alice's cat?",
    "What is my plan for Christmas in Berlin?",
];

/// One turn's figures.
#[derive(Debug, Clone, Serialize)]
pub struct TurnFigures {
    /// 1-based.
    pub turn: usize,
    /// Reservation on.
    pub reserve: bool,
    /// Time to first token, ms.
    pub ttft_ms: f64,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Prompt tokens reused from the cache.
    pub cached_tokens: u64,
    /// Tokens of the memories layer.
    pub memories_tokens: u64,
    /// Of those, served from reserved blocks.
    pub memories_reserved: u64,
    /// Of those, reused from the cache by any route.
    pub memories_cached: u64,
    /// Milliseconds the driver waited for pending reservations before this turn.
    pub waited_ms: f64,
}

/// The figures of one run.
#[derive(Debug, Clone, Serialize)]
pub struct RunSummary {
    /// Reservation on.
    pub reserve: bool,
    /// Share of each question's words sent to `POST …/prefetch` before the turn (None: no
    /// prefetch).
    pub prefetch: Option<f64>,
    /// Turns.
    pub turns: usize,
    /// Memories-layer tokens over all turns.
    pub memories_tokens: u64,
    /// Of those, served from reserved blocks.
    pub memories_reserved: u64,
    /// Of those, reused from the cache by any route.
    pub memories_cached: u64,
    /// `memories_reserved / memories_tokens`.
    pub reserved_share: f64,
    /// `memories_cached / memories_tokens`.
    pub cached_share: f64,
    /// Prompt tokens reused from the cache over all prompt tokens, turns 2..=N.
    pub prompt_cached_share: f64,
    /// Mean TTFT over turns 2..=N, ms (turn 1 computes the stable prefix in both runs).
    pub mean_ttft_ms: f64,
    /// Median TTFT over turns 2..=N, ms.
    pub median_ttft_ms: f64,
    /// Reservations made, used, expired (engine counters).
    pub reservations: Value,
}

/// Runs the conversation once (see the module docs); with `prefetch`, the first
/// `prefetch` share of each question's words (at least one) goes to `POST …/prefetch` before
/// the turn, as a client does while its user types.
pub async fn run(
    mut config: Config,
    reserve: bool,
    prefetch: Option<f64>,
    turns: usize,
    max_tokens: usize,
) -> anyhow::Result<(Vec<TurnFigures>, RunSummary)> {
    const ADMIN: &str = "bench-admin-key-0123456789";
    config.auth.admin_key.0 = ADMIN.into();
    config.memory.reserve = reserve;
    let state = web::Data::new(build_state(config).await?);
    anyhow::ensure!(state.engine.is_some(), "no model: run `make models`");
    anyhow::ensure!(
        state.memory.is_some(),
        "no embedding model: run `make models`"
    );
    let app = test::init_service(App::new().configure(configure_app(state.clone()))).await;
    let (s, t) = app_call!(
        &app,
        "POST",
        "/v1/admin/tenants",
        ADMIN,
        json!({"name": "bench"})
    );
    anyhow::ensure!(s == 201, "tenant: {t}");
    let key = t["api_key"].as_str().unwrap_or_default().to_string();
    let rules: Vec<String> = (0..12)
        .map(|i| format!("Rule {i}: answer from the memories when they hold the answer, briefly."))
        .collect();
    let layers = json!([
        {"kind": "axioms", "content": "Be honest.\nNever invent facts about the user."},
        {"kind": "identity", "content": "You are Mneme, the user's personal assistant."},
        {"kind": "rules", "content": rules.join("\n")},
    ]);
    let (s, a) = app_call!(
        &app,
        "POST",
        "/v1/agents",
        &key,
        json!({"name": "mneme", "layers": layers}),
    );
    anyhow::ensure!(s == 201, "agent: {a}");
    let mut ids = Vec::new();
    for (kind, text) in FACTS {
        let (s, n) = app_call!(
            &app,
            "POST",
            "/v1/agents/mneme/memory/nodes",
            &key,
            json!({"kind": kind, "text": text}),
        );
        anyhow::ensure!(s == 201, "node: {n}");
        ids.push(n["id"].as_i64().unwrap_or_default());
    }
    for (from, to, kind) in EDGES {
        let (s, e) = app_call!(
            &app,
            "POST",
            "/v1/agents/mneme/memory/edges",
            &key,
            json!({"from": ids[from], "to": ids[to], "kind": kind}),
        );
        anyhow::ensure!(s == 201, "edge: {e}");
    }
    let engine = state.engine().map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut out = Vec::new();
    for (i, q) in QUESTIONS.iter().cycle().take(turns).enumerate() {
        if let Some(share) = prefetch {
            let words: Vec<&str> = q.split_whitespace().collect();
            let n = ((words.len() as f64 * share).ceil() as usize).clamp(1, words.len());
            let (s, v) = app_call!(
                &app,
                "POST",
                "/v1/agents/mneme/sessions/conversation/prefetch",
                &key,
                json!({"text": words[..n].join(" ")}),
            );
            anyhow::ensure!(s == 200, "prefetch {}: {v}", i + 1);
        }
        let w = Instant::now();
        loop {
            let pending = engine
                .reservations(None)?
                .recv_async()
                .await?
                .iter()
                .any(|r| r.state == engram_engine::ReservationState::Pending);
            if !pending || w.elapsed() > Duration::from_secs(60) {
                break;
            }
            actix_web::rt::time::sleep(Duration::from_millis(20)).await;
        }
        let waited_ms = w.elapsed().as_secs_f64() * 1e3;
        let (s, v) = app_call!(
            &app,
            "POST",
            "/v1/agents/mneme/sessions/conversation/turns",
            &key,
            json!({"message": q, "max_tokens": max_tokens}),
        );
        anyhow::ensure!(s == 200, "turn {}: {v}", i + 1);
        let m = &v["memories"];
        let n = |v: &Value| v.as_u64().unwrap_or(0);
        out.push(TurnFigures {
            turn: i + 1,
            reserve,
            ttft_ms: v["ttft_ms"].as_f64().unwrap_or(0.0),
            prompt_tokens: n(&v["usage"]["prompt_tokens"]),
            cached_tokens: n(&v["usage"]["cached_tokens"]),
            memories_tokens: n(&m["tokens"]),
            memories_reserved: n(&m["reserved_tokens"]),
            memories_cached: n(&m["cached_tokens"]),
            waited_ms,
        });
    }
    let snap = engine.snapshot()?.recv_async().await?;
    let sum = |f: fn(&TurnFigures) -> u64| out.iter().map(f).sum::<u64>();
    let (mt, mr, mc) = (
        sum(|t| t.memories_tokens),
        sum(|t| t.memories_reserved),
        sum(|t| t.memories_cached),
    );
    let mut ttft: Vec<f64> = out.iter().skip(1).map(|t| t.ttft_ms).collect();
    ttft.sort_by(f64::total_cmp);
    let summary = RunSummary {
        reserve,
        prefetch,
        turns: out.len(),
        memories_tokens: mt,
        memories_reserved: mr,
        memories_cached: mc,
        reserved_share: mr as f64 / mt.max(1) as f64,
        cached_share: mc as f64 / mt.max(1) as f64,
        prompt_cached_share: {
            let later = || out.iter().skip(1);
            let cached: u64 = later().map(|t| t.cached_tokens).sum();
            cached as f64 / later().map(|t| t.prompt_tokens).sum::<u64>().max(1) as f64
        },
        mean_ttft_ms: ttft.iter().sum::<f64>() / ttft.len().max(1) as f64,
        median_ttft_ms: ttft.get(ttft.len() / 2).copied().unwrap_or(0.0),
        reservations: json!(snap.reservations),
    };
    Ok((out, summary))
}
