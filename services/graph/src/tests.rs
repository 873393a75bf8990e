use super::*;

const DAY: i64 = 24 * 3600 * 1000;
const NOW: i64 = 100 * DAY;

fn node(id: u64, kind: NodeKind, tenant: u64, text: &str) -> Node {
    Node {
        id: NodeId(id),
        kind,
        tenant: format!("t{tenant}"),
        agent: "a1".into(),
        session: None,
        text: text.into(),
        importance: 0.5,
        tokens: estimate_tokens(text),
        created_ms: NOW - 10 * DAY,
        updated_ms: NOW - 10 * DAY,
        last_accessed_ms: NOW - 10 * DAY,
    }
}

fn edge(id: u64, from: u64, to: u64, kind: EdgeKind) -> Edge {
    Edge {
        id: EdgeId(id),
        from: NodeId(from),
        to: NodeId(to),
        kind,
        weight: 1.0,
        valid_from_ms: None,
        valid_to_ms: None,
    }
}

/// Tenant 1: two episodes in order; Alice (entity) mentioned by the first episode and by two
/// facts, the newer fact superseding the older one since day 50; a concept three hops out.
/// Tenant 2: a fact with the same text as tenant 1's.
fn fixture() -> MemoryGraph {
    let mut g = MemoryGraph::new();
    for n in [
        node(1, NodeKind::Episode, 1, "user: I moved last month"),
        node(2, NodeKind::Episode, 1, "user: the flat is near the river"),
        node(3, NodeKind::Entity, 1, "Alice"),
        node(4, NodeKind::Fact, 1, "Alice lives in Paris"),
        node(5, NodeKind::Fact, 1, "Alice lives in Berlin"),
        node(6, NodeKind::Concept, 1, "housing"),
        node(7, NodeKind::Concept, 1, "rivers"),
        node(10, NodeKind::Fact, 2, "Alice lives in Paris"),
    ] {
        g.add_node(n).unwrap();
    }
    for e in [
        edge(1, 2, 1, EdgeKind::Follows),
        edge(2, 1, 3, EdgeKind::Mentions),
        edge(3, 4, 3, EdgeKind::Mentions),
        edge(4, 5, 3, EdgeKind::Mentions),
        edge(6, 5, 6, EdgeKind::RelatesTo),
        edge(7, 6, 7, EdgeKind::RelatesTo),
    ] {
        g.add_edge(e).unwrap();
    }
    let mut sup = edge(5, 5, 4, EdgeKind::Supersedes);
    sup.valid_from_ms = Some(50 * DAY);
    g.add_edge(sup).unwrap();
    g
}

fn ids(r: &[Recall]) -> Vec<u64> {
    r.iter().map(|x| x.id.0).collect()
}

fn tenant(t: u64) -> QueryFilter {
    QueryFilter {
        tenant: format!("t{t}"),
        ..QueryFilter::default()
    }
}

#[test]
fn neighbours_are_recalled_through_edges_within_the_hop_bound() {
    let g = fixture();
    let s = Scoring::default();
    // Seeded at the first episode: Alice (1 hop), the Berlin fact (2 hops), housing (3 hops).
    let r = g.hybrid_query(&[(NodeId(1), 0.9)], 10, 2, &tenant(1), &s, NOW);
    assert_eq!(ids(&r)[0], 1, "the seed leads");
    let mut got = ids(&r);
    got.sort_unstable();
    assert_eq!(got, vec![1, 2, 3, 5]);
    let alice = r.iter().find(|x| x.id == NodeId(3)).unwrap();
    assert_eq!(alice.hops, 1);
    let expect = 0.9 * s.edges.mentions * s.hop_decay;
    assert!((alice.proximity - expect).abs() < 1e-6);
    assert_eq!(alice.similarity, 0.0);
    // One more hop reaches the concept.
    let r3 = g.hybrid_query(&[(NodeId(1), 0.9)], 10, 3, &tenant(1), &s, NOW);
    assert!(ids(&r3).contains(&6));
    assert!(!ids(&r3).contains(&7));
}

#[test]
fn superseded_facts_do_not_surface_while_the_edge_is_valid() {
    let g = fixture();
    let s = Scoring::default();
    // The old fact as a direct seed, and Alice next to it.
    let seeds = [(NodeId(4), 0.95), (NodeId(3), 0.5)];
    let r = g.hybrid_query(&seeds, 10, 2, &tenant(1), &s, NOW);
    assert!(!ids(&r).contains(&4), "{:?}", ids(&r));
    assert!(ids(&r).contains(&5));
    assert!(g.is_superseded(NodeId(4), NOW));
    // Before the supersession started, the old fact is current.
    let before = g.hybrid_query(&seeds, 10, 2, &tenant(1), &s, 40 * DAY);
    assert_eq!(ids(&before)[0], 4);
    assert!(!g.is_superseded(NodeId(4), 40 * DAY));
}

