use super::*;

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("engram-vector-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// A unit vector pointing mostly along axis `axis`.
fn unit(dim: usize, axis: usize, tilt: f32) -> Vec<f32> {
    let mut v = vec![0.0; dim];
    v[axis % dim] = 1.0;
    v[(axis + 1) % dim] = tilt;
    let n = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    v.iter().map(|x| x / n).collect()
}

fn point(id: u64, tenant: u64, agent: u64, kind: &str, v: Vec<f32>) -> VectorPoint {
    VectorPoint {
        id,
        vector: v,
        tenant: format!("t{tenant}"),
        agent: format!("a{agent}"),
        kind: kind.into(),
        scope: String::new(),
    }
}

fn filter(tenant: u64) -> VectorFilter {
    VectorFilter {
        tenant: format!("t{tenant}"),
        ..VectorFilter::default()
    }
}

#[test]
fn search_is_tenant_scoped_filtered_ordered_and_survives_reopening() {
    let d = dir("scoped");
    let dim = 8;
    let store = EdgeStore::open(&d, dim).unwrap();
    // The same direction stored by two tenants; tenant 2's copy is the exact match.
    store
        .upsert(&[
            point(1, 1, 10, "fact", unit(dim, 0, 0.1)),
            point(2, 1, 10, "episode", unit(dim, 0, 0.3)),
            point(3, 1, 11, "fact", unit(dim, 3, 0.0)),
            point(4, 2, 20, "fact", unit(dim, 0, 0.0)),
        ])
        .unwrap();
    assert_eq!(store.count().unwrap(), 4);
    let q = unit(dim, 0, 0.0);
    let hits = store.search(&q, 10, &filter(1)).unwrap();
    let ids: Vec<u64> = hits.iter().map(|h| h.id).collect();
    assert_eq!(ids, vec![1, 2, 3], "tenant 1 only, nearest first");
    assert!(hits[0].score > hits[1].score && hits[1].score > hits[2].score);
    assert!(
        (hits[0].score - 1.0 / 1.01f32.sqrt()).abs() < 1e-4,
        "{}",
        hits[0].score
    );
    assert_eq!(
        store
            .search(&q, 10, &filter(2))
            .unwrap()
            .iter()
            .map(|h| h.id)
            .collect::<Vec<_>>(),
        vec![4]
    );
    assert!(store.search(&q, 10, &filter(3)).unwrap().is_empty());
    let facts_of_10 = VectorFilter {
        tenant: "t1".into(),
        agent: Some("a10".into()),
        kinds: Some(vec!["fact".into()]),
        scopes: None,
    };
    let hits = store.search(&q, 10, &facts_of_10).unwrap();
    assert_eq!(hits.iter().map(|h| h.id).collect::<Vec<_>>(), vec![1]);
    assert_eq!(store.search(&q, 1, &filter(1)).unwrap().len(), 1);
    store.flush().unwrap();
    drop(store);

    let store = EdgeStore::open(&d, dim).unwrap();
    assert_eq!(store.count().unwrap(), 4);
    let again = store.search(&q, 10, &filter(1)).unwrap();
    assert_eq!(
        again.iter().map(|h| h.id).collect::<Vec<_>>(),
        vec![1, 2, 3]
    );
    // Replace, delete, clear.
    store
        .upsert(&[point(3, 1, 11, "fact", unit(dim, 0, 0.0))])
        .unwrap();
    assert_eq!(store.search(&q, 1, &filter(1)).unwrap()[0].id, 3);
    store.delete(&[3, 99]).unwrap();
    assert_eq!(store.count().unwrap(), 3);
    store.clear().unwrap();
    assert_eq!(store.count().unwrap(), 0);
    // qdrant-edge flushes on drop (and panics if its directory is gone): drop it first.
    drop(store);
    let _ = std::fs::remove_dir_all(&d);
}

/// A search names the scopes it may see; a session's private point is found only by a search
/// that names that session, in the embedded store and through the remote protocol.
fn check_scopes(store: &dyn VectorStore, dim: usize) {
    let scoped = |id, scope: &str, tilt| VectorPoint {
        scope: scope.into(),
        ..point(id, 7, 70, "fact", unit(dim, 0, tilt))
    };
    store
        .upsert(&[
            scoped(71, "", 0.3),
            scoped(72, "alice", 0.0),
            scoped(73, "bob", 0.1),
        ])
        .unwrap();
    let q = unit(dim, 0, 0.0);
    let found = |scopes: Option<Vec<&str>>| -> Vec<u64> {
        let f = VectorFilter {
            scopes: scopes.map(|s| s.into_iter().map(String::from).collect()),
            ..filter(7)
        };
        store
            .search(&q, 10, &f)
            .unwrap()
            .iter()
            .map(|h| h.id)
            .collect()
    };
    assert_eq!(found(None), vec![72, 73, 71]);
    assert_eq!(found(Some(vec!["", "bob"])), vec![73, 71]);
    assert_eq!(found(Some(vec!["", "alice"])), vec![72, 71]);
    assert_eq!(found(Some(vec![""])), vec![71]);
}

#[test]
fn a_session_s_private_points_are_found_only_by_its_own_searches() {
    let dim = 8;
    check_scopes(&EdgeStore::open(&dir("scopes"), dim).unwrap(), dim);
}

#[test]
fn bad_vectors_and_a_width_change_are_refused() {
    let d = dir("bad");
    let store = EdgeStore::open(&d, 4).unwrap();
    store
        .upsert(&[point(1, 1, 1, "fact", unit(4, 0, 0.0))])
        .unwrap();
    assert!(matches!(
        store.upsert(&[point(2, 1, 1, "fact", vec![1.0; 5])]),
        Err(VectorError::Dimension {
            expected: 4,
            got: 5
        })
    ));
    assert!(matches!(
        store.upsert(&[point(3, 1, 1, "fact", vec![f32::NAN, 0.0, 0.0, 1.0])]),
        Err(VectorError::NotFinite(3))
    ));
    assert!(matches!(
        store.search(&[1.0; 3], 5, &filter(1)),
        Err(VectorError::Dimension { .. })
    ));
    assert_eq!(store.count().unwrap(), 1, "nothing stored by refused calls");
    drop(store);
    assert!(matches!(
        EdgeStore::open(&d, 8),
        Err(VectorError::Mismatch {
            found: 4,
            expected: 8,
            ..
        })
    ));
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn optimizing_keeps_every_point_and_the_tenant_filter() {
    let d = dir("optimize");
    let dim = 16;
    let store = EdgeStore::open(&d, dim).unwrap();
    let points: Vec<VectorPoint> = (0..3_000u64)
        .map(|i| {
            point(
                i + 1,
                1 + i % 2,
                1,
                "fact",
                unit(dim, i as usize, (i % 7) as f32 / 7.0),
            )
        })
        .collect();
    for chunk in points.chunks(500) {
        store.upsert(chunk).unwrap();
    }
    let q = unit(dim, 4, 0.0);
    let before = store.search(&q, 10, &filter(1)).unwrap();
    store.optimize().unwrap();
    assert_eq!(store.count().unwrap(), 3_000);
    let after = store.search(&q, 10, &filter(1)).unwrap();
    assert_eq!(after.len(), 10);
    // Tenant 1 holds the odd ids (i even → id odd).
    assert!(after.iter().all(|h| h.id % 2 == 1), "{after:?}");
    assert_eq!(after[0].score, before[0].score);
    drop(store);
    let _ = std::fs::remove_dir_all(&d);
}

/// The remote store through Qdrant's gRPC protocol, against the qdrant-edge-backed test server
/// (`grpc_server`; not a Qdrant server).
#[cfg(feature = "qdrant-server")]
mod remote {
    use super::*;
    use crate::RemoteStore;
    use crate::grpc_server::TestServer;

    fn local() -> std::net::SocketAddr {
        "127.0.0.1:0".parse().unwrap()
    }

    #[test]
    fn the_remote_store_upserts_searches_tenant_scoped_deletes_and_clears() {
        let d = dir("remote-ops");
        let server = TestServer::start(&d, local()).unwrap();
        let dim = 8;
        let store = RemoteStore::open(&server.url(), None, "memory", dim).unwrap();
        check_scopes(&store, dim);
        store.clear().unwrap();
        // The same direction stored by two tenants; tenant 2's copy is the exact match.
        store
            .upsert(&[
                point(1, 1, 1, "fact", unit(dim, 0, 0.2)),
                point(2, 2, 1, "fact", unit(dim, 0, 0.0)),
                point(3, 1, 2, "episode", unit(dim, 0, 0.1)),
                point(4, 1, 1, "fact", unit(dim, 3, 0.0)),
            ])
            .unwrap();
        assert_eq!(store.count().unwrap(), 4);
        let q = unit(dim, 0, 0.0);
        let hits = store.search(&q, 10, &filter(1)).unwrap();
        let ids: Vec<u64> = hits.iter().map(|h| h.id).collect();
        assert_eq!(ids, [3, 1, 4], "tenant 1 only, best first: {hits:?}");
        assert!(hits[0].score > hits[1].score && hits[1].score > hits[2].score);
        // Agent and kind filters go to the server with the tenant.
        let f = VectorFilter {
            agent: Some("a1".into()),
            kinds: Some(vec!["fact".into()]),
            ..filter(1)
        };
        let ids: Vec<u64> = store
            .search(&q, 10, &f)
            .unwrap()
            .iter()
            .map(|h| h.id)
            .collect();
        assert_eq!(ids, [1, 4]);
        assert_eq!(store.search(&q, 10, &filter(2)).unwrap()[0].id, 2);
        assert!(store.search(&q, 10, &filter(9)).unwrap().is_empty());
        // A re-upsert replaces, a delete removes, a clear empties.
        store
            .upsert(&[point(1, 1, 1, "fact", unit(dim, 5, 0.0))])
            .unwrap();
        let ids: Vec<u64> = store
            .search(&q, 1, &filter(1))
            .unwrap()
            .iter()
            .map(|h| h.id)
            .collect();
        assert_eq!(ids, [3]);
        store.delete(&[3, 99]).unwrap();
        assert_eq!(store.count().unwrap(), 3);
        assert!(
            !store
                .search(&q, 10, &filter(1))
                .unwrap()
                .iter()
                .any(|h| h.id == 3)
        );
        // Bad vectors are refused before they leave.
        assert!(matches!(
            store.upsert(&[point(7, 1, 1, "fact", vec![1.0; 3])]),
            Err(VectorError::Dimension { .. })
        ));
        store.clear().unwrap();
        assert_eq!(store.count().unwrap(), 0);
        // Another width for the same collection is refused.
        assert!(matches!(
            RemoteStore::open(&server.url(), None, "memory", 16),
            Err(VectorError::Mismatch { .. })
        ));
        server.stop();
    }

    #[test]
    fn the_remote_store_fails_while_the_server_is_down_and_reconnects_when_it_is_back() {
        let d = dir("remote-reconnect");
        let server = TestServer::start(&d, local()).unwrap();
        let addr = server.addr;
        let dim = 4;
        let store = RemoteStore::open(&server.url(), None, "memory", dim).unwrap();
        store
            .upsert(&[point(1, 1, 1, "fact", unit(dim, 0, 0.0))])
            .unwrap();
        server.stop();
        let down = store.count();
        assert!(matches!(down, Err(VectorError::Remote(_))), "{down:?}");
        // Back on the same port over the same data: the same client works again.
        let server = TestServer::start(&d, addr).unwrap();
        let mut back = store.count();
        for _ in 0..50 {
            if back.is_ok() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
            back = store.count();
        }
        assert_eq!(back.unwrap(), 1);
        let hits = store.search(&unit(dim, 0, 0.0), 5, &filter(1)).unwrap();
        assert_eq!(hits.len(), 1);
        server.stop();
    }

    #[test]
    fn the_test_server_refuses_what_it_does_not_speak() {
        let d = dir("remote-refuse");
        let server = TestServer::start(&d, local()).unwrap();
        let rt = tokio::runtime::Runtime::new().unwrap();
        let client = qdrant_client::Qdrant::from_url(&server.url())
            .skip_compatibility_check()
            .build()
            .unwrap();
        rt.block_on(async {
            // A search without a tenant condition.
            client
                .create_collection(
                    qdrant_client::qdrant::CreateCollectionBuilder::new("c").vectors_config(
                        qdrant_client::qdrant::VectorParamsBuilder::new(
                            4,
                            qdrant_client::qdrant::Distance::Cosine,
                        ),
                    ),
                )
                .await
                .unwrap();
            let err = client
                .search_points(qdrant_client::qdrant::SearchPointsBuilder::new(
                    "c",
                    vec![1.0, 0.0, 0.0, 0.0],
                    3,
                ))
                .await
                .unwrap_err();
            assert!(err.to_string().contains("tenant"), "{err}");
            // A call outside the subset.
            let err = client
                .scroll(qdrant_client::qdrant::ScrollPointsBuilder::new("c"))
                .await
                .unwrap_err();
            assert!(err.to_string().contains("not implemented"), "{err}");
        });
        server.stop();
    }
}
