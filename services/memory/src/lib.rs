//! The memory service: the database's memory nodes and edges as an in-process graph
//! ([`engram_graph::MemoryGraph`]) and a vector index ([`engram_vector::VectorStore`]), with the
//! embedding model that fills it.
//!
//! - **Source of truth**: the database. At start the graph is rebuilt from its rows; the vector
//!   index is kept across restarts and re-embedded in full when the embedding model's fingerprint
//!   (recorded in `memory_meta`) changed or its point count disagrees with the database (a crash
//!   between the two writes).
//! - **Writes** go to the database first, then to the graph and the index; a failed index write
//!   is repaired at the next start.
//! - **Recall** ([`MemoryService::recall`]): the query text is embedded, the index gives seeds
//!   (tenant and agent always in its filter), the graph expands and scores them
//!   (`engram_graph`'s documented formula), the best are kept within a token budget and rendered
//!   in canonical order (node id), one line each, so that overlapping neighbourhoods render with
//!   a shared token prefix.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};

use engram_graph::{
    Edge, EdgeId, EdgeKind, MemoryGraph, Node, NodeId, NodeKind, QueryFilter, Recall, Scoring,
    SessionScope, canonical_order,
};
use engram_model::embed::Embedder;
use engram_store::{MemoryEdgeRow, MemoryNodeRow, Store};
use engram_vector::{EdgeStore, VectorFilter, VectorPoint, VectorStore};
use sha2::{Digest, Sha256};

use serde::{Deserialize, Serialize};

/// The `[memory]` section of the service's configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MemorySection {
    /// Turn ingest, recall into the memories layer and the memory API (`false`: the API answers
    /// 503 `memory_unavailable`).
    pub enabled: bool,
    /// Directory of the embedding model (`config.json`, `model.safetensors`, `tokenizer.json`).
    pub embedder_path: PathBuf,
    /// Where the embedded vector index lives (empty: beside the SQLite file, or
    /// `data/vectors/<hash of the URL>` for PostgreSQL). Unused when `vector_url` is set.
    pub vector_dir: PathBuf,
    /// A remote Qdrant's gRPC address (`http://host:6334`) instead of the embedded index, so
    /// nodes sharing a database share the vectors (the binary needs the `qdrant` feature).
    pub vector_url: String,
    /// The collection on that server.
    pub vector_collection: String,
    /// Its API key, if it asks for one (set it through `ENGRAM__MEMORY__VECTOR_API_KEY`).
    #[serde(skip_serializing)]
    pub vector_api_key: String,
    /// Nodes recalled into the memories layer at most.
    pub recall_k: usize,
    /// Hops of graph expansion.
    pub hops: u32,
    /// Vector seeds per query at least.
    pub seeds: usize,
    /// Every turn becomes an episode node linked to its predecessor, and every line a layer
    /// spilled over its budget (but the memories layer's own) a fact node of the agent, once.
    pub ingest_turns: bool,
    /// After each turn, reserve cold-tier blocks for the neighbourhood of what was just said.
    /// Off by default: on the conversation bench its reservations were never claimed (0 blocks
    /// served, TTFT 225 against 220 ms without, `benches/results/2026-11-25-conversation/`),
    /// and a turn that may or may not reuse a background prefill makes answers depend on timing.
    /// Explicit reservations (`"reserve": true` on a query, prefetch) do not need it.
    pub reserve: bool,
    /// How long an unused reservation lives, seconds.
    pub reservation_ttl_secs: u64,
}

impl Default for MemorySection {
    fn default() -> Self {
        Self {
            enabled: true,
            embedder_path: PathBuf::from("models/all-MiniLM-L6-v2"),
            vector_dir: PathBuf::new(),
            vector_url: String::new(),
            vector_collection: "engram_memory".into(),
            vector_api_key: String::new(),
            recall_k: 8,
            hops: 2,
            seeds: 16,
            ingest_turns: true,
            reserve: false,
            reservation_ttl_secs: 600,
        }
    }
}

