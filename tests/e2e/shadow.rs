//! A cache that survives: the real binary killed with SIGKILL while the shadow writes, again
//! and again, recovers byte-identical blocks or recomputes, and answers like a run that was never
//! killed; a flipped byte is detected; an evicted session is read back from disk on a miss; a
//! shadow larger than the cold tier recovers what fits. Cache files: `cache_files.rs`.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use engram_kvcore::SplitMix64;
use engram_server::Config;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::harness::{ADMIN, Server, model_path, sqlite_url};

const SESSIONS: [&str; 3] = ["s0", "s1", "s2"];
pub(crate) const AXIOMS: &str = "You are a terse assistant. Answer in one short sentence.";

pub(crate) fn message(i: usize) -> String {
    const TOPICS: [&str; 10] = [
        "the colour of the sky",
        "why bread rises",
        "the capital of France",
        "how a bicycle stays up",
        "what a prime number is",
        "the boiling point of water",
        "why leaves turn red",
        "what a compiler does",
        "how tides work",
        "the speed of sound",
    ];
    format!("Turn {i}: tell me about {}.", TOPICS[i % TOPICS.len()])
}

pub(crate) fn session_of(i: usize) -> &'static str {
    SESSIONS[i % SESSIONS.len()]
}

/// The server's session key: 32 bits of the agent over 32 bits of the session's name.
fn session_key(agent_id: &str, session: &str) -> u64 {
    let h = Sha256::digest(format!("{agent_id}/{session}").as_bytes());
    let a = Sha256::digest(format!("engram-agent\0{agent_id}").as_bytes());
    (u64::from(u32::from_le_bytes(a[..4].try_into().unwrap())) << 32)
        | u64::from(u32::from_le_bytes(h[..4].try_into().unwrap()))
}

pub fn fresh_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "engram-e2e-{name}-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Runs one turn (greedy, 8 tokens); returns the text and the cached prompt tokens.
pub(crate) fn turn(srv: &Server, key: &str, session: &str, msg: &str) -> (String, u64) {
    let v = turn_answer(srv, key, session, msg);
    (
        v["text"].as_str().unwrap().to_string(),
        v["usage"]["cached_tokens"].as_u64().unwrap(),
    )
}

/// [`turn`]'s whole answer.
fn turn_answer(srv: &Server, key: &str, session: &str, msg: &str) -> Value {
    let (s, v) = srv.call(
        "POST",
        &format!("/v1/agents/bot/sessions/{session}/turns"),
        Some(key),
        json!({"message": msg, "max_tokens": 8}),
    );
    assert_eq!(s, 200, "{v}");
    v
}

/// A turn's `cache` figures: blocks found hot, warmed from the cold tier, computed; checked
/// against its usage (16-token blocks: the reused blocks are the cached tokens, and the three
/// cover every full block of the prompt but the last token's).
fn turn_cache(v: &Value) -> [u64; 3] {
    let c = &v["cache"];
    let n = ["hot_blocks", "warmed_blocks", "computed_blocks"]
        .map(|k| c[k].as_u64().unwrap_or_else(|| panic!("no cache.{k}: {v}")));
    let usage = &v["usage"];
    assert_eq!(
        (n[0] + n[1]) * 16,
        usage["cached_tokens"].as_u64().unwrap(),
        "{v}"
    );
    assert_eq!(
        n.iter().sum::<u64>(),
        (usage["prompt_tokens"].as_u64().unwrap() - 1) / 16,
        "{v}"
    );
    n
}

/// A turn's `cache.arrival` figures: the prompt's leading blocks hot and cold when the turn
/// arrived, before any replay; never more than the prompt's full blocks.
fn turn_arrival(v: &Value) -> [u64; 2] {
    let a = &v["cache"]["arrival"];
    let n = ["hot_blocks", "cold_blocks"].map(|k| {
        a[k].as_u64()
            .unwrap_or_else(|| panic!("no cache.arrival.{k}: {v}"))
    });
    assert!(
        (n[0] + n[1]) * 16 <= v["usage"]["prompt_tokens"].as_u64().unwrap(),
        "{v}"
    );
    n
}

/// Where a test's shadow lives.
pub(crate) enum Backend {
    Local(PathBuf),
    #[cfg(feature = "s3")]
    S3(crate::storage::S3Server),
}