#[test]
fn another_tenant_is_never_reached() {
    let mut g = fixture();
    let s = Scoring::default();
    // Seeds naming tenant 1's nodes do not leak into tenant 2's query, and vice versa.
    let r = g.hybrid_query(
        &[(NodeId(3), 0.9), (NodeId(10), 0.8)],
        10,
        3,
        &tenant(2),
        &s,
        NOW,
    );
    assert_eq!(ids(&r), vec![10]);
    let r = g.hybrid_query(&[(NodeId(10), 0.9)], 10, 3, &tenant(1), &s, NOW);
    assert!(r.is_empty());
    // And no edge can join them.
    let before = g.edge_count();
    assert_eq!(
        g.add_edge(edge(99, 10, 3, EdgeKind::RelatesTo)),
        Err(GraphError::CrossTenant {
            from: "t2".into(),
            to: "t1".into()
        })
    );
    assert_eq!(g.edge_count(), before);
}

#[test]
fn filters_scoring_terms_and_order_are_as_documented() {
    let mut g = fixture();
    let s = Scoring::default();
    let facts = QueryFilter {
        tenant: "t1".into(),
        agent: Some("a1".into()),
        kinds: Some(vec![NodeKind::Fact]),
        exclude_session: None,
        exclude_since_ms: None,
        sessions: SessionScope::Every,
    };
    let r = g.hybrid_query(&[(NodeId(1), 0.9)], 10, 3, &facts, &s, NOW);
    assert_eq!(ids(&r), vec![5]);
    let other_agent = QueryFilter {
        agent: Some("a2".into()),
        ..facts.clone()
    };
    assert!(
        g.hybrid_query(&[(NodeId(1), 0.9)], 10, 3, &other_agent, &s, NOW)
            .is_empty()
    );
    // Recency: a node touched now scores exactly a_rec·(1 − 2^(−10 days / half-life)) more.
    let q = |g: &MemoryGraph| g.hybrid_query(&[(NodeId(6), 0.5)], 1, 0, &tenant(1), &s, NOW);
    let old = q(&g)[0].score;
    g.touch(&[NodeId(6)], NOW);
    let new = q(&g)[0].score;
    let aged = (-(std::f64::consts::LN_2) * (10 * DAY) as f64 / s.half_life_ms).exp() as f32;
    assert!((new - old - s.recency * (1.0 - aged)).abs() < 1e-6);
    // Equal scores are ordered by id, and k truncates.
    let mut flat = MemoryGraph::new();
    for id in [9, 3, 7] {
        flat.add_node(node(id, NodeKind::Fact, 1, "same")).unwrap();
    }
    let seeds = [(NodeId(9), 0.5), (NodeId(3), 0.5), (NodeId(7), 0.5)];
    let r = flat.hybrid_query(&seeds, 2, 1, &tenant(1), &s, NOW);
    assert_eq!(ids(&r), vec![3, 7]);
    let mut all = flat.hybrid_query(&seeds, 9, 1, &tenant(1), &s, NOW);
    all.reverse();
    canonical_order(&mut all);
    assert_eq!(ids(&all), vec![3, 7, 9]);
    // Creation time comes first: a newer node renders after the older ones, whatever its id.
    let mut late = node(1, NodeKind::Fact, 1, "same");
    late.created_ms = NOW - DAY;
    flat.add_node(late).unwrap();
    let seeds = [
        (NodeId(1), 0.5),
        (NodeId(9), 0.5),
        (NodeId(3), 0.5),
        (NodeId(7), 0.5),
    ];
    let mut all = flat.hybrid_query(&seeds, 9, 1, &tenant(1), &s, NOW);
    canonical_order(&mut all);
    assert_eq!(ids(&all), vec![3, 7, 9, 1]);
}

