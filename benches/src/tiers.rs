//! `engram-bench tiers`: the tier bridge and the shadow's byte budget under a steady
//! multi-session load, through the real app with its background loops (tier cycles every
//! `tiers.interval_ms`, flushes every `shadow.interval_ms`).
//!
//! 1. **Working set**: `sessions` sessions of one tenant take `warm_turns` turns each, round
//!    robin, with no budget; the cached blocks (hot + cold) and the shadow's bytes after a flush
//!    are the working set.
//! 2. **Steady load** in a fresh process: the hot, cold and shadow budgets at half the working
//!    set; the same warm-up, then `turns` turns over the sessions drawn by a Zipf(1) law
//!    (seeded): some sessions busy, most occasional. A conversation ends after `2 ×
//!    warm_turns` turns (deleted) and a new one takes its place, so the working set stays
//!    steady (the warm-up leaves every session at the average length). Turns come back to back
//!    (`gap_ms` 0: the service saturated) or paced, arrivals a Poisson process with a mean gap
//!    of `gap_ms` (a turn that finds the previous one still running waits for it: one client).
//!    Counted over the steady phase: every tier
//!    move of every block (the bridge's, the turns' warms, admission's evictions, cold drops),
//!    the bridge's own moves, the tier cycles that ran, and the shadow's bytes after every turn.
//!
//! Figures: moves per working-set block per cycle (all moves, and the bridge's alone), the
//! shadow's largest size against its budget, sessions archived and thawed, TTFT p50/p95.

use std::path::Path;
use std::time::{Duration, Instant};

use actix_web::{App, test, web};
use engram_kvcore::SplitMix64;
use engram_server::{Config, build_state, configure_app, spawn_background};
use serde::Serialize;
use serde_json::json;

const ADMIN: &str = crate::BENCH_ADMIN;

/// `engram_archive_sessions_total` by event, `[archived, thawed]`, from the app's `/metrics`.
macro_rules! archive_counts {
    ($app:expr) => {{
        let req = test::TestRequest::get()
            .uri("/metrics")
            .insert_header(("authorization", format!("Bearer {ADMIN}")))
            .to_request();
        let resp = test::call_service($app, req).await;
        let body = test::read_body(resp).await;
        let text = String::from_utf8_lossy(&body).into_owned();
        let get = |event: &str| -> u64 {
            let name = format!("engram_archive_sessions_total{{event=\"{event}\"}} ");
            text.lines()
                .find_map(|l| l.strip_prefix(&name)?.parse().ok())
                .unwrap_or(0)
        };
        [get("archived"), get("thawed")]
    }};
}

/// The load: sessions, turns, and their pace.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Load {
    /// Sessions.
    pub sessions: usize,
    /// Warm-up turns per session.
    pub warm_turns: usize,
    /// Steady turns.
    pub turns: usize,
    /// Tier-bridge interval, ms.
    pub cycle_ms: u64,
    /// Mean gap between the steady turns' arrivals, ms (0: back to back).
    pub gap_ms: u64,
}

/// What the steady load measured.
#[derive(Debug, Clone, Serialize)]
pub struct TierFigures {
    /// Sessions, warm-up turns each, steady turns.
    pub sessions: usize,
    /// Warm-up turns per session.
    pub warm_turns: usize,
    /// Steady turns.
    pub turns: usize,
    /// Tier-bridge interval, ms; flush interval, ms.
    pub intervals_ms: [u64; 2],
    /// Mean gap between the steady turns' arrivals, ms (0: back to back).
    pub gap_ms: u64,
    /// Steady phase: wall seconds, and the share of them a turn was running.
    pub wall_s: f64,
    /// Busy share of the wall time.
    pub busy_share: f64,
    /// Working set: cached blocks, their bytes, the shadow's bytes.
    pub working_set_blocks: usize,
    /// Bytes of those blocks.
    pub working_set_bytes: u64,
    /// The shadow's bytes after a flush of the working set.
    pub working_set_shadow_bytes: u64,
    /// Budgets of the steady run: hot, cold, shadow bytes.
    pub budgets: [u64; 3],
    /// Tier cycles during the steady phase.
    pub cycles: u64,
    /// Every tier move during the steady phase.
    pub moves: u64,
    /// The bridge's own moves (spilled, warmed, removed).
    pub bridge_moves: u64,
    /// Moves of a block within 100 cycles of its previous move (flips), every mover's.
    pub quick_moves: u64,
    /// quick_moves / moves.
    pub quick_share: f64,
    /// moves / (working-set blocks × cycles).
    pub moves_per_block_per_cycle: f64,
    /// bridge_moves / (working-set blocks × cycles).
    pub bridge_moves_per_block_per_cycle: f64,
    /// Admission evictions (hot tier full at a turn's start) during the steady phase.
    pub admission_evictions: u64,
    /// The shadow's largest size seen after a turn, bytes.
    pub shadow_max_bytes: u64,
    /// Samples (one per turn) with the shadow over its budget.
    pub shadow_over_budget_samples: usize,
    /// Sessions archived and thawed during the run.
    pub archived: u64,
    /// Sessions thawed.
    pub thawed: u64,
    /// Prompt tokens reused over prompt tokens, steady phase.
    pub cached_share: f64,
    /// TTFT p50 and p95 of the steady turns, ms.
    pub ttft_ms: [f64; 2],
}

