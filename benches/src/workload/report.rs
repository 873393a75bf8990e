//! The workload report: per scenario and server, TTFT percentiles, time per output token, cached share,
//! errors and wall time per repetition, their spread over repetitions, the Engram/peer ratios,
//! and SVG plots (TTFT distribution, TTFT by turn index).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use serde::Serialize;

use super::RunResult;

/// The `q` quantile (0..=1) of sorted values, linear between ranks.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let at = q.clamp(0.0, 1.0) * (sorted.len() - 1) as f64;
    let (lo, hi) = (at.floor() as usize, at.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (at - lo as f64)
}

/// Figures of one repetition.
#[derive(Debug, Clone, Serialize)]
pub struct RepStats {
    /// Repetition.
    pub rep: usize,
    /// Requests that succeeded.
    pub ok: usize,
    /// Requests that failed.
    pub errors: usize,
    /// TTFT p50, ms.
    pub ttft_p50: f64,
    /// TTFT p95, ms.
    pub ttft_p95: f64,
    /// TTFT p99, ms.
    pub ttft_p99: f64,
    /// Time per output token, ms: the mean over requests of each stream's mean gap between
    /// content deltas after the first (the stream's own arrival times; a server's work after
    /// its last token, such as a prompt-cache save, does not count).
    pub tpot_ms: f64,
    /// Cached prompt tokens over prompt tokens (endpoints that report both).
    pub cached_share: Option<f64>,
    /// Wall time of all measured requests, ms.
    pub wall_ms: f64,
    /// TTFT p50 of the requests after the restart, ms.
    pub after_restart_ttft_p50: Option<f64>,
    /// Restart plus wait until the endpoint answered, ms.
    pub restart_ms: Option<f64>,
    /// The probe's prompt tokens.
    pub probe_prompt_tokens: Option<u64>,
    /// Mean prompt tokens per measured request (endpoints that report them).
    pub prompt_tokens: Option<f64>,
}

/// Mean and range of a figure over repetitions.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Spread {
    /// Mean.
    pub mean: f64,
    /// Smallest.
    pub min: f64,
    /// Largest.
    pub max: f64,
}

impl Spread {
    fn of(v: impl IntoIterator<Item = f64>) -> Option<Self> {
        let v: Vec<f64> = v.into_iter().filter(|x| x.is_finite()).collect();
        if v.is_empty() {
            return None;
        }
        Some(Self {
            mean: v.iter().sum::<f64>() / v.len() as f64,
            min: v.iter().copied().fold(f64::INFINITY, f64::min),
            max: v.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        })
    }

    fn show(s: Option<Self>, digits: usize) -> String {
        match s {
            None => "n/a".into(),
            Some(s) if s.max - s.min < 10f64.powi(-(digits as i32)) => {
                format!("{:.digits$}", s.mean)
            }
            Some(s) => format!(
                "{:.digits$} ({:.digits$}–{:.digits$})",
                s.mean, s.min, s.max
            ),
        }
    }
}

/// One server in one scenario.
#[derive(Debug, Clone, Serialize)]
pub struct ServerSummary {
    /// Label.
    pub label: String,
    /// Per repetition.
    pub reps: Vec<RepStats>,
    /// TTFT p50 over repetitions.
    pub ttft_p50: Option<Spread>,
    /// TTFT p95.
    pub ttft_p95: Option<Spread>,
    /// TTFT p99.
    pub ttft_p99: Option<Spread>,
    /// Time per output token, ms.
    pub tpot_ms: Option<Spread>,
    /// Cached share.
    pub cached_share: Option<Spread>,
    /// Wall time.
    pub wall_ms: Option<Spread>,
    /// TTFT p50 after the restart.
    pub after_restart_ttft_p50: Option<Spread>,
    /// Mean prompt tokens per request.
    pub prompt_tokens: Option<Spread>,
    /// Mean TTFT by turn index (all repetitions), ms.
    pub ttft_by_turn: Vec<f64>,
}