#[test]
fn bad_changes_are_refused_and_change_nothing() {
    let mut g = fixture();
    let (n, e) = (g.node_count(), g.edge_count());
    assert_eq!(
        g.add_node(node(1, NodeKind::Fact, 1, "again")),
        Err(GraphError::DuplicateNode(NodeId(1)))
    );
    let mut bad = node(50, NodeKind::Fact, 1, "x");
    bad.importance = 1.5;
    assert!(matches!(
        g.add_node(bad),
        Err(GraphError::OutOfRange {
            field: "importance",
            ..
        })
    ));
    assert_eq!(
        g.add_edge(edge(1, 2, 3, EdgeKind::Mentions)),
        Err(GraphError::DuplicateEdge(EdgeId(1)))
    );
    assert_eq!(
        g.add_edge(edge(50, 2, 77, EdgeKind::Mentions)),
        Err(GraphError::UnknownNode(NodeId(77)))
    );
    assert_eq!(
        g.add_edge(edge(50, 2, 2, EdgeKind::Mentions)),
        Err(GraphError::SelfLoop(NodeId(2)))
    );
    let mut heavy = edge(50, 2, 3, EdgeKind::Mentions);
    heavy.weight = -0.1;
    assert!(g.add_edge(heavy).is_err());
    let mut backwards = edge(50, 2, 3, EdgeKind::Mentions);
    backwards.valid_from_ms = Some(10);
    backwards.valid_to_ms = Some(10);
    assert!(g.add_edge(backwards).is_err());
    let moved = node(3, NodeKind::Entity, 2, "Alice");
    assert!(matches!(
        g.update_node(moved),
        Err(GraphError::CrossTenant { .. })
    ));
    assert_eq!((g.node_count(), g.edge_count()), (n, e));
    assert_eq!(g.node(NodeId(3)).unwrap().tenant, "t1");
}

#[test]
fn removing_a_node_removes_its_edges() {
    let mut g = fixture();
    let gone = g.remove_node(NodeId(3)).unwrap();
    let mut gone: Vec<u64> = gone.iter().map(|e| e.0).collect();
    gone.sort_unstable();
    assert_eq!(gone, vec![2, 3, 4]);
    assert!(g.edge(EdgeId(2)).is_none());
    assert_eq!(g.edge_count(), 4);
    assert_eq!(
        g.remove_node(NodeId(3)),
        Err(GraphError::UnknownNode(NodeId(3)))
    );
    // Episode 1 no longer reaches the facts.
    let r = g.hybrid_query(
        &[(NodeId(1), 0.9)],
        10,
        3,
        &tenant(1),
        &Scoring::default(),
        NOW,
    );
    let mut got = ids(&r);
    got.sort_unstable();
    assert_eq!(got, vec![1, 2]);
    assert_eq!(g.remove_edge(EdgeId(1)).unwrap().kind, EdgeKind::Follows);
    assert_eq!(g.edges_of(NodeId(1)).unwrap().len(), 0);
}

#[test]
fn kinds_round_trip_their_wire_names() {
    for k in NodeKind::ALL {
        assert_eq!(NodeKind::parse(k.as_str()), Some(k));
    }
    for k in EdgeKind::ALL {
        assert_eq!(EdgeKind::parse(k.as_str()), Some(k));
    }
    assert_eq!(NodeKind::parse("fish"), None);
    assert!(NodeKind::Fact.is_semantic() && !NodeKind::Episode.is_semantic());
}

mod props {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// Any graph, any seeds: results are the tenant's, unique, at most k, sorted by score
        /// then id, never superseded, and the same when the graph is built in reverse order.
        #[test]
        fn recall_is_bounded_unique_sorted_and_independent_of_build_order(
            n in 2usize..30,
            raw_edges in proptest::collection::vec((0usize..30, 0usize..30, 0usize..5), 0..60),
            seeds in proptest::collection::vec((0usize..30, 0.0f32..1.0), 1..5),
            k in 1usize..10,
            hops in 0u32..4,
        ) {
            let nodes: Vec<Node> = (0..n)
                .map(|i| node(i as u64 + 1, NodeKind::ALL[i % 4], 1 + (i % 3 == 0) as u64, "t"))
                .collect();
            let edges: Vec<Edge> = raw_edges
                .iter()
                .enumerate()
                .filter(|(_, (a, b, _))| a % n != b % n)
                .map(|(j, (a, b, kind))| {
                    edge(j as u64 + 1, (a % n) as u64 + 1, (b % n) as u64 + 1, EdgeKind::ALL[*kind])
                })
                .collect();
            let build = |rev: bool| {
                let mut g = MemoryGraph::new();
                let mut ns = nodes.clone();
                let mut es = edges.clone();
                if rev {
                    ns.reverse();
                    es.reverse();
                }
                for x in ns {
                    g.add_node(x).unwrap();
                }
                for x in es {
                    let _ = g.add_edge(x); // cross-tenant ones are refused
                }
                g
            };
            let seeds: Vec<(NodeId, f32)> =
                seeds.iter().map(|&(i, s)| (NodeId((i % n) as u64 + 1), s)).collect();
            let (a, b) = (build(false), build(true));
            let f = tenant(1);
            let ra = a.hybrid_query(&seeds, k, hops, &f, &Scoring::default(), NOW);
            let rb = b.hybrid_query(&seeds, k, hops, &f, &Scoring::default(), NOW);
            prop_assert_eq!(&ra, &rb);
            prop_assert!(ra.len() <= k);
            for w in ra.windows(2) {
                prop_assert!(w[0].score > w[1].score || (w[0].score == w[1].score && w[0].id < w[1].id));
            }
            let mut seen = std::collections::HashSet::new();
            for r in &ra {
                prop_assert!(seen.insert(r.id));
                prop_assert_eq!(&a.node(r.id).unwrap().tenant, "t1");
                prop_assert!(!a.is_superseded(r.id, NOW));
                prop_assert!(r.hops <= hops);
            }
        }
    }
}

