//! Admin inspection: tier occupancy and counters, the block listing by meaning, and `/metrics`.

use actix_web::{HttpResponse, get, web};
use engram_engine::{BlockQuery, EngineSnapshot, PUBLIC_TENANT};
use engram_kvcore::{BlockFilter, SessionId, SourceLayer, TenantId, Tier};
use serde::Deserialize;
use serde_json::json;

use crate::auth::{MetricsCaller, ReadCaller};
use crate::error::ApiError;
use crate::state::AppState;
use crate::turn::{Answer, session_key};

async fn snapshot(state: &AppState) -> Result<EngineSnapshot, ApiError> {
    let rx = state.engine()?.snapshot()?;
    Ok(rx.answer().await?)
}

/// Tier occupancy, prefix-cache size, hits by tier, evictions by source layer, queue depth.
#[utoipa::path(
    tag = "admin",
    responses(
        (status = 200, description = "Occupancy, counters, queue depth", body = engram_engine::EngineSnapshot),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[get("/v1/admin/cache")]
pub async fn cache(_: ReadCaller, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    Ok(HttpResponse::Ok().json(snapshot(&state).await?))
}

/// A block with its owner.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct BlockView {
    /// The block's meaning and place.
    #[serde(flatten)]
    pub block: engram_engine::BlockInfo,
    /// The owning tenant's id, `public` for a public layer's block (null: a tenant deleted
    /// meanwhile).
    pub tenant_id: Option<String>,
}

/// A page of blocks.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct BlockPageView {
    /// Blocks that pass the filter.
    pub total: usize,
    /// Skipped.
    pub offset: usize,
    /// Page size.
    pub limit: usize,
    /// This page, in id order.
    pub blocks: Vec<BlockView>,
}

/// Filters of the block listing.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct BlockParams {
    /// Tenant id, or `public` for the blocks of layers an operator marked public.
    pub tenant: Option<String>,
    /// Agent (with `session`).
    pub agent: Option<String>,
    /// Session (needs `tenant` and `agent`).
    pub session: Option<String>,
    /// Source layer (`axioms`, `user_turn`, …).
    pub source: Option<String>,
    /// `hot`, `cold` or `recompute`.
    pub tier: Option<String>,
    /// Only pinned (`true`) or unpinned (`false`) blocks.
    pub pinned: Option<bool>,
    /// Blocks to skip.
    #[serde(default)]
    pub offset: usize,
    /// Page size (1–1000, default 100).
    pub limit: Option<usize>,
}

