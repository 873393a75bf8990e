//! Admin inspection: tier occupancy and counters, the block listing by meaning, and `/metrics`.

use actix_web::{HttpResponse, get, web};
use engram_engine::{BlockQuery, EngineSnapshot, PUBLIC_TENANT};
use engram_kvcore::{BlockFilter, SessionId, SourceLayer, TenantId, Tier};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::auth::AdminCaller;
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
        (status = 200, description = "Occupancy, counters, queue depth", body = serde_json::Value),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[get("/v1/admin/cache")]
pub async fn cache(_: AdminCaller, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    Ok(HttpResponse::Ok().json(snapshot(&state).await?))
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
        (status = 200, description = "A page of blocks", body = serde_json::Value),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 400, description = "Invalid filter", body = crate::error::ErrorSchema),
        (status = 404, description = "Unknown tenant or agent", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[get("/v1/admin/blocks")]
pub async fn blocks(
    _: AdminCaller,
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
    let blocks: Vec<Value> = page
        .blocks
        .iter()
        .map(|b| {
            let mut v = json!(b);
            v["tenant_id"] = if b.tenant == PUBLIC_TENANT.0 {
                json!("public")
            } else {
                let owner = tenants.iter().find(|t| t.cache_salt == b.tenant);
                json!(owner.map(|t| t.id.clone()))
            };
            v
        })
        .collect();
    Ok(HttpResponse::Ok().json(json!({
        "total": page.total,
        "offset": params.offset,
        "limit": limit,
        "blocks": blocks,
    })))
}

/// Prometheus metrics: cache hits by tier, evictions by layer, queue depth, occupancy, TTFT.
#[utoipa::path(
    tag = "admin",
    responses(
        (status = 200, description = "Prometheus text format", content_type = "text/plain; version=0.0.4", body = String),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[get("/metrics")]
pub async fn metrics(_: AdminCaller, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let mut out = String::new();
    if let Some(engine) = &state.engine {
        let rx = engine.snapshot()?;
        let s = rx.answer().await?;
        let c = &s.counters;
        let _ = std::fmt::Write::write_fmt(
            &mut out,
            format_args!(
                "# HELP engram_tier_moves_total Tier moves of cached blocks (spill, warm, removal, readmission, down-tiering, leaving the cache), by the bridge, the turns and admission alike.\n\
             # TYPE engram_tier_moves_total counter\n\
             engram_tier_moves_total {}\n\
             # HELP engram_tier_quick_moves_total Tier moves of a block within 100 tier-bridge cycles of its previous move (flips).\n\
             # TYPE engram_tier_quick_moves_total counter\n\
             engram_tier_quick_moves_total {}\n\
             # HELP engram_admission_evictions_total Hot blocks spilled or dropped at admission because the hot tier was full.\n\
             # TYPE engram_admission_evictions_total counter\n\
             engram_admission_evictions_total {}\n",
                s.tier_moves, s.quick_moves, c.admission_evictions
            ),
        );
        out.push_str(
            "# HELP engram_cache_blocks_total Prompt blocks by the tier that served them (disk_hit: read back from the shadow on a miss into the cold tier, then warmed, so also counted as cold_hit).\n",
        );
        out.push_str("# TYPE engram_cache_blocks_total counter\n");
        // By tier: hot blocks reused, cold blocks warmed, blocks read back from the shadow on a
        // miss (into the cold tier, so the turn then warms them: they count as cold_hit too),
        // and blocks prefilled.
        for (kind, n) in [
            ("hot_hit", c.hot_hits),
            ("cold_hit", c.cold_hits),
            ("disk_hit", state.metrics.disk_hits()),
            ("miss", c.misses),
        ] {
            out.push_str(&format!(
                "engram_cache_blocks_total{{result=\"{kind}\"}} {n}\n"
            ));
        }
        out.push_str("# HELP engram_evictions_total Blocks evicted, by source layer and kind.\n");
        out.push_str("# TYPE engram_evictions_total counter\n");
        for (kind, map) in [("spilled", &c.spilled), ("dropped", &c.dropped)] {
            for (layer, n) in map {
                let layer = serde_json::to_value(layer)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_string))
                    .unwrap_or_default();
                out.push_str(&format!(
                    "engram_evictions_total{{layer=\"{layer}\",kind=\"{kind}\"}} {n}\n"
                ));
            }
        }
        out.push_str(
            "# HELP engram_cold_quota_dropped_total Cold blocks dropped because their tenant was over its cold quota.\n",
        );
        out.push_str("# TYPE engram_cold_quota_dropped_total counter\n");
        out.push_str(&format!(
            "engram_cold_quota_dropped_total {}\n",
            c.cold_quota_dropped
        ));
        out.push_str(
            "# HELP engram_down_tier_blocks_total Cold blocks re-encoded to narrower codecs instead of dropped (down-tiering), and those a turn warmed back.\n",
        );
        out.push_str("# TYPE engram_down_tier_blocks_total counter\n");
        for (kind, n) in [("reduced", c.down_tiered), ("warmed", c.down_tier_hits)] {
            out.push_str(&format!(
                "engram_down_tier_blocks_total{{result=\"{kind}\"}} {n}\n"
            ));
        }
        let r = &s.reservations;
        out.push_str(
            "# HELP engram_reservations_total Cold-tier reservations of memory neighbourhoods, by outcome.\n",
        );
        out.push_str("# TYPE engram_reservations_total counter\n");
        for (kind, n) in [
            ("made", r.made),
            ("warmed", r.warmed),
            ("expired", r.expired),
            ("refused", r.refused),
            ("failed", r.failed),
        ] {
            out.push_str(&format!(
                "engram_reservations_total{{result=\"{kind}\"}} {n}\n"
            ));
        }
        out.push_str(
            "# HELP engram_reservation_blocks_served_total Prompt blocks turns reused from reservations.\n",
        );
        out.push_str("# TYPE engram_reservation_blocks_served_total counter\n");
        out.push_str(&format!(
            "engram_reservation_blocks_served_total {}\n",
            r.blocks_served
        ));
        out.push_str(
            "# HELP engram_reservation_hit_rate Reservations used over those used or expired.\n",
        );
        out.push_str("# TYPE engram_reservation_hit_rate gauge\n");
        out.push_str(&format!(
            "engram_reservation_hit_rate {}\n",
            r.hit_rate().unwrap_or(0.0)
        ));
        let o = &s.occupancy;
        out.push_str("# TYPE engram_queue_depth gauge\n");
        out.push_str(&format!("engram_queue_depth {}\n", s.queued));
        out.push_str("# TYPE engram_running_sequences gauge\n");
        out.push_str(&format!("engram_running_sequences {}\n", o.running));
        out.push_str("# TYPE engram_tier_blocks gauge\n");
        for (tier, used, cap) in [
            ("hot", o.hot_used, o.hot_capacity),
            ("cold", o.cold_used, o.cold_capacity),
            ("reduced", o.reduced_used, o.reduced_capacity),
        ] {
            out.push_str(&format!(
                "engram_tier_blocks{{tier=\"{tier}\",state=\"used\"}} {used}\n"
            ));
            out.push_str(&format!(
                "engram_tier_blocks{{tier=\"{tier}\",state=\"capacity\"}} {cap}\n"
            ));
        }
    }
    render_shadow_and_tiers(&state, &mut out);
    state.metrics.render_ttft(&mut out);
    state.metrics.render_miss_reads(&mut out);
    state.metrics.render_archive(&mut out);
    state.tokens.render(&mut out);
    Ok(HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4")
        .body(out))
}

