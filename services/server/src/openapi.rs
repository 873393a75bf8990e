//! The OpenAPI document (utoipa), served at `/openapi.json` with Swagger UI at `/docs` (its
//! assets are compiled in, so it works offline). `openapi/openapi.json` in the repository is
//! this document; a test fails when they differ (`make openapi` rewrites the file).

use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

use crate::api;

/// Bearer authentication: a tenant's API key, or the admin key.
#[derive(Debug)]
struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// The Engram API.
#[derive(Debug, OpenApi)]
#[openapi(
    info(
        title = "Engram",
        description = "Agent memory with a semantic KV cache: tenants, agents, layered prompts, turns, a memory graph with hybrid recall and cold-tier reservations, a cache that survives restarts (shadow, per-session save/load/export/import), a tier bridge, OpenAI-compatible chat and cache inspection.",
        license(name = "Apache-2.0")
    ),
    paths(
        api::health::healthz,
        api::health::readyz,
        api::admin::create_tenant,
        api::admin::list_tenants,
        api::admin::create_key,
        api::admin::revoke_key,
        api::admin::mark_layer_public,
        api::agents::create_agent,
        api::agents::list_agents,
        api::agents::get_agent,
        api::agents::put_layer,
        api::agents::list_layers,
        api::agents::preview_context,
        api::turns::create_turn,
        api::turns::working_memory,
        api::turns::session_cache,
        api::openai::list_models,
        api::openai::chat_completions,
        api::inspect::cache,
        api::inspect::blocks,
        api::inspect::metrics,
        api::memory::create_node,
        api::memory::list_nodes,
        api::memory::get_node,
        api::memory::update_node,
        api::memory::delete_node,
        api::memory::create_edge,
        api::memory::list_edges,
        api::memory::delete_edge,
        api::memory::query,
        api::memory::list_reservations,
        api::memory::warm_reservation,
        api::memory::admin_reservations,
        api::memory::admin_memory,
        api::cache::save,
        api::cache::load,
        api::cache::export,
        api::cache::import,
        api::cache::admin_shadow,
        api::cache::admin_flush,
        api::cache::admin_tiers,
        api::cache::admin_tier_cycle,
        api::lifecycle::delete_session,
        api::lifecycle::delete_agent,
        api::lifecycle::delete_tenant,
    ),
    components(schemas(crate::error::ErrorSchema)),
    modifiers(&BearerAuth),
    tags(
        (name = "health", description = "Probes"),
        (name = "admin", description = "Operator: tenants, keys, cache inspection, metrics"),
        (name = "agents", description = "Agents, layers and prompt previews"),
        (name = "sessions", description = "Turns and session state"),
        (name = "openai", description = "OpenAI-compatible endpoints"),
        (name = "memory", description = "The agent's memory graph: nodes, edges, hybrid recall, cold-tier reservations"),
    )
)]
pub struct ApiDoc;

/// The document as pretty JSON (what `openapi/openapi.json` holds).
pub fn spec_json() -> String {
    ApiDoc::openapi().to_pretty_json().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fails when the code's spec drifts from the committed file; `UPDATE_OPENAPI=1` rewrites it.
    #[test]
    fn the_committed_spec_matches_the_code() {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../openapi/openapi.json");
        let spec = spec_json() + "\n";
        if std::env::var_os("UPDATE_OPENAPI").is_some() {
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, &spec).unwrap();
        }
        let committed = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            committed == spec,
            "openapi/openapi.json is out of date: run `make openapi` and commit it"
        );
        // Every route is documented.
        for route in [
            "/v1/agents",
            "/v1/chat/completions",
            "/v1/admin/blocks",
            "/v1/agents/{agent}/memory/query",
            "/v1/agents/{agent}/memory/reservations",
            "/healthz",
        ] {
            assert!(spec.contains(&format!("\"{route}\"")), "{route}");
        }
    }
}