/// Blocks with their meaning (source layer, importance, tenant, session, tokens, tier, pin,
/// priority), filtered and paginated in id order.
#[utoipa::path(
    tag = "admin",
    params(BlockParams),
    responses(
        (status = 200, description = "A page of blocks", body = BlockPageView),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 400, description = "Invalid filter", body = crate::error::ErrorSchema),
        (status = 404, description = "Unknown tenant or agent", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[get("/v1/admin/blocks")]
pub async fn blocks(
    _: ReadCaller,
    state: web::Data<AppState>,
    params: web::Query<BlockParams>,
) -> Result<HttpResponse, ApiError> {
    let mut filter = BlockFilter::default();
    let tenants = state.store.tenants().await?;
    if params.tenant.as_deref() == Some("public") {
        filter.tenant = Some(PUBLIC_TENANT);
        if params.session.is_some() {
            return Err(ApiError::invalid("public blocks belong to no session"));
        }
    } else if let Some(t) = &params.tenant {
        let tenant = state.store.tenant(t).await?;
        filter.tenant = Some(TenantId(tenant.cache_salt));
        if let Some(session) = &params.session {
            let agent = params
                .agent
                .as_deref()
                .ok_or_else(|| ApiError::invalid("`session` needs `agent`"))?;
            let agent = state.store.agent(&tenant.id, agent).await?;
            let SessionId(key) = session_key(&agent, session);
            filter.session = Some(SessionId(key));
        }
    } else if params.session.is_some() {
        return Err(ApiError::invalid("`session` needs `tenant` and `agent`"));
    }
    if let Some(s) = &params.source {
        let source: SourceLayer = serde_json::from_value(json!(s))
            .map_err(|_| ApiError::invalid(format!("unknown source layer `{s}`")))?;
        filter.source = Some(source);
    }
    if let Some(t) = &params.tier {
        filter.tier = Some(match t.as_str() {
            "hot" => Tier::Hot,
            "cold" => Tier::Cold,
            "recompute" => Tier::Recompute,
            _ => return Err(ApiError::invalid("tier is hot, cold or recompute")),
        });
    }
    filter.pinned = params.pinned;
    let limit = params.limit.unwrap_or(100);
    if !(1..=1000).contains(&limit) {
        return Err(ApiError::invalid("limit must be within 1..=1000"));
    }
    let rx = state.engine()?.blocks(BlockQuery {
        filter,
        offset: params.offset,
        limit,
    })?;
    let page = rx.answer().await?;
    let blocks: Vec<BlockView> = page
        .blocks
        .into_iter()
        .map(|b| {
            let tenant_id = if b.tenant == PUBLIC_TENANT.0 {
                Some("public".to_string())
            } else {
                tenants
                    .iter()
                    .find(|t| t.cache_salt == b.tenant)
                    .map(|t| t.id.clone())
            };
            BlockView {
                block: b,
                tenant_id,
            }
        })
        .collect();
    Ok(HttpResponse::Ok().json(BlockPageView {
        total: page.total,
        offset: params.offset,
        limit,
        blocks,
    }))
}

/// Prometheus metrics: cache hits by tier, evictions by layer, queue depth, occupancy, TTFT.
#[utoipa::path(
    tag = "admin",
    responses(
        (status = 200, description = "The OpenMetrics text format", content_type = "application/openmetrics-text; version=1.0.0; charset=utf-8", body = String),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[get("/metrics")]
pub async fn metrics(
    _: MetricsCaller,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    use crate::metrics::{counter, counters, gauge, gauge_f64, gauges, labels};
    let mut reg = prometheus_client::registry::Registry::default();
    if let Some(engine) = &state.engine {
        let rx = engine.snapshot()?;
        let s = rx.answer().await?;
        let c = &s.counters;
        reg.register(
            "engram_tier_moves",
            "Tier moves of cached blocks (spill, warm, removal, readmission, down-tiering, leaving the cache), by the bridge, the turns and admission alike",
            counter(s.tier_moves),
        );
        reg.register(
            "engram_tier_quick_moves",
            "Tier moves of a block within 100 tier-bridge cycles of its previous move (flips)",
            counter(s.quick_moves),
        );
        reg.register(
            "engram_tier_staged_spills",
            "Spills that took a copy the tier bridge staged ahead (nothing copied at spill time)",
            counter(s.staged.used),
        );
        reg.register(
            "engram_tier_staged_dropped",
            "Staged copies dropped unused (their cold slots wanted, or the block written, removed or freed)",
            counter(s.staged.dropped),
        );
        reg.register(
            "engram_tier_staged_blocks",
            "Hot blocks staged now (with a copy in the cold tier)",
            gauge(s.staged.staged as u64),
        );
        reg.register(
            "engram_admission_evictions",
            "Hot blocks spilled or dropped at admission because the hot tier was full",
            counter(c.admission_evictions),
        );
        reg.register(
            "engram_admission_staged_spills",
            "Of the admission evictions, spills onto a copy the tier bridge had staged (nothing copied on the turn's path)",
            counter(c.admission_staged),
        );
        reg.register(
            "engram_relocated_runs",
            "Prompts that reused a segment cached at another position (model.relocate_segments)",
            counter(c.relocated_runs),
        );
        reg.register(
            "engram_relocated_blocks",
            "Prompt blocks filled by copying a segment's codes from another position instead of computing them",
            counter(c.relocated_blocks),
        );
        // By tier: hot blocks reused, cold blocks warmed, blocks read back from the shadow on a
        // miss (into the cold tier, so the turn then warms them: they count as cold_hit too),
        // and blocks prefilled.
        reg.register(
            "engram_cache_blocks",
            "Prompt blocks by the tier that served them (disk_hit: read back from the shadow on a miss into the cold tier, then warmed, so also counted as cold_hit)",
            counters(
                "result",
                [
                    ("hot_hit", c.hot_hits),
                    ("cold_hit", c.cold_hits),
                    ("disk_hit", state.metrics.disk_hits()),
                    ("miss", c.misses),
                ],
            ),
        );
        let evictions = prometheus_client::metrics::family::Family::<
            crate::metrics::Labels,
            prometheus_client::metrics::counter::Counter,
        >::default();
        for (kind, map) in [("spilled", &c.spilled), ("dropped", &c.dropped)] {
            for (layer, n) in map {
                let layer = serde_json::to_value(layer)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_string))
                    .unwrap_or_default();
                evictions
                    .get_or_create(&labels(&[("layer", &layer), ("kind", kind)]))
                    .inc_by(*n);
            }
        }
        reg.register(
            "engram_evictions",
            "Blocks evicted, by source layer and kind",
            evictions,
        );
        reg.register(
            "engram_cold_quota_dropped",
            "Cold blocks dropped because their tenant was over its cold quota",
            counter(c.cold_quota_dropped),
        );
        reg.register(
            "engram_down_tier_blocks",
            "Cold blocks re-encoded to narrower codecs instead of dropped (down-tiering), and those a turn warmed back",
            counters(
                "result",
                [("reduced", c.down_tiered), ("warmed", c.down_tier_hits)],
            ),
        );
        let r = &s.reservations;
        reg.register(
            "engram_reservations",
            "Cold-tier reservations of memory neighbourhoods, by outcome",
            counters(
                "result",
                [
                    ("made", r.made),
                    ("warmed", r.warmed),
                    ("expired", r.expired),
                    ("refused", r.refused),
                    ("failed", r.failed),
                ],
            ),
        );
        reg.register(
            "engram_reservation_blocks_served",
            "Prompt blocks turns reused from reservations",
            counter(r.blocks_served),
        );
        reg.register(
            "engram_reservation_hit_rate",
            "Reservations used over those used or expired",
            gauge_f64(r.hit_rate().unwrap_or(0.0)),
        );
        let o = &s.occupancy;
        reg.register(
            "engram_queue_depth",
            "Requests waiting for admission to the engine",
            gauge(s.queued as u64),
        );
        reg.register(
            "engram_running_sequences",
            "Sequences the engine is running",
            gauge(o.running as u64),
        );
        let mut tiers = Vec::new();
        for (tier, used, cap) in [
            ("hot", o.hot_used, o.hot_capacity),
            ("cold", o.cold_used, o.cold_capacity),
            ("reduced", o.reduced_used, o.reduced_capacity),
        ] {
            tiers.push((labels(&[("tier", tier), ("state", "used")]), used as u64));
            tiers.push((labels(&[("tier", tier), ("state", "capacity")]), cap as u64));
        }
        reg.register(
            "engram_tier_blocks",
            "KV blocks per tier, used and capacity",
            gauges(tiers),
        );
    }
    register_shadow_and_tiers(&state, &mut reg);
    state.metrics.register(&mut reg);
    state.tokens.register(&mut reg);
    reg.register(
        "engram_readiness_pings",
        "Database pings /readyz sent (at most one a second, whatever its request rate)",
        crate::metrics::counters("result", [("sent", state.ready.pings())]),
    );
    if state.shadow.is_some() {
        reg.register(
            "engram_shadow_budget_bytes",
            "The shadow's byte budget in force (0: none)",
            gauge(state.shadow_budget),
        );
    }
    Ok(HttpResponse::Ok()
        .content_type(crate::metrics::CONTENT_TYPE)
        .body(crate::metrics::render(&reg)))
}

