//! A remote Qdrant through `qdrant-client` (gRPC), so several Engram nodes sharing a database
//! share one vector index (`memory.vector_url`).
//!
//! The [`VectorStore`] trait is synchronous (the embedded store blocks on its disk the same
//! way): each call runs on the store's own small Tokio runtime and the caller waits for its
//! answer on a channel, so it works from async handlers without nesting runtimes. One
//! collection (cosine distance, keyword payload indexes on `tenant`, `agent` and `kind`);
//! every search carries the tenant condition in Qdrant's filter. A lost connection fails the
//! call (`VectorError::Remote`); the client reconnects on the next one.

use std::collections::HashMap;
use std::future::Future;
use std::time::Duration;

use qdrant_client::Qdrant;
use qdrant_client::qdrant::{
    Condition, CountPointsBuilder, CreateCollectionBuilder, CreateFieldIndexCollectionBuilder,
    DeletePointsBuilder, Distance, FieldType, Filter, PointStruct, PointsIdsList,
    SearchPointsBuilder, UpsertPointsBuilder, Value, VectorParamsBuilder,
};

use crate::{
    FIELDS, Hit, VectorError, VectorFilter, VectorPoint, VectorResult, VectorStore, check,
};

/// How long one call may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// A collection of a remote Qdrant.
pub struct RemoteStore {
    client: Qdrant,
    /// Always `Some` until dropped (then shut down without blocking: a store may be dropped
    /// from an async context).
    runtime: Option<tokio::runtime::Runtime>,
    collection: String,
    dim: usize,
    url: String,
}

impl std::fmt::Debug for RemoteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteStore")
            .field("url", &self.url)
            .field("collection", &self.collection)
            .field("dim", &self.dim)
            .finish_non_exhaustive()
    }
}

fn remote(e: impl std::fmt::Display) -> VectorError {
    VectorError::Remote(e.to_string())
}

impl RemoteStore {
    /// Connects to `url` (`http://host:6334`, the gRPC port) and opens `collection`, creating it
    /// for `dim`-wide cosine vectors with its payload indexes when it does not exist; an
    /// existing collection of another width is [`VectorError::Mismatch`].
    pub fn open(
        url: &str,
        api_key: Option<&str>,
        collection: &str,
        dim: usize,
    ) -> VectorResult<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("engram-qdrant")
            .enable_all()
            .build()
            .map_err(remote)?;
        let mut config = Qdrant::from_url(url)
            .timeout(CALL_TIMEOUT)
            .connect_timeout(Duration::from_secs(5))
            .skip_compatibility_check();
        if let Some(k) = api_key.filter(|k| !k.is_empty()) {
            config = config.api_key(k.to_string());
        }
        let client = config.build().map_err(remote)?;
        let me = Self {
            client,
            runtime: Some(runtime),
            collection: collection.to_string(),
            dim,
            url: url.to_string(),
        };
        me.ensure_collection()?;
        Ok(me)
    }

    /// The server's address.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Runs `fut` on the store's runtime and waits for it (from any thread, async or not).
    fn call<T: Send + 'static>(
        &self,
        fut: impl Future<Output = VectorResult<T>> + Send + 'static,
    ) -> VectorResult<T> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let runtime = self
            .runtime
            .as_ref()
            .ok_or_else(|| VectorError::Remote("the store is closed".into()))?;
        runtime.spawn(async move {
            let _ = tx.send(fut.await);
        });
        rx.recv_timeout(CALL_TIMEOUT + Duration::from_secs(5))
            .map_err(|_| VectorError::Remote("no answer from the vector server".into()))?
    }

    fn ensure_collection(&self) -> VectorResult<()> {
        let (client, name, dim) = (self.client.clone(), self.collection.clone(), self.dim);
        self.call(async move {
            if client.collection_exists(&name).await.map_err(remote)? {
                let info = client.collection_info(&name).await.map_err(remote)?;
                let found = info
                    .result
                    .and_then(|r| r.config)
                    .and_then(|c| c.params)
                    .and_then(|p| p.vectors_config)
                    .and_then(|v| v.config)
                    .and_then(|c| match c {
                        qdrant_client::qdrant::vectors_config::Config::Params(p) => Some(p.size),
                        qdrant_client::qdrant::vectors_config::Config::ParamsMap(_) => None,
                    });
                return match found {
                    Some(size) if size as usize == dim => Ok(()),
                    other => Err(VectorError::Mismatch {
                        path: format!("qdrant collection {name}").into(),
                        found: other.map_or(0, |s| s as usize),
                        expected: dim,
                    }),
                };
            }
            client
                .create_collection(
                    CreateCollectionBuilder::new(&name)
                        .vectors_config(VectorParamsBuilder::new(dim as u64, Distance::Cosine)),
                )
                .await
                .map_err(remote)?;
            for (field, _) in FIELDS {
                client
                    .create_field_index(
                        CreateFieldIndexCollectionBuilder::new(&name, field, FieldType::Keyword)
                            .wait(true),
                    )
                    .await
                    .map_err(remote)?;
            }
            Ok(())
        })
    }
}