/// The configured vector store: a remote Qdrant (`vector_url`) or qdrant-edge in `dir`.
fn open_vectors(
    config: &MemorySection,
    dir: &Path,
    dim: usize,
) -> Result<Box<dyn VectorStore>, MemoryError> {
    if config.vector_url.is_empty() {
        return Ok(Box::new(EdgeStore::open(dir, dim)?));
    }
    #[cfg(feature = "qdrant")]
    {
        Ok(Box::new(engram_vector::RemoteStore::open(
            &config.vector_url,
            Some(&config.vector_api_key),
            &config.vector_collection,
            dim,
        )?))
    }
    #[cfg(not(feature = "qdrant"))]
    {
        Err(MemoryError::Vector(engram_vector::VectorError::Remote(
            "memory.vector_url needs a binary built with the `qdrant` feature".into(),
        )))
    }
}

/// `memory_meta` key of the fingerprint the stored vectors were embedded with.
pub const FINGERPRINT_KEY: &str = "embedding_fingerprint";

/// Why the memory service failed, at start or on a request.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    /// The embedding model could not be loaded.
    #[error("embedding model at {path}: {source}")]
    Embedder {
        /// Its directory.
        path: PathBuf,
        /// Why.
        source: engram_model::ModelError,
    },
    /// The vector index failed.
    #[error("vector index: {0}")]
    Vector(#[from] engram_vector::VectorError),
    /// The database failed.
    #[error("database: {0}")]
    Store(#[from] engram_store::StoreError),
    /// A stored row does not form a valid graph.
    #[error("memory graph: {0}")]
    Graph(#[from] engram_graph::GraphError),
    /// Embedding failed.
    #[error("embedding: {0}")]
    Embed(engram_model::ModelError),
    /// The index's directory could not be made.
    #[error("{path}: {source}")]
    Io {
        /// The directory.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The graph's lock was poisoned by a panic.
    #[error("memory graph lock poisoned")]
    Poisoned,
    /// The embedder answered no vector for a text.
    #[error("the embedder returned no vector")]
    NoVector,
    /// A row holds a value the graph does not know.
    #[error("stored memory row {id}: {reason}")]
    Corrupt {
        /// The row.
        id: i64,
        /// What is wrong.
        reason: String,
    },
}

/// How the start went (logged, and checked by tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Startup {
    /// Nodes loaded from the database.
    pub nodes: usize,
    /// Edges loaded.
    pub edges: usize,
    /// Nodes embedded again (0 when the index was current).
    pub reembedded: usize,
}

/// One recalled node with what the memories layer needs.
#[derive(Debug, Clone, serde::Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Recalled {
    /// Scores (see `engram_graph`).
    #[serde(flatten)]
    pub recall: Recall,
    /// Kind.
    pub kind: NodeKind,
    /// Text.
    pub text: String,
    /// Importance.
    pub importance: f32,
    /// The session of an episode.
    pub session: Option<String>,
}

/// A rendered neighbourhood: the nodes kept for the memories layer, in canonical order.
#[derive(Debug, Clone, Default)]
pub struct Neighbourhood {
    /// Kept nodes, canonical order.
    pub nodes: Vec<Recalled>,
    /// Their lines, as the memories layer shows them.
    pub text: String,
    /// Tokens of `nodes` (the nodes' own counts).
    pub tokens: u32,
}

impl Neighbourhood {
    /// Node ids, canonical order.
    pub fn ids(&self) -> Vec<u64> {
        self.nodes.iter().map(|n| n.recall.id.0).collect()
    }
}

/// A recall query.
#[derive(Debug, Clone)]
pub struct RecallQuery<'a> {
    /// The tenant (always enforced).
    pub tenant: &'a str,
    /// The agent.
    pub agent: &'a str,
    /// The query text.
    pub text: &'a str,
    /// Results at most.
    pub k: usize,
    /// Hops of expansion.
    pub hops: u32,
    /// Only these kinds.
    pub kinds: Option<Vec<NodeKind>>,
    /// Leave this session's nodes out.
    pub exclude_session: Option<&'a str>,
    /// With `exclude_session`: only those created at or after this time (ms); `None`: all.
    pub exclude_since_ms: Option<i64>,
    /// Evaluate recency at this time (ms); now by default.
    pub at_ms: i64,
    /// Which sessions' nodes it may see (see [`SessionScope`]): a turn of an agent whose
    /// memory is session-scoped sees only its own session's and the agent's own.
    pub sessions: SessionScope,
    /// The session whose request carries the text (`None`: the agent's own, a memory query
    /// without a session): its cached embedding is forgotten with that session.
    pub asker: Option<&'a str>,
}