#[cfg(feature = "s3")]
const S3_URL: &str = "s3://engram-shadow/node-1";

impl Backend {
    fn configure(&self, c: &mut Config) {
        match self {
            Backend::Local(dir) => c.shadow.dir = dir.clone(),
            #[cfg(feature = "s3")]
            Backend::S3(s3) => {
                let s = s3.settings(S3_URL);
                c.shadow.url = s.url;
                c.shadow.s3_endpoint = s.endpoint;
                c.shadow.s3_region = s.region;
                c.shadow.s3_allow_http = true;
                let (id, secret) = s.credentials.unwrap();
                c.shadow.s3_access_key_id = id;
                c.shadow.s3_secret_access_key.0 = secret;
            }
        }
    }

    fn store(&self) -> std::sync::Arc<dyn engram_shadow::Storage> {
        let mut c = Config::default();
        self.configure(&mut c);
        engram_server::shadow_storage(&c).unwrap()
    }

    /// The directory holding the shadow's files as plain files (the S3 server's bucket).
    pub(crate) fn files(&self) -> PathBuf {
        match self {
            Backend::Local(dir) => dir.clone(),
            #[cfg(feature = "s3")]
            Backend::S3(s3) => s3.root.join("engram-shadow/node-1"),
        }
    }
}

pub(crate) fn config(url: &str, shadow: Option<&Path>) -> Config {
    config_with(
        url,
        shadow.map(|d| Backend::Local(d.to_path_buf())).as_ref(),
    )
}

pub(crate) fn config_with(url: &str, shadow: Option<&Backend>) -> Config {
    let mut c = Config::default();
    c.database.url = url.to_string();
    c.auth.admin_key.0 = ADMIN.into();
    c.model.path = model_path();
    c.model.hot_mib = Some(128);
    c.model.cold_mib = Some(128);
    c.memory.enabled = false;
    c.tiers.enabled = false;
    match shadow {
        Some(backend) => {
            backend.configure(&mut c);
            c.shadow.interval_ms = 3_600_000;
        }
        None => c.shadow.enabled = false,
    }
    c
}

/// The texts and cached prompt tokens of a never-killed, never-shadowed run of `n` scripted
/// turns.
fn reference(n: usize) -> Vec<(String, u64)> {
    let srv = Server::start_with(config(&sqlite_url(), None));
    let (key, _) = srv.tenant_with_bot("t", AXIOMS);
    let texts = (0..n)
        .map(|i| turn(&srv, &key, session_of(i), &message(i)))
        .collect();
    srv.stop();
    texts
}

/// `engram serve` as a child process writing its shadow every `interval_ms`.
fn spawn(url: &str, dir: &Path, interval_ms: u64) -> (Child, Server) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_engram-under-test"))
        .args(["serve", "--bind", "127.0.0.1:0", "--database-url", url])
        .env("ENGRAM__AUTH__ADMIN_KEY", ADMIN)
        .env("ENGRAM__MODEL__PATH", model_path())
        .env("ENGRAM__MODEL__HOT_MIB", "128")
        .env("ENGRAM__MODEL__COLD_MIB", "128")
        .env("ENGRAM__MEMORY__ENABLED", "false")
        .env("ENGRAM__TIERS__ENABLED", "false")
        .env("ENGRAM__SHADOW__DIR", dir)
        .env("ENGRAM__SHADOW__INTERVAL_MS", interval_ms.to_string())
        // 1 MiB/s: a turn's segment takes a few hundred ms to write, so kills land mid-write.
        .env("ENGRAM__SHADOW__MAX_WRITE_MIB_PER_SEC", "1")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, lines) = mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let addr: SocketAddr = loop {
        let line = lines.recv_timeout(Duration::from_secs(300)).unwrap();
        if let Some(a) = crate::harness::served_at(&line) {
            break a;
        }
    };
    (child, Server::at(addr))
}

pub(crate) fn shadow_status(srv: &Server) -> Value {
    let (s, v) = srv.call("GET", "/v1/admin/shadow", Some(ADMIN), Value::Null);
    assert_eq!(s, 200, "{v}");
    v
}

