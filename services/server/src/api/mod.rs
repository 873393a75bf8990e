//! HTTP resources, one module each; handlers are thin over the store, the engine and the
//! life of a turn (`crate::turn`), and no api module imports another (but the SSE pump and
//! the idempotency key, `chat` and `tools`, the chat turn and the tool-call and
//! structured-output helpers the OpenAI- and Anthropic-style routes share, and `mcp`, a facade
//! over the memory routes and the chat turn).

pub mod admin;
pub mod agents;
pub mod cache;
mod chat;
pub mod completions;
pub mod embeddings;
pub mod health;
mod history;
mod idempotency;
pub mod inspect;
pub mod lifecycle;
pub mod mcp;
pub mod memory;
pub mod messages;
pub mod openai;
pub mod responses;
pub mod sessions;
mod stream;
mod tools;
pub mod turns;

use actix_web::web;

/// Every route, listed once: [`configure`] registers them and [`Paths`] documents them.
macro_rules! routes {
    ($($module:ident::$handler:ident),* $(,)?) => {
        /// Registers every route.
        pub fn configure(cfg: &mut web::ServiceConfig) {
            $(cfg.service($module::$handler);)*
        }

        /// Every route's OpenAPI operation (merged into `crate::openapi::ApiDoc`).
        #[derive(Debug, utoipa::OpenApi)]
        #[openapi(paths($($module::$handler),*))]
        pub struct Paths;
    };
}

#[rustfmt::skip]
routes!(
    health::healthz, health::readyz, admin::create_tenant, admin::list_tenants,
    admin::create_key, admin::revoke_key, admin::mark_layer_public, admin::create_admin_key,
    admin::list_admin_keys, admin::revoke_admin_key, agents::create_agent,
    agents::list_agents, agents::get_agent, agents::put_layer, agents::list_layers,
    agents::preview_context, turns::create_turn, sessions::inject_context, sessions::fork_session, sessions::prefetch,
    sessions::list_sessions, sessions::session_log,
    turns::working_memory, turns::session_cache,
    openai::list_models, openai::chat_completions, completions::completions,
    embeddings::embeddings, messages::create_message, messages::count_tokens,
    responses::create_response, responses::get_response, responses::delete_response, mcp::mcp,
    embeddings::tokenize, embeddings::detokenize, inspect::cache, inspect::blocks,
    inspect::metrics, memory::create_node, memory::list_nodes, memory::get_node,
    memory::update_node, memory::delete_node, memory::create_edge, memory::list_edges,
    memory::delete_edge, memory::query, memory::list_reservations, memory::warm_reservation,
    memory::admin_reservations, memory::admin_memory, memory::admin_node, cache::save, cache::load, cache::evict, cache::archive, cache::export,
    cache::export_agent, cache::import_agent,
    cache::import, cache::admin_shadow, cache::admin_flush, cache::admin_tiers,
    cache::admin_tier_cycle, lifecycle::delete_session, lifecycle::delete_agent,
    lifecycle::delete_tenant,
);
