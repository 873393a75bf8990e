//! Vector stores for the memory graph, behind one trait ([`VectorStore`]).
//!
//! - [`EdgeStore`]: qdrant-edge, embedded in the process and persisted in a directory under the
//!   data dir (the default). Cosine distance, payload indexes on `tenant`, `agent`, `kind` and
//!   `scope` (the session a node is private to, `""` for none).
//! - `RemoteStore` (feature `qdrant`): a collection of a remote Qdrant through `qdrant-client`,
//!   so Engram nodes sharing a database share the index.
//! - `grpc_server` (feature `qdrant-server`, for tests): a server speaking Qdrant's gRPC
//!   protocol — the subset Engram's client uses — backed by qdrant-edge. It is not a Qdrant
//!   server; no package registry ships one.
//!
//! Every point carries its owner in its payload and every search names a tenant: the tenant
//! condition is part of the store's filter, never a post-filter, so a search cannot return
//! another tenant's points. The database is the source of truth; a store can be cleared and
//! refilled from it (when the embedding model changes, its fingerprint says so).

use std::path::{Path, PathBuf};

use qdrant_edge::{
    Condition, CountRequest, Distance, EdgeConfigBuilder, EdgeShard, EdgeVectorParamsBuilder,
    FieldCondition, FieldIndexOperations, Filter, JsonPath, Match, MatchAny, MatchValue,
    NamedQuery, Payload, PayloadFieldSchema, PayloadSchemaType, PointId, PointInsertOperations,
    PointOperations, PointStructPersisted, QueryEnum, QueryRequest, ScoringQuery, UpdateOperation,
    ValueVariants, VectorInternal, VectorStructPersisted, WithPayloadInterface, WithVector,
};

/// The payload fields every point carries.
pub(crate) const FIELDS: [(&str, PayloadSchemaType); 4] = [
    ("tenant", PayloadSchemaType::Keyword),
    ("agent", PayloadSchemaType::Keyword),
    ("kind", PayloadSchemaType::Keyword),
    ("scope", PayloadSchemaType::Keyword),
];

/// What the payload of a point holds: [`VectorPoint`]'s owner fields. A store written before a
/// field existed lacks it; the memory service re-indexes when this changes.
pub const PAYLOAD_VERSION: u32 = 2;

/// A vector-store failure.
#[derive(Debug, thiserror::Error)]
pub enum VectorError {
    /// A vector of the wrong width.
    #[error("vector of {got} dimensions; the store holds {expected}")]
    Dimension {
        /// The store's width.
        expected: usize,
        /// The vector's.
        got: usize,
    },
    /// A vector with a NaN or an infinity.
    #[error("vector of point {0} is not finite")]
    NotFinite(u64),
    /// The store on disk was made for another width.
    #[error("the store at {path} holds {found}-dimensional vectors, not {expected}")]
    Mismatch {
        /// The directory.
        path: PathBuf,
        /// Its width.
        found: usize,
        /// The width asked for.
        expected: usize,
    },
    /// Filesystem.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// The engine underneath.
    #[error("vector engine: {0}")]
    Engine(String),
    /// The remote vector server (unreachable, or it refused the call).
    #[error("vector server: {0}")]
    Remote(String),
}

/// Result of vector-store operations.
pub type VectorResult<T> = Result<T, VectorError>;

fn engine(e: impl std::fmt::Display) -> VectorError {
    VectorError::Engine(e.to_string())
}

/// One point: a node's vector and its owner.
#[derive(Debug, Clone, PartialEq)]
pub struct VectorPoint {
    /// The node id.
    pub id: u64,
    /// The embedding.
    pub vector: Vec<f32>,
    /// Owner tenant.
    pub tenant: String,
    /// Owner agent.
    pub agent: String,
    /// Node kind (`episode`, `fact`, …).
    pub kind: String,
    /// The session the node belongs to (`""`: none, the agent's own).
    pub scope: String,
}

/// What a search may return.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct VectorFilter {
    /// The tenant (always enforced).
    pub tenant: String,
    /// Only this agent's points.
    pub agent: Option<String>,
    /// Only these kinds (`None`: all).
    pub kinds: Option<Vec<String>>,
    /// Only points of these scopes (`None`: all; `""` is the agent's own, of no session).
    pub scopes: Option<Vec<String>>,
}