/// One scenario.
#[derive(Debug, Clone, Serialize)]
pub struct ScenarioSummary {
    /// Workload name.
    pub workload: String,
    /// What it models.
    pub description: String,
    /// Requests per run.
    pub requests: usize,
    /// Servers, in label order.
    pub servers: Vec<ServerSummary>,
    /// `peer TTFT p50 / Engram TTFT p50` etc., against each other server (`> 1`: Engram faster).
    pub ratios: Vec<Ratio>,
}

/// Engram (or the reference label) against one peer.
#[derive(Debug, Clone, Serialize)]
pub struct Ratio {
    /// The label the ratios are of (Engram's runs, or the variant `--engram-label` names).
    pub of: String,
    /// The peer's label.
    pub peer: String,
    /// Peer TTFT p50 over Engram's, per repetition pair (mean and range).
    pub ttft_p50: Option<Spread>,
    /// Peer TTFT p95 over Engram's.
    pub ttft_p95: Option<Spread>,
    /// Peer wall time over Engram's (end to end).
    pub wall: Option<Spread>,
    /// Peer time per output token over Engram's.
    pub tpot: Option<Spread>,
    /// Peer TTFT p50 after the restart over Engram's.
    pub after_restart_ttft_p50: Option<Spread>,
    /// Engram's mean prompt tokens per request over the peer's: the servers computed the same
    /// prompts only when it is close to 1 (see [`COMPARABLE`]).
    pub prompt_tokens: Option<Spread>,
}

/// How far apart the servers' mean prompt tokens per request may be (as a ratio) for their
/// TTFTs to compare like with like; the report flags a scenario beyond it.
pub const COMPARABLE: f64 = 0.05;

/// The whole report.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Scenarios, in the order first seen.
    pub scenarios: Vec<ScenarioSummary>,
}

fn rep_stats(r: &RunResult) -> RepStats {
    let ok: Vec<_> = r.requests.iter().filter(|q| q.error.is_none()).collect();
    let mut ttft: Vec<f64> = ok.iter().filter_map(|q| q.ttft_ms).collect();
    ttft.sort_by(f64::total_cmp);
    let gaps: Vec<f64> = ok.iter().filter_map(|q| q.itl_ms).collect();
    let reported: Vec<_> = ok
        .iter()
        .filter_map(|q| Some((q.prompt_tokens?, q.cached_tokens?)))
        .collect();
    let prompt: u64 = reported.iter().map(|x| x.0).sum();
    let mut after: Vec<f64> = ok
        .iter()
        .filter(|q| q.after_restart)
        .filter_map(|q| q.ttft_ms)
        .collect();
    after.sort_by(f64::total_cmp);
    RepStats {
        rep: r.rep,
        ok: ok.len(),
        errors: r.requests.len() - ok.len(),
        ttft_p50: quantile(&ttft, 0.50),
        ttft_p95: quantile(&ttft, 0.95),
        ttft_p99: quantile(&ttft, 0.99),
        tpot_ms: if gaps.is_empty() {
            f64::NAN
        } else {
            gaps.iter().sum::<f64>() / gaps.len() as f64
        },
        cached_share: (prompt > 0)
            .then(|| reported.iter().map(|x| x.1).sum::<u64>() as f64 / prompt as f64),
        wall_ms: r.wall_ms,
        after_restart_ttft_p50: (!after.is_empty()).then(|| quantile(&after, 0.5)),
        restart_ms: r.restart_ms,
        probe_prompt_tokens: r.probe_prompt_tokens,
        prompt_tokens: (!reported.is_empty()).then(|| prompt as f64 / reported.len() as f64),
    }
}

fn ratio(
    engram: &ServerSummary,
    peer: &ServerSummary,
    f: impl Fn(&RepStats) -> Option<f64>,
    invert: bool,
) -> Option<Spread> {
    // Pair repetitions by number; a repetition missing on either side is left out.
    Spread::of(engram.reps.iter().filter_map(|e| {
        let p = peer.reps.iter().find(|p| p.rep == e.rep)?;
        let (e, p) = (f(e)?, f(p)?);
        let r = if invert { e / p } else { p / e };
        r.is_finite().then_some(r)
    }))
}

