//! Server-side metrics through `prometheus-client`: the TTFT histogram, HTTP requests by route
//! and status, per-tenant turns, tokens and cache hits (a bounded set of tenant labels), replays
//! and the shadow's reads on a miss. `/metrics` registers these and the engine's, the shadow's
//! and the tier bridge's figures (read at the scrape) in one registry and answers the
//! OpenMetrics text format.

use std::collections::HashSet;
use std::sync::Mutex;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use serde::Serialize;

/// Upper bounds of the TTFT buckets, in seconds.
pub const TTFT_BUCKETS: [f64; 10] = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

/// Upper bounds of the HTTP latency buckets, in seconds.
pub const HTTP_BUCKETS: [f64; 12] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0,
];

/// The content type `/metrics` answers.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Label pairs.
pub type Labels = Vec<(String, String)>;

/// A family of histograms with a constructor of fixed buckets.
type Histograms = Family<Labels, Histogram, fn() -> Histogram>;

fn ttft_histogram() -> Histogram {
    Histogram::new(TTFT_BUCKETS)
}

fn http_histogram() -> Histogram {
    Histogram::new(HTTP_BUCKETS)
}

/// `[(k, v)]` as owned labels.
pub fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
        .collect()
}

/// How a turn's read of the shadow on a miss ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MissRead {
    /// The shadow held the session: its blocks went back into the cold tier.
    Loaded,
    /// The shadow holds nothing of the session (its blocks are recomputed).
    Absent,
    /// Another node's shadow (`shadow.peers`) held the session: loaded, and adopted into this
    /// node's shadow.
    Adopted,
    /// The shadow's entry could not be used (damaged, another model, a store error): the
    /// blocks are recomputed.
    Failed,
}

impl MissRead {
    const ALL: [Self; 4] = [Self::Loaded, Self::Absent, Self::Adopted, Self::Failed];

    fn label(self) -> &'static str {
        match self {
            Self::Loaded => "loaded",
            Self::Absent => "absent",
            Self::Adopted => "adopted",
            Self::Failed => "failed",
        }
    }
}

/// Metrics updated by handlers (cheap to update: atomics behind the families' locks).
#[derive(Debug)]
pub struct Metrics {
    ttft: Histogram,
    replayed_turns: Counter,
    disk_hit_blocks: Counter,
    miss_reads: Family<Labels, Counter>,
    archive: Family<Labels, Counter>,
    http_requests: Family<Labels, Counter>,
    http_latency: Histograms,
    tenant_turns: Family<Labels, Counter>,
    tenant_tokens: Family<Labels, Counter>,
    prefetch: Family<Labels, Counter>,
    prefetch_turns: Family<Labels, Counter>,
    /// Tenants with their own label; at most `tenant_cap`.
    labelled: Mutex<HashSet<String>>,
    tenant_cap: usize,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new(64)
    }
}

impl Metrics {
    /// Metrics that give at most `tenant_labels` tenants their own `tenant` label (the rest
    /// share `tenant="other"`).
    pub fn new(tenant_labels: usize) -> Self {
        let miss_reads = Family::default();
        for m in MissRead::ALL {
            drop(miss_reads.get_or_create(&labels(&[("result", m.label())])));
        }
        let archive = Family::default();
        for event in ["archived", "thawed"] {
            drop(archive.get_or_create(&labels(&[("event", event)])));
        }
        let prefetch = Family::default();
        for outcome in PrefetchOutcome::ALL {
            drop(prefetch.get_or_create(&labels(&[("outcome", outcome.label())])));
        }
        let prefetch_turns = Family::default();
        for result in ["hit", "miss"] {
            drop(prefetch_turns.get_or_create(&labels(&[("result", result)])));
        }
        Self {
            ttft: ttft_histogram(),
            replayed_turns: Counter::default(),
            disk_hit_blocks: Counter::default(),
            miss_reads,
            archive,
            http_requests: Family::default(),
            http_latency: Family::new_with_constructor(http_histogram),
            tenant_turns: Family::default(),
            tenant_tokens: Family::default(),
            prefetch,
            prefetch_turns,
            labelled: Mutex::new(HashSet::new()),
            tenant_cap: tenant_labels,
        }
    }

    /// The label a tenant's series carry: its id while fewer than the cap have one, else
    /// `other`.
    pub fn tenant_label(&self, tenant: &str) -> String {
        let Ok(mut seen) = self.labelled.lock() else {
            return "other".into();
        };
        if seen.contains(tenant) {
            return tenant.to_string();
        }
        if seen.len() < self.tenant_cap {
            seen.insert(tenant.to_string());
            return tenant.to_string();
        }
        "other".into()
    }

