//! `engram-bench shadow`: what the shadow is worth and what it costs, through the real app.
//!
//! Per session size (tokens of history), three tenants hold the same conversation (tenants never
//! share blocks, so each measures alone):
//! - **hot**: tenant 1's next turn in the process that computed the history;
//! - **recovered**: the process restarts with recovery on; tenant 2's next turn warms the
//!   recovered blocks;
//! - **cold**: the process restarts with recovery, replay and the read on a miss off; tenant 3's
//!   next turn prefills everything from the turn log. In that process `cache/load` then loads tenant 1's session from disk.
//!
//! - **evicted**: after its hot turn, tenant 1's session is evicted (`cache/evict`: written, then
//!   dropped from hot and cold); its next turn reads the blocks back from disk on the miss.
//! - **archived**: then tenant 1's session is archived (`cache/archive`: its KV deleted from
//!   memory and disk, a marker keeping its chain); its next turn thaws it by replaying its
//!   prefills from the turn log.
//!
//! Write throughput: the flush that wrote the three histories against a plain sequential write
//! (one file, `write_all` + `fsync`) of the same number of bytes. Steady load: the same scripted
//! short turns with the shadow flushing every `interval` and with the shadow off.

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use actix_web::{App, test, web};
use serde::Serialize;
use serde_json::{Value, json};

use engram_server::Config;
use engram_server::{build_state, configure_app};

const ADMIN: &str = crate::BENCH_ADMIN;

/// One session size.
#[derive(Debug, Clone, Serialize)]
pub struct SizeFigures {
    /// History tokens (prompt tokens of the measured turn, less the new message).
    pub prompt_tokens: u64,
    /// TTFT of the next turn: hot, after a recovering restart, after a restart without it.
    pub ttft_ms: [f64; 3],
    /// Prompt tokens reused in the same three turns.
    pub cached_tokens: [u64; 3],
    /// cold / recovered and cold / hot.
    pub speedup: [f64; 2],
    /// TTFT of the hot tenant's turn after `cache/evict` (its blocks dropped from hot and
    /// cold): read back from disk on the miss.
    pub evicted_ttft_ms: f64,
    /// Prompt tokens reused in that turn.
    pub evicted_cached_tokens: u64,
    /// cold / evicted.
    pub evicted_speedup: f64,
    /// TTFT of the hot tenant's next turn after `cache/archive` (its KV deleted from memory
    /// and disk): thawed by replaying its prefills from the turn log.
    pub archived_ttft_ms: f64,
    /// Prompt tokens reused in that turn (what the replay computed).
    pub archived_cached_tokens: u64,
    /// The archive marker's bytes over the entry bytes it replaced.
    pub archive_footprint: f64,
    /// archived / evicted: what the disk read saves over the archive's replay.
    pub evicted_vs_archived: f64,
    /// The recovering restart's recovery (all three tenants' entries), ms.
    pub recovery_ms: f64,
    /// `cache/load` of one session from disk into the cold tier, ms (engine side).
    pub load_ms: f64,
    /// The flush of the three sessions: bytes and ms.
    pub flush_bytes: u64,
    /// Its duration.
    pub flush_ms: f64,
    /// A plain sequential write + fsync of as many bytes, ms.
    pub plain_ms: f64,
}

/// Steady load with and without the shadow.
#[derive(Debug, Clone, Serialize)]
pub struct LoadFigures {
    /// Turns in each run.
    pub turns: usize,
    /// Flush interval of the shadowed run, ms.
    pub interval_ms: u64,
    /// Wall time with the shadow, and without, ms.
    pub wall_ms: [f64; 2],
    /// Flushes during the shadowed run.
    pub flushes: u64,
    /// Extra wall time of the shadowed run as a share of the other.
    pub overhead: f64,
}

fn config(model: &Path, dir: &Path, recover: bool, shadow: bool) -> Config {
    let mut c = Config::default();
    c.model.path = model.to_path_buf();
    c.database.url = format!("sqlite://{}/engram.db?mode=rwc", dir.display());
    c.auth.admin_key.0 = ADMIN.into();
    c.memory.enabled = false;
    c.tiers.enabled = false;
    c.shadow.enabled = shadow;
    c.shadow.dir = dir.join("shadow");
    c.shadow.recover = recover;
    c.shadow.interval_ms = 3_600_000;
    c
}

