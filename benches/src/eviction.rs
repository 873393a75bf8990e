//! `engram-bench eviction`: attention-aware eviction against priority-only eviction, same
//! load, same process, fresh state for each policy.
//!
//! The load: `agents` agents of one tenant, each with a long stable prefix (five layers of
//! varied prose, `layer_lines` lines each) and one conversation. Warm-up: `warm_turns` turns per
//! agent, round robin, with no hot-tier limit; the cached blocks then (hot + cold) are the
//! working set. Each policy then runs in a fresh process state with the hot tier sized to
//! `hot_share` of the working set (whole MiB, rounded up): the same warm-up, then `turns` turns
//! over the agents drawn by a Zipf(`zipf_s`) law (seeded: the same agents in the same order for
//! every policy) — a few agents busy, most occasional. A conversation ends after `2 ×
//! warm_turns` turns (deleted) and a new one takes its place, so the working set stays steady.
//!
//! With `cold_share` > 0 the cold tier is bounded to that share of the working set too and the
//! shadow is off, so blocks the cold tier drops are recomputed on their next use: the policy then
//! decides misses, not only which cached blocks are hot.
//!
//! With `shift_at` > 0 the popularity shifts at that steady turn: the busy agents become
//! occasional ones and the other way round (how fast a ranking by use forgets, `[eviction]
//! use_half_life`, decides the turns after it).
//!
//! Figures per policy, over the steady turns: the hot hit rate (prompt blocks found hot at
//! admission over the prompt blocks a turn could reuse: hot + cold hits + misses) over every
//! admission the engine counted and over the turns' own prompts (the server also prefills the
//! canonical prefix after each turn, whose blocks the turn has just made hot), the cold
//! hits, the misses (recomputed), TTFT p50/p95, admission evictions; and whether every reply
//! equals the first policy's (eviction moves blocks, it never changes them).

use std::path::Path;

use actix_web::{App, test, web};
use engram_kvcore::SplitMix64;
use engram_server::{Config, build_state, configure_app, spawn_background};
use serde::Serialize;
use serde_json::json;

const ADMIN: &str = crate::BENCH_ADMIN;

/// The load.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Load {
    /// Agents (one conversation each).
    pub agents: usize,
    /// Lines of prose per stable layer (five layers per agent).
    pub layer_lines: usize,
    /// Warm-up turns per agent.
    pub warm_turns: usize,
    /// Steady turns.
    pub turns: usize,
    /// Tokens generated per turn.
    pub max_tokens: usize,
    /// Hot tier as a share of the working set.
    pub hot_share: f64,
    /// Cold tier as a share of the working set (0: the default size, which holds this load);
    /// bounded, the shadow is off, so what the cold tier drops is recomputed: the policy then
    /// decides misses, not only cold hits.
    #[serde(default)]
    pub cold_share: f64,
    /// Exponent of the Zipf law over agents (0: uniform).
    pub zipf_s: f64,
    /// Seed of the steady turns' draw over agents.
    pub seed: u64,
    /// Run the tier loop (off: only admissions move blocks, so what stays hot is the eviction
    /// ranking's choice alone).
    pub tier_loop: bool,
    /// From this steady turn on (0: never), popularity shifts: the agent drawn at Zipf rank `k`
    /// is agent `(k + agents / 2) mod agents`, so the busy agents become occasional ones and
    /// the other way round (what aging the use counts is for).
    #[serde(default)]
    pub shift_at: usize,
}

/// The steady turns' seed unless `--seed` says otherwise (every run before the option existed
/// drew with it).
pub const SEED: u64 = 0xe71c_7ed5;