/// With two peers or more (two builds of llama.cpp, say), one more line: on each measure, the
/// ratio against the peer that did best there (the smallest mean ratio), so a result is never
/// read against the slower build of a peer. Its prompt-token ratio is the one furthest from 1.
fn with_best_peer(mut ratios: Vec<Ratio>) -> Vec<Ratio> {
    // Peers only: Engram's own variants (`engram-relocate`, or `engram` when a variant is the
    // reference) are not a server a user would pick instead.
    let peers: Vec<&Ratio> = ratios
        .iter()
        .filter(|r| !r.peer.starts_with("engram"))
        .collect();
    if peers.len() < 2 {
        return ratios;
    }
    let best = |f: fn(&Ratio) -> Option<Spread>| {
        peers
            .iter()
            .filter_map(|r| f(r))
            .min_by(|a, b| a.mean.total_cmp(&b.mean))
    };
    let line = Ratio {
        of: peers[0].of.clone(),
        peer: format!(
            "the better of {} on each measure",
            peers
                .iter()
                .map(|r| r.peer.as_str())
                .collect::<Vec<_>>()
                .join(" and ")
        ),
        ttft_p50: best(|r| r.ttft_p50),
        ttft_p95: best(|r| r.ttft_p95),
        wall: best(|r| r.wall),
        tpot: best(|r| r.tpot),
        after_restart_ttft_p50: best(|r| r.after_restart_ttft_p50),
        prompt_tokens: peers
            .iter()
            .filter_map(|r| r.prompt_tokens)
            .max_by(|a, b| (a.mean - 1.0).abs().total_cmp(&(b.mean - 1.0).abs())),
    };
    ratios.push(line);
    ratios
}

/// Summarizes runs (any number of scenarios, servers and repetitions).
pub fn summarize(runs: &[RunResult], engram_label: &str) -> Report {
    let mut order: Vec<String> = Vec::new();
    let mut by: BTreeMap<(String, String), Vec<&RunResult>> = BTreeMap::new();
    for r in runs {
        if !order.contains(&r.workload) {
            order.push(r.workload.clone());
        }
        by.entry((r.workload.clone(), r.label.clone()))
            .or_default()
            .push(r);
    }
    let scenarios = order
        .iter()
        .map(|w| {
            let servers: Vec<ServerSummary> = by
                .iter()
                .filter(|((ww, _), _)| ww == w)
                .map(|((_, label), rs)| {
                    let reps: Vec<RepStats> = rs.iter().map(|r| rep_stats(r)).collect();
                    let turns = rs
                        .iter()
                        .flat_map(|r| r.requests.iter().map(|q| q.turn + 1))
                        .max()
                        .unwrap_or(0);
                    let ttft_by_turn = (0..turns)
                        .map(|t| {
                            let v: Vec<f64> = rs
                                .iter()
                                .flat_map(|r| r.requests.iter())
                                .filter(|q| q.turn == t && q.error.is_none())
                                .filter_map(|q| q.ttft_ms)
                                .collect();
                            v.iter().sum::<f64>() / v.len().max(1) as f64
                        })
                        .collect();
                    ServerSummary {
                        label: label.clone(),
                        ttft_p50: Spread::of(reps.iter().map(|r| r.ttft_p50)),
                        ttft_p95: Spread::of(reps.iter().map(|r| r.ttft_p95)),
                        ttft_p99: Spread::of(reps.iter().map(|r| r.ttft_p99)),
                        tpot_ms: Spread::of(reps.iter().map(|r| r.tpot_ms)),
                        cached_share: Spread::of(reps.iter().filter_map(|r| r.cached_share)),
                        wall_ms: Spread::of(reps.iter().map(|r| r.wall_ms)),
                        after_restart_ttft_p50: Spread::of(
                            reps.iter().filter_map(|r| r.after_restart_ttft_p50),
                        ),
                        prompt_tokens: Spread::of(reps.iter().filter_map(|r| r.prompt_tokens)),
                        reps,
                        ttft_by_turn,
                    }
                })
                .collect();
            let ratios = match servers.iter().find(|s| s.label == engram_label) {
                Some(e) => servers
                    .iter()
                    .filter(|s| s.label != engram_label)
                    .map(|p| Ratio {
                        of: e.label.clone(),
                        peer: p.label.clone(),
                        ttft_p50: ratio(e, p, |r| Some(r.ttft_p50), false),
                        ttft_p95: ratio(e, p, |r| Some(r.ttft_p95), false),
                        wall: ratio(e, p, |r| Some(r.wall_ms), false),
                        tpot: ratio(e, p, |r| Some(r.tpot_ms), false),
                        after_restart_ttft_p50: ratio(e, p, |r| r.after_restart_ttft_p50, false),
                        prompt_tokens: ratio(e, p, |r| r.prompt_tokens, true),
                    })
                    .collect(),
                None => Vec::new(),
            };
            let ratios = with_best_peer(ratios);
            let first = runs.iter().find(|r| &r.workload == w);
            ScenarioSummary {
                workload: w.clone(),
                description: first
                    .map(|r| r.spec.description.clone())
                    .unwrap_or_default(),
                requests: first.map_or(0, |r| r.requests.len()),
                servers,
                ratios,
            }
        })
        .collect();
    Report { scenarios }
}

