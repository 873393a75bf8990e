//! Bounded work per request (issue 64, item 5): an agent export streams in the memory of one
//! session, an import reads its file from the spool a block at a time, and one agent export per
//! tenant runs at a time. Four tenants export an agent of 1,000 sessions at once; the peak
//! resident set above the idle one is printed and bounded.

use std::io::{Read, Write};
use std::net::TcpStream;

use serde_json::{Value, json};

use crate::harness::{Server, sqlite_url};
use crate::shadow::{AXIOMS, config, turn};

/// Sessions of each agent.
const SESSIONS: usize = 1000;
/// Tenants exporting at once.
const EXPORTS: usize = 4;
/// The bound on the peak resident set above idle while they run.
const BOUND_MIB: f64 = 512.0;

fn status_kib(field: &str) -> f64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    s.lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{field} not in /proc/self/status"))
}

/// An agent file of `n` sessions of `k` blocks each, every block distinct (its tokens differ),
/// `k` the fewest that make the file at least `bytes` long, made from the first block of a real
/// agent export: the shape of a large agent without the turns that would compute it.
fn agent_file(one: &[u8], n: usize, bytes: usize) -> Vec<u8> {
    let len = u64::from_le_bytes(one[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&one[8..8 + len]).unwrap();
    let data = &one[8 + len..];
    let meta: Value =
        serde_json::from_str(header["__metadata__"]["engram.agent"].as_str().unwrap()).unwrap();
    let block_bytes = data.len() / meta["blocks"].as_array().unwrap().len();
    let k = bytes.div_ceil(n * block_bytes).max(1);
    let first = meta["blocks"][0].clone();
    let blocks: Vec<Value> = (0..n * k)
        .map(|i| {
            let mut b = first.clone();
            b["tokens"][0] = json!(1000 + i);
            b
        })
        .collect();
    let sessions: Vec<Value> = (0..n)
        .map(|i| {
            let rows: Vec<usize> = (i * k..(i + 1) * k).collect();
            json!({"name": format!("s{i}"), "stable_blocks": 0, "rows": rows})
        })
        .collect();
    let n = n * k;
    let mut agent = meta.clone();
    agent["blocks"] = json!(blocks);
    agent["sessions"] = json!(sessions);
    // Each tensor of the source: its first block's slice, repeated n times.
    let mut tensors: Vec<(String, Value)> = header
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    tensors.sort_by_key(|(_, v)| v["data_offsets"][0].as_u64().unwrap());
    let mut out_header = serde_json::Map::new();
    out_header.insert(
        "__metadata__".into(),
        json!({"engram.agent": agent.to_string()}),
    );
    let mut body = Vec::new();
    for (name, info) in &tensors {
        let (s, e) = (
            info["data_offsets"][0].as_u64().unwrap() as usize,
            info["data_offsets"][1].as_u64().unwrap() as usize,
        );
        let blocks = info["shape"][0].as_u64().unwrap() as usize;
        let per = (e - s) / blocks;
        let start = body.len();
        for _ in 0..n {
            body.extend_from_slice(&data[s..s + per]);
        }
        let mut shape = info["shape"].clone();
        shape[0] = json!(n);
        out_header.insert(
            name.clone(),
            json!({"dtype": "U8", "shape": shape, "data_offsets": [start, body.len()]}),
        );
    }
    let mut head = serde_json::to_vec(&Value::Object(out_header)).unwrap();
    head.resize(head.len().div_ceil(8) * 8, b' ');
    let mut file = (head.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(&head);
    file.extend_from_slice(&body);
    file
}

/// Downloads `path` without keeping it: its status, the bytes received and the
/// `content-length` announced.
fn drain(srv: &Server, path: &str, key: &str) -> (u16, u64, u64) {
    let mut s = TcpStream::connect(srv.addr).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\nauthorization: Bearer {key}\r\n\r\n"
    )
    .unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        s.read_exact(&mut byte).unwrap();
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head).to_lowercase();
    let status: u16 = head.split(' ').nth(1).unwrap().parse().unwrap();
    let announced = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length: "))
        .map_or(0, |v| v.trim().parse().unwrap());
    let mut buf = vec![0u8; 1 << 20];
    let mut got = 0u64;
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => got += n as u64,
        }
    }
    (status, got, announced)
}

