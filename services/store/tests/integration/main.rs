//! The store against both backends: SQLite (a temp file) and PostgreSQL (a fresh database on
//! `ENGRAM_TEST_POSTGRES` or `postgres://postgres@127.0.0.1:5432/test`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::atomic::{AtomicUsize, Ordering};

use engram_store::{AdminScope, Backend, MemoryScope, NewEntry, Quotas, Role, Store, StoreError};
use sqlx::Executor;

static N: AtomicUsize = AtomicUsize::new(0);

const QUOTAS: Quotas = Quotas {
    hot_blocks: 100,
    cold_blocks: 200,
    sessions: 3,
    shadow_mib: 5,
};

fn admin_url() -> String {
    std::env::var("ENGRAM_TEST_POSTGRES")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// Drops the PostgreSQL databases of finished tests.
async fn drop_database(db: &str) {
    let admin = sqlx::AnyPool::connect(&admin_url()).await.unwrap();
    admin
        .execute(format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)").as_str())
        .await
        .unwrap();
}

/// Runs `f` on a fresh store of each backend, then removes them.
async fn for_each_backend<F, Fut>(f: F)
where
    F: Fn(Store) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let (stores, db) = stores().await;
    for s in stores {
        f(s.clone()).await;
        s.close().await;
    }
    drop_database(&db).await;
}

/// A fresh store of each backend, and the PostgreSQL database's name.
async fn stores() -> (Vec<Store>, String) {
    let n = N.fetch_add(1, Ordering::Relaxed);
    let tag = format!("{}_{n}", std::process::id());
    let dir = std::env::temp_dir().join(format!("engram-store-{tag}"));
    // A directory left by an earlier run whose process had this id would hold its rows.
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let sqlite = Store::connect(&format!("sqlite://{}/db.sqlite?mode=rwc", dir.display()))
        .await
        .unwrap();
    sqlx::any::install_default_drivers();
    let admin = sqlx::AnyPool::connect(&admin_url())
        .await
        .expect("PostgreSQL at 127.0.0.1:5432 (database `test`, trust auth) is required");
    let db = format!("engram_test_{tag}");
    admin
        .execute(format!("DROP DATABASE IF EXISTS {db}").as_str())
        .await
        .unwrap();
    admin
        .execute(format!("CREATE DATABASE {db}").as_str())
        .await
        .unwrap();
    let base = admin_url();
    let url = format!("{}/{db}", &base[..base.rfind('/').unwrap()]);
    let pg = Store::connect(&url).await.unwrap();
    assert_eq!(
        (sqlite.backend(), pg.backend()),
        (Backend::Sqlite, Backend::Postgres)
    );
    (vec![sqlite, pg], db)
}

#[tokio::test]
async fn operator_keys_carry_their_scopes_and_stop_when_revoked() {
    for_each_backend(|s| async move {
        let (scraper, secret) = s
            .create_admin_key("prometheus", &[AdminScope::Metrics, AdminScope::Metrics])
            .await
            .unwrap();
        assert_eq!(scraper.scopes, vec![AdminScope::Metrics]);
        assert!(scraper.allows(AdminScope::Metrics));
        assert!(!scraper.allows(AdminScope::Read) && !scraper.allows(AdminScope::Admin));
        let found = s.admin_key_of_secret(&secret).await.unwrap().unwrap();
        assert_eq!(found, scraper);
        let (ops, ops_secret) = s
            .create_admin_key("ops", &[AdminScope::Admin])
            .await
            .unwrap();
        assert!(ops.allows(AdminScope::Read) && ops.allows(AdminScope::Metrics));
        assert!(
            s.admin_key_of_secret("eka_made_up")
                .await
                .unwrap()
                .is_none()
        );
        s.revoke_admin_key(&scraper.id).await.unwrap();
        assert!(s.admin_key_of_secret(&secret).await.unwrap().is_none());
        assert!(matches!(
            s.revoke_admin_key(&scraper.id).await,
            Err(StoreError::NotFound { .. })
        ));
        let all = s.admin_keys(None, 10).await.unwrap();
        assert_eq!(
            s.admin_keys(Some((all[0].created_at, &all[0].id)), 10)
                .await
                .unwrap(),
            all[1..]
        );
        assert_eq!(all.len(), 2);
        assert!(
            all.iter()
                .any(|k| k.id == scraper.id && k.revoked_at.is_some())
        );
        assert!(s.admin_key_of_secret(&ops_secret).await.unwrap().is_some());
    })
    .await;
}