/// A message of about `tokens` tokens of varied prose.
fn filler(tokens: usize) -> String {
    const WORDS: [&str; 12] = [
        "river", "lantern", "orchard", "granite", "harbour", "meadow", "violin", "compass",
        "glacier", "library", "falcon", "ember",
    ];
    let mut s = String::from("Here are my notes; keep them in mind.\n");
    let mut i = 0usize;
    // About 12 tokens per sentence with this tokenizer; trimmed by the caller's count.
    while s.len() < tokens * 4 {
        s.push_str(&format!(
            "Note {i}: the {} near the {} was {} metres from the {}.\n",
            WORDS[i % 12],
            WORDS[(i * 5 + 3) % 12],
            (i * 37) % 1000,
            WORDS[(i * 7 + 1) % 12]
        ));
        i += 1;
    }
    s
}

/// Runs one turn; evaluates to `(ttft_ms, cached_tokens, prompt_tokens)`.
macro_rules! turn {
    ($app:expr, $key:expr, $session:expr, $message:expr, $max:expr) => {{
        let (s, v) = app_call!(
            $app,
            "POST",
            &format!("/v1/agents/bot/sessions/{}/turns", $session),
            $key,
            json!({"message": $message, "max_tokens": $max}),
        );
        anyhow::ensure!(s == 200, "turn: {v}");
        (
            v["ttft_ms"].as_f64().unwrap_or(0.0),
            v["usage"]["cached_tokens"].as_u64().unwrap_or(0),
            v["usage"]["prompt_tokens"].as_u64().unwrap_or(0),
        )
    }};
}