/// A cached query embedding's key: who asked, and the text.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct QueryKey {
    tenant: String,
    agent: String,
    asker: Option<String>,
    text: String,
}

/// Bytes of query embeddings (and their texts) kept.
const QUERY_CACHE_BYTES: u64 = 8 << 20;

/// The memory service (see the module docs).
#[derive(Debug)]
pub struct MemoryService {
    graph: RwLock<MemoryGraph>,
    vectors: Box<dyn VectorStore>,
    embedder: Arc<Embedder>,
    /// Query embeddings by who asked and the text (moka, least recently used leave first): a
    /// session's recalls embed a text once. The tenant is in the key, so no tenant's query is
    /// ever faster because another asked it; so are the agent and the asking session, so
    /// deleting a session (or an agent) forgets every text its requests had embedded.
    queries: moka::sync::Cache<QueryKey, Arc<Vec<f32>>>,
    config: MemorySection,
    /// Newest episode per (agent, session): the predecessor the next turn follows.
    last_episode: Mutex<HashMap<(String, String), NodeId>>,
    startup: Startup,
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The vector directory for a database URL when none is configured: beside an SQLite file, or
/// `data/vectors/<hash of the URL>` for PostgreSQL.
pub fn default_vector_dir(database_url: &str) -> PathBuf {
    default_data_dir(database_url, "vectors")
}

/// `name/` beside the SQLite file, or `data/<name>/<hash of the URL>` for PostgreSQL.
pub fn default_data_dir(database_url: &str, name: &str) -> PathBuf {
    if let Some(path) = database_url
        .strip_prefix("sqlite://")
        .map(|p| p.split('?').next().unwrap_or(p))
        && let Some(dir) = Path::new(path).parent()
    {
        return dir.join(name);
    }
    let h = Sha256::digest(database_url.as_bytes());
    PathBuf::from("data").join(name).join(hex(&h[..8]))
}

pub(crate) fn node_of(r: &MemoryNodeRow) -> Result<Node, MemoryError> {
    let kind = NodeKind::parse(&r.kind).ok_or_else(|| MemoryError::Corrupt {
        id: r.id,
        reason: format!("unknown node kind `{}`", r.kind),
    })?;
    Ok(Node {
        id: NodeId(r.id as u64),
        kind,
        tenant: r.tenant_id.clone(),
        agent: r.agent_id.clone(),
        session: r.session_id.clone(),
        text: r.text.clone(),
        importance: r.importance as f32,
        tokens: u32::try_from(r.tokens).unwrap_or(u32::MAX),
        created_ms: r.created_at,
        updated_ms: r.updated_at,
        last_accessed_ms: r.last_accessed_at,
    })
}

pub(crate) fn edge_of(r: &MemoryEdgeRow) -> Result<Edge, MemoryError> {
    let kind = EdgeKind::parse(&r.kind).ok_or_else(|| MemoryError::Corrupt {
        id: r.id,
        reason: format!("unknown edge kind `{}`", r.kind),
    })?;
    Ok(Edge {
        id: EdgeId(r.id as u64),
        from: NodeId(r.from_id as u64),
        to: NodeId(r.to_id as u64),
        kind,
        weight: r.weight as f32,
        valid_from_ms: r.valid_from,
        valid_to_ms: r.valid_to,
    })
}

fn point(n: &Node, vector: Vec<f32>) -> VectorPoint {
    VectorPoint {
        id: n.id.0,
        vector,
        tenant: n.tenant.clone(),
        agent: n.agent.clone(),
        kind: n.kind.as_str().to_string(),
        scope: n.session.clone().unwrap_or_default(),
    }
}

/// Texts embedded per batch at start.
const BATCH: usize = 32;

impl MemoryService {
    /// The service as configured, unless it is disabled or its embedding model is missing
    /// (logged): its index in `config.vector_dir`, or beside the database at `database_url`.
    pub async fn start(
        config: &MemorySection,
        store: &Store,
        database_url: &str,
    ) -> Result<Option<Self>, MemoryError> {
        if !config.enabled {
            return Ok(None);
        }
        if !config.embedder_path.join("model.safetensors").is_file() {
            tracing::warn!(
                "no embedding model at {}; the memory graph is off (run `make models`)",
                config.embedder_path.display()
            );
            return Ok(None);
        }
        let dir = if config.vector_dir.as_os_str().is_empty() {
            default_vector_dir(database_url)
        } else {
            config.vector_dir.clone()
        };
        std::fs::create_dir_all(&dir).map_err(|source| MemoryError::Io {
            path: dir.clone(),
            source,
        })?;
        let service = Self::open(config, store, &dir).await?;
        let s = service.startup();
        tracing::info!(
            "memory graph: {} nodes, {} edges, {} re-embedded; vectors in {}",
            s.nodes,
            s.edges,
            s.reembedded,
            dir.display()
        );
        Ok(Some(service))
    }