#[test]
fn the_current_sessions_episodes_relay_proximity_but_do_not_surface() {
    let mut g = fixture();
    for id in [1, 2] {
        let mut n = g.node(NodeId(id)).unwrap().clone();
        n.session = Some("s1".into());
        g.update_node(n).unwrap();
    }
    let s = Scoring::default();
    let all = g.hybrid_query(&[(NodeId(2), 0.9)], 10, 2, &tenant(1), &s, NOW);
    assert!(ids(&all).contains(&2) && ids(&all).contains(&3));
    let other = QueryFilter {
        exclude_session: Some("s1".into()),
        ..tenant(1)
    };
    let r = g.hybrid_query(&[(NodeId(2), 0.9)], 10, 2, &other, &s, NOW);
    // Episodes 1 and 2 are hidden, yet Alice (two hops through them) is still reached.
    assert!(!ids(&r).contains(&1) && !ids(&r).contains(&2));
    assert!(ids(&r).contains(&3));
    let r3 = r.iter().find(|x| x.id == NodeId(3)).unwrap();
    let a3 = all.iter().find(|x| x.id == NodeId(3)).unwrap();
    assert_eq!(r3.score, a3.score);
    // Another session's name hides nothing.
    let s2 = QueryFilter {
        exclude_session: Some("s2".into()),
        ..tenant(1)
    };
    assert_eq!(
        ids(&g.hybrid_query(&[(NodeId(2), 0.9)], 10, 2, &s2, &s, NOW)),
        ids(&all)
    );
    // Only the episodes since a time are hidden (the window still shows them): an older one
    // surfaces again.
    let (t1, t2) = (
        g.node(NodeId(1)).unwrap().created_ms,
        g.node(NodeId(2)).unwrap().created_ms,
    );
    let mut n2 = g.node(NodeId(2)).unwrap().clone();
    n2.created_ms = t1.min(t2) - 10;
    g.update_node(n2).unwrap();
    let since = QueryFilter {
        exclude_since_ms: Some(t1.min(t2) - 5),
        ..other
    };
    let r = g.hybrid_query(&[(NodeId(2), 0.9)], 10, 2, &since, &s, NOW);
    assert!(
        ids(&r).contains(&2) && !ids(&r).contains(&1),
        "{:?}",
        ids(&r)
    );
}

#[test]
fn a_session_scoped_query_never_sees_nor_walks_through_another_session_s_nodes() {
    let mut g = fixture();
    for id in [1, 2] {
        let mut n = g.node(NodeId(id)).unwrap().clone();
        n.session = Some("alice".into());
        g.update_node(n).unwrap();
    }
    let s = Scoring::default();
    let every = g.hybrid_query(&[(NodeId(2), 0.9)], 10, 2, &tenant(1), &s, NOW);
    assert!(ids(&every).contains(&2) && ids(&every).contains(&3));
    let alice = QueryFilter {
        sessions: SessionScope::Only(Some("alice".into())),
        ..tenant(1)
    };
    // Her own session sees what the unscoped query sees.
    assert_eq!(
        ids(&g.hybrid_query(&[(NodeId(2), 0.9)], 10, 2, &alice, &s, NOW)),
        ids(&every)
    );
    // Bob's neither returns her nodes nor reaches a node through them: seeded only by her
    // episode, his query finds nothing at all.
    for bob in [
        SessionScope::Only(Some("bob".into())),
        SessionScope::Only(None),
    ] {
        let f = QueryFilter {
            sessions: bob.clone(),
            ..tenant(1)
        };
        let r = g.hybrid_query(&[(NodeId(2), 0.9)], 10, 2, &f, &s, NOW);
        assert!(r.is_empty(), "{bob:?}: {:?}", ids(&r));
        // Seeded by a node of no session, he gets the agent's nodes, never hers.
        let r = g.hybrid_query(&[(NodeId(3), 0.9)], 10, 2, &f, &s, NOW);
        assert!(ids(&r).contains(&3), "{:?}", ids(&r));
        assert!(!ids(&r).contains(&1) && !ids(&r).contains(&2));
    }
}