impl Drop for RemoteStore {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

/// Qdrant's filter for `f`: the tenant always, the agent, kinds and scopes when given.
fn filter_of(f: &VectorFilter) -> Filter {
    let mut must = vec![Condition::matches("tenant", f.tenant.clone())];
    if let Some(a) = &f.agent {
        must.push(Condition::matches("agent", a.clone()));
    }
    if let Some(kinds) = &f.kinds {
        must.push(Condition::matches("kind", kinds.clone()));
    }
    if let Some(scopes) = &f.scopes {
        must.push(Condition::matches("scope", scopes.clone()));
    }
    Filter::must(must)
}

impl VectorStore for RemoteStore {
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
        let list: Vec<PointStruct> = points
            .iter()
            .map(|p| {
                let payload: HashMap<String, Value> = [
                    ("tenant".to_string(), Value::from(p.tenant.clone())),
                    ("agent".to_string(), Value::from(p.agent.clone())),
                    ("kind".to_string(), Value::from(p.kind.clone())),
                    ("scope".to_string(), Value::from(p.scope.clone())),
                ]
                .into_iter()
                .collect();
                PointStruct::new(p.id, p.vector.clone(), payload)
            })
            .collect();
        let (client, name) = (self.client.clone(), self.collection.clone());
        self.call(async move {
            client
                .upsert_points(UpsertPointsBuilder::new(name, list).wait(true))
                .await
                .map(|_| ())
                .map_err(remote)
        })
    }

    fn delete(&self, ids: &[u64]) -> VectorResult<()> {
        if ids.is_empty() {
            return Ok(());
        }
        let ids: Vec<_> = ids.iter().map(|&i| i.into()).collect();
        let (client, name) = (self.client.clone(), self.collection.clone());
        self.call(async move {
            client
                .delete_points(
                    DeletePointsBuilder::new(name)
                        .points(PointsIdsList { ids })
                        .wait(true),
                )
                .await
                .map(|_| ())
                .map_err(remote)
        })
    }

    fn search(&self, query: &[f32], k: usize, filter: &VectorFilter) -> VectorResult<Vec<Hit>> {
        check(self.dim, 0, query)?;
        if k == 0 {
            return Ok(Vec::new());
        }
        let req = SearchPointsBuilder::new(self.collection.clone(), query.to_vec(), k as u64)
            .filter(filter_of(filter));
        let client = self.client.clone();
        let found = self.call(async move { client.search_points(req).await.map_err(remote) })?;
        let mut hits: Vec<Hit> = found
            .result
            .into_iter()
            .filter_map(|p| match p.id.and_then(|i| i.point_id_options) {
                Some(qdrant_client::qdrant::point_id::PointIdOptions::Num(id)) => {
                    Some(Hit { id, score: p.score })
                }
                _ => None,
            })
            .collect();
        hits.sort_by(|a, b| b.score.total_cmp(&a.score).then(a.id.cmp(&b.id)));
        Ok(hits)
    }

    fn count(&self) -> VectorResult<usize> {
        let (client, name) = (self.client.clone(), self.collection.clone());
        self.call(async move {
            let r = client
                .count(CountPointsBuilder::new(name).exact(true))
                .await
                .map_err(remote)?;
            Ok(r.result.map_or(0, |c| c.count as usize))
        })
    }

    fn clear(&self) -> VectorResult<()> {
        let (client, name) = (self.client.clone(), self.collection.clone());
        self.call(async move {
            client
                .delete_points(
                    DeletePointsBuilder::new(name)
                        .points(Filter::default())
                        .wait(true),
                )
                .await
                .map(|_| ())
                .map_err(remote)
        })
    }

    fn flush(&self) -> VectorResult<()> {
        // Every write waited for the server to apply it.
        Ok(())
    }
}
