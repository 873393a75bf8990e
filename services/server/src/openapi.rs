//! The OpenAPI document (utoipa), served at `/openapi.json` with Swagger UI at `/docs` (its
//! assets are compiled in, so it works offline). `openapi/openapi.json` in the repository is
//! this document; a test fails when they differ (`make openapi` rewrites the file).

use utoipa::openapi::link::LinkBuilder;
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

/// What an agent or session name may be (`turn::check_name`): so generated requests name real
/// resources, and a name outside it is a negative case.
pub const NAME_PATTERN: &str = "^[A-Za-z0-9_-]{1,64}$";

fn standardize(path: &str, method: &str, op: &mut Operation) {
    for p in op.parameters.iter_mut().flatten() {
        if matches!(p.parameter_in, ParameterIn::Path)
            && matches!(p.name.as_str(), "agent" | "session")
            && let Some(RefOr::T(Schema::Object(o))) = &mut p.schema
        {
            o.pattern = Some(NAME_PATTERN.to_string());
        }
    }
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

/// OpenAPI links between operations: what a created resource's answer names, and the operations
/// that take it (schemathesis's stateful phase follows them, so the attack suite's generated
/// sequences create a resource as one tenant and use it as the other).
#[derive(Debug)]
struct Links;

/// A link: (name, target operation id, its parameters as runtime expressions).
type LinkRow = (
    &'static str,
    &'static str,
    &'static [(&'static str, &'static str)],
);

const AGENT_FROM_BODY: &[(&str, &str)] = &[("agent", "$response.body#/agent/name")];
const SESSION_FROM_PATH: &[(&str, &str)] = &[
    ("agent", "$request.path.agent"),
    ("session", "$request.path.session"),
];
const FORKED: &[(&str, &str)] = &[
    ("agent", "$request.path.agent"),
    ("session", "$response.body#/session"),
];
const NODE_FROM_BODY: &[(&str, &str)] = &[
    ("agent", "$request.path.agent"),
    ("id", "$response.body#/id"),
];
const TENANT_FROM_BODY: &[(&str, &str)] = &[("tenant", "$response.body#/tenant/id")];
const TENANT_KEY: &[(&str, &str)] = &[
    ("tenant", "$response.body#/tenant/id"),
    ("key", "$response.body#/key/id"),
];
const KEY_OF_TENANT: &[(&str, &str)] = &[
    ("tenant", "$request.path.tenant"),
    ("key", "$response.body#/key/id"),
];

/// (path, method, status, links).
const LINKS: &[(&str, &str, &str, &[LinkRow])] = &[
    (
        "/v1/agents",
        "post",
        "201",
        &[
            ("GetAgent", "get_agent", AGENT_FROM_BODY),
            ("ListLayers", "list_layers", AGENT_FROM_BODY),
            ("PutLayer", "put_layer", AGENT_FROM_BODY),
            ("PreviewContext", "preview_context", AGENT_FROM_BODY),
            ("CreateNode", "create_node", AGENT_FROM_BODY),
            ("ListNodes", "list_nodes", AGENT_FROM_BODY),
            ("Query", "query", AGENT_FROM_BODY),
            ("CreateTurn", "create_turn", AGENT_FROM_BODY),
            ("ExportAgent", "export_agent", AGENT_FROM_BODY),
            ("DeleteAgent", "delete_agent", AGENT_FROM_BODY),
        ],
    ),
    (
        "/v1/agents/{agent}/sessions/{session}/turns",
        "post",
        "200",
        &[
            ("SessionCache", "session_cache", SESSION_FROM_PATH),
            ("WorkingMemory", "working_memory", SESSION_FROM_PATH),
            ("Export", "export", SESSION_FROM_PATH),
            ("Save", "save", SESSION_FROM_PATH),
            ("Evict", "evict", SESSION_FROM_PATH),
            ("Archive", "archive", SESSION_FROM_PATH),
            ("Fork", "fork_session", SESSION_FROM_PATH),
            ("Prefetch", "prefetch", SESSION_FROM_PATH),
            ("InjectContext", "inject_context", SESSION_FROM_PATH),
            ("DeleteSession", "delete_session", SESSION_FROM_PATH),
        ],
    ),
    (
        "/v1/agents/{agent}/sessions/{session}/fork",
        "post",
        "201",
        &[
            ("CreateTurn", "create_turn", FORKED),
            ("WorkingMemory", "working_memory", FORKED),
            ("DeleteSession", "delete_session", FORKED),
        ],
    ),
    (
        "/v1/agents/{agent}/memory/nodes",
        "post",
        "201",
        &[
            ("GetNode", "get_node", NODE_FROM_BODY),
            ("UpdateNode", "update_node", NODE_FROM_BODY),
            ("DeleteNode", "delete_node", NODE_FROM_BODY),
        ],
    ),
    (
        "/v1/agents/{agent}/memory/edges",
        "post",
        "201",
        &[("DeleteEdge", "delete_edge", NODE_FROM_BODY)],
    ),
    (
        "/v1/admin/tenants",
        "post",
        "201",
        &[
            ("CreateKey", "create_key", TENANT_FROM_BODY),
            ("RevokeKey", "revoke_key", TENANT_KEY),
            ("DeleteTenant", "delete_tenant", TENANT_FROM_BODY),
        ],
    ),
    (
        "/v1/admin/tenants/{tenant}/keys",
        "post",
        "201",
        &[("RevokeKey", "revoke_key", KEY_OF_TENANT)],
    ),
    (
        "/v1/admin/keys",
        "post",
        "201",
        &[(
            "RevokeAdminKey",
            "revoke_admin_key",
            &[("key", "$response.body#/key/id")],
        )],
    ),
];

impl Modify for Links {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        for (path, method, status, links) in LINKS {
            let Some(item) = openapi.paths.paths.get_mut(*path) else {
                continue;
            };
            let op = match *method {
                "get" => &mut item.get,
                "put" => &mut item.put,
                "post" => &mut item.post,
                "delete" => &mut item.delete,
                _ => &mut item.patch,
            };
            let Some(RefOr::T(response)) = op
                .as_mut()
                .and_then(|op| op.responses.responses.get_mut(*status))
            else {
                continue;
            };
            for (name, target, params) in *links {
                let mut link = LinkBuilder::new().operation_id(*target);
                for (param, expr) in *params {
                    link = link.parameter(*param, *expr);
                }
                response
                    .links
                    .insert((*name).to_string(), RefOr::T(link.build()));
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
        (name = "openai", description = "OpenAI-compatible endpoints (and the tokenizer's, as llama.cpp's and vLLM's servers have them)"),
        (name = "anthropic", description = "Anthropic's Messages API"),
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
    Links.modify(&mut doc);
    doc
}

/// The document as served: [`spec`] as JSON, with each link's fields named as OpenAPI names
/// them (utoipa 5 writes `Link`'s fields in snake case: `operation_id` for `operationId`).
pub fn document() -> serde_json::Value {
    let mut doc = serde_json::to_value(spec()).unwrap_or_default();
    let Some(paths) = doc.get_mut("paths").and_then(|p| p.as_object_mut()) else {
        return doc;
    };
    let links = paths
        .values_mut()
        .filter_map(|item| item.as_object_mut())
        .flat_map(|item| item.values_mut())
        .filter_map(|op| op.get_mut("responses").and_then(|r| r.as_object_mut()))
        .flat_map(|responses| responses.values_mut())
        .filter_map(|r| r.get_mut("links").and_then(|l| l.as_object_mut()))
        .flat_map(|links| links.values_mut())
        .filter_map(|link| link.as_object_mut());
    for link in links {
        for (from, to) in [
            ("operation_id", "operationId"),
            ("operation_ref", "operationRef"),
            ("request_body", "requestBody"),
        ] {
            if let Some(v) = link.remove(from) {
                link.insert(to.to_string(), v);
            }
        }
    }
    doc
}

/// The document as pretty JSON (what `openapi/openapi.json` holds).
pub fn spec_json() -> String {
    serde_json::to_string_pretty(&document()).unwrap_or_default()
}
