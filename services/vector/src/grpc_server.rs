//! A server speaking Qdrant's gRPC protocol — the subset Engram's client uses: collections
//! (create, exists, info, delete), points (upsert, delete by ids or all, search with keyword
//! filters, count, payload indexes) and the health check — backed by qdrant-edge through
//! [`EdgeStore`], one store per collection under a directory. It exists for tests: no package
//! registry ships a Qdrant server. **It is not a Qdrant server**: any other call answers
//! `UNIMPLEMENTED`, and filters other than keyword matches on `tenant`, `agent` and `kind` are
//! refused.
//!
//! [`TestServer::start`] serves it on a local port from its own thread and runtime; drop or
//! [`TestServer::stop`] ends it (a restart on the same port is how the tests cut connections).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use qdrant_client::qdrant as q;
use tonic::{Request, Response, Status};

use crate::{EdgeStore, VectorFilter, VectorPoint, VectorStore};

/// The service: collections by name.
#[derive(Debug, Clone)]
pub struct Service {
    dir: PathBuf,
    collections: Arc<Mutex<HashMap<String, Arc<EdgeStore>>>>,
}

fn internal(e: impl std::fmt::Display) -> Status {
    Status::internal(e.to_string())
}

fn ok_points() -> Response<q::PointsOperationResponse> {
    Response::new(q::PointsOperationResponse {
        result: Some(q::UpdateResult {
            operation_id: Some(0),
            status: q::UpdateStatus::Completed as i32,
        }),
        ..Default::default()
    })
}

/// A keyword condition's field and its values.
fn keywords(c: &q::Condition) -> Result<(String, Vec<String>), Status> {
    use q::condition::ConditionOneOf;
    use q::r#match::MatchValue;
    let Some(ConditionOneOf::Field(f)) = &c.condition_one_of else {
        return Err(Status::invalid_argument(
            "only field conditions are supported",
        ));
    };
    let values = match f.r#match.as_ref().and_then(|m| m.match_value.as_ref()) {
        Some(MatchValue::Keyword(k)) => vec![k.clone()],
        Some(MatchValue::Keywords(ks)) => ks.strings.clone(),
        _ => {
            return Err(Status::invalid_argument(
                "only keyword matches are supported",
            ));
        }
    };
    Ok((f.key.clone(), values))
}

/// A Qdrant filter as Engram's: a tenant match is required.
fn filter_of(f: Option<&q::Filter>) -> Result<VectorFilter, Status> {
    let f = f.ok_or_else(|| Status::invalid_argument("a search names its tenant"))?;
    if !f.should.is_empty() || !f.must_not.is_empty() {
        return Err(Status::invalid_argument(
            "only `must` filters are supported",
        ));
    }
    let mut out = VectorFilter::default();
    let mut tenant = None;
    for c in &f.must {
        let (key, values) = keywords(c)?;
        match (key.as_str(), values.as_slice()) {
            ("tenant", [t]) => tenant = Some(t.clone()),
            ("agent", [a]) => out.agent = Some(a.clone()),
            ("kind", _) => out.kinds = Some(values),
            ("scope", _) => out.scopes = Some(values),
            _ => {
                return Err(Status::invalid_argument(format!(
                    "unsupported condition on {key}"
                )));
            }
        }
    }
    out.tenant = tenant.ok_or_else(|| Status::invalid_argument("a search names its tenant"))?;
    Ok(out)
}

fn payload_str(p: &HashMap<String, q::Value>, key: &str) -> Result<String, Status> {
    match p.get(key).and_then(|v| v.kind.as_ref()) {
        Some(q::value::Kind::StringValue(s)) => Ok(s.clone()),
        _ => Err(Status::invalid_argument(format!(
            "payload `{key}` must be a string"
        ))),
    }
}

fn dense(v: Option<&q::Vectors>) -> Result<Vec<f32>, Status> {
    use q::vectors::VectorsOptions;
    match v.and_then(|v| v.vectors_options.as_ref()) {
        Some(VectorsOptions::Vector(v)) => match &v.vector {
            Some(q::vector::Vector::Dense(d)) => Ok(d.data.clone()),
            None => {
                #[allow(deprecated)]
                let data = v.data.clone();
                Ok(data)
            }
            Some(_) => Err(Status::invalid_argument("only dense vectors are supported")),
        },
        _ => Err(Status::invalid_argument(
            "one unnamed dense vector per point",
        )),
    }
}