#[tokio::test]
async fn tenants_keys_and_isolation() {
    for_each_backend(|s| async move {
        let a = s.create_tenant("acme", QUOTAS).await.unwrap();
        let b = s.create_tenant("globex", QUOTAS).await.unwrap();
        assert_ne!(a.cache_salt, b.cache_salt);
        assert!(matches!(
            s.create_tenant("acme", QUOTAS).await,
            Err(StoreError::Conflict { .. })
        ));
        assert_eq!(s.tenants().await.unwrap().len(), 2);
        let (key, secret) = s.create_key(&a.id).await.unwrap();
        assert!(secret.starts_with("ek_") && secret.len() > 40);
        assert_eq!(s.authenticate(&secret).await.unwrap().unwrap().id, a.id);
        assert!(s.authenticate("ek_wrong").await.unwrap().is_none());
        // Another tenant cannot revoke it; its owner can, and then it stops working.
        assert!(matches!(
            s.revoke_key(&b.id, &key.id).await,
            Err(StoreError::NotFound { .. })
        ));
        s.revoke_key(&a.id, &key.id).await.unwrap();
        assert!(s.authenticate(&secret).await.unwrap().is_none());

        let agent = s
            .create_agent(&a.id, "helper", MemoryScope::Session)
            .await
            .unwrap();
        assert_eq!(s.agent(&a.id, "helper").await.unwrap(), agent);
        assert_eq!(s.agent(&a.id, &agent.id).await.unwrap(), agent);
        assert!(matches!(
            s.agent(&b.id, &agent.id).await,
            Err(StoreError::NotFound { .. })
        ));
        // Names are unique per tenant, not globally.
        let other = s
            .create_agent(&b.id, "helper", MemoryScope::Agent)
            .await
            .unwrap();
        // The scope is stored and read back.
        assert_eq!(
            s.agent(&b.id, "helper").await.unwrap().memory_scope,
            MemoryScope::Agent
        );
        assert_eq!(other.memory_scope, MemoryScope::Agent);
        assert!(matches!(
            s.create_agent(&a.id, "helper", MemoryScope::Session).await,
            Err(StoreError::Conflict { .. })
        ));
        assert_eq!(s.agents(&a.id).await.unwrap().len(), 1);
    })
    .await;
}

#[tokio::test]
async fn layers_are_versioned() {
    for_each_backend(|s| async move {
        let t = s.create_tenant("t", QUOTAS).await.unwrap();
        let a = s
            .create_agent(&t.id, "a", MemoryScope::Session)
            .await
            .unwrap();
        s.put_layer(&a.id, "axioms", "be honest", 200, true, 1.0)
            .await
            .unwrap();
        s.put_layer(&a.id, "memories", "likes tea", 1100, false, 0.6)
            .await
            .unwrap();
        let v2 = s
            .put_layer(&a.id, "axioms", "be kind", 250, true, 0.9)
            .await
            .unwrap();
        assert_eq!(v2.version, 2);
        let current = s.layers(&a.id).await.unwrap();
        assert_eq!(current.len(), 2);
        let axioms = current.iter().find(|l| l.kind == "axioms").unwrap();
        assert_eq!(
            (axioms.content.as_str(), axioms.budget, axioms.stable),
            ("be kind", 250, true)
        );
        assert!((axioms.importance - 0.9).abs() < 1e-9);
        let history = s.layer_history(&a.id, "axioms").await.unwrap();
        assert_eq!(
            history
                .iter()
                .map(|l| l.content.as_str())
                .collect::<Vec<_>>(),
            ["be honest", "be kind"]
        );
        // The operator's public mark belongs to one version: a later edit is private again.
        let marked = s.set_layer_public(&a.id, "axioms", true).await.unwrap();
        assert_eq!((marked.version, marked.public), (2, true));
        assert!(!history[0].public && !history[1].public);
        let v3 = s
            .put_layer(&a.id, "axioms", "be brief", 250, true, 0.9)
            .await
            .unwrap();
        assert!(!v3.public);
        let flags: Vec<bool> = s
            .layer_history(&a.id, "axioms")
            .await
            .unwrap()
            .iter()
            .map(|l| l.public)
            .collect();
        assert_eq!(flags, [false, true, false]);
        assert!(matches!(
            s.set_layer_public(&a.id, "soul", true).await,
            Err(StoreError::NotFound { .. })
        ));
    })
    .await;
}

