//! Engram's memory graph: what an agent remembers, as nodes linked by typed edges, and the
//! scoring that recalls a neighbourhood for a query.
//!
//! - **Nodes** are episodic (a turn or an event of a session) or semantic (a fact, an entity, a
//!   concept). Each carries its text, an importance in 0..=1, its owner (tenant, agent), and
//!   created / updated / last-accessed times (milliseconds since the Unix epoch).
//! - **Edges** are typed ([`EdgeKind`]), weighted (0..=1) and may carry a validity interval
//!   `[valid_from, valid_to)`. An edge outside its interval is not traversed. A `supersedes` edge
//!   `new → old` marks `old` as outdated while the edge is valid: outdated nodes never surface
//!   and are not walked through.
//! - **Tenancy** is structural: an edge never joins two tenants, and a query names its tenant,
//!   so no path and no seed can reach another tenant's nodes.
//!
//! The crate is pure and synchronous (no I/O, no async): the database is the source of truth and
//! the service rebuilds the graph from it at start. Ids are the database's.
//!
//! # Recall scoring ([`MemoryGraph::hybrid_query`])
//! Seeds come from a vector search: `(node, similarity)`, similarity clamped to 0..=1. From the
//! seeds, proximity spreads along edges in either direction for at most `hops` hops:
//!
//! `proximity(n) = max over paths p from a seed s to n of  sim(s) · Π_{e ∈ p} (w_kind(e) · weight(e) · hop_decay)`
//!
//! (a seed's own proximity is its similarity). Every reached node that passes the filter gets
//!
//! `score = a_sim · sim(n) + a_prox · proximity(n) + a_rec · 2^(−age(n) / half_life) + a_imp · importance(n)`
//!
//! where `sim(n)` is 0 for nodes that were not seeds and `age` is `now − last_accessed` (never
//! negative). Results are ordered by score, then by id (ascending): the same graph and query
//! always give the same list. [`canonical_order`] re-sorts a result by creation time (then id)
//! for rendering, so that overlapping neighbourhoods render with a shared prefix — a newer node
//! joins at the end, after the older ones a previous turn showed — and the same memories
//! inserted in the same order render alike for any agent (ids are random).

use std::collections::{BTreeMap, HashMap};

use petgraph::Direction;
use petgraph::stable_graph::{EdgeIndex, NodeIndex, StableDiGraph};
use petgraph::visit::EdgeRef;
use serde::{Deserialize, Serialize};

/// A node's id (the database row id).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct NodeId(pub u64);

/// An edge's id (the database row id).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct EdgeId(pub u64);

impl std::fmt::Display for NodeId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl std::fmt::Display for EdgeId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// What a node holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum NodeKind {
    /// A turn or an event of a session (episodic memory).
    Episode,
    /// A statement held true (semantic).
    Fact,
    /// A person, place or thing (semantic).
    Entity,
    /// An idea or topic (semantic).
    Concept,
}

impl NodeKind {
    /// Every kind, in a fixed order.
    pub const ALL: [Self; 4] = [Self::Episode, Self::Fact, Self::Entity, Self::Concept];

    /// Facts, entities and concepts.
    pub fn is_semantic(self) -> bool {
        self != Self::Episode
    }

    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Episode => "episode",
            Self::Fact => "fact",
            Self::Entity => "entity",
            Self::Concept => "concept",
        }
    }

    /// Parses a wire name.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.as_str() == s)
    }
}

/// How two nodes relate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EdgeKind {
    /// An episode or fact names an entity.
    Mentions,
    /// Two nodes are about the same thing.
    RelatesTo,
    /// A fact was distilled from an episode or another fact.
    DerivedFrom,
    /// An episode follows the previous one of its session.
    Follows,
    /// A newer node replaces an older one while the edge is valid.
    Supersedes,
}

impl EdgeKind {
    /// Every kind, in a fixed order.
    pub const ALL: [Self; 5] = [
        Self::Mentions,
        Self::RelatesTo,
        Self::DerivedFrom,
        Self::Follows,
        Self::Supersedes,
    ];

    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Mentions => "mentions",
            Self::RelatesTo => "relates_to",
            Self::DerivedFrom => "derived_from",
            Self::Follows => "follows",
            Self::Supersedes => "supersedes",
        }
    }

    /// Parses a wire name.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.as_str() == s)
    }
}