/// The Markdown summary.
pub fn markdown(report: &Report, header: &str) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "# Agent workload: Engram and its peers\n\n{header}\n");
    for s in &report.scenarios {
        let _ = writeln!(md, "## {}\n\n{}\n", s.workload, s.description);
        let _ = writeln!(
            md,
            "{} requests per run. Figures: mean over repetitions (range).\n",
            s.requests
        );
        md.push_str(
            "| server | reps | errors | TTFT p50 ms | TTFT p95 ms | TTFT p99 ms | ms per output token \
             | cached share | wall s | TTFT p50 after restart ms | prompt tokens per request \
             | probe prompt tokens |\n\
             |---|---|---|---|---|---|---|---|---|---|---|---|\n",
        );
        for v in &s.servers {
            let errors: usize = v.reps.iter().map(|r| r.errors).sum();
            let probe: Vec<String> = v
                .reps
                .iter()
                .map(|r| {
                    r.probe_prompt_tokens
                        .map_or("n/a".into(), |p| p.to_string())
                })
                .collect();
            let wall = v.wall_ms.map(|w| Spread {
                mean: w.mean / 1e3,
                min: w.min / 1e3,
                max: w.max / 1e3,
            });
            let _ = writeln!(
                md,
                "| {} | {} | {errors} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                v.label,
                v.reps.len(),
                Spread::show(v.ttft_p50, 1),
                Spread::show(v.ttft_p95, 1),
                Spread::show(v.ttft_p99, 1),
                Spread::show(v.tpot_ms, 2),
                Spread::show(v.cached_share, 3),
                Spread::show(wall, 1),
                Spread::show(v.after_restart_ttft_p50, 1),
                Spread::show(v.prompt_tokens, 0),
                probe.join(", "),
            );
        }
        for r in &s.ratios {
            let _ = writeln!(
                md,
                "\n{} against {}: TTFT p50 {}×, TTFT p95 {}×, end-to-end wall {}×, time per \
                 output token {}×, TTFT p50 after restart {}× (> 1: {} better).",
                r.of,
                r.peer,
                Spread::show(r.ttft_p50, 2),
                Spread::show(r.ttft_p95, 2),
                Spread::show(r.wall, 2),
                Spread::show(r.tpot, 2),
                Spread::show(r.after_restart_ttft_p50, 2),
                r.of,
            );
            if let Some(p) = r.prompt_tokens
                && (p.min < 1.0 - COMPARABLE || p.max > 1.0 + COMPARABLE)
            {
                let _ = writeln!(
                    md,
                    "\n**Not comparable:** {}'s requests carried {}× the prompt tokens of \
                     {}'s; the servers did not compute the same prompts.",
                    r.of,
                    Spread::show(Some(p), 2),
                    r.peer,
                );
            }
        }
        let _ = writeln!(
            md,
            "\n![TTFT distribution]({0}-ttft-cdf.svg) ![TTFT by turn]({0}-ttft-by-turn.svg)\n",
            s.workload
        );
    }
    md
}

const COLORS: [&str; 4] = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"];