/// The shadow's and the tier bridge's counters in the Prometheus text format.
fn render_shadow_and_tiers(state: &AppState, out: &mut String) {
    use std::fmt::Write;
    if let Some(shadow) = &state.shadow {
        let s = shadow.status();
        let _ = write!(
            out,
            "# HELP engram_shadow_writes_total Shadow flushes, by result.\n\
             # TYPE engram_shadow_writes_total counter\n\
             engram_shadow_writes_total{{result=\"ok\"}} {}\n\
             engram_shadow_writes_total{{result=\"failed\"}} {}\n\
             # HELP engram_shadow_bytes_written_total Bytes of segment files the shadow wrote.\n\
             # TYPE engram_shadow_bytes_written_total counter\n\
             engram_shadow_bytes_written_total {}\n\
             # HELP engram_shadow_blocks_written_total Blocks the shadow wrote.\n\
             # TYPE engram_shadow_blocks_written_total counter\n\
             engram_shadow_blocks_written_total {}\n\
             # HELP engram_shadow_entries Entries on disk, by kind.\n\
             # TYPE engram_shadow_entries gauge\n\
             engram_shadow_entries{{kind=\"session\"}} {}\n\
             engram_shadow_entries{{kind=\"prefix\"}} {}\n\
             # HELP engram_shadow_bytes Bytes of segment files on disk.\n\
             # TYPE engram_shadow_bytes gauge\n\
             engram_shadow_bytes {}\n\
             # HELP engram_shadow_archived_sessions Sessions in the tokens-only archive now.\n\
             # TYPE engram_shadow_archived_sessions gauge\n\
             engram_shadow_archived_sessions {}\n\
             # HELP engram_shadow_recovery_total Entries the last start recovered or skipped, by result.\n\
             # TYPE engram_shadow_recovery_total counter\n",
            s.writes,
            s.failures,
            s.bytes_written,
            s.blocks_written,
            s.sessions,
            s.prefixes,
            s.bytes_on_disk,
            s.archived_sessions
        );
        for (result, n) in &s.recovery_counts {
            let _ = writeln!(
                out,
                "engram_shadow_recovery_total{{result=\"{result}\"}} {n}"
            );
        }
    }
    let t = state.tiers.totals.lock().map(|t| *t).unwrap_or_default();
    let _ = write!(
        out,
        "# HELP engram_tier_cycles_total Tier-bridge (OODA) cycles run.\n\
         # TYPE engram_tier_cycles_total counter\n\
         engram_tier_cycles_total {}\n\
         # HELP engram_tier_actions_total Blocks the tier bridge moved, by action.\n\
         # TYPE engram_tier_actions_total counter\n\
         engram_tier_actions_total{{action=\"spill\"}} {}\n\
         engram_tier_actions_total{{action=\"warm\"}} {}\n\
         engram_tier_actions_total{{action=\"remove\"}} {}\n",
        t[0], t[1], t[2], t[3]
    );
}