/// A node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Node {
    /// Id.
    pub id: NodeId,
    /// Kind.
    pub kind: NodeKind,
    /// Owner tenant (the database's tenant id).
    pub tenant: String,
    /// Owner agent (the database's agent id).
    pub agent: String,
    /// The session of an episode.
    pub session: Option<String>,
    /// What is remembered.
    pub text: String,
    /// 0..=1.
    pub importance: f32,
    /// Tokens of `text` (the service counts them with the model's tokenizer).
    pub tokens: u32,
    /// Creation time, ms since the epoch.
    pub created_ms: i64,
    /// Last change, ms since the epoch.
    pub updated_ms: i64,
    /// Last recall, ms since the epoch.
    pub last_accessed_ms: i64,
}

/// An edge.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Edge {
    /// Id.
    pub id: EdgeId,
    /// Source.
    pub from: NodeId,
    /// Target.
    pub to: NodeId,
    /// Kind.
    pub kind: EdgeKind,
    /// 0..=1; multiplies the proximity that crosses it.
    pub weight: f32,
    /// Start of validity (inclusive), ms; `None`: always.
    pub valid_from_ms: Option<i64>,
    /// End of validity (exclusive), ms; `None`: never ends.
    pub valid_to_ms: Option<i64>,
}

impl Edge {
    /// Whether the edge holds at `at`.
    pub fn valid_at(&self, at: i64) -> bool {
        self.valid_from_ms.is_none_or(|f| at >= f) && self.valid_to_ms.is_none_or(|t| at < t)
    }
}

/// A rejected change. The graph is unchanged after every error.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GraphError {
    /// The node id is taken.
    #[error("node {0} already exists")]
    DuplicateNode(NodeId),
    /// No such node.
    #[error("node {0} does not exist")]
    UnknownNode(NodeId),
    /// The edge id is taken.
    #[error("edge {0} already exists")]
    DuplicateEdge(EdgeId),
    /// No such edge.
    #[error("edge {0} does not exist")]
    UnknownEdge(EdgeId),
    /// The edge would join two tenants.
    #[error("an edge cannot join tenant {from} and tenant {to}")]
    CrossTenant {
        /// Source's tenant.
        from: String,
        /// Target's tenant.
        to: String,
    },
    /// An edge from a node to itself.
    #[error("an edge cannot join node {0} to itself")]
    SelfLoop(NodeId),
    /// A value out of range.
    #[error("`{field}` = {value} is out of range ({reason})")]
    OutOfRange {
        /// The field.
        field: &'static str,
        /// The value.
        value: f64,
        /// The rule.
        reason: &'static str,
    },
}

/// Result of graph operations.
pub type GraphResult<T> = Result<T, GraphError>;

fn unit(field: &'static str, v: f32) -> GraphResult<()> {
    if (0.0..=1.0).contains(&v) {
        Ok(())
    } else {
        Err(GraphError::OutOfRange {
            field,
            value: f64::from(v),
            reason: "must be within 0..=1",
        })
    }
}

/// Multipliers of proximity per edge kind (0 stops traversal through that kind).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct EdgeWeights {
    /// `mentions`.
    pub mentions: f32,
    /// `relates_to`.
    pub relates_to: f32,
    /// `derived_from`.
    pub derived_from: f32,
    /// `follows`.
    pub follows: f32,
    /// `supersedes` (0 by default: an outdated node's neighbourhood is not the new one's).
    pub supersedes: f32,
}

impl Default for EdgeWeights {
    fn default() -> Self {
        Self {
            mentions: 0.8,
            relates_to: 0.7,
            derived_from: 0.6,
            follows: 0.5,
            supersedes: 0.0,
        }
    }
}

impl EdgeWeights {
    /// The multiplier of `kind`.
    pub fn of(&self, kind: EdgeKind) -> f32 {
        match kind {
            EdgeKind::Mentions => self.mentions,
            EdgeKind::RelatesTo => self.relates_to,
            EdgeKind::DerivedFrom => self.derived_from,
            EdgeKind::Follows => self.follows,
            EdgeKind::Supersedes => self.supersedes,
        }
    }
}

/// Weights of the recall score (see the crate docs).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Scoring {
    /// `a_sim`.
    pub similarity: f32,
    /// `a_prox`.
    pub proximity: f32,
    /// `a_rec`.
    pub recency: f32,
    /// `a_imp`.
    pub importance: f32,
    /// Age at which recency halves, ms.
    pub half_life_ms: f64,
    /// Multiplier per hop (on top of the edge weights).
    pub hop_decay: f32,
    /// Per-kind edge multipliers.
    pub edges: EdgeWeights,
}