fn num_id(id: Option<&q::PointId>) -> Result<u64, Status> {
    match id.and_then(|i| i.point_id_options.as_ref()) {
        Some(q::point_id::PointIdOptions::Num(n)) => Ok(*n),
        _ => Err(Status::invalid_argument("numeric point ids only")),
    }
}

impl Service {
    /// Collections in `dir` (one qdrant-edge store per collection, reopened by name).
    pub fn new(dir: &Path) -> Self {
        Self {
            dir: dir.to_path_buf(),
            collections: Arc::default(),
        }
    }

    fn collection(&self, name: &str) -> Result<Arc<EdgeStore>, Status> {
        let mut map = self.collections.lock().map_err(internal)?;
        if let Some(c) = map.get(name) {
            return Ok(c.clone());
        }
        let path = self.dir.join(name);
        let dim_file = path.join(crate::DIM_FILE);
        let dim: usize = std::fs::read_to_string(&dim_file)
            .map_err(|_| Status::not_found(format!("collection {name} not found")))?
            .trim()
            .parse()
            .map_err(internal)?;
        let store = Arc::new(EdgeStore::open(&path, dim).map_err(internal)?);
        map.insert(name.to_string(), store.clone());
        Ok(store)
    }

    fn exists(
        &self,
        r: q::CollectionExistsRequest,
    ) -> Result<Response<q::CollectionExistsResponse>, Status> {
        let exists = self.collection(&r.collection_name).is_ok();
        Ok(Response::new(q::CollectionExistsResponse {
            result: Some(q::CollectionExists { exists }),
            time: 0.0,
        }))
    }

    fn create(
        &self,
        r: q::CreateCollection,
    ) -> Result<Response<q::CollectionOperationResponse>, Status> {
        let params = match r.vectors_config.and_then(|v| v.config) {
            Some(q::vectors_config::Config::Params(p)) => p,
            _ => return Err(Status::invalid_argument("one unnamed vector config")),
        };
        if params.distance != q::Distance::Cosine as i32 {
            return Err(Status::invalid_argument("cosine distance only"));
        }
        if self.collection(&r.collection_name).is_ok() {
            return Err(Status::already_exists(r.collection_name));
        }
        let store = EdgeStore::open(&self.dir.join(&r.collection_name), params.size as usize)
            .map_err(internal)?;
        self.collections
            .lock()
            .map_err(internal)?
            .insert(r.collection_name, Arc::new(store));
        Ok(Response::new(q::CollectionOperationResponse {
            result: true,
            time: 0.0,
        }))
    }