/// Measures one session size in `dir` (see the module docs).
pub async fn size(model: &Path, dir: &Path, tokens: usize) -> anyhow::Result<SizeFigures> {
    std::fs::create_dir_all(dir)?;
    let next = "Thanks. Which note mentions the falcon first?";
    // 1. Compute the history for three tenants, flush, and take tenant 1's next turn hot.
    let state = web::Data::new(build_state(config(model, dir, true, true)).await?);
    anyhow::ensure!(state.engine.is_some(), "no model: run `make models`");
    let app = test::init_service(App::new().configure(configure_app(state.clone()))).await;
    let engine = state.engine().map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut text = filler(tokens);
    let have = engine.tokenizer().encode(&text)?.len();
    if have > tokens {
        let keep = text.len() * tokens / have;
        text.truncate(text.floor_char_boundary(keep));
    }
    let mut keys = Vec::new();
    for t in 0..3 {
        let key = tenant!(&app, format!("t{t}"));
        turn!(&app, &key, "s", &text, 1);
        keys.push(key);
    }
    let shadow = state.shadow().map_err(|e| anyhow::anyhow!("{e}"))?;
    let flush = shadow.flush(engine, None).await?;
    let plain_ms = plain_write(&dir.join("plain.bin"), flush.bytes as usize)?;
    let hot = turn!(&app, &keys[0], "s", next, 1);
    // Tenant 1 evicted (saved, then dropped from hot and cold): its next turn reads the
    // session back from disk on the miss.
    let (s, ev) = app_call!(
        &app,
        "POST",
        "/v1/agents/bot/sessions/s/cache/evict",
        &keys[0],
        Value::Null
    );
    anyhow::ensure!(s == 200, "evict: {ev}");
    let evicted = turn!(&app, &keys[0], "s", "And which note mentions the ember?", 1);
    // Tenant 1 archived (its KV deleted from memory and disk, its chain kept as a marker): its
    // next turn thaws it by replaying its prefills from the turn log.
    let (s, ar) = app_call!(
        &app,
        "POST",
        "/v1/agents/bot/sessions/s/cache/archive",
        &keys[0],
        Value::Null
    );
    anyhow::ensure!(s == 200 && ar["archived"] == true, "archive: {ar}");
    let archived = turn!(
        &app,
        &keys[0],
        "s",
        "And which note mentions the glacier?",
        1
    );
    let footprint = ar["marker_bytes"].as_f64().unwrap_or(0.0)
        / ar["entry_bytes"].as_f64().unwrap_or(1.0).max(1.0);
    // Thawed, it is written again (the restart below loads it from disk).
    let (s, sv) = app_call!(
        &app,
        "POST",
        "/v1/agents/bot/sessions/s/cache/save",
        &keys[0],
        Value::Null
    );
    anyhow::ensure!(s == 200, "save: {sv}");
    drop(app);
    state.store.close().await;
    drop(state);

    // 2. Restart with recovery: tenant 2's next turn.
    let state = web::Data::new(build_state(config(model, dir, true, true)).await?);
    let recovery_ms = state
        .shadow
        .as_ref()
        .map_or(0.0, |s| s.status().recovery_ms);
    let app = test::init_service(App::new().configure(configure_app(state.clone()))).await;
    let recovered = turn!(&app, &keys[1], "s", next, 1);
    drop(app);
    state.store.close().await;
    drop(state);

    // 3. Restart without recovery (and without replay: one prefill of the whole history, the
    //    plain recompute): tenant 3's next turn; then load tenant 1 from disk.
    let mut cold_config = config(model, dir, false, true);
    cold_config.shadow.replay = false;
    cold_config.shadow.read_on_miss = false;
    let state = web::Data::new(build_state(cold_config).await?);
    let app = test::init_service(App::new().configure(configure_app(state.clone()))).await;
    let cold = turn!(&app, &keys[2], "s", next, 1);
    let (s, load) = app_call!(
        &app,
        "POST",
        "/v1/agents/bot/sessions/s/cache/load",
        &keys[0],
        Value::Null
    );
    anyhow::ensure!(s == 200, "load: {load}");
    drop(app);
    state.store.close().await;
    drop(state);
    Ok(SizeFigures {
        prompt_tokens: cold.2,
        ttft_ms: [hot.0, recovered.0, cold.0],
        cached_tokens: [hot.1, recovered.1, cold.1],
        speedup: [cold.0 / recovered.0.max(1e-9), cold.0 / hot.0.max(1e-9)],
        evicted_ttft_ms: evicted.0,
        evicted_cached_tokens: evicted.1,
        evicted_speedup: cold.0 / evicted.0.max(1e-9),
        archived_ttft_ms: archived.0,
        archived_cached_tokens: archived.1,
        archive_footprint: footprint,
        evicted_vs_archived: archived.0 / evicted.0.max(1e-9),
        recovery_ms,
        load_ms: load["ms"].as_f64().unwrap_or(0.0),
        flush_bytes: flush.bytes,
        flush_ms: flush.ms,
        plain_ms,
    })
}

/// Writes `n` bytes to `path` in one sequential write and fsyncs; returns ms.
fn plain_write(path: &Path, n: usize) -> anyhow::Result<f64> {
    let data: Vec<u8> = (0..n).map(|i| (i * 31 % 251) as u8).collect();
    let t = Instant::now();
    let mut f = std::fs::File::create(path)?;
    f.write_all(&data)?;
    f.sync_all()?;
    let ms = t.elapsed().as_secs_f64() * 1e3;
    std::fs::remove_file(path)?;
    Ok(ms)
}