impl Default for Scoring {
    fn default() -> Self {
        Self {
            similarity: 0.5,
            proximity: 0.3,
            recency: 0.1,
            importance: 0.1,
            half_life_ms: 7.0 * 24.0 * 3600.0 * 1000.0,
            hop_decay: 0.9,
            edges: EdgeWeights::default(),
        }
    }
}

/// Which nodes a query may return.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct QueryFilter {
    /// The tenant (always enforced).
    pub tenant: String,
    /// Only this agent's nodes.
    pub agent: Option<String>,
    /// Only these kinds (`None`: all).
    pub kinds: Option<Vec<NodeKind>>,
    /// Never this session's nodes (the conversation already holds its episodes). They may
    /// still seed and relay proximity.
    #[serde(default)]
    pub exclude_session: Option<String>,
    /// With `exclude_session`: only its nodes created at or after this time (ms) are left
    /// out — the turns the conversation still shows; older ones (turns the window dropped) may
    /// be recalled. `None`: all of them are left out.
    #[serde(default)]
    pub exclude_since_ms: Option<i64>,
    /// Which sessions' nodes the query may see at all (returned, seeded or relayed through).
    #[serde(default)]
    pub sessions: SessionScope,
}

/// Which session-bound nodes (`session: Some`) a query sees. Nodes of no session (the agent's
/// own facts) are seen by every query of their agent.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SessionScope {
    /// Every session's (an agent whose memory is agent-wide, or the tenant's own memory API).
    #[default]
    Every,
    /// Only this session's (`None`: a stateless turn, which sees no session's nodes).
    Only(Option<String>),
}

impl SessionScope {
    /// Whether a node of `session` is within the scope.
    pub fn sees(&self, session: Option<&str>) -> bool {
        match (self, session) {
            (Self::Every, _) | (_, None) => true,
            (Self::Only(own), Some(s)) => own.as_deref() == Some(s),
        }
    }
}

impl QueryFilter {
    /// Whether `n` may be returned.
    pub fn admits(&self, n: &Node) -> bool {
        let excluded = self.exclude_session.is_some()
            && n.session == self.exclude_session
            && self.exclude_since_ms.is_none_or(|t| n.created_ms >= t);
        n.tenant == self.tenant
            && self.sessions.sees(n.session.as_deref())
            && self.agent.as_ref().is_none_or(|a| *a == n.agent)
            && self.kinds.as_ref().is_none_or(|k| k.contains(&n.kind))
            && !excluded
    }
}

/// One recalled node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Recall {
    /// The node.
    pub id: NodeId,
    /// Its total score.
    pub score: f32,
    /// Its own vector similarity (0 if it was not a seed).
    pub similarity: f32,
    /// Best seed-to-node proximity.
    pub proximity: f32,
    /// Recency term, `2^(−age/half_life)`.
    pub recency: f32,
    /// Hops from the nearest (best) seed.
    pub hops: u32,
    /// Tokens of the node's text.
    pub tokens: u32,
    /// When the node was created (ms since the Unix epoch).
    pub created_ms: i64,
}

/// Sorts a recall result by creation time, then node id: the order the memories layer renders
/// it in (see the crate docs).
pub fn canonical_order(recalls: &mut [Recall]) {
    recalls.sort_by_key(|r| (r.created_ms, r.id));
}

/// A rough token count for text without a tokenizer at hand (about four bytes a token).
pub fn estimate_tokens(text: &str) -> u32 {
    u32::try_from(text.len().div_ceil(4))
        .unwrap_or(u32::MAX)
        .max(1)
}

/// The graph (see the crate docs).
#[derive(Debug, Clone, Default)]
pub struct MemoryGraph {
    graph: StableDiGraph<Node, Edge>,
    nodes: HashMap<NodeId, NodeIndex>,
    edges: HashMap<EdgeId, EdgeIndex>,
}

impl MemoryGraph {
    /// An empty graph.
    pub fn new() -> Self {
        Self::default()
    }

    /// Nodes held.
    pub fn node_count(&self) -> usize {
        self.nodes.len()
    }

    /// Edges held.
    pub fn edge_count(&self) -> usize {
        self.edges.len()
    }