/// One policy's figures.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyFigures {
    /// `[eviction]` settings of the run.
    pub eviction: serde_json::Value,
    /// Steady turns.
    pub turns: usize,
    /// Prompt blocks found hot / (hot + cold + missed), over every admission the engine counted:
    /// the turns' prompts, the canonical prefix the server prefills after each turn (blocks the
    /// turn has just made hot) and the replays of lost turns.
    pub hot_hit_rate: f64,
    /// The same over the turns' own prompts only (each turn's `cache` figures): of the blocks a
    /// turn's prompt reused or computed, the share found hot when it arrived.
    pub turn_hot_hit_rate: f64,
    /// The turns' prompt blocks found hot, warmed from the cold tier, computed.
    pub turn_blocks: [u64; 3],
    /// Of the same blocks, the share that was hot when each turn *arrived* (its `cache.arrival`),
    /// before the server replayed the turns whose blocks the cache had lost: a replay
    /// recomputes them into the hot tier, where the turn's admission then finds them, so
    /// [`Self::turn_hot_hit_rate`] credits a policy with blocks it had lost.
    pub arrival_hot_hit_rate: f64,
    /// The turns' prompt blocks hot and cold when the turns arrived.
    pub arrival_blocks: [u64; 2],
    /// Prompt blocks found hot, cold, and missed (recomputed).
    pub hot_hits: u64,
    /// Found in the cold tier (warmed by the turn).
    pub cold_hits: u64,
    /// Not cached (recomputed).
    pub misses: u64,
    /// Hot blocks admission evicted.
    pub admission_evictions: u64,
    /// Of those, spills onto a staged copy.
    pub admission_staged: u64,
    /// Staged spills (`[tiers] stage`): spills that took a staged copy, copies dropped unused.
    pub staged_used_dropped: [u64; 2],
    /// Prompt tokens reused over prompt tokens.
    pub cached_share: f64,
    /// TTFT p50, p95 (ms).
    pub ttft_ms: [f64; 2],
    /// Mean TTFT (ms).
    pub mean_ttft_ms: f64,
    /// Every reply equals the first policy's.
    pub replies_identical: bool,
    /// Wall seconds of the steady phase.
    pub wall_s: f64,
    /// Repetition of the run (0-based; see [`compare`]).
    pub repetition: usize,
    /// Each steady turn's TTFT (ms), in turn order: turn `i` is the same agent and message
    /// under every policy and repetition.
    pub turn_ttft_ms: Vec<f64>,
    /// Each steady turn's prompt blocks found hot, warmed, computed, in turn order.
    pub turn_cache_blocks: Vec<[u64; 3]>,
    /// Each steady turn's prompt blocks hot and cold when it arrived, in turn order.
    pub turn_arrival_blocks: Vec<[u64; 2]>,
    /// [`Self::turn_hot_hit_rate`] over the turns from the load's `shift_at` on (with a shift).
    pub shifted_turn_hot_hit_rate: Option<f64>,
}

/// TTFT of one policy against the first, over every repetition: paired by turn (the same
/// agent and message, so the same prompt), the ratios with 95 % bootstrap intervals.
#[derive(Debug, Clone, Serialize)]
pub struct TtftComparison {
    /// `[eviction]` settings of the compared policy.
    pub eviction: serde_json::Value,
    /// Paired turns (repetitions × steady turns).
    pub pairs: usize,
    /// TTFT p50 over every repetition's turns: the first policy, this one (ms).
    pub p50_ms: [f64; 2],
    /// This policy's p50 over the first's, and its 95 % bootstrap interval (pairs resampled).
    pub p50_ratio: [f64; 3],
    /// Median over the pairs of this policy's TTFT over the first's (the same turn, the same
    /// repetition), and its 95 % bootstrap interval.
    pub paired_median_ratio: [f64; 3],
    /// Share of pairs where this policy's TTFT is lower.
    pub lower_share: f64,
    /// Per repetition: this policy's p50 over the first's.
    pub p50_ratio_per_repetition: Vec<f64>,
}

/// Everything the bench measured.
#[derive(Debug, Clone, Serialize)]
pub struct EvictionFigures {
    /// The load.
    pub load: Load,
    /// Working set: cached blocks after the warm-up, their bytes.
    pub working_set_blocks: usize,
    /// Bytes of the working set.
    pub working_set_bytes: u64,
    /// The hot tier of the steady runs, MiB (unless a policy sets its own `hot_share`).
    pub hot_mib: u64,
    /// The cold tier of the measured runs when bounded (MiB).
    pub cold_mib: Option<u64>,
    /// Whether the policies ran interleaved turn by turn (see [`compare`]).
    pub interleaved: bool,
    /// Per repetition, per policy, in run order (see [`compare`]).
    pub policies: Vec<PolicyFigures>,
    /// Every policy after the first against the first, over every repetition.
    pub ttft: Vec<TtftComparison>,
}