    /// One generation of `tenant`: its TTFT, its prompt tokens (cached: reused from the KV
    /// cache; prefilled: computed) and its completion tokens.
    pub fn observe_turn(
        &self,
        tenant: &str,
        cached: u64,
        prefilled: u64,
        completion: u64,
        ttft_ms: f64,
    ) {
        self.ttft.observe(ttft_ms / 1e3);
        let t = self.tenant_label(tenant);
        self.tenant_turns
            .get_or_create(&labels(&[("tenant", &t)]))
            .inc();
        for (kind, n) in [
            ("cached", cached),
            ("prefilled", prefilled),
            ("completion", completion),
        ] {
            self.tenant_tokens
                .get_or_create(&labels(&[("tenant", &t), ("kind", kind)]))
                .inc_by(n);
        }
    }

    /// One HTTP request answered (`route`: the matched pattern, so the series stay bounded).
    pub fn observe_http(&self, method: &str, route: &str, status: u16, secs: f64) {
        let status = status.to_string();
        let l = labels(&[("method", method), ("route", route), ("status", &status)]);
        self.http_requests.get_or_create(&l).inc();
        self.http_latency.get_or_create(&l).observe(secs);
    }

    /// Counts turns replayed to recompute lost blocks.
    pub fn count_replayed(&self, n: u64) {
        self.replayed_turns.inc_by(n);
    }

    /// Counts one read of the shadow on a miss, and the blocks it loaded into the cold tier.
    pub fn count_miss_read(&self, outcome: MissRead, blocks: u64) {
        self.miss_reads
            .get_or_create(&labels(&[("result", outcome.label())]))
            .inc();
        self.disk_hit_blocks.inc_by(blocks);
    }

    /// Blocks turns read back from the shadow on a miss so far.
    pub fn disk_hits(&self) -> u64 {
        self.disk_hit_blocks.get()
    }

    /// Counts a session archived (`thawed` false) or thawed by its next turn.
    pub fn count_archive(&self, thawed: bool) {
        let event = if thawed { "thawed" } else { "archived" };
        self.archive
            .get_or_create(&labels(&[("event", event)]))
            .inc();
    }

    /// Counts one prefetch request by what it did.
    pub fn count_prefetch(&self, outcome: PrefetchOutcome) {
        self.prefetch
            .get_or_create(&labels(&[("outcome", outcome.label())]))
            .inc();
    }

    /// Counts a turn that followed a reserving prefetch of its session: a hit when it showed
    /// exactly the memories the prefetch reserved.
    pub fn count_prefetch_turn(&self, hit: bool) {
        let result = if hit { "hit" } else { "miss" };
        self.prefetch_turns
            .get_or_create(&labels(&[("result", result)]))
            .inc();
    }

    /// Prefetch figures so far: requests by outcome, and the turns after a reserving prefetch
    /// that hit and missed.
    pub fn prefetch_figures(&self) -> PrefetchFigures {
        let get = |f: &Family<Labels, Counter>, k: &str, v: &str| {
            f.get_or_create(&labels(&[(k, v)])).get()
        };
        let turns = |r| get(&self.prefetch_turns, "result", r);
        let (hits, misses) = (turns("hit"), turns("miss"));
        PrefetchFigures {
            reserved: get(&self.prefetch, "outcome", PrefetchOutcome::Reserved.label()),
            unchanged: get(
                &self.prefetch,
                "outcome",
                PrefetchOutcome::Unchanged.label(),
            ),
            nothing: get(&self.prefetch, "outcome", PrefetchOutcome::Nothing.label()),
            capacity: get(&self.prefetch, "outcome", PrefetchOutcome::Capacity.label()),
            hits,
            misses,
            hit_rate: (hits + misses > 0).then(|| hits as f64 / (hits + misses) as f64),
        }
    }

    /// Turns replayed so far.
    pub fn replayed(&self) -> u64 {
        self.replayed_turns.get()
    }

    /// Registers the server's own families (clones share the values).
    pub fn register(&self, reg: &mut Registry) {
        reg.register(
            "engram_ttft_seconds",
            "Time from submission to the first token",
            self.ttft.clone(),
        );
        reg.register(
            "engram_replayed_turns",
            "Earlier turns replayed to recompute lost blocks",
            self.replayed_turns.clone(),
        );
        reg.register(
            "engram_shadow_miss_reads",
            "Turns whose cache miss read the session from the shadow, by outcome",
            self.miss_reads.clone(),
        );
        reg.register(
            "engram_archive_sessions",
            "Sessions moved to the tokens-only archive (KV deleted, chain kept), and thawed by their next turn's replay",
            self.archive.clone(),
        );
        reg.register(
            "engram_http_requests",
            "HTTP requests answered, by method, route pattern and status",
            self.http_requests.clone(),
        );
        reg.register(
            "engram_http_request_duration_seconds",
            "Time to answer an HTTP request (a stream: to its headers), by method, route pattern and status",
            self.http_latency.clone(),
        );
        reg.register(
            "engram_prefetch_requests",
            "Prefetch requests (POST …/sessions/{s}/prefetch) by outcome: reserved (the neighbourhood's memories computed ahead in the cold tier), unchanged (the session's last prefetch reserved the same), nothing (no memory recalled, or no memories layer), capacity (cold tier or queue full)",
            self.prefetch.clone(),
        );
        reg.register(
            "engram_prefetch_turns",
            "Turns after a reserving prefetch of their session: hit when the turn showed exactly the memories the prefetch reserved",
            self.prefetch_turns.clone(),
        );
        reg.register(
            "engram_tenant_turns",
            "Generations by tenant (the first metrics.tenant_labels tenants by id, the rest as other)",
            self.tenant_turns.clone(),
        );
        reg.register(
            "engram_tenant_tokens",
            "Tokens by tenant and kind: prompt tokens cached (reused from the KV cache, the cache hits) or prefilled, and completion tokens",
            self.tenant_tokens.clone(),
        );
    }
}