/// CRC-32C of each block of a session's export (blocks as they are in memory now).
pub(crate) fn export_crcs(srv: &Server, key: &str, session: &str) -> Vec<u32> {
    let (s, body) = srv.raw(
        "GET",
        &format!("/v1/agents/bot/sessions/{session}/cache/export"),
        Some(key),
        b"",
    );
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&body));
    let n = u64::from_le_bytes(body[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&body[8..8 + n]).unwrap();
    let meta: Value =
        serde_json::from_str(header["__metadata__"]["engram.session"].as_str().unwrap()).unwrap();
    meta["blocks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["crc32c"].as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn sigkill_during_shadow_writes_recovers_or_recomputes_and_answers_like_a_clean_run() {
    const ITERATIONS: usize = 30;
    let expected = reference(ITERATIONS);
    let url = sqlite_url();
    let dir = fresh_dir("shadow-crash");
    let mut rng = SplitMix64::new(0x5eed_2026_1121);
    let mut key = String::new();
    let mut agent_id = String::new();
    let mut counts: HashMap<String, u64> = HashMap::new();
    let (mut byte_identical, mut cached_after_restart, mut cleaned, mut replayed) = (0, 0, 0, 0);
    for (i, (want_text, want_cached)) in expected.iter().enumerate() {
        let (mut child, srv) = spawn(&url, &dir, 10);
        if i == 0 {
            let (k, a) = srv.tenant_with_bot("t", AXIOMS);
            key = k;
            agent_id = a["agent"]["id"].as_str().unwrap().to_string();
        } else {
            let status = shadow_status(&srv);
            cleaned += status["cleaned_files"].as_u64().unwrap();
            for e in status["recovery"].as_array().unwrap() {
                let outcome = e["outcome"].as_str().unwrap().to_string();
                if e["kind"] == "session" {
                    *counts.entry(outcome.clone()).or_default() += 1;
                }
                // Every entry either recovered or was skipped for a named reason.
                assert!(!outcome.is_empty());
                if e["kind"] != "session" || outcome != "recovered" {
                    continue;
                }
                let session = SESSIONS
                    .iter()
                    .find(|s| session_key(&agent_id, s) == e["session"].as_u64().unwrap())
                    .unwrap();
                // The blocks now in memory are the bytes the shadow wrote before the kill.
                let on_disk: Vec<u32> = e["crc32c"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|c| c.as_u64().unwrap() as u32)
                    .collect();
                let in_memory = export_crcs(&srv, &key, session);
                assert!(
                    in_memory.ends_with(&on_disk),
                    "session {session}: memory {in_memory:?} vs disk {on_disk:?}"
                );
                byte_identical += 1;
            }
        }
        let session = session_of(i);
        let (text, cached) = turn(&srv, &key, session, &message(i));
        assert_eq!(&text, want_text, "turn {i} ({session}) after {i} kills");
        // Recovered and replayed blocks give this turn exactly the reuse of the clean run.
        assert_eq!(cached, *want_cached, "turn {i} ({session}): cached tokens");
        if i >= SESSIONS.len() && cached > 0 {
            cached_after_restart += 1;
        }
        let (_, m) = srv.call("GET", "/metrics", Some(ADMIN), Value::Null);
        replayed += m
            .as_str()
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("engram_replayed_turns_total "))
            .and_then(|n| n.trim().parse::<u64>().ok())
            .unwrap();
        // SIGKILL at a random moment while the shadow writes this turn's blocks.
        std::thread::sleep(Duration::from_micros(rng.next_u64() % 300_000));
        child.kill().unwrap();
        child.wait().unwrap();
    }
    // A last start checks the final state the same way.
    let (mut child, srv) = spawn(&url, &dir, 10);
    let status = shadow_status(&srv);
    for e in status["recovery"].as_array().unwrap() {
        if e["kind"] == "session" {
            *counts
                .entry(e["outcome"].as_str().unwrap().to_string())
                .or_default() += 1;
        }
    }
    child.kill().unwrap();
    child.wait().unwrap();
    println!(
        "shadow crash loop: {ITERATIONS} SIGKILLs; session entries at restart: {counts:?}; \
         byte-identical checks {byte_identical}; turns with cached_tokens > 0 after a restart \
         {cached_after_restart}/{}; temp/orphan files cleaned {cleaned}; earlier turns \
         replayed to recompute lost blocks {replayed}",
        ITERATIONS - SESSIONS.len()
    );
    assert!(
        counts.get("recovered").copied().unwrap_or(0) > 0,
        "nothing was ever recovered: {counts:?}"
    );
    assert!(cached_after_restart > 0);
    assert!(cleaned > 0, "no kill landed during a write");
}

