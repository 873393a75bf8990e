//! # engram-server
//!
//! The HTTP service: actix-web over the store, the context pipeline and the engine. `main`
//! and the end-to-end tests build the same app through [`configure_app`].

#![forbid(unsafe_code)]

pub mod admin_page;
pub mod api;
pub mod auth;
pub mod error;
pub mod keys;
pub mod limits;
pub mod metrics;
pub mod openapi;
pub mod pages;
pub mod readiness;
pub mod request_id;
pub mod state;
pub mod telemetry;
pub mod tokens;
pub mod turn;

use std::path::Path;
use std::sync::Arc;

use actix_web::error::JsonPayloadError;
use actix_web::http::StatusCode;
use actix_web::{App, HttpResponse, HttpServer, web};
use engram_engine::{Engine, EngineCore};
use engram_store::Store;

pub use engram_config::{Config, ConfigError};
pub use error::ApiError;
pub use state::AppState;

/// Why the service could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The database could not be opened or migrated.
    #[error("database: {0}")]
    Store(#[from] engram_store::StoreError),
    /// The model exists but could not be loaded.
    #[error("model: {0}")]
    Engine(#[from] engram_engine::EngineError),
    /// The memory graph or its vector index could not be opened.
    #[error("memory: {0}")]
    Memory(#[from] engram_memory::MemoryError),
    /// The shadow directory could not be opened.
    #[error("shadow: {0}")]
    Shadow(#[from] engram_shadow::ShadowError),
    /// The listener or a directory failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// Opens the store and, when the model file exists, the engine.
pub async fn build_state(config: Config) -> Result<AppState, StartError> {
    if let Some(path) = config
        .database
        .url
        .strip_prefix("sqlite://")
        .map(|p| p.split('?').next().unwrap_or(p))
        && let Some(dir) = Path::new(path).parent()
        && !dir.as_os_str().is_empty()
    {
        std::fs::create_dir_all(dir)?;
    }
    let store = Store::connect(&config.database.url).await?;
    let engine = if config.model.path.exists() {
        let mut engine_config = config.model.engine_config()?;
        engine_config.eviction = config.eviction;
        let block_size = engine_config.block_size;
        let core = EngineCore::load(&config.model.path, engine_config)?;
        let o = core.occupancy();
        let tier = |blocks: usize| {
            format!(
                "{blocks} blocks, {} tokens, {} MiB",
                blocks * block_size,
                (blocks * o.block_bytes) >> 20
            )
        };
        let head_dim = core.store().shape().head_dim;
        tracing::info!(
            "KV tiers: hot {}; cold {} ({} bytes a block of {block_size} tokens); codecs {} \
             ({:.2} bits an element)",
            tier(o.hot_capacity),
            tier(o.cold_capacity),
            o.block_bytes,
            core.codecs(),
            core.codecs().bits_per_element(head_dim)
        );
        Some(Engine::spawn(core)?)
    } else {
        tracing::warn!(
            "no model at {}; generation answers 503 (run `make models`)",
            config.model.path.display()
        );
        None
    };
    let memory =
        engram_memory::MemoryService::start(&config.memory, &store, &config.database.url).await?;
    // Start-up's temporaries (a model's blocks read into rows before its integer panels, the
    // embedder's load) go back to the system rather than stay in the allocator's heap.
    engram_qmatmul::release_freed_memory();
    let shadow = match &engine {
        Some(engine) if config.shadow.enabled => Some(open_shadow(&config, engine, &store).await?),
        _ => None,
    };
    let shadow_budget = match &shadow {
        Some(_) => shadow_budget(&config),
        None => 0,
    };
    let mut state = AppState::new(store, engine, memory, config);
    state.shadow = shadow;
    state.shadow_budget = shadow_budget;
    Ok(state)
}

/// The shadow's byte budget: `shadow.budget_mib` when set; else half the space free under a
/// local shadow directory now (logged), so a shadow never fills its disk by default; none on
/// S3, whose bucket has its own quota.
pub fn shadow_budget(config: &Config) -> u64 {
    let s = &config.shadow;
    if s.budget_mib > 0 {
        return s.budget_mib << 20;
    }
    if !s.url.is_empty() {
        return 0;
    }
    let dir = shadow_dir(config);
    match fs4::available_space(&dir) {
        Ok(free) => {
            let budget = free / 2;
            tracing::info!(
                "shadow budget: {} MiB (half the {} MiB free under {}; set shadow.budget_mib \
                 to choose)",
                budget >> 20,
                free >> 20,
                dir.display()
            );
            budget
        }
        Err(e) => {
            // Without a figure the shadow still needs a bound: 1 GiB, stated.
            tracing::warn!(
                "shadow budget: free space under {} unknown ({e}); 1024 MiB",
                dir.display()
            );
            1 << 30
        }
    }
}

/// The shadow's local directory: `shadow.dir`, or its default beside the database.
fn shadow_dir(config: &Config) -> std::path::PathBuf {
    let s = &config.shadow;
    if s.dir.as_os_str().is_empty() {
        engram_memory::default_data_dir(&config.database.url, "shadow")
    } else {
        s.dir.clone()
    }
}

/// The shadow's store as configured: `shadow.url` (S3-compatible) or the local directory.
pub fn shadow_storage(
    config: &Config,
) -> Result<Arc<dyn engram_shadow::Storage>, engram_shadow::ShadowError> {
    let s = &config.shadow;
    let dir = shadow_dir(config);
    let s3 = (!s.url.is_empty()).then(|| s.s3_settings());
    engram_shadow::open_storage(s3.as_ref(), &dir)
}

/// The other nodes' shadows `shadow.peers` names (s3:// URLs with this node's endpoint and
/// credentials, or directories).
pub fn peer_storages(
    config: &Config,
) -> Result<Vec<Arc<dyn engram_shadow::Storage>>, engram_shadow::ShadowError> {
    config
        .shadow
        .peer_list()
        .into_iter()
        .map(|peer| {
            if peer.starts_with("s3://") {
                let s3 = engram_shadow::S3Settings {
                    url: peer,
                    ..config.shadow.s3_settings()
                };
                engram_shadow::open_storage(Some(&s3), Path::new(""))
            } else {
                engram_shadow::open_storage(None, Path::new(&peer))
            }
        })
        .collect()
}

/// The shadow directory, recovered into the engine's cold tier when `shadow.recover` is on.
async fn open_shadow(
    config: &Config,
    engine: &Engine,
    db: &Store,
) -> Result<engram_shadow::Shadow, StartError> {
    let s = &config.shadow;
    let store = shadow_storage(config)?;
    let dir = store.location();
    let shadow = engram_shadow::Shadow::open(store, s.interval_ms, s.max_write_mib_per_sec)?
        .with_peers(peer_storages(config)?);
    if !s.recover {
        let n = shadow.index().await?;
        tracing::info!("shadow: {n} entries in {dir} left on disk (shadow.recover is off)");
    } else {
        // Each tenant's cold quota bounds what the recovery gives it back.
        let quotas: std::collections::HashMap<u64, usize> = db
            .tenants()
            .await?
            .iter()
            .map(|t| {
                let quota = usize::try_from(t.quotas.cold_blocks).unwrap_or(usize::MAX);
                (t.cache_salt, quota)
            })
            .collect();
        let outcomes = shadow.recover(engine, &quotas).await?;
        let status = shadow.status();
        let tokens: usize = outcomes.iter().map(|o| o.tokens).sum();
        tracing::info!(
            "shadow: {} entries in {dir}: {:?}, {tokens} tokens recovered in {:.1} ms",
            outcomes.len(),
            status.recovery_counts,
            status.recovery_ms
        );
    }
    Ok(shadow)
}

/// Background work: the shadow's flushes and the tier bridge's cycles, each on its interval;
/// idle tenants' rate-limit state is forgotten every minute.
pub fn spawn_background(state: web::Data<AppState>) {
    let st = state.clone();
    actix_web::rt::spawn(async move {
        loop {
            actix_web::rt::time::sleep(std::time::Duration::from_secs(60)).await;
            st.limits.shrink();
        }
    });
    if state.shadow.is_some() && state.engine.is_some() {
        let st = state.clone();
        actix_web::rt::spawn(async move {
            let every = std::time::Duration::from_millis(st.config.shadow.interval_ms);
            // What the last flush wrote: the room the next one is given before it writes.
            let mut last = 0u64;
            loop {
                actix_web::rt::time::sleep(every).await;
                if let (Some(shadow), Some(engine)) = (&st.shadow, &st.engine) {
                    enforce_shadow_budget(&st, shadow, last).await;
                    match shadow.flush(engine, None).await {
                        Ok(r) => last = r.bytes,
                        Err(e) => tracing::warn!("shadow flush failed: {e}"),
                    }
                    enforce_shadow_budget(&st, shadow, 0).await;
                }
            }
        });
    }
    if state.config.tiers.enabled && state.engine.is_some() {
        let st = state.clone();
        actix_web::rt::spawn(async move {
            let every = std::time::Duration::from_millis(st.config.tiers.interval_ms);
            let window = std::time::Duration::from_secs(st.config.tiers.active_window_secs);
            loop {
                actix_web::rt::time::sleep(every).await;
                if let Ok(engine) = st.engine() {
                    let _ = engram_engine::tier_cycle(engine, &st.tiers, window).await;
                }
            }
        });
    }
}

/// Archives the least recently written sessions of each tenant over its own shadow quota
/// (`quotas.shadow_mib`), then of any tenant while the shadow is over its budget
/// ([`shadow_budget`]) less `headroom` bytes (see [`budget_target`]; sessions with a turn within
/// `tiers.active_window_secs` are kept); errors are logged.
pub async fn enforce_shadow_budget(
    state: &AppState,
    shadow: &engram_shadow::Shadow,
    headroom: u64,
) {
    let window = std::time::Duration::from_secs(state.config.tiers.active_window_secs);
    let active: std::collections::HashSet<_> = state.tiers.active(window).into_iter().collect();
    // Each tenant within its own quota first, then the whole shadow within its budget.
    let quotas: std::collections::HashMap<u64, u64> = match state.store.tenants().await {
        Ok(ts) => ts
            .iter()
            .map(|t| (t.cache_salt, t.quotas.shadow_mib << 20))
            .collect(),
        Err(e) => {
            tracing::warn!("shadow: tenants' quotas unreadable: {e}");
            Default::default()
        }
    };
    let over_quota = shadow
        .over_tenant_budgets(
            |t| quotas.get(&t.0).copied().unwrap_or(0),
            |k| active.contains(&k),
        )
        .await;
    let budget = budget_target(state.shadow_budget, headroom);
    let over_budget = if budget == 0 {
        Vec::new()
    } else {
        shadow.over_budget(budget, |k| active.contains(&k)).await
    };
    for key in over_quota.into_iter().chain(over_budget) {
        if let Err(e) = api::cache::archive_session(state, key, false).await {
            tracing::warn!("shadow: archiving a session over the budget failed: {e}");
            return;
        }
    }
}

/// The shadow's size to archive down to: `budget` less the room the next write wants
/// (`headroom`, the size of the last background flush), at most half the budget — so a flush
/// about as large as the last one stays within the budget while it writes, and a single huge
/// flush does not archive everything. `0` when there is no budget.
pub fn budget_target(budget: u64, headroom: u64) -> u64 {
    budget - headroom.min(budget / 2)
}

fn json_error(err: JsonPayloadError, _: &actix_web::HttpRequest) -> actix_web::Error {
    let e = match &err {
        JsonPayloadError::Overflow { .. } | JsonPayloadError::OverflowKnownLength { .. } => {
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "payload_too_large",
                "the request body is over the limit",
            )
        }
        JsonPayloadError::ContentType => ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "send `Content-Type: application/json`",
        ),
        other => ApiError::invalid(format!("invalid JSON body: {other}")),
    };
    e.into()
}

/// Registers state, limits, error handlers and every route on an app.
pub fn configure_app(state: web::Data<AppState>) -> impl FnOnce(&mut web::ServiceConfig) {
    move |cfg: &mut web::ServiceConfig| {
        let limit = state.config.server.body_limit_bytes;
        let mcp = web::Data::new(api::mcp::service(state.clone().into_inner()));
        cfg.app_data(state)
            .app_data(mcp)
            .app_data(
                web::JsonConfig::default()
                    .limit(limit)
                    .error_handler(json_error),
            )
            .app_data(web::PayloadConfig::default().limit(limit))
            // A path or query that does not parse answers JSON like every other error.
            .app_data(
                web::PathConfig::default().error_handler(|e, _| {
                    ApiError::not_found(format!("no such resource: {e}")).into()
                }),
            )
            .app_data(
                web::QueryConfig::default()
                    .error_handler(|e, _| ApiError::invalid(format!("invalid query: {e}")).into()),
            )
            // One scope over every route, so that every answer (a 404 for no route included)
            // carries its request id.
            .service(
                web::scope("")
                    .wrap(actix_web::middleware::from_fn(request_id::middleware))
                    .wrap(telemetry::logger())
                    .configure(api::configure)
                    .configure(admin_page::configure)
                    .service(
                        utoipa_swagger_ui::SwaggerUi::new("/docs/{_:.*}")
                            .external_url_unchecked("/openapi.json", openapi::document()),
                    )
                    .default_service(web::to(|| async {
                        HttpResponse::NotFound().json(
                            serde_json::json!({"code": "not_found", "message": "no such route"}),
                        )
                    })),
            );
    }
}

/// Serves until SIGTERM or SIGINT (Ctrl-C), then stops accepting connections and gives
/// running requests (streams included) `server.shutdown_grace_secs` to finish before it closes
/// the database. A second signal does not cut the grace short; SIGKILL does.
pub async fn serve(config: Config) -> Result<(), StartError> {
    let bind = config.server.bind.clone();
    let grace = config.server.shutdown_grace_secs;
    let state = web::Data::new(build_state(config).await?);
    spawn_background(state.clone());
    let app_state = state.clone();
    let server = HttpServer::new(move || App::new().configure(configure_app(app_state.clone())))
        .bind(&bind)?
        .shutdown_timeout(grace)
        .disable_signals();
    for addr in server.addrs() {
        tracing::info!("serving on http://{addr}");
    }
    let server = server.run();
    let handle = server.handle();
    actix_web::rt::spawn(async move {
        let reason = shutdown_signal().await;
        tracing::info!("{reason}: draining running requests for up to {grace} s");
        handle.stop(true).await;
    });
    server.await?;
    if let (Some(shadow), Some(engine)) = (&state.shadow, &state.engine) {
        match shadow.flush(engine, None).await {
            Ok(r) => tracing::info!(
                "shadow: final flush wrote {} blocks ({} bytes) in {:.1} ms",
                r.blocks,
                r.bytes,
                r.ms
            ),
            Err(e) => tracing::warn!("shadow: final flush failed: {e}"),
        }
    }
    state.store.close().await;
    tracing::info!("stopped");
    Ok(())
}

/// Waits for SIGTERM or SIGINT; names the one that came.
async fn shutdown_signal() -> &'static str {
    #[cfg(unix)]
    {
        use actix_web::rt::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => "SIGTERM",
                    _ = actix_web::rt::signal::ctrl_c() => "SIGINT",
                }
            }
            Err(_) => {
                let _ = actix_web::rt::signal::ctrl_c().await;
                "SIGINT"
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = actix_web::rt::signal::ctrl_c().await;
        "Ctrl-C"
    }
}

