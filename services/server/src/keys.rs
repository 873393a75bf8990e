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

/// API-key lookups remembered (moka, keyed by the key's SHA-256, so no secret is held): a
/// found key for `auth.key_cache_ms`, so a busy tenant's requests do not each ask the
/// database; an unknown key for `auth.unknown_key_cache_ms`, so a client retrying a wrong key
/// does not either. Revocations and tenant deletions through this node clear both.
#[derive(Debug)]
pub struct KeyCache {
    cache: Option<moka::sync::Cache<[u8; 32], Tenant>>,
    unknown: Option<moka::sync::Cache<[u8; 32], ()>>,
}

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

impl KeyCache {
    /// A cache whose found keys live `ttl_ms` and unknown ones `unknown_ms` (none when 0).
    pub fn new(ttl_ms: u64, unknown_ms: u64) -> Self {
        Self {
            cache: cache_of(ttl_ms),
            unknown: cache_of(unknown_ms),
        }
    }

    /// The key's tenant: remembered, or — when `lookup` allows it (the caller's lookup rate) —
    /// asked of the store, and remembered either way.
    pub async fn authenticate<E>(
        &self,
        store: &engram_store::Store,
        key: &str,
        lookup: impl FnOnce() -> Result<(), E>,
    ) -> Result<Option<Tenant>, KeyError<E>> {
        let h: [u8; 32] = Sha256::digest(key.as_bytes()).into();
        if let Some(t) = self.cache.as_ref().and_then(|c| c.get(&h)) {
            return Ok(Some(t));
        }
        if self.unknown.as_ref().is_some_and(|c| c.contains_key(&h)) {
            return Ok(None);
        }
        lookup().map_err(KeyError::Throttled)?;
        let found = store.authenticate(key).await.map_err(KeyError::Store)?;
        match (&found, &self.cache, &self.unknown) {
            (Some(t), Some(c), _) => c.insert(h, t.clone()),
            (None, _, Some(u)) => u.insert(h, ()),
            _ => {}
        }
        Ok(found)
    }

    /// Forgets every lookup (a key was revoked or created, or a tenant deleted).
    pub fn clear(&self) {
        if let Some(c) = &self.cache {
            c.invalidate_all();
        }
        if let Some(u) = &self.unknown {
            u.invalidate_all();
        }
    }
}

/// Operator keys remembered like tenant keys ([`KeyCache`]'s two caches): the stored keys of
/// `POST /v1/admin/keys`, keyed by the secret's SHA-256.
#[derive(Debug)]
pub struct OperatorKeys {
    found: Option<moka::sync::Cache<[u8; 32], engram_store::AdminKey>>,
    unknown: Option<moka::sync::Cache<[u8; 32], ()>>,
}

impl OperatorKeys {
    /// Found keys live `ttl_ms`, unknown ones `unknown_ms` (none when 0).
    pub fn new(ttl_ms: u64, unknown_ms: u64) -> Self {
        Self {
            found: cache_of(ttl_ms),
            unknown: cache_of(unknown_ms),
        }
    }

    /// Forgets every lookup (a key was issued or revoked).
    pub fn clear(&self) {
        if let Some(c) = &self.found {
            c.invalidate_all();
        }
        if let Some(u) = &self.unknown {
            u.invalidate_all();
        }
    }

    /// The stored operator key of `key`: remembered, or — when `lookup` allows it (the
    /// caller's lookup rate) — asked of the store, and remembered either way.
    pub async fn find<E>(
        &self,
        store: &engram_store::Store,
        key: &str,
        lookup: impl FnOnce() -> Result<(), E>,
    ) -> Result<Option<engram_store::AdminKey>, KeyError<E>> {
        let h: [u8; 32] = Sha256::digest(key.as_bytes()).into();
        if let Some(k) = self.found.as_ref().and_then(|c| c.get(&h)) {
            return Ok(Some(k));
        }
        if self.unknown.as_ref().is_some_and(|c| c.contains_key(&h)) {
            return Ok(None);
        }
        lookup().map_err(KeyError::Throttled)?;
        let found = store
            .admin_key_of_secret(key)
            .await
            .map_err(KeyError::Store)?;
        match (&found, &self.found, &self.unknown) {
            (Some(k), Some(c), _) => c.insert(h, k.clone()),
            (None, _, Some(u)) => u.insert(h, ()),
            _ => {}
        }
        Ok(found)
    }
}