fn config(model: &Path, dir: &Path, budgets: Option<[u64; 3]>, cycle_ms: u64) -> Config {
    let mut c = Config::default();
    c.model.path = model.to_path_buf();
    c.database.url = format!("sqlite://{}/engram.db?mode=rwc", dir.display());
    c.auth.admin_key.0 = ADMIN.into();
    c.memory.enabled = false;
    c.shadow.dir = dir.join("shadow");
    c.shadow.interval_ms = 2_000;
    c.tiers.enabled = true;
    c.tiers.interval_ms = cycle_ms;
    // A session is active (protected from the archive, its blocks warmed) for 5 s after a turn.
    c.tiers.active_window_secs = 5;
    if let Some([hot, cold, shadow]) = budgets {
        c.tiers.policy.hot_budget_bytes = hot;
        c.tiers.policy.cold_budget_bytes = cold;
        c.shadow.budget_mib = shadow.div_ceil(1 << 20);
    }
    c
}

/// A session's message of turn `i`: varied prose of ~40 tokens.
fn message(session: usize, i: usize) -> String {
    const WORDS: [&str; 12] = [
        "river", "lantern", "orchard", "granite", "harbour", "meadow", "violin", "compass",
        "glacier", "library", "falcon", "ember",
    ];
    format!(
        "Session {session}, note {i}: the {} near the {} was {} metres from the {}; the {} \
         stood {} paces past the {}. What is closest to the {}?",
        WORDS[(session + i) % 12],
        WORDS[(i * 5 + 3) % 12],
        (i * 37 + session * 11) % 1000,
        WORDS[(i * 7 + 1) % 12],
        WORDS[(session * 3 + i) % 12],
        (i * 13) % 90,
        WORDS[(session * 5 + 2) % 12],
        WORDS[(i + 4) % 12],
    )
}

/// Session `s`'s conversation number `generation`.
fn name(s: usize, generation: usize) -> String {
    format!("s{s}g{generation}")
}

/// A Zipf(1) draw over `n` ranks.
fn zipf(rng: &mut SplitMix64, n: usize) -> usize {
    let h: f64 = (1..=n).map(|k| 1.0 / k as f64).sum();
    let mut u = rng.next_open01() * h;
    for k in 1..=n {
        u -= 1.0 / k as f64;
        if u <= 0.0 {
            return k - 1;
        }
    }
    n - 1
}