/// A search hit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Hit {
    /// The node id.
    pub id: u64,
    /// Cosine similarity.
    pub score: f32,
}

/// What every vector store does.
pub trait VectorStore: Send + Sync + std::fmt::Debug {
    /// Vector width.
    fn dim(&self) -> usize;
    /// Inserts or replaces points.
    fn upsert(&self, points: &[VectorPoint]) -> VectorResult<()>;
    /// Removes points (unknown ids are ignored).
    fn delete(&self, ids: &[u64]) -> VectorResult<()>;
    /// The `k` nearest points that pass `filter`, best first (ties by id).
    fn search(&self, query: &[f32], k: usize, filter: &VectorFilter) -> VectorResult<Vec<Hit>>;
    /// Points held.
    fn count(&self) -> VectorResult<usize>;
    /// Removes every point.
    fn clear(&self) -> VectorResult<()>;
    /// Makes every change durable.
    fn flush(&self) -> VectorResult<()>;
    /// Builds search indexes over what was written (HNSW above the engine's size threshold);
    /// blocking. A no-op where the engine indexes on its own.
    fn optimize(&self) -> VectorResult<()> {
        Ok(())
    }
}

pub(crate) fn check(dim: usize, id: u64, v: &[f32]) -> VectorResult<()> {
    if v.len() != dim {
        return Err(VectorError::Dimension {
            expected: dim,
            got: v.len(),
        });
    }
    if v.iter().any(|x| !x.is_finite()) {
        return Err(VectorError::NotFinite(id));
    }
    Ok(())
}

fn key(name: &str) -> VectorResult<JsonPath> {
    JsonPath::try_from(name).map_err(|_| VectorError::Engine(format!("bad payload key {name}")))
}

fn matches(name: &str, value: ValueVariants) -> VectorResult<Condition> {
    Ok(Condition::Field(FieldCondition::new_match(
        key(name)?,
        Match::Value(MatchValue { value }),
    )))
}

impl VectorFilter {
    fn to_filter(&self) -> VectorResult<Filter> {
        let mut must = vec![matches(
            "tenant",
            ValueVariants::String(self.tenant.clone()),
        )?];
        if let Some(a) = &self.agent {
            must.push(matches("agent", ValueVariants::String(a.clone()))?);
        }
        for (name, values) in [("kind", &self.kinds), ("scope", &self.scopes)] {
            if let Some(values) = values {
                must.push(Condition::Field(FieldCondition::new_match(
                    key(name)?,
                    Match::Any(MatchAny {
                        any: qdrant_edge::AnyVariants::Strings(values.iter().cloned().collect()),
                    }),
                )));
            }
        }
        Ok(Filter {
            should: None,
            min_should: None,
            must: Some(must),
            must_not: None,
        })
    }
}

/// qdrant-edge in a directory (see the crate docs).
#[derive(Debug)]
pub struct EdgeStore {
    shard: EdgeShard,
    dim: usize,
    path: PathBuf,
}

/// The store's own record of its width, beside the shard.
pub(crate) const DIM_FILE: &str = "engram-dim";