    /// Loads the embedder, opens the index and rebuilds the graph from `store` (see the
    /// module docs).
    pub async fn open(
        config: &MemorySection,
        store: &Store,
        vector_dir: &Path,
    ) -> Result<Self, MemoryError> {
        let embedder =
            Embedder::load(&config.embedder_path, &candle_core::Device::Cpu).map_err(|source| {
                MemoryError::Embedder {
                    path: config.embedder_path.clone(),
                    source,
                }
            })?;
        let vectors = open_vectors(config, vector_dir, embedder.dim())?;
        let rows = store.memory_nodes(None).await?;
        let edges = store.memory_edges(None).await?;
        let mut graph = MemoryGraph::new();
        // Ids are random: the newest episode of a session is the one created last.
        let mut newest: HashMap<(String, String), (i64, NodeId)> = HashMap::new();
        for r in &rows {
            let n = node_of(r)?;
            if let (NodeKind::Episode, Some(s)) = (n.kind, &n.session) {
                let e = newest
                    .entry((n.agent.clone(), s.clone()))
                    .or_insert((n.created_ms, n.id));
                *e = (*e).max((n.created_ms, n.id));
            }
            graph.add_node(n)?;
        }
        let last_episode: HashMap<(String, String), NodeId> =
            newest.into_iter().map(|(k, (_, id))| (k, id)).collect();
        for e in &edges {
            graph.add_edge(edge_of(e)?)?;
        }
        // The payload's layout is part of what the index must match.
        let fingerprint = format!(
            "{}:payload{}",
            hex(&embedder.fingerprint()),
            engram_vector::PAYLOAD_VERSION
        );
        let current = store.memory_meta(FINGERPRINT_KEY).await?.as_deref() == Some(&fingerprint)
            && vectors.count()? == rows.len();
        let embedder = Arc::new(embedder);
        let mut reembedded = 0;
        if !current {
            vectors.clear()?;
            let nodes: Vec<Node> = rows.iter().map(node_of).collect::<Result<_, _>>()?;
            for chunk in nodes.chunks(BATCH) {
                let texts: Vec<String> = chunk.iter().map(|n| n.text.clone()).collect();
                let vs = embed_blocking(&embedder, texts).await?;
                let points: Vec<VectorPoint> =
                    chunk.iter().zip(vs).map(|(n, v)| point(n, v)).collect();
                vectors.upsert(&points)?;
                reembedded += points.len();
            }
            vectors.flush()?;
            store.set_memory_meta(FINGERPRINT_KEY, &fingerprint).await?;
        }
        // Builds the HNSW index once the data is above the engine's threshold (blocking).
        vectors.optimize()?;
        let startup = Startup {
            nodes: rows.len(),
            edges: edges.len(),
            reembedded,
        };
        Ok(Self {
            graph: RwLock::new(graph),
            vectors,
            embedder,
            queries: moka::sync::Cache::builder()
                .max_capacity(QUERY_CACHE_BYTES)
                .weigher(|k: &QueryKey, v: &Arc<Vec<f32>>| {
                    let asker = k.asker.as_ref().map_or(0, String::len);
                    u32::try_from(
                        k.tenant.len() + k.agent.len() + asker + k.text.len() + v.len() * 4,
                    )
                    .unwrap_or(u32::MAX)
                })
                .build(),
            config: config.clone(),
            last_episode: Mutex::new(last_episode),
            startup,
        })
    }