/// The shadow's and the tier bridge's figures.
fn register_shadow_and_tiers(state: &AppState, reg: &mut prometheus_client::registry::Registry) {
    use crate::metrics::{counter, counters, gauge, gauges, labels};
    if let Some(shadow) = &state.shadow {
        let s = shadow.status();
        reg.register(
            "engram_shadow_writes",
            "Shadow flushes, by result",
            counters("result", [("ok", s.writes), ("failed", s.failures)]),
        );
        reg.register(
            "engram_shadow_bytes_written",
            "Bytes of segment files the shadow wrote",
            counter(s.bytes_written),
        );
        reg.register(
            "engram_shadow_blocks_written",
            "Blocks the shadow wrote",
            counter(s.blocks_written),
        );
        reg.register(
            "engram_shadow_entries",
            "Entries on disk, by kind",
            gauges([
                (labels(&[("kind", "session")]), s.sessions as u64),
                (labels(&[("kind", "prefix")]), s.prefixes as u64),
            ]),
        );
        reg.register(
            "engram_shadow_bytes",
            "Bytes of segment files on disk",
            gauge(s.bytes_on_disk),
        );
        reg.register(
            "engram_shadow_archived_sessions",
            "Sessions in the tokens-only archive now",
            gauge(s.archived_sessions as u64),
        );
        reg.register(
            "engram_shadow_recovery",
            "Entries the last start recovered or skipped, by result",
            counters(
                "result",
                s.recovery_counts
                    .iter()
                    .map(|(result, n)| (result.as_str(), *n)),
            ),
        );
    }
    let t = state.tiers.totals.lock().map(|t| *t).unwrap_or_default();
    reg.register(
        "engram_tier_cycles",
        "Tier-bridge (OODA) cycles run",
        counter(t[0]),
    );
    reg.register(
        "engram_tier_actions",
        "Blocks the tier bridge moved, by action",
        counters(
            "action",
            [
                ("spill", t[1]),
                ("warm", t[2]),
                ("remove", t[3]),
                ("stage", t[4]),
            ],
        ),
    );
}