#[tokio::test]
async fn the_turn_log_and_working_memory_persist() {
    for_each_backend(|s| async move {
        let t = s.create_tenant("t", QUOTAS).await.unwrap();
        let a = s
            .create_agent(&t.id, "a", MemoryScope::Session)
            .await
            .unwrap();
        assert!(s.ensure_session(&t.id, &a.id, "s1").await.unwrap());
        assert!(!s.ensure_session(&t.id, &a.id, "s1").await.unwrap());
        assert_eq!(s.session_count(&t.id).await.unwrap(), 1);
        assert_eq!(
            s.append_turn(&a.id, "s1", Role::User, "hi ünïcode", &[1, 2, 3])
                .await
                .unwrap(),
            1
        );
        assert_eq!(
            s.append_turn(&a.id, "s1", Role::Assistant, "hello", &[])
                .await
                .unwrap(),
            2
        );
        let turns = s.turns(&a.id, "s1").await.unwrap();
        assert_eq!(turns.len(), 2);
        assert_eq!(
            (turns[0].role, turns[0].text.as_str()),
            (Role::User, "hi ünïcode")
        );
        assert_eq!(turns[0].tokens, vec![1, 2, 3]);
        assert!(turns[1].tokens.is_empty());
        // A turn for a session that does not exist is refused (foreign key), nothing stored.
        assert!(
            s.append_turn(&a.id, "nope", Role::User, "x", &[])
                .await
                .is_err()
        );
        assert!(s.turns(&a.id, "nope").await.unwrap().is_empty());
        s.add_working_memory(&a.id, "s1", "memories", &["l1".into(), "l2".into()])
            .await
            .unwrap();
        let wm = s.working_memory(&a.id, "s1").await.unwrap();
        assert_eq!(
            wm.iter().map(|w| w.line.as_str()).collect::<Vec<_>>(),
            ["l1", "l2"]
        );
        // A line spilled again is kept once; the session keeps its newest lines only.
        let added = s
            .add_working_memory(&a.id, "s1", "memories", &["l2".into(), "l3".into()])
            .await
            .unwrap();
        assert_eq!(added, ["l3"]);
        let lines =
            |wm: Vec<engram_store::WorkingLine>| wm.into_iter().map(|w| w.line).collect::<Vec<_>>();
        assert_eq!(
            lines(s.working_memory(&a.id, "s1").await.unwrap()),
            ["l1", "l2", "l3"]
        );
        let many: Vec<String> = (0..600).map(|i| format!("fact {i}")).collect();
        s.add_working_memory(&a.id, "s1", "neurons", &many)
            .await
            .unwrap();
        let kept = lines(s.working_memory(&a.id, "s1").await.unwrap());
        let max = engram_store::WORKING_MEMORY_LINES as usize;
        assert_eq!(kept.len(), max);
        assert_eq!(kept.last().map(String::as_str), Some("fact 599"));
        assert_eq!(kept[0], format!("fact {}", 600 - max));
    })
    .await;
}

