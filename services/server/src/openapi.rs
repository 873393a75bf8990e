//! The OpenAPI document (utoipa), served at `/openapi.json` with Swagger UI at `/docs` (its
//! assets are compiled in, so it works offline). `openapi/openapi.json` in the repository is
//! this document; a test fails when they differ (`make openapi` rewrites the file).

use utoipa::openapi::path::{Operation, ParameterIn};
use utoipa::openapi::schema::{ObjectBuilder, Schema, SchemaFormat, SchemaType, Type};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::{ContentBuilder, KnownFormat, Ref, RefOr, ResponseBuilder};
use utoipa::{Modify, OpenApi};

use crate::api;

/// One server-sent event as a client parses it (the `text/event-stream` answers of the turn and
/// chat routes): `data` holds one JSON value, or `[DONE]` at the end of an OpenAI stream.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct SseEvent {
    /// The event's data line.
    pub data: String,
    /// The event type (`message` when the server names none).
    pub event: Option<String>,
    /// The event id (none are sent).
    pub id: Option<String>,
    /// A reconnection delay in ms (none is sent).
    pub retry: Option<u64>,
}

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

/// The error answers every operation can give, declared from what the code does: a request
/// body can be malformed (400), over the limit (413) or not JSON (415); a path or query can be
/// invalid (400) or name nothing (404); a tenant route can be over the tenant's rate (429);
/// every authenticated route answers 401 without a valid key and 429 over the client's key
/// lookups; an operator route answers 403 to a key without its scope. Binary bodies are declared as
/// `string`/`binary` (not as arrays of integers), untyped JSON answers as objects.
#[derive(Debug)]
struct StandardResponses;

fn error_response(description: &str) -> RefOr<utoipa::openapi::Response> {
    RefOr::T(
        ResponseBuilder::new()
            .description(description)
            .content(
                "application/json",
                ContentBuilder::new()
                    .schema(Some(Ref::from_schema_name("ErrorSchema")))
                    .build(),
            )
            .build(),
    )
}

fn binary() -> RefOr<utoipa::openapi::schema::Schema> {
    RefOr::T(utoipa::openapi::schema::Schema::Object(
        ObjectBuilder::new()
            .schema_type(Type::String)
            .format(Some(SchemaFormat::KnownFormat(KnownFormat::Binary)))
            .build(),
    ))
}

fn standardize(path: &str, method: &str, op: &mut Operation) {
    let params = op.parameters.as_deref().unwrap_or_default();
    let has_path = params
        .iter()
        .any(|p| matches!(p.parameter_in, ParameterIn::Path));
    let has_query = params
        .iter()
        .any(|p| matches!(p.parameter_in, ParameterIn::Query));
    let authenticated = op.security.as_ref().is_some_and(|s| !s.is_empty());
    let tenant_route = authenticated && !path.starts_with("/v1/admin") && path != "/metrics";
    let mut add = |code: &str, description: &str| {
        op.responses
            .responses
            .entry(code.to_string())
            .or_insert_with(|| error_response(description));
    };
    if let Some(body) = &mut op.request_body {
        for (kind, content) in body.content.iter_mut() {
            if kind == "application/octet-stream" {
                content.schema = Some(binary());
            }
        }
        add("400", "Invalid input");
        add("413", "The request body is over the limit");
        add("415", "The body is not of the declared content type");
    }
    if has_path || has_query {
        add("400", "Invalid input");
    }
    if has_path {
        add("404", "Not found");
    }
    if authenticated {
        add("401", "Missing or wrong key");
    }
    if authenticated && method != "get" {
        add(
            "409",
            "Conflicts with what is stored: a name taken, or a resource deleted meanwhile",
        );
    }
    if tenant_route {
        add(
            "429",
            "Over the tenant's request rate or generation slots, or the client's key lookups \
             (`Retry-After`)",
        );
    } else if authenticated {
        add(
            "403",
            "The key lacks the scope the operation needs, or no admin key is configured",
        );
        add("429", "Over the client's key lookups (`Retry-After`)");
    }
    // What reaches the engine, the memory graph or the shadow can find them off, stopped or
    // full; so can a delete (it forgets the cache).
    let engine_paths = [
        "/sessions/",
        "/memory",
        "/chat/",
        "/context",
        "/layers",
        "/v1/admin/blocks",
        "/v1/admin/cache",
        "/v1/admin/tiers",
        "/v1/admin/shadow",
        "/v1/admin/reservations",
    ];
    let delete = method == "delete"
        && (path == "/v1/agents/{agent}" || path == "/v1/admin/tenants/{tenant}");
    if engine_paths.iter().any(|p| path.contains(p)) || delete {
        add(
            "503",
            "The model, the memory graph or the shadow is unavailable, or the engine is full",
        );
    }
    for r in op.responses.responses.values_mut() {
        let RefOr::T(r) = r else { continue };
        if let Some(c) = r.content.get_mut("application/octet-stream") {
            c.schema = Some(binary());
        }
        // Every JSON answer is an object: say so where the handler's type is untyped.
        if let Some(c) = r.content.get_mut("application/json")
            && let Some(RefOr::T(Schema::Object(o))) = &mut c.schema
            && o.schema_type == SchemaType::AnyValue
            && o.properties.is_empty()
        {
            o.schema_type = SchemaType::Type(Type::Object);
        }
    }
}

impl Modify for StandardResponses {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        for (path, item) in openapi.paths.paths.iter_mut() {
            for (method, op) in [
                ("get", &mut item.get),
                ("put", &mut item.put),
                ("post", &mut item.post),
                ("delete", &mut item.delete),
                ("patch", &mut item.patch),
            ] {
                if let Some(op) = op {
                    standardize(path, method, op);
                }
            }
        }
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
    components(schemas(crate::error::ErrorSchema)),
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

/// The document: [`ApiDoc`] with every route of [`api::Paths`], then the security scheme and
/// the standard error answers on each operation.
pub fn spec() -> utoipa::openapi::OpenApi {
    let mut doc = ApiDoc::openapi();
    doc.merge(api::Paths::openapi());
    BearerAuth.modify(&mut doc);
    StandardResponses.modify(&mut doc);
    doc
}

/// The document as pretty JSON (what `openapi/openapi.json` holds).
pub fn spec_json() -> String {
    spec().to_pretty_json().unwrap_or_default()
}
