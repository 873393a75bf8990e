//! `engram-bench memory`: hybrid recall latency at scale and embedding throughput.
//!
//! The graph is synthetic and its vectors are **random unit vectors** (seeded), not embeddings
//! of text: embedding a million sentences on a CPU would take hours, and the latency of a
//! nearest-neighbour search and a bounded graph walk does not depend on what the vectors mean.
//! Shape: one tenant holds 90 % of the nodes (a second tenant the rest, so the tenant filter
//! has work to do); per tenant, sessions of 20 episodes chained by `follows`, every fourth node a
//! fact that `mentions` one of a pool of entities, and a `relates_to` edge from each fact to a
//! random fact. Queries are fresh random unit vectors; each is a vector search for the seeds
//! (tenant and agent filter) followed by `hybrid_query` (k 8, hops 2), the service's recall path
//! without the query embedding, which is measured on its own (real MiniLM on real sentences).

use std::path::Path;
use std::time::Instant;

use engram_graph::{
    Edge, EdgeId, EdgeKind, MemoryGraph, Node, NodeId, NodeKind, QueryFilter, Scoring,
};
use engram_vector::{EdgeStore, VectorFilter, VectorPoint, VectorStore};
use serde::Serialize;

/// The seeded generator of the synthetic graph (kvcore's SplitMix64).
pub type Rng = engram_kvcore::SplitMix64;

/// Uniform in `0..n` (`n` > 0).
pub fn below(rng: &mut Rng, n: u64) -> u64 {
    rng.next_u64() % n.max(1)
}

/// A random unit vector of `dim` dimensions.
pub fn unit(rng: &mut Rng, dim: usize) -> Vec<f32> {
    let mut v = rng.gaussian_vec(dim);
    let n = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-12);
    v.iter_mut().for_each(|x| *x /= n);
    v
}