    /// A node.
    pub fn node(&self, id: NodeId) -> Option<&Node> {
        self.nodes.get(&id).and_then(|&i| self.graph.node_weight(i))
    }

    /// An edge.
    pub fn edge(&self, id: EdgeId) -> Option<&Edge> {
        self.edges.get(&id).and_then(|&i| self.graph.edge_weight(i))
    }

    /// The edges touching `id` (both directions), by edge id.
    pub fn edges_of(&self, id: NodeId) -> GraphResult<Vec<&Edge>> {
        let &i = self.nodes.get(&id).ok_or(GraphError::UnknownNode(id))?;
        let mut out: Vec<&Edge> = self
            .graph
            .edges_directed(i, Direction::Outgoing)
            .chain(self.graph.edges_directed(i, Direction::Incoming))
            .map(|e| e.weight())
            .collect();
        out.sort_by_key(|e| e.id);
        Ok(out)
    }

    /// Adds a node.
    pub fn add_node(&mut self, node: Node) -> GraphResult<()> {
        if self.nodes.contains_key(&node.id) {
            return Err(GraphError::DuplicateNode(node.id));
        }
        unit("importance", node.importance)?;
        let id = node.id;
        let i = self.graph.add_node(node);
        self.nodes.insert(id, i);
        Ok(())
    }

    /// Replaces a node's contents (same id; tenant and agent cannot change).
    pub fn update_node(&mut self, node: Node) -> GraphResult<()> {
        let &i = self
            .nodes
            .get(&node.id)
            .ok_or(GraphError::UnknownNode(node.id))?;
        unit("importance", node.importance)?;
        let old = &self.graph[i];
        if old.tenant != node.tenant {
            return Err(GraphError::CrossTenant {
                from: old.tenant.clone(),
                to: node.tenant,
            });
        }
        self.graph[i] = node;
        Ok(())
    }

    /// Removes a node and its edges; returns the removed edges' ids.
    pub fn remove_node(&mut self, id: NodeId) -> GraphResult<Vec<EdgeId>> {
        let i = self.nodes.remove(&id).ok_or(GraphError::UnknownNode(id))?;
        let gone: Vec<EdgeId> = self
            .graph
            .edges_directed(i, Direction::Outgoing)
            .chain(self.graph.edges_directed(i, Direction::Incoming))
            .map(|e| e.weight().id)
            .collect();
        for e in &gone {
            self.edges.remove(e);
        }
        self.graph.remove_node(i);
        Ok(gone)
    }

    /// Adds an edge between two nodes of one tenant.
    pub fn add_edge(&mut self, edge: Edge) -> GraphResult<()> {
        if self.edges.contains_key(&edge.id) {
            return Err(GraphError::DuplicateEdge(edge.id));
        }
        let &a = self
            .nodes
            .get(&edge.from)
            .ok_or(GraphError::UnknownNode(edge.from))?;
        let &b = self
            .nodes
            .get(&edge.to)
            .ok_or(GraphError::UnknownNode(edge.to))?;
        if a == b {
            return Err(GraphError::SelfLoop(edge.from));
        }
        let (ta, tb) = (&self.graph[a].tenant, &self.graph[b].tenant);
        if ta != tb {
            return Err(GraphError::CrossTenant {
                from: ta.clone(),
                to: tb.clone(),
            });
        }
        unit("weight", edge.weight)?;
        if let (Some(f), Some(t)) = (edge.valid_from_ms, edge.valid_to_ms)
            && t <= f
        {
            return Err(GraphError::OutOfRange {
                field: "valid_to_ms",
                value: t as f64,
                reason: "must be after valid_from_ms",
            });
        }
        let id = edge.id;
        let e = self.graph.add_edge(a, b, edge);
        self.edges.insert(id, e);
        Ok(())
    }

    /// Removes an edge.
    pub fn remove_edge(&mut self, id: EdgeId) -> GraphResult<Edge> {
        let e = self.edges.remove(&id).ok_or(GraphError::UnknownEdge(id))?;
        self.graph.remove_edge(e).ok_or(GraphError::UnknownEdge(id))
    }

    /// Marks nodes as recalled at `now` (recency counts from here).
    pub fn touch(&mut self, ids: &[NodeId], now_ms: i64) {
        for id in ids {
            if let Some(&i) = self.nodes.get(id) {
                let n = &mut self.graph[i];
                n.last_accessed_ms = n.last_accessed_ms.max(now_ms);
            }
        }
    }

