//! HTTP resources, one module each; handlers are thin over the store, the engine and the
//! life of a turn (`crate::turn`), and no api module imports another (but the SSE pump).

pub mod admin;
pub mod agents;
pub mod cache;
pub mod health;
pub mod inspect;
pub mod lifecycle;
pub mod memory;
pub mod openai;
mod stream;
pub mod turns;

use actix_web::web;

/// Registers every route.
pub fn configure(cfg: &mut web::ServiceConfig) {
    cfg.service(health::healthz)
        .service(health::readyz)
        .service(admin::create_tenant)
        .service(admin::list_tenants)
        .service(admin::create_key)
        .service(admin::revoke_key)
        .service(admin::mark_layer_public)
        .service(agents::create_agent)
        .service(agents::list_agents)
        .service(agents::get_agent)
        .service(agents::put_layer)
        .service(agents::list_layers)
        .service(agents::preview_context)
        .service(turns::create_turn)
        .service(turns::working_memory)
        .service(turns::session_cache)
        .service(openai::list_models)
        .service(openai::chat_completions)
        .service(inspect::cache)
        .service(inspect::blocks)
        .service(inspect::metrics)
        .service(memory::create_node)
        .service(memory::list_nodes)
        .service(memory::get_node)
        .service(memory::update_node)
        .service(memory::delete_node)
        .service(memory::create_edge)
        .service(memory::list_edges)
        .service(memory::delete_edge)
        .service(memory::query)
        .service(memory::list_reservations)
        .service(memory::warm_reservation)
        .service(memory::admin_reservations)
        .service(memory::admin_memory)
        .service(cache::save)
        .service(cache::load)
        .service(cache::export)
        .service(cache::import)
        .service(cache::admin_shadow)
        .service(cache::admin_flush)
        .service(cache::admin_tiers)
        .service(cache::admin_tier_cycle)
        .service(lifecycle::delete_session)
        .service(lifecycle::delete_agent)
        .service(lifecycle::delete_tenant);
}