/// Figures of one graph size.
#[derive(Debug, Clone, Serialize)]
pub struct ScaleReport {
    /// Nodes in the graph.
    pub nodes: usize,
    /// Edges.
    pub edges: usize,
    /// Vectors: always `random_unit` here.
    pub vectors: &'static str,
    /// Seconds to write the vectors into the index.
    pub load_s: f64,
    /// Seconds the index optimizer (HNSW build) took; `None`: not built (exact scan).
    pub index_s: Option<f64>,
    /// Queries timed.
    pub queries: usize,
    /// Vector search (seeds), ms.
    pub search_p50_ms: f64,
    /// Vector search (seeds), ms.
    pub search_p99_ms: f64,
    /// Graph expansion and scoring, ms.
    pub graph_p50_ms: f64,
    /// Graph expansion and scoring, ms.
    pub graph_p99_ms: f64,
    /// Both, ms.
    pub total_p50_ms: f64,
    /// Both, ms.
    pub total_p99_ms: f64,
    /// Mean results per query.
    pub mean_results: f64,
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// Builds a synthetic graph of `n` nodes (see the module docs) into `dir` and times `queries`
/// recalls.
pub fn scale(
    n: usize,
    queries: usize,
    dir: &Path,
    seed: u64,
    index: bool,
) -> anyhow::Result<ScaleReport> {
    const DIM: usize = 384;
    let mut rng = Rng::new(seed);
    let store = EdgeStore::open(dir, DIM)?;
    let mut graph = MemoryGraph::new();
    let tenant_of = |i: usize| if i % 10 == 9 { "t2" } else { "t1" };
    let entities = (n / 50).max(1);
    let mut edges = 0u64;
    let mut facts: Vec<usize> = Vec::new();
    let t = Instant::now();
    let mut batch = Vec::with_capacity(1024);
    let mut load_s = 0.0;
    for i in 0..n {
        let tenant = tenant_of(i);
        let kind = if i % 10 == 0 && i / 10 < entities {
            NodeKind::Entity
        } else if i % 4 == 3 {
            NodeKind::Fact
        } else {
            NodeKind::Episode
        };
        graph.add_node(Node {
            id: NodeId(i as u64 + 1),
            kind,
            tenant: tenant.into(),
            agent: "a".into(),
            session: (kind == NodeKind::Episode).then(|| format!("s{}", i / 200)),
            text: format!("node {i}"),
            importance: (below(&mut rng, 100) as f32) / 100.0,
            tokens: 12,
            created_ms: i as i64,
            updated_ms: i as i64,
            last_accessed_ms: (below(&mut rng, 1 << 30)) as i64,
        })?;
        batch.push(VectorPoint {
            id: i as u64 + 1,
            vector: unit(&mut rng, DIM),
            tenant: tenant.into(),
            agent: "a".into(),
            kind: kind.as_str().into(),
            scope: String::new(),
        });
        if batch.len() == 1024 {
            let w = Instant::now();
            store.upsert(&batch)?;
            load_s += w.elapsed().as_secs_f64();
            batch.clear();
        }
        // Edges within the tenant: the episode chain (stride 10 keeps the tenant), mentions and
        // relates_to.
        let mut link = |from: usize, to: usize, kind: EdgeKind, g: &mut MemoryGraph| {
            if from != to && tenant_of(from) == tenant_of(to) {
                edges += 1;
                g.add_edge(Edge {
                    id: EdgeId(edges),
                    from: NodeId(from as u64 + 1),
                    to: NodeId(to as u64 + 1),
                    kind,
                    weight: 1.0,
                    valid_from_ms: None,
                    valid_to_ms: None,
                })
                .map(|_| ())
            } else {
                Ok(())
            }
        };
        if kind == NodeKind::Episode && i >= 10 && (i / 10) % 20 != 0 {
            link(i, i - 10, EdgeKind::Follows, &mut graph)?;
        }
        if kind == NodeKind::Fact {
            let e = (below(&mut rng, entities as u64) as usize) * 10;
            if e < i {
                link(i, e, EdgeKind::Mentions, &mut graph)?;
            }
            if let Some(&other) = facts.get(below(&mut rng, facts.len().max(1) as u64) as usize) {
                link(i, other, EdgeKind::RelatesTo, &mut graph)?;
            }
            facts.push(i);
        }
    }
    let w = Instant::now();
    store.upsert(&batch)?;
    store.flush()?;
    load_s += w.elapsed().as_secs_f64();
    let index_s = if index {
        let w = Instant::now();
        store.optimize()?;
        Some(w.elapsed().as_secs_f64())
    } else {
        None
    };
    let _ = t;
    let (mut search, mut walk, mut total) = (Vec::new(), Vec::new(), Vec::new());
    let mut results = 0usize;
    let filter = VectorFilter {
        tenant: "t1".into(),
        agent: Some("a".into()),
        kinds: None,
        scopes: None,
    };
    let qfilter = QueryFilter {
        tenant: "t1".into(),
        agent: Some("a".into()),
        ..QueryFilter::default()
    };
    let scoring = Scoring::default();
    for q in 0..queries + 5 {
        let v = unit(&mut rng, DIM);
        let t0 = Instant::now();
        let hits = store.search(&v, 16, &filter)?;
        let t1 = Instant::now();
        let seeds: Vec<(NodeId, f32)> = hits.iter().map(|h| (NodeId(h.id), h.score)).collect();
        let r = graph.hybrid_query(&seeds, 8, 2, &qfilter, &scoring, 1 << 31);
        let t2 = Instant::now();
        if q < 5 {
            continue; // warm-up
        }
        results += r.len();
        search.push((t1 - t0).as_secs_f64() * 1e3);
        walk.push((t2 - t1).as_secs_f64() * 1e3);
        total.push((t2 - t0).as_secs_f64() * 1e3);
    }
    for v in [&mut search, &mut walk, &mut total] {
        v.sort_by(f64::total_cmp);
    }
    drop(store);
    Ok(ScaleReport {
        nodes: n,
        edges: graph.edge_count(),
        vectors: "random_unit",
        load_s,
        index_s,
        queries,
        search_p50_ms: pct(&search, 0.5),
        search_p99_ms: pct(&search, 0.99),
        graph_p50_ms: pct(&walk, 0.5),
        graph_p99_ms: pct(&walk, 0.99),
        total_p50_ms: pct(&total, 0.5),
        total_p99_ms: pct(&total, 0.99),
        mean_results: results as f64 / queries.max(1) as f64,
    })
}

/// Embedding throughput of the real model on generated sentences.
#[derive(Debug, Clone, Serialize)]
pub struct EmbedReport {
    /// Sentences embedded.
    pub sentences: usize,
    /// Per call.
    pub batch: usize,
    /// Mean words per sentence.
    pub mean_words: f64,
    /// Sentences per second.
    pub per_second: f64,
}

const SUBJECTS: [&str; 8] = [
    "Alice",
    "My manager",
    "The landlord",
    "Our team",
    "The doctor",
    "My brother",
    "The client",
    "Grandma",
];
const VERBS: [&str; 8] = [
    "moved to",
    "asked about",
    "complained about",
    "booked a trip to",
    "recommended",
    "forgot",
    "paid for",
    "is worried about",
];
const OBJECTS: [&str; 8] = [
    "the flat near the river",
    "the quarterly report",
    "a new violin",
    "the train to Berlin",
    "the overdue invoice",
    "a vegetarian restaurant",
    "the dentist appointment next Tuesday",
    "the broken coffee machine",
];

/// A generated sentence.
pub fn sentence(rng: &mut Rng) -> String {
    let p = |r: &mut Rng, a: &[&str]| a[below(r, a.len() as u64) as usize].to_string();
    format!(
        "{} {} {} last week.",
        p(rng, &SUBJECTS),
        p(rng, &VERBS),
        p(rng, &OBJECTS)
    )
}

/// Embeds `n` generated sentences in batches of `batch`.
pub fn embed_rate(
    embedder: &engram_engine::embed::Embedder,
    n: usize,
    batch: usize,
) -> anyhow::Result<EmbedReport> {
    let mut rng = Rng::new(7);
    let texts: Vec<String> = (0..n).map(|_| sentence(&mut rng)).collect();
    let words: usize = texts.iter().map(|t| t.split_whitespace().count()).sum();
    // Warm-up.
    embedder.embed(&[texts[0].as_str()])?;
    let t = Instant::now();
    for chunk in texts.chunks(batch.max(1)) {
        let refs: Vec<&str> = chunk.iter().map(String::as_str).collect();
        embedder.embed(&refs)?;
    }
    Ok(EmbedReport {
        sentences: n,
        batch,
        mean_words: words as f64 / n.max(1) as f64,
        per_second: n as f64 / t.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_synthetic_graph_answers_every_query_within_its_tenant() {
        let dir = std::env::temp_dir().join(format!("engram-bench-mem-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let r = scale(2_000, 20, &dir, 3, true).unwrap_or_else(|e| panic!("{e}"));
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(r.nodes, 2_000);
        assert!(r.edges > 500, "{r:?}");
        assert_eq!(r.queries, 20);
        // k = 8 and the tenant holds 1,800 nodes: every query fills its k.
        assert!((r.mean_results - 8.0).abs() < 1e-9, "{r:?}");
        assert!(r.total_p99_ms >= r.total_p50_ms);
    }

    #[test]
    fn unit_vectors_are_unit_and_seeded() {
        let (mut a, mut b) = (Rng::new(1), Rng::new(1));
        let (u, v) = (unit(&mut a, 384), unit(&mut b, 384));
        assert_eq!(u, v);
        let n: f32 = u.iter().map(|x| x * x).sum();
        assert!((n - 1.0).abs() < 1e-5);
        assert_ne!(u, unit(&mut Rng::new(2), 384));
    }
}