fn p(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// One run: warm-up, then (with budgets) the steady phase.
async fn run(
    model: &Path,
    dir: &Path,
    load: Load,
    budgets: Option<[u64; 3]>,
) -> anyhow::Result<(usize, u64, u64, Option<TierFigures>)> {
    let Load {
        sessions,
        warm_turns,
        turns,
        cycle_ms,
        gap_ms,
    } = load;
    std::fs::create_dir_all(dir)?;
    let state = web::Data::new(build_state(config(model, dir, budgets, cycle_ms)).await?);
    anyhow::ensure!(state.engine.is_some(), "no model: run `make models`");
    spawn_background(state.clone());
    let app = test::init_service(App::new().configure(configure_app(state.clone()))).await;
    let key = tenant!(&app, "load");
    let mut said = vec![0usize; sessions];
    let mut ttft = Vec::new();
    let (mut cached, mut prompt) = (0u64, 0u64);
    let mut one = |v: &serde_json::Value, steady: bool| {
        if steady {
            ttft.push(v["ttft_ms"].as_f64().unwrap_or(0.0));
            cached += v["usage"]["cached_tokens"].as_u64().unwrap_or(0);
            prompt += v["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
        }
    };
    for i in 0..warm_turns {
        for (s, n) in said.iter_mut().enumerate() {
            let (st, v) = app_call!(
                &app,
                "POST",
                &format!("/v1/agents/bot/sessions/{}/turns", name(s, 0)),
                &key,
                json!({"message": message(s, i), "max_tokens": 4}),
            );
            anyhow::ensure!(st == 200, "turn: {v}");
            *n += 1;
            one(&v, false);
        }
    }
    let engine = state.engine().map_err(|e| anyhow::anyhow!("{e}"))?;
    let shadow = state.shadow().map_err(|e| anyhow::anyhow!("{e}"))?;
    let snapshot = || async {
        engine
            .snapshot()
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .recv_async()
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))
    };
    let Some(budgets) = budgets else {
        shadow.flush(engine, None).await?;
        let s = snapshot().await?;
        let blocks = s.occupancy.hot_used + s.occupancy.cold_used;
        let bytes = blocks as u64 * s.occupancy.block_bytes as u64;
        let shadow_bytes = shadow.status().bytes_on_disk;
        drop(app);
        state.store.close().await;
        return Ok((blocks, bytes, shadow_bytes, None));
    };
    let before = snapshot().await?;
    let totals = || state.tiers.totals.lock().map(|t| *t).unwrap_or_default();
    let bridge_before = totals();
    let archive_before = archive_counts!(&app);
    let mut rng = SplitMix64::new(0x7113_5eed);
    // Arrivals have their own stream, so that the sessions drawn do not depend on the pace.
    let mut arrivals = SplitMix64::new(0xa441_7a15);
    let (mut shadow_max, mut over) = (0u64, 0usize);
    let started = Instant::now();
    let mut busy = Duration::ZERO;
    let mut next_at = started;
    let mut generation = vec![0usize; sessions];
    for _ in 0..turns {
        if gap_ms > 0 {
            let gap = -(gap_ms as f64) * arrivals.next_open01().ln();
            next_at += Duration::from_secs_f64(gap / 1e3);
            let now = Instant::now();
            if next_at > now {
                actix_web::rt::time::sleep(next_at - now).await;
            }
        }
        let turn_started = Instant::now();
        let s = zipf(&mut rng, sessions);
        if said[s] >= 2 * warm_turns {
            // The conversation ends; a new one takes its place.
            let (st, v) = app_call!(
                &app,
                "DELETE",
                &format!("/v1/agents/bot/sessions/{}", name(s, generation[s])),
                &key,
                serde_json::Value::Null,
            );
            anyhow::ensure!(st == 200 || st == 204, "delete: {v}");
            generation[s] += 1;
            said[s] = 0;
        }
        let (st, v) = app_call!(
            &app,
            "POST",
            &format!("/v1/agents/bot/sessions/{}/turns", name(s, generation[s])),
            &key,
            json!({"message": message(s, said[s]), "max_tokens": 4}),
        );
        anyhow::ensure!(st == 200, "turn: {v}");
        busy += turn_started.elapsed();
        said[s] += 1;
        one(&v, true);
        let bytes = shadow.status().bytes_on_disk;
        shadow_max = shadow_max.max(bytes);
        if bytes > budgets[2].div_ceil(1 << 20) << 20 {
            over += 1;
        }
    }
    let wall = started.elapsed();
    let after = snapshot().await?;
    let bridge_after = totals();
    let archive_after = archive_counts!(&app);
    drop(app);
    state.store.close().await;
    // Let the background loops notice the end.
    actix_web::rt::time::sleep(Duration::from_millis(50)).await;
    let cycles = bridge_after[0] - bridge_before[0];
    let bridge_moves: u64 = (1..4).map(|i| bridge_after[i] - bridge_before[i]).sum();
    let moves = after.tier_moves - before.tier_moves;
    ttft.sort_by(f64::total_cmp);
    let figures = TierFigures {
        sessions,
        warm_turns,
        turns,
        intervals_ms: [cycle_ms, 2_000],
        gap_ms,
        wall_s: wall.as_secs_f64(),
        busy_share: busy.as_secs_f64() / wall.as_secs_f64().max(1e-9),
        working_set_blocks: 0,
        working_set_bytes: 0,
        working_set_shadow_bytes: 0,
        budgets,
        cycles,
        moves,
        bridge_moves,
        quick_moves: after.quick_moves - before.quick_moves,
        quick_share: (after.quick_moves - before.quick_moves) as f64 / moves.max(1) as f64,
        moves_per_block_per_cycle: 0.0,
        bridge_moves_per_block_per_cycle: 0.0,
        admission_evictions: after.counters.admission_evictions
            - before.counters.admission_evictions,
        shadow_max_bytes: shadow_max,
        shadow_over_budget_samples: over,
        archived: archive_after[0] - archive_before[0],
        thawed: archive_after[1] - archive_before[1],
        cached_share: cached as f64 / prompt.max(1) as f64,
        ttft_ms: [p(&ttft, 0.5), p(&ttft, 0.95)],
    };
    eprintln!(
        "engram-bench tiers: {turns} steady turns in {:.1} s, {cycles} cycles",
        wall.as_secs_f64()
    );
    Ok((0, 0, 0, Some(figures)))
}

/// Measures the working set, then the steady load at half of it (see the module docs).
pub async fn steady(model: &Path, dir: &Path, load: Load) -> anyhow::Result<TierFigures> {
    let warm_up = Load { turns: 0, ..load };
    let (blocks, bytes, shadow_bytes, _) = run(model, &dir.join("ws"), warm_up, None).await?;
    let budgets = [bytes / 2, bytes / 2, shadow_bytes / 2];
    let (_, _, _, figures) = run(model, &dir.join("steady"), load, Some(budgets)).await?;
    let mut f = figures.ok_or_else(|| anyhow::anyhow!("no steady figures"))?;
    f.working_set_blocks = blocks;
    f.working_set_bytes = bytes;
    f.working_set_shadow_bytes = shadow_bytes;
    let per = (blocks as f64 * f.cycles.max(1) as f64).max(1.0);
    f.moves_per_block_per_cycle = f.moves as f64 / per;
    f.bridge_moves_per_block_per_cycle = f.bridge_moves as f64 / per;
    Ok(f)
}