    /// How the start went.
    pub fn startup(&self) -> Startup {
        self.startup
    }

    /// Nodes and edges in the graph, points in the vector index.
    pub fn counts(&self) -> Result<(usize, usize, usize), MemoryError> {
        let g = self.graph_read()?;
        let points = self.vectors.count()?;
        Ok((g.node_count(), g.edge_count(), points))
    }

    /// The configuration.
    pub fn config(&self) -> &MemorySection {
        &self.config
    }

    fn graph_read(&self) -> Result<std::sync::RwLockReadGuard<'_, MemoryGraph>, MemoryError> {
        self.graph.read().map_err(|_| MemoryError::Poisoned)
    }

    fn graph_write(&self) -> Result<std::sync::RwLockWriteGuard<'_, MemoryGraph>, MemoryError> {
        self.graph.write().map_err(|_| MemoryError::Poisoned)
    }

    /// Unit vectors of `texts` and the tokens the embedder read of them (on a blocking
    /// thread).
    pub async fn embed_counted(
        &self,
        texts: Vec<String>,
    ) -> Result<(Vec<Vec<f32>>, usize), MemoryError> {
        let mut tokens = 0;
        for t in &texts {
            tokens += self.embedder.count_tokens(t).map_err(MemoryError::Embed)?;
        }
        Ok((embed_blocking(&self.embedder, texts).await?, tokens))
    }

    /// The embedding model's name (its directory's).
    pub fn embedder_name(&self) -> String {
        self.config
            .embedder_path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    }

    /// Unit vectors of `texts` (on a blocking thread).
    pub async fn embed(&self, texts: Vec<String>) -> Result<Vec<Vec<f32>>, MemoryError> {
        embed_blocking(&self.embedder, texts).await
    }

    /// A node by id, if the tenant owns it.
    pub fn node(&self, tenant: &str, id: NodeId) -> Result<Option<Node>, MemoryError> {
        Ok(self
            .graph_read()?
            .node(id)
            .filter(|n| n.tenant == tenant)
            .cloned())
    }

    /// Adds a stored node to the graph and the index.
    pub async fn add(&self, row: &MemoryNodeRow) -> Result<Node, MemoryError> {
        let n = node_of(row)?;
        let v = self.embed(vec![n.text.clone()]).await?;
        self.graph_write()?.add_node(n.clone())?;
        self.index(&n, v)?;
        if let (NodeKind::Episode, Some(s)) = (n.kind, &n.session)
            && let Ok(mut last) = self.last_episode.lock()
        {
            // The episode just added is the session's newest.
            last.insert((n.agent.clone(), s.clone()), n.id);
        }
        Ok(n)
    }

    fn index(&self, n: &Node, mut v: Vec<Vec<f32>>) -> Result<(), MemoryError> {
        let vector = v.pop().ok_or(MemoryError::NoVector)?;
        self.vectors
            .upsert(&[point(n, vector)])
            .map_err(MemoryError::from)
    }

    /// Replaces a stored node in the graph and re-embeds it.
    pub async fn update(&self, row: &MemoryNodeRow) -> Result<Node, MemoryError> {
        let n = node_of(row)?;
        let v = self.embed(vec![n.text.clone()]).await?;
        self.graph_write()?.update_node(n.clone())?;
        self.index(&n, v)?;
        Ok(n)
    }

    /// Removes a node (the database already deleted it and its edges).
    pub fn remove(&self, id: NodeId) -> Result<(), MemoryError> {
        let _ = self.graph_write()?.remove_node(id);
        self.vectors.delete(&[id.0]).map_err(MemoryError::from)
    }

    /// Forgets nodes the database already deleted (a session, agent or tenant deleted):
    /// removes them, and their edges, from the graph and their vectors from the index, and the
    /// sessions' episode chains (`session: None`: every session of `agent`; `agent: None`:
    /// the nodes' own agents).
    pub fn forget(
        &self,
        ids: &[i64],
        agent: Option<&str>,
        session: Option<&str>,
    ) -> Result<(), MemoryError> {
        let ids: Vec<u64> = ids.iter().filter_map(|&i| u64::try_from(i).ok()).collect();
        let mut agents: HashSet<String> = HashSet::new();
        {
            let mut g = self.graph_write()?;
            for &id in &ids {
                if let Some(n) = g.node(NodeId(id)) {
                    agents.insert(n.agent.clone());
                }
                let _ = g.remove_node(NodeId(id));
            }
        }
        if !ids.is_empty() {
            self.vectors.delete(&ids)?;
            self.vectors.flush()?;
        }
        if let Some(a) = agent {
            agents.insert(a.to_string());
        }
        if let Ok(mut last) = self.last_episode.lock() {
            last.retain(|(a, s), _| !(agents.contains(a) && session.is_none_or(|x| x == s)));
        }
        Ok(())
    }

    /// Query embeddings cached (all tenants').
    pub fn cached_queries(&self) -> usize {
        self.queries.iter().count()
    }

    /// Forgets the cached query embeddings that match: those `tenant`'s requests embedded, of
    /// `agent` when given, asked by `session` when given (a deleted session, agent or tenant).
    pub fn forget_queries(&self, tenant: &str, agent: Option<&str>, session: Option<&str>) {
        // Invalidation by predicate needs moka's support for it; a scan does the same here
        // (the cache holds at most a few MiB).
        let keys: Vec<QueryKey> = self
            .queries
            .iter()
            .filter(|(k, _)| {
                k.tenant == tenant
                    && agent.is_none_or(|a| k.agent == a)
                    && session.is_none_or(|s| k.asker.as_deref() == Some(s))
            })
            .map(|(k, _)| (*k).clone())
            .collect();
        for k in keys {
            self.queries.invalidate(&k);
        }
    }

    /// Adds a stored edge to the graph.
    pub fn add_edge(&self, row: &MemoryEdgeRow) -> Result<Edge, MemoryError> {
        let e = edge_of(row)?;
        self.graph_write()?.add_edge(e.clone())?;
        Ok(e)
    }

    /// Removes an edge (the database already deleted it).
    pub fn remove_edge(&self, id: EdgeId) -> Result<(), MemoryError> {
        let _ = self.graph_write()?.remove_edge(id);
        Ok(())
    }

    /// The session's newest episode (the next turn's predecessor).
    pub fn last_episode(&self, agent: &str, session: &str) -> Option<NodeId> {
        self.last_episode
            .lock()
            .ok()?
            .get(&(agent.to_string(), session.to_string()))
            .copied()
    }

    /// Records a recall in the graph (the database is updated by the caller).
    pub fn touch(&self, ids: &[NodeId], at: i64) -> Result<(), MemoryError> {
        self.graph_write()?.touch(ids, at);
        Ok(())
    }

    /// Hybrid recall (see the module docs): at most `q.k` nodes, best first.
    pub async fn recall(&self, q: &RecallQuery<'_>) -> Result<Vec<Recalled>, MemoryError> {
        if q.k == 0 {
            return Ok(Vec::new());
        }
        let key = QueryKey {
            tenant: q.tenant.to_string(),
            agent: q.agent.to_string(),
            asker: q.asker.map(str::to_string),
            text: q.text.to_string(),
        };
        let query = match self.queries.get(&key) {
            Some(v) => v,
            None => {
                let v = self.embed(vec![q.text.to_string()]).await?;
                let Some(v) = v.into_iter().next() else {
                    return Ok(Vec::new());
                };
                let v = Arc::new(v);
                self.queries.insert(key, v.clone());
                v
            }
        };
        let query = query.as_slice();
        let kinds = q
            .kinds
            .as_ref()
            .map(|ks| ks.iter().map(|k| k.as_str().to_string()).collect());
        // Seeds: more than k, since the graph filter may drop some and neighbours compete.
        let hits = self.vectors.search(
            query,
            (q.k * 2).max(self.config.seeds),
            &VectorFilter {
                tenant: q.tenant.to_string(),
                agent: Some(q.agent.to_string()),
                kinds,
                scopes: match &q.sessions {
                    SessionScope::Every => None,
                    SessionScope::Only(s) => {
                        Some(std::iter::once(String::new()).chain(s.clone()).collect())
                    }
                },
            },
        )?;
        let seeds: Vec<(NodeId, f32)> = hits.iter().map(|h| (NodeId(h.id), h.score)).collect();
        let filter = QueryFilter {
            tenant: q.tenant.to_string(),
            agent: Some(q.agent.to_string()),
            kinds: q.kinds.clone(),
            exclude_session: q.exclude_session.map(str::to_string),
            exclude_since_ms: q.exclude_since_ms,
            sessions: q.sessions.clone(),
        };
        let g = self.graph_read()?;
        let recalls = g.hybrid_query(&seeds, q.k, q.hops, &filter, &Scoring::default(), q.at_ms);
        Ok(recalls
            .into_iter()
            .filter_map(|r| {
                let n = g.node(r.id)?;
                Some(Recalled {
                    kind: n.kind,
                    text: n.text.clone(),
                    importance: n.importance,
                    session: n.session.clone(),
                    recall: r,
                })
            })
            .collect())
    }
}