/// What a prefetch request did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum PrefetchOutcome {
    /// The neighbourhood's memories were queued for computing in the cold tier.
    Reserved,
    /// The session's last prefetch reserved the same neighbourhood.
    Unchanged,
    /// Nothing was recalled, or the agent's prompt has no memories layer.
    Nothing,
    /// The cold tier or the engine's queue was full.
    Capacity,
}

impl PrefetchOutcome {
    /// Every outcome.
    pub const ALL: [Self; 4] = [
        Self::Reserved,
        Self::Unchanged,
        Self::Nothing,
        Self::Capacity,
    ];

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Reserved => "reserved",
            Self::Unchanged => "unchanged",
            Self::Nothing => "nothing",
            Self::Capacity => "capacity",
        }
    }
}

/// Prefetch figures (admin views).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, utoipa::ToSchema)]
pub struct PrefetchFigures {
    /// Requests that reserved a neighbourhood.
    pub reserved: u64,
    /// Requests whose neighbourhood the session's last prefetch had reserved.
    pub unchanged: u64,
    /// Requests that recalled nothing to reserve.
    pub nothing: u64,
    /// Requests skipped for capacity.
    pub capacity: u64,
    /// Turns after a reserving prefetch that showed exactly its memories.
    pub hits: u64,
    /// Turns after a reserving prefetch that showed other memories.
    pub misses: u64,
    /// hits / (hits + misses); null before any.
    pub hit_rate: Option<f64>,
}

/// A counter holding `n` (for figures read at the scrape).
pub fn counter(n: u64) -> Counter {
    let c = Counter::default();
    c.inc_by(n);
    c
}

/// A counter family holding `values` under one label.
pub fn counters<'a>(
    label: &str,
    values: impl IntoIterator<Item = (&'a str, u64)>,
) -> Family<Labels, Counter> {
    let f = Family::<Labels, Counter>::default();
    for (v, n) in values {
        f.get_or_create(&labels(&[(label, v)])).inc_by(n);
    }
    f
}

/// An integer gauge holding `n`.
pub fn gauge(n: u64) -> Gauge {
    let g = Gauge::<i64>::default();
    g.set(i64::try_from(n).unwrap_or(i64::MAX));
    g
}

/// A float gauge holding `x`.
pub fn gauge_f64(x: f64) -> Gauge<f64, AtomicU64> {
    let g = Gauge::<f64, AtomicU64>::default();
    g.set(x);
    g
}

/// A gauge family holding `values` under labels.
pub fn gauges(values: impl IntoIterator<Item = (Labels, u64)>) -> Family<Labels, Gauge> {
    let f = Family::<Labels, Gauge>::default();
    for (l, n) in values {
        f.get_or_create(&l)
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }
    f
}

/// The registry in the OpenMetrics text format.
pub fn render(reg: &Registry) -> String {
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = encode(&mut out, reg);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenant_labels_are_bounded_and_a_labelled_tenant_keeps_its_label() {
        let m = Metrics::new(2);
        assert_eq!(m.tenant_label("a"), "a");
        assert_eq!(m.tenant_label("b"), "b");
        assert_eq!(m.tenant_label("c"), "other");
        assert_eq!(m.tenant_label("a"), "a");
        m.observe_turn("c", 3, 4, 5, 120.0);
        m.observe_turn("d", 1, 1, 1, 20.0);
        let mut reg = Registry::default();
        m.register(&mut reg);
        let text = render(&reg);
        assert!(
            text.contains("engram_tenant_turns_total{tenant=\"other\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("engram_tenant_tokens_total{tenant=\"other\",kind=\"cached\"} 4"),
            "{text}"
        );
        assert!(text.contains("engram_ttft_seconds_count 2"), "{text}");
        assert!(text.contains("# HELP engram_ttft_seconds "), "{text}");
        assert!(text.ends_with("# EOF\n"), "{text}");
        let none = Metrics::new(0);
        assert_eq!(none.tenant_label("a"), "other");
    }
}