/// The same short turns with the shadow flushing every `interval_ms`, and with it off.
pub async fn steady(
    model: &Path,
    dir: &Path,
    turns: usize,
    interval_ms: u64,
) -> anyhow::Result<LoadFigures> {
    let mut wall = [0.0; 2];
    let mut flushes = 0;
    for (run, shadow) in [(0usize, true), (1, false)] {
        let d = dir.join(format!("steady-{run}"));
        std::fs::create_dir_all(&d)?;
        let mut c = config(model, &d, false, shadow);
        c.shadow.interval_ms = interval_ms;
        let state = web::Data::new(build_state(c).await?);
        engram_server::spawn_background(state.clone());
        let app = test::init_service(App::new().configure(configure_app(state.clone()))).await;
        let key = tenant!(&app, "steady");
        let t = Instant::now();
        for i in 0..turns {
            let msg = format!("Question {i}: name a colour and a number below {}.", i + 10);
            turn!(&app, &key, format!("s{}", i % 4), &msg, 8);
        }
        wall[run] = t.elapsed().as_secs_f64() * 1e3;
        if let Some(s) = &state.shadow {
            flushes = s.status().writes;
        }
        drop(app);
        state.store.close().await;
        drop(state);
        actix_web::rt::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(LoadFigures {
        turns,
        interval_ms,
        wall_ms: wall,
        flushes,
        overhead: wall[0] / wall[1] - 1.0,
    })
}

/// Recovery of a shadow larger than the cold tier, at one multiple of its capacity.
#[derive(Debug, Clone, Serialize)]
pub struct RecoveryMemory {
    /// Shadow bytes over cold-tier bytes.
    pub multiple: f64,
    /// Bytes of the shadow's segments.
    pub shadow_bytes: u64,
    /// Cold-tier capacity, bytes.
    pub cold_bytes: u64,
    /// Entries recovered into the cold tier, and left on disk (read on a miss).
    pub recovered: u64,
    /// Entries left on disk.
    pub on_disk: u64,
    /// Peak resident memory the restart (model load, tiers, recovery) added, MiB.
    pub peak_growth_mib: f64,
    /// The recovery's duration, ms.
    pub recovery_ms: f64,
}

/// Resident and peak resident memory of this process, KiB (Linux `/proc/self/status`).
fn rss_kib() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// Restarts over shadows of `sessions` sessions of ~`tokens` tokens with a cold tier of
/// `cold_mib`, one run per entry of `sessions`: the peak memory the restart adds, against the
/// shadow's size (flat when recovery streams entry by entry and stops at the cold capacity).
/// The peak is reset before each restart (`/proc/self/clear_refs`, 5).
pub async fn recovery_memory(
    model: &Path,
    dir: &Path,
    cold_mib: u64,
    tokens: usize,
    sessions: &[usize],
) -> anyhow::Result<Vec<RecoveryMemory>> {
    let mut out = Vec::new();
    let text = filler(tokens);
    for &n in sessions {
        let d = dir.join(format!("recovery-{n}"));
        std::fs::create_dir_all(&d)?;
        let mut c = config(model, &d, true, true);
        c.model.cold_mib = Some(cold_mib);
        let state = web::Data::new(build_state(c.clone()).await?);
        let app = test::init_service(App::new().configure(configure_app(state.clone()))).await;
        let key = tenant!(&app, "recovery");
        for s in 0..n {
            turn!(&app, &key, format!("s{s}"), &format!("{s}: {text}"), 1);
        }
        let shadow = state.shadow().map_err(|e| anyhow::anyhow!("{e}"))?;
        let engine = state.engine().map_err(|e| anyhow::anyhow!("{e}"))?;
        shadow.flush(engine, None).await?;
        let shadow_bytes = shadow.status().bytes_on_disk;
        drop(app);
        state.store.close().await;
        drop(state);
        actix_web::rt::time::sleep(Duration::from_millis(200)).await;
        let _ = std::fs::write("/proc/self/clear_refs", "5");
        let (before, _) = rss_kib();
        let state = web::Data::new(build_state(c).await?);
        let (_, peak) = rss_kib();
        let status = state
            .shadow
            .as_ref()
            .map(|s| s.status())
            .unwrap_or_default();
        let count = |k: &str| status.recovery_counts.get(k).copied().unwrap_or(0);
        out.push(RecoveryMemory {
            multiple: shadow_bytes as f64 / (cold_mib << 20) as f64,
            shadow_bytes,
            cold_bytes: cold_mib << 20,
            recovered: count("recovered"),
            on_disk: count("on_disk"),
            peak_growth_mib: peak.saturating_sub(before) as f64 / 1024.0,
            recovery_ms: status.recovery_ms,
        });
        state.store.close().await;
        drop(state);
        actix_web::rt::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(out)
}
