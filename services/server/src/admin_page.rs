//! The admin web page at `/admin`: static assets compiled into the binary (Preact + htm,
//! vendored from npm; no build step), served with a strict Content-Security-Policy (scripts,
//! styles and fetches from this origin only; no inline script, no frames). The page holds no
//! data: it signs in with the admin key (kept in the tab's `sessionStorage`, sent as a Bearer
//! header) and reads the admin API like any client.

use actix_web::http::header;
use actix_web::{HttpResponse, get, web};

/// The policy every asset is served with.
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
                       connect-src 'self'; img-src 'self' data:; base-uri 'none'; \
                       form-action 'none'; frame-ancestors 'none'";

const INDEX: &str = include_str!("../admin/index.html");
const APP: &str = include_str!("../admin/app.js");
const CSS: &str = include_str!("../admin/admin.css");
const VENDOR: &str = include_str!("../admin/vendor/htm-preact-standalone.module.js");

fn asset(content_type: &str, body: &'static str) -> HttpResponse {
    HttpResponse::Ok()
        .content_type(content_type)
        .insert_header((header::CONTENT_SECURITY_POLICY, CSP))
        .insert_header((header::X_CONTENT_TYPE_OPTIONS, "nosniff"))
        .insert_header((header::REFERRER_POLICY, "no-referrer"))
        .insert_header((header::X_FRAME_OPTIONS, "DENY"))
        .insert_header((header::CACHE_CONTROL, "no-cache"))
        .body(body)
}

/// The page.
#[get("/admin")]
pub async fn index() -> HttpResponse {
    asset("text/html; charset=utf-8", INDEX)
}

/// The page (trailing slash).
#[get("/admin/")]
pub async fn index_slash() -> HttpResponse {
    asset("text/html; charset=utf-8", INDEX)
}

/// Its script.
#[get("/admin/app.js")]
pub async fn app() -> HttpResponse {
    asset("text/javascript; charset=utf-8", APP)
}

/// Its styles.
#[get("/admin/admin.css")]
pub async fn css() -> HttpResponse {
    asset("text/css; charset=utf-8", CSS)
}

/// Preact + htm.
#[get("/admin/vendor/htm-preact-standalone.module.js")]
pub async fn vendor() -> HttpResponse {
    asset("text/javascript; charset=utf-8", VENDOR)
}

/// Registers the page's routes.
pub fn configure(cfg: &mut web::ServiceConfig) {
    cfg.service(index)
        .service(index_slash)
        .service(app)
        .service(css)
        .service(vendor);
}