/// A line chart as SVG: `series` of `(label, points)`, optional log-10 x axis.
fn svg_chart(
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[(String, Vec<(f64, f64)>)],
    log_x: bool,
) -> String {
    let (w, h, l, r, t, b) = (640.0, 400.0, 70.0, 30.0, 40.0, 50.0);
    let tx = |x: f64| if log_x { x.max(1e-3).log10() } else { x };
    let pts: Vec<(f64, f64)> = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|&(x, y)| (tx(x), y)))
        .filter(|(x, y)| x.is_finite() && y.is_finite())
        .collect();
    let (mut x0, mut x1) = pts.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |a, p| {
        (a.0.min(p.0), a.1.max(p.0))
    });
    let y1 = pts.iter().fold(0.0f64, |a, p| a.max(p.1)).max(1e-9) * 1.05;
    if !x0.is_finite() {
        (x0, x1) = (0.0, 1.0);
    }
    if log_x {
        (x0, x1) = (x0.floor(), x1.ceil().max(x0.floor() + 1.0));
    } else if x1 - x0 < 1e-9 {
        x1 = x0 + 1.0;
    }
    let px = |x: f64| l + (x - x0) / (x1 - x0) * (w - l - r);
    let py = |y: f64| h - b - y / y1 * (h - t - b);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" \
         font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" \
         fill=\"white\"/>\n<text x=\"{}\" y=\"22\" text-anchor=\"middle\" font-size=\"15\">{title}\
         </text>\n",
        w / 2.0
    );
    let _ = writeln!(
        s,
        "<line x1=\"{l}\" y1=\"{0}\" x2=\"{1}\" y2=\"{0}\" stroke=\"black\"/><line x1=\"{l}\" \
         y1=\"{t}\" x2=\"{l}\" y2=\"{0}\" stroke=\"black\"/>",
        h - b,
        w - r
    );
    let ticks: Vec<f64> = if log_x || x1 - x0 <= 12.0 {
        // Decades, or every integer of a short axis (turns).
        (x0.ceil() as i64..=x1.floor() as i64)
            .map(|e| e as f64)
            .collect()
    } else {
        (0..=5).map(|i| x0 + (x1 - x0) * i as f64 / 5.0).collect()
    };
    for x in ticks {
        let label = if log_x {
            format!("{}", 10f64.powf(x))
        } else {
            format!("{x:.0}")
        };
        let _ = writeln!(
            s,
            "<line x1=\"{0}\" y1=\"{1}\" x2=\"{0}\" y2=\"{2}\" stroke=\"#ccc\"/><text x=\"{0}\" \
             y=\"{3}\" text-anchor=\"middle\">{label}</text>",
            px(x),
            t,
            h - b,
            h - b + 16.0
        );
    }
    for i in 0..=4 {
        let y = y1 / 1.05 * i as f64 / 4.0;
        let _ = writeln!(
            s,
            "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{}</text>",
            l - 6.0,
            py(y) + 4.0,
            if y1 < 10.0 {
                format!("{y:.2}")
            } else {
                format!("{y:.0}")
            }
        );
    }
    let _ = writeln!(
        s,
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{x_label}</text>\n<text x=\"16\" y=\"{}\" \
         text-anchor=\"middle\" transform=\"rotate(-90 16 {})\">{y_label}</text>",
        (l + w - r) / 2.0,
        h - 12.0,
        (t + h - b) / 2.0,
        (t + h - b) / 2.0
    );
    for (i, (label, points)) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let path: Vec<String> = points
            .iter()
            .filter(|(x, y)| tx(*x).is_finite() && y.is_finite())
            .map(|&(x, y)| format!("{:.1},{:.1}", px(tx(x)), py(y)))
            .collect();
        let _ = writeln!(
            s,
            "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"2\" points=\"{}\"/>\n\
             <text x=\"{}\" y=\"{}\" fill=\"{color}\">{label}</text>",
            path.join(" "),
            l + 10.0,
            t + 16.0 + 16.0 * i as f64
        );
    }
    s.push_str("</svg>\n");
    s
}

