//! Lookups of API keys and operator keys, remembered for a short time (the database is asked
//! once per key and TTL, not once per request), and the hook that throttles the lookups that
//! do reach the database (`crate::auth` passes the caller's per-IP limit).

use engram_store::Tenant;
use sha2::{Digest, Sha256};

/// Why a key could not be looked up.
#[derive(Debug, thiserror::Error)]
pub enum KeyError<E> {
    /// The caller is over its lookup rate.
    #[error("too many key lookups")]
    Throttled(E),
    /// The database failed.
    #[error(transparent)]
    Store(engram_store::StoreError),
}

/// Key lookups remembered (moka, keyed by the key's SHA-256, so no secret is held): a found
/// key for `auth.key_cache_ms`, so a busy client's requests do not each ask the database; an
/// unknown key for `auth.unknown_key_cache_ms`, so a client retrying a wrong key does not
/// either. Revocations and deletions through this node clear both. `V` is what a key names: a
/// [`Tenant`] ([`KeyCache`]) or a stored operator key ([`OperatorKeys`]).
#[derive(Debug)]
pub struct Lookups<V: Clone + Send + Sync + 'static> {
    found: Option<moka::sync::Cache<[u8; 32], V>>,
    unknown: Option<moka::sync::Cache<[u8; 32], ()>>,
}

/// Tenant API keys' lookups.
pub type KeyCache = Lookups<Tenant>;
/// Operator keys' lookups (the stored keys of `POST /v1/admin/keys`).
pub type OperatorKeys = Lookups<engram_store::AdminKey>;

fn cache_of<V: Clone + Send + Sync + 'static>(
    ttl_ms: u64,
) -> Option<moka::sync::Cache<[u8; 32], V>> {
    (ttl_ms > 0).then(|| {
        moka::sync::Cache::builder()
            .max_capacity(100_000)
            .time_to_live(std::time::Duration::from_millis(ttl_ms))
            .build()
    })
}

impl<V: Clone + Send + Sync + 'static> Lookups<V> {
    /// Found keys live `ttl_ms` and unknown ones `unknown_ms` (none when 0).
    pub fn new(ttl_ms: u64, unknown_ms: u64) -> Self {
        Self {
            found: cache_of(ttl_ms),
            unknown: cache_of(unknown_ms),
        }
    }

    /// What `key` names: remembered, or — when `lookup` allows it (the caller's lookup rate) —
    /// `fetch`ed from the store, and remembered either way.
    pub async fn get<E, F>(
        &self,
        key: &str,
        lookup: impl FnOnce() -> Result<(), E>,
        fetch: impl FnOnce() -> F,
    ) -> Result<Option<V>, KeyError<E>>
    where
        F: std::future::Future<Output = Result<Option<V>, engram_store::StoreError>>,
    {
        let h: [u8; 32] = Sha256::digest(key.as_bytes()).into();
        if let Some(v) = self.found.as_ref().and_then(|c| c.get(&h)) {
            return Ok(Some(v));
        }
        if self.unknown.as_ref().is_some_and(|c| c.contains_key(&h)) {
            return Ok(None);
        }
        lookup().map_err(KeyError::Throttled)?;
        let found = fetch().await.map_err(KeyError::Store)?;
        match (&found, &self.found, &self.unknown) {
            (Some(v), Some(c), _) => c.insert(h, v.clone()),
            (None, _, Some(u)) => u.insert(h, ()),
            _ => {}
        }
        Ok(found)
    }

    /// Forgets every lookup (a key was issued or revoked, or a tenant deleted).
    pub fn clear(&self) {
        if let Some(c) = &self.found {
            c.invalidate_all();
        }
        if let Some(u) = &self.unknown {
            u.invalidate_all();
        }
    }
}