    /// Whether a valid `supersedes` edge points at `id` at `at`.
    pub fn is_superseded(&self, id: NodeId, at: i64) -> bool {
        self.nodes.get(&id).is_some_and(|&i| self.superseded(i, at))
    }

    fn superseded(&self, i: NodeIndex, at: i64) -> bool {
        self.graph
            .edges_directed(i, Direction::Incoming)
            .any(|e| e.weight().kind == EdgeKind::Supersedes && e.weight().valid_at(at))
    }

    /// Hybrid recall (see the crate docs): `seeds` from a vector search, expanded `hops` hops,
    /// filtered, scored, the best `k` in a deterministic order.
    pub fn hybrid_query(
        &self,
        seeds: &[(NodeId, f32)],
        k: usize,
        hops: u32,
        filter: &QueryFilter,
        scoring: &Scoring,
        now_ms: i64,
    ) -> Vec<Recall> {
        // Best (proximity, hops) per node; similarity per seed. BTreeMaps keep every step in
        // node-id order, so ties and float sums never depend on hash order.
        let mut best: BTreeMap<NodeIndex, (f32, u32)> = BTreeMap::new();
        let mut sims: HashMap<NodeIndex, f32> = HashMap::new();
        let usable = |i: NodeIndex| {
            let n = &self.graph[i];
            n.tenant == filter.tenant
                && filter.sessions.sees(n.session.as_deref())
                && !self.superseded(i, now_ms)
        };
        for &(id, sim) in seeds {
            let Some(&i) = self.nodes.get(&id) else {
                continue;
            };
            if !usable(i) {
                continue;
            }
            let sim = if sim.is_finite() {
                sim.clamp(0.0, 1.0)
            } else {
                0.0
            };
            let s = sims.entry(i).or_insert(0.0);
            *s = s.max(sim);
            let b = best.entry(i).or_insert((0.0, 0));
            b.0 = b.0.max(sim);
        }
        // Bounded relaxation, one hop per round, from the nodes improved in the last round, with
        // their proximity as the round began (a node improved in round h has a path of h hops).
        let mut frontier: Vec<(NodeIndex, f32)> = best.iter().map(|(&i, b)| (i, b.0)).collect();
        for hop in 1..=hops {
            let mut next: BTreeMap<NodeIndex, ()> = BTreeMap::new();
            for &(i, prox) in &frontier {
                let out = self.graph.edges_directed(i, Direction::Outgoing);
                let inc = self.graph.edges_directed(i, Direction::Incoming);
                for e in out.chain(inc) {
                    let w = e.weight();
                    let f = scoring.edges.of(w.kind) * w.weight * scoring.hop_decay;
                    if f <= 0.0 || !w.valid_at(now_ms) {
                        continue;
                    }
                    let j = if e.source() == i {
                        e.target()
                    } else {
                        e.source()
                    };
                    if !usable(j) {
                        continue;
                    }
                    let p = prox * f;
                    let cur = best.get(&j).map_or(0.0, |b| b.0);
                    if p > cur {
                        best.insert(j, (p, hop));
                        next.insert(j, ());
                    }
                }
            }
            frontier = next.into_keys().map(|i| (i, best[&i].0)).collect();
            if frontier.is_empty() {
                break;
            }
        }
        let ln2 = std::f64::consts::LN_2;
        let mut out: Vec<Recall> = best
            .into_iter()
            .filter_map(|(i, (proximity, hops))| {
                let n = &self.graph[i];
                if !filter.admits(n) {
                    return None;
                }
                let similarity = sims.get(&i).copied().unwrap_or(0.0);
                let age = (now_ms - n.last_accessed_ms).max(0) as f64;
                let recency = if scoring.half_life_ms > 0.0 {
                    (-ln2 * age / scoring.half_life_ms).exp() as f32
                } else {
                    0.0
                };
                let score = scoring.similarity * similarity
                    + scoring.proximity * proximity
                    + scoring.recency * recency
                    + scoring.importance * n.importance;
                Some(Recall {
                    id: n.id,
                    score,
                    similarity,
                    proximity,
                    recency,
                    hops,
                    tokens: n.tokens,
                    created_ms: n.created_ms,
                })
            })
            .collect();
        out.sort_by(|a, b| b.score.total_cmp(&a.score).then(a.id.cmp(&b.id)));
        out.truncate(k);
        out
    }
}

#[cfg(test)]
mod tests;