/// Keeps the best recalls whose tokens fit `budget` and renders them in canonical order.
pub fn render(mut recalls: Vec<Recalled>, budget: u32) -> Neighbourhood {
    let mut used = 0u32;
    recalls.retain(|r| {
        // Each line costs its text plus about two tokens of framing ("- ", newline).
        let cost = r.recall.tokens.saturating_add(2);
        let keep = used.saturating_add(cost) <= budget;
        if keep {
            used += cost;
        }
        keep
    });
    let mut order: Vec<Recall> = recalls.iter().map(|r| r.recall.clone()).collect();
    canonical_order(&mut order);
    let mut by_id: HashMap<NodeId, Recalled> =
        recalls.into_iter().map(|r| (r.recall.id, r)).collect();
    let nodes: Vec<Recalled> = order.iter().filter_map(|r| by_id.remove(&r.id)).collect();
    let text = nodes
        .iter()
        .map(|n| {
            format!(
                "- {}",
                n.text.split_whitespace().collect::<Vec<_>>().join(" ")
            )
        })
        .collect::<Vec<_>>()
        .join("\n");
    let tokens = nodes.iter().map(|n| n.recall.tokens).sum();
    Neighbourhood {
        nodes,
        text,
        tokens,
    }
}

async fn embed_blocking(
    embedder: &Arc<Embedder>,
    texts: Vec<String>,
) -> Result<Vec<Vec<f32>>, MemoryError> {
    let e = embedder.clone();
    let out = tokio::task::spawn_blocking(move || {
        let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
        e.embed(&refs)
    })
    .await
    .map_err(|_| {
        MemoryError::Embed(engram_model::ModelError::InvalidConfig {
            field: "embedder",
            reason: "the embedding thread failed".into(),
        })
    })?;
    out.map_err(MemoryError::Embed)
}