/// The eviction settings compared (`[eviction]` as JSON): priority-only, attention-aware
/// (defaults: whole chains), and attention-aware block by block (`whole_chains` off).
pub fn policies() -> Vec<serde_json::Value> {
    vec![
        json!({"mode": "priority"}),
        json!({"mode": "attention"}),
        json!({"mode": "attention", "whole_chains": false}),
    ]
}

fn config(
    model: &Path,
    dir: &Path,
    tiers: Option<(u64, Option<u64>)>,
    eviction: &serde_json::Value,
    tier_loop: bool,
) -> Config {
    let mut c = Config::default();
    c.tiers.enabled = tier_loop;
    c.model.path = model.to_path_buf();
    c.database.url = format!("sqlite://{}/engram.db?mode=rwc", dir.display());
    c.auth.admin_key.0 = ADMIN.into();
    c.memory.enabled = false;
    c.shadow.dir = dir.join("shadow");
    if let Some((hot, cold)) = tiers {
        c.model.hot_mib = Some(hot);
        if let Some(cold) = cold {
            c.model.cold_mib = Some(cold);
            c.shadow.enabled = false;
        }
    }
    if let Some(m) = eviction["mode"].as_str() {
        c.eviction.mode = engram_engine::EvictionMode::parse(m).unwrap_or_default();
    }
    if let Some(w) = eviction["mass_weight"].as_f64() {
        c.eviction.mass_weight = w;
    }
    if let Some(w) = eviction["recency_weight"].as_f64() {
        c.eviction.recency_weight = w;
    }
    if let Some(w) = eviction["frequency_weight"].as_f64() {
        c.eviction.frequency_weight = w;
    }
    if let Some(w) = eviction["use_weight"].as_f64() {
        c.eviction.use_weight = w;
    }
    if let Some(n) = eviction["idle_steps"].as_u64() {
        c.eviction.idle_steps = n;
    }
    if let Some(n) = eviction["use_half_life"].as_u64() {
        c.eviction.use_half_life = n;
    }
    if let Some(b) = eviction["whole_chains"].as_bool() {
        c.eviction.whole_chains = b;
    }
    // Not an `[eviction]` key: `[tiers] stage`, so that one run can compare the bridge's
    // spill-ahead with its staging.
    if let Some(stage) = eviction["stage"].as_bool() {
        c.tiers.policy.stage = stage;
    }
    c
}

const WORDS: [&str; 24] = [
    "river", "lantern", "orchard", "granite", "harbour", "meadow", "violin", "compass", "glacier",
    "library", "falcon", "ember", "invoice", "ledger", "freight", "pallet", "customs", "tariff",
    "courier", "depot", "manifest", "berth", "quay", "dock",
];