/// Writes `report.json`, `report.md` and two SVG plots per scenario into `dir`.
pub fn write(
    runs: &[RunResult],
    engram_label: &str,
    header: &str,
    dir: &Path,
) -> std::io::Result<Report> {
    std::fs::create_dir_all(dir)?;
    let report = summarize(runs, engram_label);
    let json = serde_json::to_string_pretty(&report).map_err(std::io::Error::other)?;
    std::fs::write(dir.join("report.json"), json)?;
    std::fs::write(dir.join("report.md"), markdown(&report, header))?;
    for s in &report.scenarios {
        let cdf: Vec<(String, Vec<(f64, f64)>)> = s
            .servers
            .iter()
            .map(|v| {
                let mut t: Vec<f64> = runs
                    .iter()
                    .filter(|r| r.workload == s.workload && r.label == v.label)
                    .flat_map(|r| r.requests.iter().filter_map(|q| q.ttft_ms))
                    .collect();
                t.sort_by(f64::total_cmp);
                let n = t.len() as f64;
                let pts = t
                    .iter()
                    .enumerate()
                    .map(|(i, &x)| (x, (i + 1) as f64 / n))
                    .collect();
                (v.label.clone(), pts)
            })
            .collect();
        std::fs::write(
            dir.join(format!("{}-ttft-cdf.svg", s.workload)),
            svg_chart(
                &format!("{}: TTFT distribution", s.workload),
                "TTFT, ms (log scale)",
                "share of requests",
                &cdf,
                true,
            ),
        )?;
        let by_turn: Vec<(String, Vec<(f64, f64)>)> = s
            .servers
            .iter()
            .map(|v| {
                let pts = v
                    .ttft_by_turn
                    .iter()
                    .enumerate()
                    .map(|(i, &y)| ((i + 1) as f64, y))
                    .collect();
                (v.label.clone(), pts)
            })
            .collect();
        std::fs::write(
            dir.join(format!("{}-ttft-by-turn.svg", s.workload)),
            svg_chart(
                &format!("{}: mean TTFT by turn", s.workload),
                "turn of the session",
                "TTFT, ms",
                &by_turn,
                false,
            ),
        )?;
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::workload::{RequestRecord, Workload};

    fn run(label: &str, rep: usize, ttfts: &[f64]) -> RunResult {
        RunResult {
            workload: "w".into(),
            label: label.into(),
            rep,
            endpoint: String::new(),
            started_unix_ms: 0,
            wall_ms: ttfts.iter().sum::<f64>() + 100.0,
            probe_prompt_tokens: Some(42),
            restart_ms: None,
            spec: Workload::load("b").unwrap(),
            requests: ttfts
                .iter()
                .enumerate()
                .map(|(i, &t)| RequestRecord {
                    index: i,
                    session: "s".into(),
                    agent: "a".into(),
                    turn: i % 2,
                    start_ms: 0.0,
                    ttft_ms: Some(t),
                    itl_ms: Some(10.0),
                    total_ms: t + 150.0,
                    chunks: 16,
                    completion_tokens: 16,
                    prompt_tokens: Some(100),
                    cached_tokens: Some(if i == 0 { 0 } else { 80 }),
                    after_restart: false,
                    error: None,
                    text: String::new(),
                })
                .collect(),
        }
    }

    #[test]
    fn quantiles_interpolate() {
        let v = [1.0, 2.0, 3.0, 4.0, 5.0];
        assert_eq!(quantile(&v, 0.5), 3.0);
        assert_eq!(quantile(&v, 0.0), 1.0);
        assert_eq!(quantile(&v, 1.0), 5.0);
        assert!((quantile(&v, 0.95) - 4.8).abs() < 1e-12);
        assert!(quantile(&[], 0.5).is_nan());
    }

    #[test]
    fn ratios_pair_repetitions_and_report_the_spread() {
        let runs = vec![
            run("engram", 1, &[10.0, 20.0, 30.0]),
            run("engram", 2, &[20.0, 40.0, 60.0]),
            run("peer", 1, &[100.0, 200.0, 300.0]),
            run("peer", 2, &[100.0, 200.0, 300.0]),
        ];
        let r = summarize(&runs, "engram");
        let s = &r.scenarios[0];
        assert_eq!(s.servers.len(), 2);
        let e = &s.servers[0];
        assert_eq!(e.ttft_p50.unwrap().min, 20.0);
        assert_eq!(e.ttft_p50.unwrap().max, 40.0);
        // Cached share: 160 of 300 prompt tokens.
        assert!((e.cached_share.unwrap().mean - 160.0 / 300.0).abs() < 1e-12);
        // Time per output token: the streams' own gaps (10 ms), not (total − TTFT) / tokens.
        assert!((e.tpot_ms.unwrap().mean - 10.0).abs() < 1e-9);
        let ratio = s.ratios[0].ttft_p50.unwrap();
        assert_eq!((ratio.min, ratio.max), (5.0, 10.0));
        assert_eq!(e.ttft_by_turn, vec![30.0, 30.0]);
        let md = markdown(&r, "test");
        assert!(md.contains("| engram | 2 | 0 | 30.0 (20.0–40.0)"), "{md}");
        assert!(md.contains("TTFT p50 7.50 (5.00–10.00)×"), "{md}");
        // Both servers saw 100 prompt tokens a request: comparable.
        assert_eq!(s.ratios[0].prompt_tokens.unwrap().mean, 1.0);
        assert!(!md.contains("Not comparable"), "{md}");
    }

    #[test]
    fn servers_that_computed_other_prompts_are_flagged() {
        let mut short = run("engram", 1, &[10.0, 20.0]);
        for q in &mut short.requests {
            q.prompt_tokens = Some(73);
        }
        let runs = vec![short, run("peer", 1, &[50.0, 90.0])];
        let r = summarize(&runs, "engram");
        let p = r.scenarios[0].ratios[0].prompt_tokens.unwrap();
        assert!((p.mean - 0.73).abs() < 1e-12);
        let md = markdown(&r, "test");
        assert!(md.contains("| 73 | 42 |"), "{md}");
        assert!(
            md.contains("**Not comparable:** engram's requests carried 0.73×"),
            "{md}"
        );
        // The ratios name what they compare (a run may use another reference label).
        assert!(md.contains("\nengram against peer: TTFT p50"), "{md}");
        assert!(md.contains("(> 1: engram better)"), "{md}");
    }

    #[test]
    fn two_peers_give_a_line_against_the_better_one_on_each_measure() {
        // Peer `fast` has the shorter TTFT, peer `lean` the shorter token gaps.
        let mut lean = run("lean", 1, &[60.0, 100.0]);
        for q in &mut lean.requests {
            q.itl_ms = Some(5.0);
        }
        let runs = vec![
            run("engram", 1, &[10.0, 20.0]),
            // An Engram variant is no peer: it never wins the better-peer line.
            run("engram-relocate", 1, &[1.0, 2.0]),
            run("fast", 1, &[30.0, 50.0]),
            lean,
        ];
        let r = summarize(&runs, "engram");
        let ratios = &r.scenarios[0].ratios;
        assert_eq!(ratios.len(), 4);
        let best = &ratios[3];
        assert_eq!(best.peer, "the better of fast and lean on each measure");
        // TTFT against `fast` (40 / 15), time per token against `lean` (5 / 10).
        assert!((best.ttft_p50.unwrap().mean - 40.0 / 15.0).abs() < 1e-9);
        assert!((best.tpot.unwrap().mean - 0.5).abs() < 1e-9);
        let md = markdown(&r, "test");
        assert!(
            md.contains("engram against the better of fast and lean"),
            "{md}"
        );
    }

    #[test]
    fn plots_are_svg_with_one_line_per_server() {
        let runs = vec![
            run("engram", 1, &[10.0, 20.0]),
            run("peer", 1, &[50.0, 90.0]),
        ];
        let dir = std::env::temp_dir().join(format!("engram-report-{}", std::process::id()));
        write(&runs, "engram", "h", &dir).unwrap();
        for f in ["w-ttft-cdf.svg", "w-ttft-by-turn.svg"] {
            let svg = std::fs::read_to_string(dir.join(f)).unwrap();
            assert!(svg.starts_with("<svg"), "{f}");
            assert_eq!(svg.matches("<polyline").count(), 2, "{f}");
        }
        assert!(dir.join("report.md").is_file() && dir.join("report.json").is_file());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