#[test]
fn a_flipped_byte_is_detected_and_that_session_recomputes_correctly() {
    flipped_byte(Backend::Local(fresh_dir("shadow-flip")));
}

/// The same through S3: objects on a real S3-compatible server, recovered at start.
#[cfg(feature = "s3")]
#[test]
fn through_s3_the_cache_survives_a_restart_and_a_flipped_byte_is_detected() {
    flipped_byte(Backend::S3(crate::storage::S3Server::start(
        "engram-shadow",
    )));
}

fn flipped_byte(backend: Backend) {
    let msgs = [
        "What is tea?",
        "And coffee?",
        "Name a fruit.",
        "Which is red?",
    ];
    // Never shadowed: x gets turns 0, 1, 3; y gets turn 2.
    let reference = {
        let srv = Server::start_with(config(&sqlite_url(), None));
        let (key, _) = srv.tenant_with_bot("t", AXIOMS);
        let out: Vec<String> = [("x", 0), ("x", 1), ("y", 2), ("x", 3)]
            .iter()
            .map(|&(s, i)| turn(&srv, &key, s, msgs[i]).0)
            .collect();
        srv.stop();
        out
    };
    let url = sqlite_url();
    let srv = Server::start_with(config_with(&url, Some(&backend)));
    let (key, a) = srv.tenant_with_bot("t", AXIOMS);
    let agent_id = a["agent"]["id"].as_str().unwrap().to_string();
    for (n, &(s, i)) in [("x", 0), ("x", 1), ("y", 2)].iter().enumerate() {
        assert_eq!(turn(&srv, &key, s, msgs[i]).0, reference[n]);
    }
    let (s, f) = srv.call("POST", "/v1/admin/shadow/flush", Some(ADMIN), Value::Null);
    assert_eq!(s, 200, "{f}");
    assert!(f["blocks"].as_u64().unwrap() > 0);
    srv.stop();
    let v = engram_shadow::verify(backend.store().as_ref()).unwrap();
    assert!(v.damaged.is_empty() && v.ok >= 2, "{v:?}");

    // Flip one byte in the middle of a segment of x's entry.
    let dir = backend.files();
    let x_entry = dir.join("entries").join(
        std::fs::read_dir(dir.join("entries"))
            .unwrap()
            .flatten()
            .map(|d| d.file_name().to_string_lossy().into_owned())
            .find(|n| n.ends_with(&format!("{:016x}", session_key(&agent_id, "x"))))
            .unwrap(),
    );
    let seg = std::fs::read_dir(&x_entry)
        .unwrap()
        .flatten()
        .map(|d| d.path())
        .find(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .unwrap();
    let mut bytes = std::fs::read(&seg).unwrap();
    let mid = bytes.len() - bytes.len() / 3;
    bytes[mid] ^= 0x10;
    std::fs::write(&seg, bytes).unwrap();
    let v = engram_shadow::verify(backend.store().as_ref()).unwrap();
    assert_eq!(v.damaged.len(), 1, "{v:?}");
    assert_eq!(v.damaged[0].1, "checksum");

    let srv = Server::start_with(config_with(&url, Some(&backend)));
    let status = shadow_status(&srv);
    let outcome = |session: &str| {
        status["recovery"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["session"].as_u64() == Some(session_key(&agent_id, session)))
            .map(|e| e["outcome"].as_str().unwrap().to_string())
            .unwrap()
    };
    assert_eq!(outcome("x"), "checksum");
    assert_eq!(outcome("y"), "recovered");
    assert_eq!(status["recovery_counts"]["checksum"], 1, "{status}");
    // x recomputes from the turn log (its two turns replayed as they first ran) and answers
    // exactly as the never-shadowed run did.
    let (text, _) = turn(&srv, &key, "x", msgs[3]);
    assert_eq!(text, reference[3]);
    let (_, m) = srv.call("GET", "/metrics", Some(ADMIN), Value::Null);
    let m = m.as_str().unwrap_or_default().to_string();
    assert!(
        m.contains("engram_shadow_recovery_total{result=\"checksum\"} 1"),
        "{m}"
    );
    // Turn 0's prompt and warm-up, then turn 1's: four prefills replayed.
    assert!(m.contains("engram_replayed_turns_total 4"), "{m}");
    srv.stop();
}

/// One chat completion of session `x` through the OpenAI route (greedy, 8 tokens); returns the
/// text and the cached prompt tokens.
fn chat(srv: &Server, key: &str, msg: &str) -> (String, u64) {
    let (s, v) = srv.call(
        "POST",
        "/v1/chat/completions",
        Some(key),
        json!({"model": "bot", "user": "x", "max_tokens": 8,
               "messages": [{"role": "user", "content": msg}]}),
    );
    assert_eq!(s, 200, "{v}");
    (
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string(),
        v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
    )
}

/// The OpenAI route with a `user` session takes the native route's steps: after a restart that
/// lost every block (no shadow), the session's earlier turns are replayed before its prompt is
/// built, so the answer and its reuse equal those of a run that never restarted.
#[test]
fn the_openai_route_replays_a_session_s_lost_turns_like_the_native_route() {
    let msgs = ["What is tea?", "And coffee?", "Which has more caffeine?"];
    let reference = {
        let srv = Server::start_with(config(&sqlite_url(), None));
        let (key, _) = srv.tenant_with_bot("t", AXIOMS);
        turn(&srv, &key, "x", msgs[0]);
        turn(&srv, &key, "x", msgs[1]);
        let out = chat(&srv, &key, msgs[2]);
        srv.stop();
        out
    };
    let url = sqlite_url();
    let srv = Server::start_with(config(&url, None));
    let (key, _) = srv.tenant_with_bot("t", AXIOMS);
    turn(&srv, &key, "x", msgs[0]);
    turn(&srv, &key, "x", msgs[1]);
    srv.stop();
    // The turn log survives the restart; the cache does not.
    let srv = Server::start_with(config(&url, None));
    let (text, cached) = chat(&srv, &key, msgs[2]);
    let (_, m) = srv.call("GET", "/metrics", Some(ADMIN), Value::Null);
    let m = m.as_str().unwrap_or_default().to_string();
    // Turn 0's prompt and warm-up, then turn 1's: four prefills replayed.
    assert!(m.contains("engram_replayed_turns_total 4"), "{m}");
    assert_eq!((text, cached), reference);
    srv.stop();
}

/// The value of a Prometheus sample line `name` (with its labels) in `/metrics`.
pub(crate) fn metric(srv: &Server, name: &str) -> u64 {
    let (_, m) = srv.call("GET", "/metrics", Some(ADMIN), Value::Null);
    let m = m.as_str().unwrap_or_default().to_string();
    m.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {m}"))
}

fn session_tiers(srv: &Server, key: &str, session: &str) -> Value {
    let (s, v) = srv.call(
        "GET",
        &format!("/v1/agents/bot/sessions/{session}/cache"),
        Some(key),
        Value::Null,
    );
    assert_eq!(s, 200, "{v}");
    v
}

#[test]
fn an_evicted_session_is_read_back_from_disk_on_a_miss_and_answers_like_a_hot_one() {
    let dir = fresh_dir("shadow-miss");
    let srv = Server::start_with(config(&sqlite_url(), Some(&dir)));
    // Tenants never share blocks: `hot` keeps its cache, `evicted` loses it.
    let (hot, _) = srv.tenant_with_bot("hot", AXIOMS);
    let (evicted, _) = srv.tenant_with_bot("evicted", AXIOMS);
    for i in 0..3 {
        assert_eq!(
            turn(&srv, &hot, "s", &message(i)),
            turn(&srv, &evicted, "s", &message(i))
        );
    }
    let replayed = metric(&srv, "engram_replayed_turns_total");
    let (s, ev) = srv.call(
        "POST",
        "/v1/agents/bot/sessions/s/cache/evict",
        Some(&evicted),
        Value::Null,
    );
    assert_eq!(s, 200, "{ev}");
    let dropped = ev["dropped"].as_u64().unwrap();
    assert!(ev["saved"].as_u64().unwrap() > 0 && dropped > 0, "{ev}");
    // Only the pinned stable prefix stays in memory.
    let tiers = session_tiers(&srv, &evicted, "s");
    assert_eq!(tiers["blocks"], ev["pinned"], "{tiers} after {ev}");
    // The next turn reads the session back from the shadow: nothing replayed, every block of
    // the conversation reused, the same answer as the session that never lost its cache.
    let want = turn_answer(&srv, &hot, "s", &message(3));
    let got = turn_answer(&srv, &evicted, "s", &message(3));
    assert_eq!(
        (&got["text"], &got["usage"]["cached_tokens"]),
        (&want["text"], &want["usage"]["cached_tokens"])
    );
    assert_eq!(
        metric(&srv, "engram_shadow_miss_reads_total{result=\"loaded\"}"),
        1
    );
    // The chain's blocks came back (the earlier prompts' volatile tails, dropped too, are in
    // no chain and were never needed again).
    let disk_hits = metric(&srv, "engram_cache_blocks_total{result=\"disk_hit\"}");
    assert!(
        disk_hits > 0 && disk_hits <= dropped,
        "{disk_hits} of {dropped}"
    );
    // The turn's answer says so: the blocks read back were warmed from the cold tier, the
    // session that kept its cache found its blocks hot; both computed the same new blocks.
    // When they arrived, the evicted session had only its pinned prefix (the read came
    // after); the other had every block admission then found.
    let (got_arrival, want_arrival) = (turn_arrival(&got), turn_arrival(&want));
    let (got, want) = (turn_cache(&got), turn_cache(&want));
    let pinned = ev["pinned"].as_u64().unwrap();
    assert_eq!(got_arrival, [pinned, 0], "{got:?}");
    assert_eq!(want_arrival, [want[0], want[1]]);
    assert!(got[1] >= disk_hits, "{got:?}, {disk_hits} read back");
    assert!(want[0] > got[0], "{want:?} against {got:?}");
    assert_eq!(got[2], want[2]);
    assert_eq!(metric(&srv, "engram_replayed_turns_total"), replayed);
    // A turn that misses nothing reads nothing.
    assert_eq!(
        turn(&srv, &evicted, "s", &message(4)),
        turn(&srv, &hot, "s", &message(4))
    );
    assert_eq!(
        metric(&srv, "engram_shadow_miss_reads_total{result=\"loaded\"}"),
        1
    );

    // A damaged entry is never served: a flipped byte in every segment of the evicted
    // tenant's entry fails the read (CRC), and the turn replays the session instead.
    let (s, ev) = srv.call(
        "POST",
        "/v1/agents/bot/sessions/s/cache/evict",
        Some(&evicted),
        Value::Null,
    );
    assert_eq!(s, 200, "{ev}");
    let mut flipped = 0;
    for entry in std::fs::read_dir(dir.join("entries")).unwrap() {
        let entry = entry.unwrap().path();
        if !entry
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("s-")
        {
            continue;
        }
        for seg in std::fs::read_dir(&entry).unwrap() {
            let seg = seg.unwrap().path();
            if seg
                .file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("seg-")
            {
                let mut bytes = std::fs::read(&seg).unwrap();
                let at = bytes.len() - 7;
                bytes[at] ^= 0x10;
                std::fs::write(&seg, bytes).unwrap();
                flipped += 1;
            }
        }
    }
    assert!(flipped > 0);
    assert_eq!(
        turn(&srv, &evicted, "s", &message(5)),
        turn(&srv, &hot, "s", &message(5))
    );
    assert_eq!(
        metric(&srv, "engram_shadow_miss_reads_total{result=\"failed\"}"),
        1
    );
    assert!(metric(&srv, "engram_replayed_turns_total") > replayed);
    // The damaged entry was removed: the next eviction writes the session whole again, and
    // the turn after it reads it back.
    let (s, ev) = srv.call(
        "POST",
        "/v1/agents/bot/sessions/s/cache/evict",
        Some(&evicted),
        Value::Null,
    );
    assert_eq!(s, 200, "{ev}");
    assert!(ev["saved"].as_u64().unwrap() >= disk_hits, "{ev}");
    assert_eq!(
        turn(&srv, &evicted, "s", &message(6)),
        turn(&srv, &hot, "s", &message(6))
    );
    assert_eq!(
        metric(&srv, "engram_shadow_miss_reads_total{result=\"loaded\"}"),
        2
    );
    srv.stop();

    // Without a shadow an eviction saves nothing and the next turn replays.
    let srv = Server::start_with(config(&sqlite_url(), None));
    let (key, _) = srv.tenant_with_bot("t", AXIOMS);
    turn(&srv, &key, "s", &message(0));
    let (s, ev) = srv.call(
        "POST",
        "/v1/agents/bot/sessions/s/cache/evict",
        Some(&key),
        Value::Null,
    );
    assert_eq!((s, ev["saved"].as_u64()), (200, Some(0)), "{ev}");
    assert!(ev["dropped"].as_u64().unwrap() > 0, "{ev}");
    let v = turn_answer(&srv, &key, "s", &message(1));
    assert_eq!(metric(&srv, "engram_replayed_turns_total"), 2);
    // The replay recomputed the lost blocks into the hot tier before the turn was admitted:
    // admission found them hot, the turn's arrival figures say they were gone.
    let (arrival, cache) = (turn_arrival(&v), turn_cache(&v));
    assert_eq!(arrival, [ev["pinned"].as_u64().unwrap(), 0], "{v}");
    assert!(cache[0] > arrival[0], "{v}");
    srv.stop();
}

#[test]
fn a_shadow_larger_than_the_cold_tier_recovers_what_fits_and_the_rest_on_a_miss() {
    let url = sqlite_url();
    let dir = fresh_dir("shadow-large");
    let srv = Server::start_with(config(&url, Some(&dir)));
    let (key, agent) = srv.tenant_with_bot("t", AXIOMS);
    let agent_id = agent["agent"]["id"].as_str().unwrap().to_string();
    let notes = "Summarise the following notes. ".repeat(24);
    let names = ["s0", "s1", "s2", "s3"];
    let mut prompts = Vec::new();
    for (i, name) in names.iter().enumerate() {
        turn(&srv, &key, name, &format!("{notes} ({i})"));
        prompts.push(turn(&srv, &key, name, &message(i)));
    }
    let (s, f) = srv.call("POST", "/v1/admin/shadow/flush", Some(ADMIN), Value::Null);
    assert_eq!(s, 200, "{f}");
    let on_disk_bytes = shadow_status(&srv)["bytes_on_disk"].as_u64().unwrap();
    srv.stop();

    // A node whose cold tier holds under half of the shadow.
    let mut small = config(&url, Some(&dir));
    small.model.cold_mib = Some(((on_disk_bytes / 3) >> 20).max(1));
    let srv = Server::start_with(small);
    let status = shadow_status(&srv);
    let counts = &status["recovery_counts"];
    assert!(
        counts["recovered"].as_u64().unwrap_or(0) >= 1
            && counts["on_disk"].as_u64().unwrap_or(0) >= 1,
        "{status}"
    );
    let (_, cache) = srv.call("GET", "/v1/admin/cache", Some(ADMIN), Value::Null);
    let occ = &cache["occupancy"];
    assert!(
        occ["cold_used"].as_u64().unwrap() <= occ["cold_capacity"].as_u64().unwrap(),
        "{cache}"
    );
    // The sessions written last were loaded first; a session left on disk is read back on its
    // next turn's miss and reuses its conversation.
    let left: Vec<u64> = status["recovery"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["outcome"] == "on_disk" && e["kind"] == "session")
        .map(|e| e["session"].as_u64().unwrap())
        .collect();
    let name = names
        .iter()
        .find(|n| left.contains(&session_key(&agent_id, n)))
        .unwrap_or_else(|| panic!("no session left on disk: {status}"));
    assert_ne!(
        *name, "s3",
        "the last written session is recovered first: {status}"
    );
    let (_, cached) = turn(&srv, &key, name, "And in one word?");
    assert_eq!(
        metric(&srv, "engram_shadow_miss_reads_total{result=\"loaded\"}"),
        1
    );
    let i = names.iter().position(|n| n == name).unwrap();
    let (_, before) = prompts[i];
    assert!(cached >= before, "{cached} cached after {before}");
    srv.stop();
}