/// `lines` lines of varied prose, seeded.
fn prose(seed: u64, lines: usize) -> String {
    let mut rng = SplitMix64::new(seed);
    let mut w = || WORDS[(rng.next_u64() % WORDS.len() as u64) as usize];
    (0..lines)
        .map(|i| {
            format!(
                "{i}. When the {} meets the {}, check the {} before the {}.",
                w(),
                w(),
                w(),
                w()
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Agent `a`'s five stable layers.
fn layers(a: usize, lines: usize) -> serde_json::Value {
    let kinds = ["axioms", "identity", "rules", "capabilities", "soul"];
    let layers: Vec<_> = kinds
        .iter()
        .enumerate()
        .map(|(k, kind)| {
            json!({
                "kind": kind,
                "content": format!("Agent {a}, {kind}:\n{}", prose((a * 10 + k) as u64 + 1, lines)),
            })
        })
        .collect();
    json!(layers)
}

/// Agent `a`'s message of turn `i`.
fn message(a: usize, i: usize) -> String {
    format!(
        "Agent {a}, question {i}: the {} left the {} at {} past the hour; where should the {} go?",
        WORDS[(a + i) % 24],
        WORDS[(i * 5 + 3) % 24],
        (i * 37 + a * 11) % 60,
        WORDS[(i * 7 + a) % 24],
    )
}

fn zipf(rng: &mut SplitMix64, n: usize, s: f64) -> usize {
    let w: Vec<f64> = (1..=n).map(|k| 1.0 / (k as f64).powf(s)).collect();
    let mut u = rng.next_open01() * w.iter().sum::<f64>();
    for (k, wk) in w.iter().enumerate() {
        u -= wk;
        if u <= 0.0 {
            return k;
        }
    }
    n - 1
}

/// The agent a Zipf rank `k` draws: `k`, or with the popularity shifted `(k + agents / 2) mod
/// agents`.
fn shifted(k: usize, agents: usize, shift: bool) -> usize {
    if shift { (k + agents / 2) % agents } else { k }
}

/// The share of `blocks` (hot, warmed, computed) found hot.
fn hot_share(blocks: [u64; 3]) -> f64 {
    blocks[0] as f64 / blocks.iter().sum::<u64>().max(1) as f64
}

/// Per-turn block counts (hot, warmed, computed; or hot, cold on arrival) summed over turns.
fn sum_blocks<const N: usize>(turns: &[[u64; N]]) -> [u64; N] {
    turns.iter().fold([0; N], |mut acc, b| {
        acc.iter_mut().zip(b).for_each(|(a, b)| *a += b);
        acc
    })
}

fn p(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// One policy of a run: `[eviction]` as JSON and the tiers (hot MiB, cold MiB when bounded;
/// none: unlimited, the working-set run).
type Arm = (serde_json::Value, Option<(u64, Option<u64>)>);

/// What one run returns: working set (blocks, bytes) of its first policy, and with a hot limit
/// each policy's steady figures and replies.
type RunOut = (usize, u64, Vec<(PolicyFigures, Vec<String>)>);

/// One fresh server state per arm (each in its own directory under `dir`), the same warm-up
/// for each, then the steady turns: every turn goes to every arm before the next, in the arms'
/// order on even turns and reversed on odd ones (`flip` swaps the two), so that machine drift
/// weighs on every arm alike.
async fn run(
    model: &Path,
    dir: &Path,
    load: Load,
    arms: &[Arm],
    flip: bool,
) -> anyhow::Result<RunOut> {
    let mut states = Vec::new();
    let mut apps = Vec::new();
    let mut keys = Vec::new();
    for (k, (eviction, tiers)) in arms.iter().enumerate() {
        let dir = dir.join(format!("a{k}"));
        std::fs::create_dir_all(&dir)?;
        let state = web::Data::new(
            build_state(config(model, &dir, *tiers, eviction, load.tier_loop)).await?,
        );
        anyhow::ensure!(state.engine.is_some(), "no model: run `make models`");
        spawn_background(state.clone());
        let app = test::init_service(App::new().configure(configure_app(state.clone()))).await;
        // The tenant (and an unused agent `bot`, which the bench's agents sit beside).
        let key = tenant!(&app, "platform");
        for a in 0..load.agents {
            let (s, v) = app_call!(
                &app,
                "POST",
                "/v1/agents",
                &key,
                json!({"name": format!("agent{a}"), "layers": layers(a, load.layer_lines)}),
            );
            anyhow::ensure!(s == 201, "agent: {v}");
        }
        states.push(state);
        apps.push(app);
        keys.push(key);
    }
    let turn = |a: usize, generation: usize, i: usize| {
        (
            format!("/v1/agents/agent{a}/sessions/c{generation}/turns"),
            json!({"message": message(a, i), "max_tokens": load.max_tokens}),
        )
    };
    for (app, key) in apps.iter().zip(&keys) {
        for i in 0..load.warm_turns {
            for a in 0..load.agents {
                let (path, body) = turn(a, 0, i);
                let (st, v) = app_call!(app, "POST", &path, key, body);
                anyhow::ensure!(st == 200, "turn: {v}");
            }
        }
    }
    let mut said = vec![load.warm_turns; load.agents];
    let snapshot = |state: &web::Data<engram_server::AppState>| -> anyhow::Result<_> {
        state
            .engine()
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .snapshot()
            .map_err(|e| anyhow::anyhow!("{e}"))
    };
    let mut before = Vec::new();
    for state in &states {
        let rx = snapshot(state)?;
        before.push(rx.recv_async().await.map_err(|e| anyhow::anyhow!("{e}"))?);
    }
    if arms[0].1.is_none() {
        let o = &before[0].occupancy;
        let blocks = o.hot_used + o.cold_used;
        let bytes = blocks as u64 * o.block_bytes as u64;
        drop(apps);
        for state in &states {
            state.store.close().await;
        }
        return Ok((blocks, bytes, Vec::new()));
    }
    /// One arm's steady turns.
    #[derive(Default)]
    struct Steady {
        ttft: Vec<f64>,
        replies: Vec<String>,
        cached: u64,
        prompt: u64,
        turn_blocks: Vec<[u64; 3]>,
        arrival: Vec<[u64; 2]>,
        wall: std::time::Duration,
    }
    let mut steady: Vec<Steady> = arms.iter().map(|_| Steady::default()).collect();
    let mut rng = SplitMix64::new(load.seed);
    let mut generation = vec![0usize; load.agents];
    for t in 0..load.turns {
        let a = shifted(
            zipf(&mut rng, load.agents, load.zipf_s),
            load.agents,
            load.shift_at > 0 && t >= load.shift_at,
        );
        let ended = said[a] >= 2 * load.warm_turns;
        let mut order: Vec<usize> = (0..arms.len()).collect();
        if (t % 2 == 1) != flip {
            order.reverse();
        }
        for k in order {
            let (app, key, s) = (&apps[k], &keys[k], &mut steady[k]);
            let started = std::time::Instant::now();
            if ended {
                let (st, v) = app_call!(
                    app,
                    "DELETE",
                    &format!("/v1/agents/agent{a}/sessions/c{}", generation[a]),
                    key,
                    serde_json::Value::Null,
                );
                anyhow::ensure!(st == 200 || st == 204, "delete: {v}");
            }
            let (path, body) = turn(
                a,
                generation[a] + usize::from(ended),
                if ended { 0 } else { said[a] },
            );
            let (st, v) = app_call!(app, "POST", &path, key, body);
            anyhow::ensure!(st == 200, "turn: {v}");
            s.wall += started.elapsed();
            s.ttft.push(
                v["ttft_ms"]
                    .as_f64()
                    .ok_or_else(|| anyhow::anyhow!("turn without ttft_ms: {v}"))?,
            );
            s.cached += v["usage"]["cached_tokens"].as_u64().unwrap_or(0);
            s.prompt += v["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
            s.replies
                .push(v["text"].as_str().unwrap_or_default().to_string());
            let mut blocks = [0u64; 3];
            for (n, k) in blocks
                .iter_mut()
                .zip(["hot_blocks", "warmed_blocks", "computed_blocks"])
            {
                *n = v["cache"][k]
                    .as_u64()
                    .ok_or_else(|| anyhow::anyhow!("turn without cache.{k}: {v}"))?;
            }
            s.turn_blocks.push(blocks);
            let mut found = [0u64; 2];
            for (n, k) in found.iter_mut().zip(["hot_blocks", "cold_blocks"]) {
                *n = v["cache"]["arrival"][k]
                    .as_u64()
                    .ok_or_else(|| anyhow::anyhow!("turn without cache.arrival.{k}: {v}"))?;
            }
            s.arrival.push(found);
        }
        if ended {
            generation[a] += 1;
            said[a] = 0;
        }
        said[a] += 1;
    }
    let mut after = Vec::new();
    for state in &states {
        let rx = snapshot(state)?;
        after.push(rx.recv_async().await.map_err(|e| anyhow::anyhow!("{e}"))?);
    }
    drop(apps);
    for state in &states {
        state.store.close().await;
    }
    actix_web::rt::time::sleep(std::time::Duration::from_millis(50)).await;
    let mut out = Vec::new();
    for (((arm, s), before), after) in arms.iter().zip(steady).zip(&before).zip(&after) {
        let (b, e) = (&before.counters, &after.counters);
        let hot_hits = e.hot_hits - b.hot_hits;
        let cold_hits = e.cold_hits - b.cold_hits;
        let misses = e.misses - b.misses;
        let mut ttft = s.ttft.clone();
        let mean = ttft.iter().sum::<f64>() / ttft.len().max(1) as f64;
        ttft.sort_by(f64::total_cmp);
        let tb = sum_blocks(&s.turn_blocks);
        let shifted_rate = (load.shift_at > 0).then(|| {
            hot_share(sum_blocks(
                s.turn_blocks.get(load.shift_at..).unwrap_or_default(),
            ))
        });
        let arrived = sum_blocks(&s.arrival);
        let figures = PolicyFigures {
            eviction: arm.0.clone(),
            turns: load.turns,
            hot_hit_rate: hot_hits as f64 / (hot_hits + cold_hits + misses).max(1) as f64,
            turn_hot_hit_rate: hot_share(tb),
            turn_blocks: tb,
            arrival_hot_hit_rate: arrived[0] as f64 / tb.iter().sum::<u64>().max(1) as f64,
            arrival_blocks: arrived,
            hot_hits,
            cold_hits,
            misses,
            admission_evictions: e.admission_evictions - b.admission_evictions,
            admission_staged: e.admission_staged - b.admission_staged,
            staged_used_dropped: [
                after.staged.used - before.staged.used,
                after.staged.dropped - before.staged.dropped,
            ],
            cached_share: s.cached as f64 / s.prompt.max(1) as f64,
            ttft_ms: [p(&ttft, 0.5), p(&ttft, 0.95)],
            mean_ttft_ms: mean,
            replies_identical: true,
            wall_s: s.wall.as_secs_f64(),
            repetition: 0,
            turn_ttft_ms: s.ttft,
            turn_cache_blocks: s.turn_blocks,
            turn_arrival_blocks: s.arrival,
            shifted_turn_hot_hit_rate: shifted_rate,
        };
        out.push((figures, s.replies));
    }
    Ok((0, 0, out))
}

/// Measures the working set, then every policy (`[eviction]` as JSON; [`policies`] by default)
/// at `hot_share` of it, `repeat` times. Each run is a fresh state per policy. Sequential: one
/// policy per run, in the given order in even repetitions and reversed in odd ones.
/// Interleaved: every policy in one run, each turn sent to every policy before the next turn
/// (the order flipping from turn to turn and from repetition to repetition), so that the
/// machine's drift over minutes weighs on every policy alike. Replies are compared with the
/// first policy's in the first repetition.
pub async fn compare(
    model: &Path,
    dir: &Path,
    load: Load,
    policies: &[serde_json::Value],
    repeat: usize,
    interleave: bool,
) -> anyhow::Result<EvictionFigures> {
    let none: Arm = (json!({}), None);
    let (blocks, bytes, _) = run(model, &dir.join("ws"), load, &[none], false).await?;
    let mib = |share: f64| ((bytes as f64 * share) / (1u64 << 20) as f64).ceil() as u64;
    let hot_mib = mib(load.hot_share);
    let cold_mib = (load.cold_share > 0.0).then(|| mib(load.cold_share).max(1));
    // Not an `[eviction]` key: a policy's own hot share (1.0: every block hot, the bound no
    // eviction can beat).
    let arm = |policy: &serde_json::Value| -> Arm {
        let hot = policy["hot_share"].as_f64().map_or(hot_mib, mib).max(1);
        (policy.clone(), Some((hot, cold_mib)))
    };
    let mut out: Vec<PolicyFigures> = Vec::new();
    let mut first: Option<Vec<String>> = None;
    for r in 0..repeat.max(1) {
        let mut runs: Vec<Vec<usize>> = if interleave {
            vec![(0..policies.len()).collect()]
        } else {
            (0..policies.len()).map(|i| vec![i]).collect()
        };
        if r % 2 == 1 && !interleave {
            runs.reverse();
        }
        for (n, run_of) in runs.iter().enumerate() {
            let arms: Vec<Arm> = run_of.iter().map(|&i| arm(&policies[i])).collect();
            let (_, _, got) = run(
                model,
                &dir.join(format!("r{r}n{n}")),
                load,
                &arms,
                r % 2 == 1,
            )
            .await?;
            anyhow::ensure!(got.len() == run_of.len(), "no steady figures");
            for (&i, (mut f, replies)) in run_of.iter().zip(got) {
                f.repetition = r;
                if i == 0 && first.is_none() {
                    first = Some(replies);
                } else if let Some(reference) = &first {
                    f.replies_identical = *reference == replies;
                } else {
                    // The first policy runs first in the first repetition.
                    anyhow::bail!("no reference replies");
                }
                eprintln!(
                    "engram-bench eviction: repetition {r}, {} hot hit rate {:.3} (turns' prompts {:.3}, on arrival {:.3}), TTFT p50 {:.1} ms",
                    f.eviction,
                    f.hot_hit_rate,
                    f.turn_hot_hit_rate,
                    f.arrival_hot_hit_rate,
                    f.ttft_ms[0]
                );
                out.push(f);
            }
        }
    }
    let ttft = compare_ttft(&out, policies);
    Ok(EvictionFigures {
        load,
        working_set_blocks: blocks,
        working_set_bytes: bytes,
        hot_mib,
        cold_mib,
        interleaved: interleave,
        policies: out,
        ttft,
    })
}

/// Bootstrap resamples of [`compare_ttft`]'s intervals.
const RESAMPLES: usize = 2000;

/// Every policy after the first against the first ([`TtftComparison`]).
pub fn compare_ttft(runs: &[PolicyFigures], policies: &[serde_json::Value]) -> Vec<TtftComparison> {
    let of = |policy: &serde_json::Value| -> Vec<&PolicyFigures> {
        let mut v: Vec<_> = runs.iter().filter(|f| f.eviction == *policy).collect();
        v.sort_by_key(|f| f.repetition);
        v
    };
    let Some(reference) = policies.first() else {
        return Vec::new();
    };
    let base = of(reference);
    policies[1..]
        .iter()
        .map(|policy| {
            let other = of(policy);
            let mut pairs = Vec::new();
            let mut per_rep = Vec::new();
            for (a, b) in base.iter().zip(&other) {
                pairs.extend(
                    a.turn_ttft_ms
                        .iter()
                        .copied()
                        .zip(b.turn_ttft_ms.iter().copied()),
                );
                per_rep.push(b.ttft_ms[0] / a.ttft_ms[0].max(f64::MIN_POSITIVE));
            }
            ttft_pairs(policy.clone(), &pairs, per_rep)
        })
        .collect()
}

/// Figures of `pairs` (the first policy's TTFT, this one's), with intervals from
/// [`RESAMPLES`] resamples of the pairs (seeded: the same pairs give the same intervals).
fn ttft_pairs(
    eviction: serde_json::Value,
    pairs: &[(f64, f64)],
    p50_ratio_per_repetition: Vec<f64>,
) -> TtftComparison {
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        p(&v, 0.5)
    };
    let p50s = |s: &[(f64, f64)]| {
        [
            median(s.iter().map(|x| x.0).collect()),
            median(s.iter().map(|x| x.1).collect()),
        ]
    };
    let p50_ratio = |s: &[(f64, f64)]| {
        let [a, b] = p50s(s);
        b / a.max(f64::MIN_POSITIVE)
    };
    let paired =
        |s: &[(f64, f64)]| median(s.iter().map(|x| x.1 / x.0.max(f64::MIN_POSITIVE)).collect());
    let mut rng = SplitMix64::new(0x0077_47f7);
    let (mut r1, mut r2) = (Vec::with_capacity(RESAMPLES), Vec::with_capacity(RESAMPLES));
    if !pairs.is_empty() {
        let mut s = vec![(0.0, 0.0); pairs.len()];
        for _ in 0..RESAMPLES {
            for x in s.iter_mut() {
                *x = pairs[(rng.next_u64() % pairs.len() as u64) as usize];
            }
            r1.push(p50_ratio(&s));
            r2.push(paired(&s));
        }
    }
    r1.sort_by(f64::total_cmp);
    r2.sort_by(f64::total_cmp);
    TtftComparison {
        eviction,
        pairs: pairs.len(),
        p50_ms: p50s(pairs),
        p50_ratio: [p50_ratio(pairs), p(&r1, 0.025), p(&r1, 0.975)],
        paired_median_ratio: [paired(pairs), p(&r2, 0.025), p(&r2, 0.975)],
        lower_share: pairs.iter().filter(|x| x.1 < x.0).count() as f64 / pairs.len().max(1) as f64,
        p50_ratio_per_repetition,
    }
}

#[cfg(test)]
mod tests {
    use super::{PolicyFigures, SplitMix64, compare_ttft, json, shifted, sum_blocks, ttft_pairs};

    #[test]
    fn a_shift_swaps_busy_and_occasional_agents_and_blocks_sum_per_kind() {
        // Unshifted, rank k is agent k; shifted, the busiest rank draws agent 6 of 12 and the
        // ranks keep distinct agents.
        assert_eq!(shifted(0, 12, false), 0);
        assert_eq!(shifted(0, 12, true), 6);
        assert_eq!(shifted(7, 12, true), 1);
        let mut agents: Vec<usize> = (0..12).map(|k| shifted(k, 12, true)).collect();
        agents.sort_unstable();
        assert_eq!(agents, (0..12).collect::<Vec<_>>());
        assert_eq!(sum_blocks(&[[1, 2, 3], [10, 0, 5]]), [11, 2, 8]);
        assert_eq!(sum_blocks(&[]), [0, 0, 0]);
    }

    #[test]
    fn ttft_ratios_pair_turns_and_bracket_the_estimate() {
        // This policy takes 0.9× the first's time on every turn, whatever the turn costs.
        let pairs: Vec<(f64, f64)> = (0..200)
            .map(|i| {
                let a = 100.0 + f64::from(i % 37) * 7.0;
                (a, a * 0.9)
            })
            .collect();
        let c = ttft_pairs(json!({"mode": "attention"}), &pairs, vec![0.9]);
        assert_eq!(c.pairs, 200);
        assert!((c.paired_median_ratio[0] - 0.9).abs() < 1e-12, "{c:?}");
        // Every resample's paired ratio is 0.9: the interval is a point.
        assert!((c.paired_median_ratio[1] - 0.9).abs() < 1e-12, "{c:?}");
        assert!((c.paired_median_ratio[2] - 0.9).abs() < 1e-12, "{c:?}");
        assert!((c.p50_ratio[0] - 0.9).abs() < 0.02, "{c:?}");
        assert!(
            c.p50_ratio[1] <= c.p50_ratio[0] && c.p50_ratio[0] <= c.p50_ratio[2],
            "{c:?}"
        );
        assert_eq!(c.lower_share, 1.0);
        // Noise around no difference: the paired interval holds 1.
        let mut rng = SplitMix64::new(3);
        let pairs: Vec<(f64, f64)> = (0..400)
            .map(|_| {
                let a = 100.0 + rng.next_open01() * 50.0;
                (a, a * (0.95 + 0.1 * rng.next_open01()))
            })
            .collect();
        let c = ttft_pairs(json!({}), &pairs, vec![]);
        assert!(
            c.paired_median_ratio[1] < 1.0 && c.paired_median_ratio[2] > 1.0,
            "{c:?}"
        );
        assert!(
            c.paired_median_ratio[2] - c.paired_median_ratio[1] < 0.02,
            "{c:?}"
        );
    }

    #[test]
    fn repetitions_pair_with_the_first_policy_of_the_same_repetition() {
        let run = |policy: &serde_json::Value, rep: usize, scale: f64| PolicyFigures {
            eviction: policy.clone(),
            turns: 3,
            hot_hit_rate: 0.0,
            turn_hot_hit_rate: 0.0,
            turn_blocks: [0; 3],
            arrival_hot_hit_rate: 0.0,
            arrival_blocks: [0; 2],
            hot_hits: 0,
            cold_hits: 0,
            misses: 0,
            admission_evictions: 0,
            admission_staged: 0,
            staged_used_dropped: [0; 2],
            cached_share: 0.0,
            ttft_ms: [200.0 * scale, 0.0],
            mean_ttft_ms: 0.0,
            replies_identical: true,
            wall_s: 0.0,
            repetition: rep,
            turn_ttft_ms: vec![100.0 * scale, 200.0 * scale, 300.0 * scale],
            turn_cache_blocks: Vec::new(),
            turn_arrival_blocks: Vec::new(),
            shifted_turn_hot_hit_rate: None,
        };
        let (a, b) = (json!({"mode": "priority"}), json!({"mode": "attention"}));
        // Repetition 1 ran reversed and slower (drift): pairs stay within a repetition.
        let runs = vec![
            run(&a, 0, 1.0),
            run(&b, 0, 0.8),
            run(&b, 1, 1.6),
            run(&a, 1, 2.0),
        ];
        let c = compare_ttft(&runs, &[a, b.clone()]);
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].eviction, b);
        assert_eq!(c[0].pairs, 6);
        assert!((c[0].paired_median_ratio[0] - 0.8).abs() < 1e-12, "{c:?}");
        assert_eq!(c[0].p50_ratio_per_repetition, vec![0.8, 0.8]);
        assert_eq!(c[0].lower_share, 1.0);
    }
}
