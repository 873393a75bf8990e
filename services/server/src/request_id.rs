//! Request ids: every response carries `x-request-id` (the client's own, when it sent a sane
//! one, or a fresh unguessable id), and every line the server logs about a request names it
//! (the request's span), so an operator finds the detail a client's generic error body leaves out.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use actix_web::HttpMessage;
use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::header::{HeaderName, HeaderValue};
use actix_web::middleware::Next;
use sha2::{Digest, Sha256};

/// The header.
pub const HEADER: &str = "x-request-id";

/// A client's id is kept when it is 1–64 characters of `[A-Za-z0-9._-]`.
fn sane(id: &str) -> bool {
    (1..=64).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// A fresh id: SHA-256 of a per-process random seed and a counter (32 hex digits), so ids
/// reveal neither the order nor the number of other tenants' requests.
pub fn fresh() -> String {
    static SEED: OnceLock<[u8; 32]> = OnceLock::new();
    static N: AtomicU64 = AtomicU64::new(0);
    let seed = SEED.get_or_init(|| {
        let mut s = [0u8; 32];
        let read = std::fs::File::open("/dev/urandom")
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut s));
        if read.is_err() {
            // No urandom: the clock and the process id still make ids unique per process.
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            s = Sha256::digest(format!("{t}/{}", std::process::id())).into();
        }
        s
    });
    let mut h = Sha256::new();
    h.update(seed);
    h.update(N.fetch_add(1, Ordering::Relaxed).to_le_bytes());
    h.finalize()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The request's id, chosen once (the client's sane one or a fresh one) and kept in the
/// request's extensions, so the request log and the response header agree.
#[derive(Debug, Clone)]
struct RequestId(String);

/// The id of `req` (chosen on the first call).
pub fn of(req: &ServiceRequest) -> String {
    if let Some(RequestId(id)) = req.extensions().get::<RequestId>() {
        return id.clone();
    }
    let id = req
        .headers()
        .get(HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|v| sane(v))
        .map_or_else(fresh, str::to_string);
    req.extensions_mut().insert(RequestId(id.clone()));
    id
}

/// The middleware (`actix_web::middleware::from_fn`).
pub async fn middleware(
    req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<impl MessageBody + 'static>, actix_web::Error> {
    let id = of(&req);
    let mut res = next.call(req).await?;
    if let Ok(v) = HeaderValue::from_str(&id) {
        res.headers_mut().insert(HeaderName::from_static(HEADER), v);
    }
    Ok(res)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_ids_are_kept_only_when_sane_and_fresh_ids_differ() {
        assert!(sane("abc-DEF_1.2"));
        assert!(!sane(""));
        assert!(!sane(&"a".repeat(65)));
        assert!(!sane("a b"));
        assert!(!sane("a\nb"));
        let (a, b) = (fresh(), fresh());
        assert_ne!(a, b);
        assert_eq!(a.len(), 32);
        assert!(sane(&a));
    }
}