#[cfg(test)]
mod tests {
    use super::budget_target;

    #[test]
    fn before_a_flush_the_shadow_makes_room_for_one_like_the_last_at_most_half_its_budget() {
        assert_eq!(budget_target(0, 123), 0, "no budget stays none");
        assert_eq!(budget_target(100 << 20, 0), 100 << 20);
        assert_eq!(budget_target(100 << 20, 30 << 20), 70 << 20);
        assert_eq!(budget_target(100 << 20, 80 << 20), 50 << 20);
    }

    #[test]
    fn without_a_budget_the_local_shadow_gets_half_the_free_disk_and_s3_none() {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut config = engram_config::Config::default();
        config.shadow.dir = dir.path().to_path_buf();
        config.shadow.budget_mib = 0;
        let free = fs4::available_space(dir.path()).expect("free space");
        let budget = super::shadow_budget(&config);
        // Other writers move the free figure between the two reads: within 1 % of half of it.
        let half = free / 2;
        assert!(budget > 0, "a bounded default");
        assert!(
            budget.abs_diff(half) <= half / 100,
            "budget {budget} B, half the free disk {half} B"
        );
        config.shadow.budget_mib = 64;
        assert_eq!(
            super::shadow_budget(&config),
            64 << 20,
            "a stated budget wins"
        );
        config.shadow.budget_mib = 0;
        config.shadow.url = "http://127.0.0.1:9/bucket".into();
        assert_eq!(
            super::shadow_budget(&config),
            0,
            "an S3 shadow has no local budget"
        );
    }
}