#[test]
fn four_tenants_export_agents_of_a_thousand_sessions_in_bounded_memory() {
    // No shadow: the cold tier holds every tenant's agent (its pages are resident at idle),
    // and an export reads them from the engine a session at a time.
    let mut c = config(&sqlite_url(), None);
    c.model.cold_mib = Some(1024);
    c.server.import_limit_mib = 1024;
    c.limits.requests_per_sec = 0;
    let srv = Server::start_with(c);
    // A real block: one turn's cache, exported as an agent.
    let (seed, _) = srv.tenant_with_bot("seed", AXIOMS);
    turn(&srv, &seed, "a", "Hello there.");
    let (s, one) = srv.raw("GET", "/v1/agents/bot/cache/export", Some(&seed), b"");
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&one));
    let file = agent_file(&one, SESSIONS, 160 << 20);
    let keys: Vec<String> = (0..EXPORTS)
        .map(|i| {
            let (key, _) = srv.tenant_with_bot(&format!("t{i}"), AXIOMS);
            let (s, b) = srv.raw("POST", "/v1/agents/bot/cache/import", Some(&key), &file);
            let v: Value = serde_json::from_slice(&b).unwrap();
            assert_eq!(s, 200, "{v}");
            assert_eq!(v["sessions"], SESSIONS, "{v}");
            key
        })
        .collect();
    // A second export of the same tenant while one streams: refused.
    let mut slow = TcpStream::connect(srv.addr).unwrap();
    write!(
        slow,
        "GET /v1/agents/bot/cache/export HTTP/1.1\r\nhost: localhost\r\nauthorization: Bearer {}\r\n\r\n",
        keys[0]
    )
    .unwrap();
    let mut first = [0u8; 12];
    slow.read_exact(&mut first).unwrap();
    assert_eq!(&first, b"HTTP/1.1 200");
    let (s, e) = srv.call(
        "GET",
        "/v1/agents/bot/cache/export",
        Some(&keys[0]),
        Value::Null,
    );
    assert_eq!((s, e["code"].as_str()), (429, Some("rate_limited")), "{e}");
    drop(slow);
    std::thread::sleep(std::time::Duration::from_millis(500));

    // Idle, then the peak while four exports run at once (VmHWM reset first).
    let idle = status_kib("VmRSS:");
    std::fs::write("/proc/self/clear_refs", "5").unwrap();
    let results: Vec<(u16, u64, u64)> = std::thread::scope(|scope| {
        let handles: Vec<_> = keys
            .iter()
            .map(|k| scope.spawn(|| drain(&srv, "/v1/agents/bot/cache/export", k)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let peak = status_kib("VmHWM:");
    let file_mib = results[0].1 as f64 / 1048576.0;
    let above = (peak - idle) / 1024.0;
    println!(
        "agent export: {EXPORTS} at once, {SESSIONS} sessions, {file_mib:.1} MiB each; \
         resident set idle {:.1} MiB, peak {:.1} MiB, {above:.1} MiB above idle (bound {BOUND_MIB})",
        idle / 1024.0,
        peak / 1024.0
    );
    for (status, got, announced) in &results {
        assert_eq!(*status, 200);
        assert_eq!(got, announced, "the whole file arrived");
    }
    // Every export is the whole agent: more than the bound together, so holding them would
    // not fit in it.
    assert!(
        file_mib * EXPORTS as f64 > BOUND_MIB,
        "{file_mib:.1} MiB each is too small to test the bound"
    );
    assert!(above <= BOUND_MIB, "{above:.1} MiB above idle");
    srv.stop();
}