impl EdgeStore {
    /// Opens the store in `dir` (created if missing) for `dim`-wide vectors.
    pub fn open(dir: &Path, dim: usize) -> VectorResult<Self> {
        let io = |source| VectorError::Io {
            path: dir.to_path_buf(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(io)?;
        let dim_file = dir.join(DIM_FILE);
        let shard = match std::fs::read_to_string(&dim_file) {
            Ok(s) => {
                let found: usize = s.trim().parse().map_err(|_| {
                    VectorError::Engine(format!("{} is not a width", dim_file.display()))
                })?;
                if found != dim {
                    return Err(VectorError::Mismatch {
                        path: dir.to_path_buf(),
                        found,
                        expected: dim,
                    });
                }
                EdgeShard::load(dir, None).map_err(engine)?
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let config = EdgeConfigBuilder::new()
                    .vector(
                        "",
                        EdgeVectorParamsBuilder::new(dim, Distance::Cosine).build(),
                    )
                    .build();
                let shard = EdgeShard::new(dir, config).map_err(engine)?;
                for (name, schema) in FIELDS {
                    shard
                        .update(UpdateOperation::FieldIndexOperation(
                            FieldIndexOperations::CreateIndex(qdrant_edge::CreateIndex {
                                field_name: key(name)?,
                                field_schema: Some(PayloadFieldSchema::FieldType(schema)),
                            }),
                        ))
                        .map_err(engine)?;
                }
                std::fs::write(&dim_file, dim.to_string()).map_err(io)?;
                shard
            }
            Err(e) => return Err(io(e)),
        };
        Ok(Self {
            shard,
            dim,
            path: dir.to_path_buf(),
        })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl VectorStore for EdgeStore {
    fn dim(&self) -> usize {
        self.dim
    }

    fn upsert(&self, points: &[VectorPoint]) -> VectorResult<()> {
        for p in points {
            check(self.dim, p.id, &p.vector)?;
        }
        if points.is_empty() {
            return Ok(());
        }
        let list = points
            .iter()
            .map(|p| {
                let mut payload = serde_json::Map::new();
                payload.insert("tenant".into(), p.tenant.clone().into());
                payload.insert("agent".into(), p.agent.clone().into());
                payload.insert("kind".into(), p.kind.clone().into());
                payload.insert("scope".into(), p.scope.clone().into());
                Ok(PointStructPersisted {
                    id: PointId::NumId(p.id),
                    vector: VectorStructPersisted::Single(p.vector.clone()),
                    payload: Some(Payload(payload)),
                })
            })
            .collect::<VectorResult<Vec<_>>>()?;
        self.shard
            .update(UpdateOperation::PointOperation(
                PointOperations::UpsertPoints(PointInsertOperations::PointsList(list)),
            ))
            .map_err(engine)
    }

    fn delete(&self, ids: &[u64]) -> VectorResult<()> {
        if ids.is_empty() {
            return Ok(());
        }
        self.shard
            .update(UpdateOperation::PointOperation(
                PointOperations::DeletePoints {
                    ids: ids.iter().map(|&i| PointId::NumId(i)).collect(),
                },
            ))
            .map_err(engine)
    }

    fn search(&self, query: &[f32], k: usize, filter: &VectorFilter) -> VectorResult<Vec<Hit>> {
        check(self.dim, 0, query)?;
        if k == 0 {
            return Ok(Vec::new());
        }
        let found = self
            .shard
            .query(QueryRequest {
                prefetches: Vec::new(),
                query: Some(ScoringQuery::Vector(QueryEnum::Nearest(NamedQuery {
                    query: VectorInternal::from(query.to_vec()),
                    using: None,
                }))),
                filter: Some(filter.to_filter()?),
                score_threshold: None,
                limit: k,
                offset: 0,
                params: None,
                with_vector: WithVector::Bool(false),
                with_payload: WithPayloadInterface::Bool(false),
            })
            .map_err(engine)?;
        let mut hits: Vec<Hit> = found
            .into_iter()
            .filter_map(|p| match p.id {
                PointId::NumId(id) => Some(Hit { id, score: p.score }),
                PointId::Uuid(_) => None,
            })
            .collect();
        hits.sort_by(|a, b| b.score.total_cmp(&a.score).then(a.id.cmp(&b.id)));
        Ok(hits)
    }

    fn count(&self) -> VectorResult<usize> {
        self.shard
            .count(CountRequest {
                filter: None,
                exact: true,
            })
            .map_err(engine)
    }

    fn clear(&self) -> VectorResult<()> {
        self.shard
            .update(UpdateOperation::PointOperation(
                PointOperations::DeletePointsByFilter(Filter {
                    should: None,
                    min_should: None,
                    must: None,
                    must_not: None,
                }),
            ))
            .map_err(engine)
    }

    fn flush(&self) -> VectorResult<()> {
        self.shard.flush();
        Ok(())
    }

    fn optimize(&self) -> VectorResult<()> {
        self.shard.optimize().map_err(engine)?;
        Ok(())
    }
}

#[cfg(feature = "qdrant-server")]
pub mod grpc_server;
#[cfg(feature = "qdrant")]
mod remote;
#[cfg(feature = "qdrant")]
pub use remote::RemoteStore;

#[cfg(test)]
mod tests;