#[tokio::test]
async fn injected_entries_keep_their_role_name_and_prefill_steps_and_a_fork_copies_the_log() {
    for_each_backend(|s| async move {
        let t = s.create_tenant("t", QUOTAS).await.unwrap();
        let a = s
            .create_agent(&t.id, "a", MemoryScope::Session)
            .await
            .unwrap();
        s.ensure_session(&t.id, &a.id, "p").await.unwrap();
        s.append_turns(
            &a.id,
            "p",
            &[(Role::User, "hi", &[1]), (Role::Assistant, "yo", &[2])],
            None,
        )
        .await
        .unwrap();
        let entry = |role, name, text, ends_prefill| NewEntry {
            role,
            name,
            text,
            tokens: &[7, 8],
            ends_prefill,
            memories: None,
        };
        let last = s
            .append_entries(
                &a.id,
                "p",
                &[
                    entry(Role::Tool, Some("search"), "3 hits", false),
                    NewEntry {
                        memories: Some("- the user likes tea"),
                        ..entry(Role::Event, Some("planner"), "plan ready", false)
                    },
                    entry(Role::System, None, "Be brief now.", true),
                ],
                Some(("inject-1", "{\"entries\":3}")),
            )
            .await
            .unwrap();
        assert_eq!(last, 5);
        let log = s.turns(&a.id, "p").await.unwrap();
        let seen: Vec<_> = log
            .iter()
            .map(|t| (t.role, t.name.as_deref(), t.ends_prefill))
            .collect();
        assert_eq!(
            seen,
            [
                (Role::User, None, true),
                (Role::Assistant, None, true),
                (Role::Tool, Some("search"), false),
                (Role::Event, Some("planner"), false),
                (Role::System, None, true),
            ]
        );
        assert_eq!(log[2].tokens, [7, 8]);
        // The memories layer logged with an entry comes back with it, and only with it.
        let memories: Vec<_> = log.iter().map(|t| t.memories.as_deref()).collect();
        assert_eq!(
            memories,
            [None, None, None, Some("- the user likes tea"), None]
        );
        assert_eq!(
            s.turn_reply(&a.id, "p", "inject-1")
                .await
                .unwrap()
                .as_deref(),
            Some("{\"entries\":3}")
        );
        s.add_working_memory(&a.id, "p", "neurons", &["spilled".into()])
            .await
            .unwrap();
        // The fork holds the same log and working memory, then goes its own way.
        assert_eq!(s.fork_session(&t.id, &a.id, "p", "f").await.unwrap(), 5);
        let forked = s.turns(&a.id, "f").await.unwrap();
        let strip = |v: Vec<engram_store::TurnRow>| {
            v.into_iter()
                .map(|t| {
                    let logged = (t.ends_prefill, t.memories);
                    (t.seq, t.role, t.name, t.text, t.tokens, logged)
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(strip(forked), strip(log.clone()));
        assert_eq!(s.working_memory(&a.id, "f").await.unwrap().len(), 1);
        assert_eq!(s.session_count(&t.id).await.unwrap(), 2);
        // Idempotency keys stay with the parent.
        assert_eq!(s.turn_reply(&a.id, "f", "inject-1").await.unwrap(), None);
        s.append_turn(&a.id, "f", Role::User, "only in the fork", &[])
            .await
            .unwrap();
        assert_eq!(s.turns(&a.id, "p").await.unwrap().len(), 5);
        assert_eq!(s.turns(&a.id, "f").await.unwrap().len(), 6);
        // A fork onto an existing session or from a missing one changes nothing.
        assert!(matches!(
            s.fork_session(&t.id, &a.id, "p", "f").await,
            Err(StoreError::Conflict { .. })
        ));
        assert!(matches!(
            s.fork_session(&t.id, &a.id, "nope", "g").await,
            Err(StoreError::NotFound { .. })
        ));
        assert_eq!(s.turns(&a.id, "f").await.unwrap().len(), 6);
        assert!(s.turns(&a.id, "g").await.unwrap().is_empty());
        // Deleting the parent leaves the fork whole.
        s.delete_session(&a.id, "p").await.unwrap();
        assert_eq!(s.turns(&a.id, "f").await.unwrap().len(), 6);
    })
    .await;
}

#[tokio::test]
async fn an_unknown_scheme_is_refused() {
    assert!(matches!(
        Store::connect("mysql://x").await,
        Err(StoreError::UnsupportedUrl { .. })
    ));
}

#[tokio::test]
async fn memory_nodes_and_edges_persist_per_tenant() {
    use engram_store::{NewMemoryEdge, NewMemoryNode};
    for_each_backend(|s| async move {
        let (a, b) = (
            s.create_tenant("mem-a", QUOTAS).await.unwrap(),
            s.create_tenant("mem-b", QUOTAS).await.unwrap(),
        );
        let (aa, ab) = (
            s.create_agent(&a.id, "bot", MemoryScope::Session)
                .await
                .unwrap(),
            s.create_agent(&b.id, "bot", MemoryScope::Session)
                .await
                .unwrap(),
        );
        let node = |t: &str, ag: &str, kind: &str, text: &str| NewMemoryNode {
            tenant_id: t.into(),
            agent_id: ag.into(),
            session_id: None,
            kind: kind.into(),
            text: text.into(),
            importance: 0.5,
            tokens: 4,
        };
        let alice = s
            .insert_memory_node(&node(&a.id, &aa.id, "entity", "Alice"))
            .await
            .unwrap();
        let fact = s
            .insert_memory_node(&node(&a.id, &aa.id, "fact", "Alice lives in Berlin"))
            .await
            .unwrap();
        let other = s
            .insert_memory_node(&node(&b.id, &ab.id, "fact", "Bob likes tea"))
            .await
            .unwrap();
        // Ids are random 53-bit numbers, not a counter shared by every tenant.
        for id in [alice.id, fact.id, other.id] {
            assert!((1..1i64 << 53).contains(&id), "{id}");
        }
        assert!(alice.id != fact.id && fact.id != other.id && alice.id != other.id);
        assert!((fact.id - alice.id).abs() > 1 || (other.id - fact.id).abs() > 1);
        assert_eq!(fact.created_at, fact.last_accessed_at);
        let edge = |t: &str, from: i64, to: i64| NewMemoryEdge {
            tenant_id: t.into(),
            from_id: from,
            to_id: to,
            kind: "mentions".into(),
            weight: 1.0,
            valid_from: Some(10),
            valid_to: None,
        };
        let e = s
            .insert_memory_edge(&edge(&a.id, fact.id, alice.id))
            .await
            .unwrap();
        assert_eq!((e.valid_from, e.valid_to), (Some(10), None));
        // An edge to another tenant's node, or as another tenant, is refused and stores nothing.
        for bad in [
            edge(&a.id, fact.id, other.id),
            edge(&b.id, fact.id, alice.id),
        ] {
            assert!(matches!(
                s.insert_memory_edge(&bad).await,
                Err(StoreError::NotFound { .. })
            ));
        }
        assert_eq!(s.memory_edges(None).await.unwrap(), vec![e.clone()]);
        assert_eq!(
            s.memory_nodes(Some(&b.id)).await.unwrap(),
            vec![other.clone()]
        );
        assert_eq!(s.memory_nodes(None).await.unwrap().len(), 3);
        // Tenant-scoped reads, updates and deletes.
        assert!(s.memory_node(&b.id, fact.id).await.is_err());
        let upd = s
            .update_memory_node(&a.id, fact.id, "Alice lives in Paris", 0.9, 5)
            .await
            .unwrap();
        assert_eq!(
            (upd.text.as_str(), upd.importance, upd.tokens),
            ("Alice lives in Paris", 0.9, 5)
        );
        assert!(
            s.update_memory_node(&b.id, fact.id, "x", 0.1, 1)
                .await
                .is_err()
        );
        s.touch_memory_nodes(&a.id, &[alice.id], alice.created_at + 1000)
            .await
            .unwrap();
        s.touch_memory_nodes(&a.id, &[alice.id], alice.created_at)
            .await
            .unwrap();
        assert_eq!(
            s.memory_node(&a.id, alice.id)
                .await
                .unwrap()
                .last_accessed_at,
            alice.created_at + 1000
        );
        assert!(s.delete_memory_node(&b.id, alice.id).await.is_err());
        s.delete_memory_node(&a.id, alice.id).await.unwrap();
        assert!(
            s.memory_edges(Some(&a.id)).await.unwrap().is_empty(),
            "edges go with the node"
        );
        assert!(s.delete_memory_edge(&a.id, e.id).await.is_err());
        // Derived-state values.
        assert_eq!(s.memory_meta("embedding_fingerprint").await.unwrap(), None);
        s.set_memory_meta("embedding_fingerprint", "abc")
            .await
            .unwrap();
        s.set_memory_meta("embedding_fingerprint", "def")
            .await
            .unwrap();
        assert_eq!(
            s.memory_meta("embedding_fingerprint")
                .await
                .unwrap()
                .as_deref(),
            Some("def")
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_writers_of_one_agent_all_land() {
    for_each_backend(|s| async move {
        let t = s.create_tenant("busy", QUOTAS).await.unwrap();
        let agent = s
            .create_agent(&t.id, "bot", MemoryScope::Session)
            .await
            .unwrap();
        s.ensure_session(&t.id, &agent.id, "s").await.unwrap();
        // Each writer reads the latest version or sequence number, then inserts the next one:
        // on SQLite a deferred transaction doing that fails with "database is locked" when
        // another writer holds the lock, instead of waiting.
        let mut tasks = Vec::new();
        for i in 0..12 {
            let (s, id) = (s.clone(), agent.id.clone());
            tasks.push(tokio::spawn(async move {
                let layer = s
                    .put_layer(&id, "rules", &format!("rule {i}"), 100, true, 0.5)
                    .await;
                let turn = s.append_turn(&id, "s", Role::User, "hi", &[1, 2]).await;
                (layer.map(|l| l.version), turn)
            }));
        }
        let mut versions = Vec::new();
        let mut seqs = Vec::new();
        for task in tasks {
            let (layer, turn) = task.await.unwrap();
            versions.push(layer.unwrap_or_else(|e| panic!("{:?}: {e}", s.backend())));
            seqs.push(turn.unwrap_or_else(|e| panic!("{:?}: {e}", s.backend())));
        }
        versions.sort_unstable();
        seqs.sort_unstable();
        assert_eq!(
            versions,
            (1..=12).collect::<Vec<i64>>(),
            "{:?}",
            s.backend()
        );
        assert_eq!(seqs, (1..=12).collect::<Vec<i64>>(), "{:?}", s.backend());
    })
    .await;
}