    fn get_info(
        &self,
        r: q::GetCollectionInfoRequest,
    ) -> Result<Response<q::GetCollectionInfoResponse>, Status> {
        let c = self.collection(&r.collection_name)?;
        let points = c.count().map_err(internal)? as u64;
        Ok(Response::new(q::GetCollectionInfoResponse {
            result: Some(q::CollectionInfo {
                status: q::CollectionStatus::Green as i32,
                points_count: Some(points),
                config: Some(q::CollectionConfig {
                    params: Some(q::CollectionParams {
                        vectors_config: Some(q::VectorsConfig {
                            config: Some(q::vectors_config::Config::Params(q::VectorParams {
                                size: c.dim() as u64,
                                distance: q::Distance::Cosine as i32,
                                ..Default::default()
                            })),
                        }),
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            time: 0.0,
        }))
    }

    fn drop_collection(
        &self,
        r: q::DeleteCollection,
    ) -> Result<Response<q::CollectionOperationResponse>, Status> {
        let gone = self
            .collections
            .lock()
            .map_err(internal)?
            .remove(&r.collection_name);
        drop(gone);
        let removed = std::fs::remove_dir_all(self.dir.join(&r.collection_name)).is_ok();
        Ok(Response::new(q::CollectionOperationResponse {
            result: removed,
            time: 0.0,
        }))
    }

    fn upsert(&self, r: q::UpsertPoints) -> Result<Response<q::PointsOperationResponse>, Status> {
        let c = self.collection(&r.collection_name)?;
        let points = r
            .points
            .iter()
            .map(|p| {
                Ok(VectorPoint {
                    id: num_id(p.id.as_ref())?,
                    vector: dense(p.vectors.as_ref())?,
                    tenant: payload_str(&p.payload, "tenant")?,
                    agent: payload_str(&p.payload, "agent")?,
                    kind: payload_str(&p.payload, "kind")?,
                    scope: payload_str(&p.payload, "scope")?,
                })
            })
            .collect::<Result<Vec<_>, Status>>()?;
        c.upsert(&points)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        Ok(ok_points())
    }

    fn delete(&self, r: q::DeletePoints) -> Result<Response<q::PointsOperationResponse>, Status> {
        use q::points_selector::PointsSelectorOneOf;
        let c = self.collection(&r.collection_name)?;
        match r.points.and_then(|p| p.points_selector_one_of) {
            Some(PointsSelectorOneOf::Points(list)) => {
                let ids = list
                    .ids
                    .iter()
                    .map(|i| num_id(Some(i)))
                    .collect::<Result<Vec<_>, Status>>()?;
                c.delete(&ids).map_err(internal)?;
            }
            // An empty filter selects every point.
            Some(PointsSelectorOneOf::Filter(f))
                if f.must.is_empty() && f.should.is_empty() && f.must_not.is_empty() =>
            {
                c.clear().map_err(internal)?;
            }
            _ => return Err(Status::invalid_argument("delete by ids, or every point")),
        }
        Ok(ok_points())
    }

    fn field_index(
        &self,
        r: q::CreateFieldIndexCollection,
    ) -> Result<Response<q::PointsOperationResponse>, Status> {
        self.collection(&r.collection_name)?;
        if !crate::FIELDS.iter().any(|(f, _)| *f == r.field_name) {
            return Err(Status::invalid_argument(
                "payload indexes on tenant, agent, kind",
            ));
        }
        // The qdrant-edge store indexes these fields from its creation.
        Ok(ok_points())
    }

    fn search(&self, r: q::SearchPoints) -> Result<Response<q::SearchResponse>, Status> {
        let c = self.collection(&r.collection_name)?;
        let filter = filter_of(r.filter.as_ref())?;
        let hits = c
            .search(&r.vector, r.limit as usize, &filter)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        Ok(Response::new(q::SearchResponse {
            result: hits
                .into_iter()
                .map(|h| q::ScoredPoint {
                    id: Some(q::PointId::from(h.id)),
                    score: h.score,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }))
    }

    fn count(&self, r: q::CountPoints) -> Result<Response<q::CountResponse>, Status> {
        if r.filter.is_some() {
            return Err(Status::invalid_argument("counts every point only"));
        }
        let c = self.collection(&r.collection_name)?;
        Ok(Response::new(q::CountResponse {
            result: Some(q::CountResult {
                count: c.count().map_err(internal)? as u64,
            }),
            ..Default::default()
        }))
    }
}

/// The service on a local port, in its own thread.
#[derive(Debug)]
pub struct TestServer {
    /// Where it listens.
    pub addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl TestServer {
    /// Serves collections kept in `dir` on `addr` (`127.0.0.1:0` for a free port).
    pub fn start(dir: &Path, addr: SocketAddr) -> std::io::Result<Self> {
        let listener = std::net::TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let service = Service::new(dir);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (ready_tx, ready) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            let runtime = match tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
            {
                Ok(r) => r,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            runtime.block_on(async move {
                let listener = match tokio::net::TcpListener::from_std(listener) {
                    Ok(l) => l,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok(()));
                let incoming = tokio_stream_of(listener);
                let _ = tonic::transport::Server::builder()
                    .add_service(q::collections_server::CollectionsServer::new(
                        service.clone(),
                    ))
                    .add_service(q::points_server::PointsServer::new(service.clone()))
                    .add_service(q::qdrant_server::QdrantServer::new(service))
                    .serve_with_incoming_shutdown(incoming, async {
                        let _ = stopped.await;
                    })
                    .await;
            });
        });
        ready
            .recv()
            .map_err(|_| std::io::Error::other("the test server thread ended"))??;
        Ok(Self {
            addr,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// `http://addr`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops serving and waits for the thread.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Accepted connections as the stream tonic serves.
fn tokio_stream_of(
    listener: tokio::net::TcpListener,
) -> impl futures_core::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    futures_util::stream::unfold(listener, |l| async move {
        let next = l.accept().await.map(|(s, _)| s);
        Some((next, l))
    })
}
#[tonic::async_trait]
impl q::collections_server::Collections for Service {
    async fn get(
        &self,
        request: Request<q::GetCollectionInfoRequest>,
    ) -> Result<Response<q::GetCollectionInfoResponse>, Status> {
        self.get_info(request.into_inner())
    }

    async fn list(
        &self,
        _request: Request<q::ListCollectionsRequest>,
    ) -> Result<Response<q::ListCollectionsResponse>, Status> {
        Err(Status::unimplemented(
            "Collections/list: not part of the subset this test server speaks",
        ))
    }

    async fn create(
        &self,
        request: Request<q::CreateCollection>,
    ) -> Result<Response<q::CollectionOperationResponse>, Status> {
        self.create(request.into_inner())
    }

    async fn update(
        &self,
        _request: Request<q::UpdateCollection>,
    ) -> Result<Response<q::CollectionOperationResponse>, Status> {
        Err(Status::unimplemented(
            "Collections/update: not part of the subset this test server speaks",
        ))
    }

    async fn delete(
        &self,
        request: Request<q::DeleteCollection>,
    ) -> Result<Response<q::CollectionOperationResponse>, Status> {
        self.drop_collection(request.into_inner())
    }

    async fn update_aliases(
        &self,
        _request: Request<q::ChangeAliases>,
    ) -> Result<Response<q::CollectionOperationResponse>, Status> {
        Err(Status::unimplemented(
            "Collections/update_aliases: not part of the subset this test server speaks",
        ))
    }

    async fn list_collection_aliases(
        &self,
        _request: Request<q::ListCollectionAliasesRequest>,
    ) -> Result<Response<q::ListAliasesResponse>, Status> {
        Err(Status::unimplemented(
            "Collections/list_collection_aliases: not part of the subset this test server speaks",
        ))
    }

    async fn list_aliases(
        &self,
        _request: Request<q::ListAliasesRequest>,
    ) -> Result<Response<q::ListAliasesResponse>, Status> {
        Err(Status::unimplemented(
            "Collections/list_aliases: not part of the subset this test server speaks",
        ))
    }

    async fn collection_cluster_info(
        &self,
        _request: Request<q::CollectionClusterInfoRequest>,
    ) -> Result<Response<q::CollectionClusterInfoResponse>, Status> {
        Err(Status::unimplemented(
            "Collections/collection_cluster_info: not part of the subset this test server speaks",
        ))
    }

    async fn collection_exists(
        &self,
        request: Request<q::CollectionExistsRequest>,
    ) -> Result<Response<q::CollectionExistsResponse>, Status> {
        self.exists(request.into_inner())
    }

    async fn update_collection_cluster_setup(
        &self,
        _request: Request<q::UpdateCollectionClusterSetupRequest>,
    ) -> Result<Response<q::UpdateCollectionClusterSetupResponse>, Status> {
        Err(Status::unimplemented(
            "Collections/update_collection_cluster_setup: not part of the subset this test server speaks",
        ))
    }

    async fn create_shard_key(
        &self,
        _request: Request<q::CreateShardKeyRequest>,
    ) -> Result<Response<q::CreateShardKeyResponse>, Status> {
        Err(Status::unimplemented(
            "Collections/create_shard_key: not part of the subset this test server speaks",
        ))
    }

    async fn delete_shard_key(
        &self,
        _request: Request<q::DeleteShardKeyRequest>,
    ) -> Result<Response<q::DeleteShardKeyResponse>, Status> {
        Err(Status::unimplemented(
            "Collections/delete_shard_key: not part of the subset this test server speaks",
        ))
    }

    async fn list_shard_keys(
        &self,
        _request: Request<q::ListShardKeysRequest>,
    ) -> Result<Response<q::ListShardKeysResponse>, Status> {
        Err(Status::unimplemented(
            "Collections/list_shard_keys: not part of the subset this test server speaks",
        ))
    }
}

#[tonic::async_trait]
impl q::points_server::Points for Service {
    async fn upsert(
        &self,
        request: Request<q::UpsertPoints>,
    ) -> Result<Response<q::PointsOperationResponse>, Status> {
        self.upsert(request.into_inner())
    }

    async fn delete(
        &self,
        request: Request<q::DeletePoints>,
    ) -> Result<Response<q::PointsOperationResponse>, Status> {
        self.delete(request.into_inner())
    }

    async fn get(
        &self,
        _request: Request<q::GetPoints>,
    ) -> Result<Response<q::GetResponse>, Status> {
        Err(Status::unimplemented(
            "Points/get: not part of the subset this test server speaks",
        ))
    }

    async fn update_vectors(
        &self,
        _request: Request<q::UpdatePointVectors>,
    ) -> Result<Response<q::PointsOperationResponse>, Status> {
        Err(Status::unimplemented(
            "Points/update_vectors: not part of the subset this test server speaks",
        ))
    }

    async fn delete_vectors(
        &self,
        _request: Request<q::DeletePointVectors>,
    ) -> Result<Response<q::PointsOperationResponse>, Status> {
        Err(Status::unimplemented(
            "Points/delete_vectors: not part of the subset this test server speaks",
        ))
    }

    async fn set_payload(
        &self,
        _request: Request<q::SetPayloadPoints>,
    ) -> Result<Response<q::PointsOperationResponse>, Status> {
        Err(Status::unimplemented(
            "Points/set_payload: not part of the subset this test server speaks",
        ))
    }

    async fn overwrite_payload(
        &self,
        _request: Request<q::SetPayloadPoints>,
    ) -> Result<Response<q::PointsOperationResponse>, Status> {
        Err(Status::unimplemented(
            "Points/overwrite_payload: not part of the subset this test server speaks",
        ))
    }

    async fn delete_payload(
        &self,
        _request: Request<q::DeletePayloadPoints>,
    ) -> Result<Response<q::PointsOperationResponse>, Status> {
        Err(Status::unimplemented(
            "Points/delete_payload: not part of the subset this test server speaks",
        ))
    }

    async fn clear_payload(
        &self,
        _request: Request<q::ClearPayloadPoints>,
    ) -> Result<Response<q::PointsOperationResponse>, Status> {
        Err(Status::unimplemented(
            "Points/clear_payload: not part of the subset this test server speaks",
        ))
    }

    async fn create_field_index(
        &self,
        request: Request<q::CreateFieldIndexCollection>,
    ) -> Result<Response<q::PointsOperationResponse>, Status> {
        self.field_index(request.into_inner())
    }

    async fn delete_field_index(
        &self,
        _request: Request<q::DeleteFieldIndexCollection>,
    ) -> Result<Response<q::PointsOperationResponse>, Status> {
        Err(Status::unimplemented(
            "Points/delete_field_index: not part of the subset this test server speaks",
        ))
    }

    async fn create_vector_name(
        &self,
        _request: Request<q::CreateVectorNameRequest>,
    ) -> Result<Response<q::PointsOperationResponse>, Status> {
        Err(Status::unimplemented(
            "Points/create_vector_name: not part of the subset this test server speaks",
        ))
    }

    async fn delete_vector_name(
        &self,
        _request: Request<q::DeleteVectorNameRequest>,
    ) -> Result<Response<q::PointsOperationResponse>, Status> {
        Err(Status::unimplemented(
            "Points/delete_vector_name: not part of the subset this test server speaks",
        ))
    }

    async fn search(
        &self,
        request: Request<q::SearchPoints>,
    ) -> Result<Response<q::SearchResponse>, Status> {
        self.search(request.into_inner())
    }

    async fn search_batch(
        &self,
        _request: Request<q::SearchBatchPoints>,
    ) -> Result<Response<q::SearchBatchResponse>, Status> {
        Err(Status::unimplemented(
            "Points/search_batch: not part of the subset this test server speaks",
        ))
    }

    async fn search_groups(
        &self,
        _request: Request<q::SearchPointGroups>,
    ) -> Result<Response<q::SearchGroupsResponse>, Status> {
        Err(Status::unimplemented(
            "Points/search_groups: not part of the subset this test server speaks",
        ))
    }

    async fn scroll(
        &self,
        _request: Request<q::ScrollPoints>,
    ) -> Result<Response<q::ScrollResponse>, Status> {
        Err(Status::unimplemented(
            "Points/scroll: not part of the subset this test server speaks",
        ))
    }

    async fn recommend(
        &self,
        _request: Request<q::RecommendPoints>,
    ) -> Result<Response<q::RecommendResponse>, Status> {
        Err(Status::unimplemented(
            "Points/recommend: not part of the subset this test server speaks",
        ))
    }

    async fn recommend_batch(
        &self,
        _request: Request<q::RecommendBatchPoints>,
    ) -> Result<Response<q::RecommendBatchResponse>, Status> {
        Err(Status::unimplemented(
            "Points/recommend_batch: not part of the subset this test server speaks",
        ))
    }

    async fn recommend_groups(
        &self,
        _request: Request<q::RecommendPointGroups>,
    ) -> Result<Response<q::RecommendGroupsResponse>, Status> {
        Err(Status::unimplemented(
            "Points/recommend_groups: not part of the subset this test server speaks",
        ))
    }

    async fn discover(
        &self,
        _request: Request<q::DiscoverPoints>,
    ) -> Result<Response<q::DiscoverResponse>, Status> {
        Err(Status::unimplemented(
            "Points/discover: not part of the subset this test server speaks",
        ))
    }

    async fn discover_batch(
        &self,
        _request: Request<q::DiscoverBatchPoints>,
    ) -> Result<Response<q::DiscoverBatchResponse>, Status> {
        Err(Status::unimplemented(
            "Points/discover_batch: not part of the subset this test server speaks",
        ))
    }

    async fn count(
        &self,
        request: Request<q::CountPoints>,
    ) -> Result<Response<q::CountResponse>, Status> {
        self.count(request.into_inner())
    }

    async fn update_batch(
        &self,
        _request: Request<q::UpdateBatchPoints>,
    ) -> Result<Response<q::UpdateBatchResponse>, Status> {
        Err(Status::unimplemented(
            "Points/update_batch: not part of the subset this test server speaks",
        ))
    }

    async fn query(
        &self,
        _request: Request<q::QueryPoints>,
    ) -> Result<Response<q::QueryResponse>, Status> {
        Err(Status::unimplemented(
            "Points/query: not part of the subset this test server speaks",
        ))
    }

    async fn query_batch(
        &self,
        _request: Request<q::QueryBatchPoints>,
    ) -> Result<Response<q::QueryBatchResponse>, Status> {
        Err(Status::unimplemented(
            "Points/query_batch: not part of the subset this test server speaks",
        ))
    }

    async fn query_groups(
        &self,
        _request: Request<q::QueryPointGroups>,
    ) -> Result<Response<q::QueryGroupsResponse>, Status> {
        Err(Status::unimplemented(
            "Points/query_groups: not part of the subset this test server speaks",
        ))
    }

    async fn facet(
        &self,
        _request: Request<q::FacetCounts>,
    ) -> Result<Response<q::FacetResponse>, Status> {
        Err(Status::unimplemented(
            "Points/facet: not part of the subset this test server speaks",
        ))
    }

    async fn search_matrix_pairs(
        &self,
        _request: Request<q::SearchMatrixPoints>,
    ) -> Result<Response<q::SearchMatrixPairsResponse>, Status> {
        Err(Status::unimplemented(
            "Points/search_matrix_pairs: not part of the subset this test server speaks",
        ))
    }

    async fn search_matrix_offsets(
        &self,
        _request: Request<q::SearchMatrixPoints>,
    ) -> Result<Response<q::SearchMatrixOffsetsResponse>, Status> {
        Err(Status::unimplemented(
            "Points/search_matrix_offsets: not part of the subset this test server speaks",
        ))
    }
}

#[tonic::async_trait]
impl q::qdrant_server::Qdrant for Service {
    async fn health_check(
        &self,
        _request: Request<q::HealthCheckRequest>,
    ) -> Result<Response<q::HealthCheckReply>, Status> {
        Ok(tonic::Response::new(q::HealthCheckReply {
            title: "engram qdrant-edge test server".into(),
            version: "0".into(),
            commit: None,
        }))
    }
}
