//! Token ids of prompt segments, kept across turns: a session's prompt is the same segments
//! turn after turn (stable layers, each earlier turn, the slow layers) plus a few new ones, so
//! a turn tokenizes only its new text — its message, the previous reply, a changed layer — and
//! finds every other segment's ids here. Keyed by the SHA-256 of the tenant's cache salt and the
//! segment's text (the tokenizer is the server's one), so no tenant's turn is ever faster
//! because another tenant sent the same text; bounded by the bytes of the ids it holds (least
//! recently used leave first); a restart starts it empty.
//!
//! Each entry remembers the sessions that used it (up to [`OWNERS`]; past that, or used outside
//! a session, it is the tenant's): deleting a session forgets the texts only it used, deleting
//! a tenant forgets all of its texts.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use engram_kvcore::TenantId;
use sha2::{Digest, Sha256};

/// Bytes of token ids the cache holds at most (about 8 M tokens).
pub const CAPACITY_BYTES: u64 = 32 << 20;

/// Sessions an entry remembers by name before it counts as the whole tenant's.
pub const OWNERS: usize = 8;

/// Who used an entry.
#[derive(Debug)]
enum Owners {
    /// These sessions' keys, and no one else.
    Sessions(Vec<u64>),
    /// The tenant at large (more sessions than [`OWNERS`], or a use outside a session).
    Tenant,
}

/// A segment's ids, the tenant they were tokenized for, and who used them.
#[derive(Debug)]
struct Entry {
    ids: Arc<[u32]>,
    tenant: TenantId,
    owners: Mutex<Owners>,
}

impl Entry {
    fn used_by(&self, session: Option<u64>) {
        let mut o = self
            .owners
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match (&mut *o, session) {
            (Owners::Tenant, _) => {}
            (Owners::Sessions(v), Some(s)) if v.contains(&s) => {}
            (Owners::Sessions(v), Some(s)) if v.len() < OWNERS => v.push(s),
            _ => *o = Owners::Tenant,
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Bytes;

impl quick_cache::Weighter<[u8; 32], Arc<Entry>> for Bytes {
    fn weight(&self, _: &[u8; 32], e: &Arc<Entry>) -> u64 {
        // The key and the entry's own overhead count too, so empty texts are not free.
        128 + 4 * e.ids.len() as u64
    }
}

/// Segment texts' token ids, per tenant, shared by the tenant's turns.
pub struct TokenCache {
    cache: quick_cache::sync::Cache<[u8; 32], Arc<Entry>, Bytes>,
    encoded: AtomicU64,
    reused: AtomicU64,
}

impl std::fmt::Debug for TokenCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenCache")
            .field("segments", &self.cache.len())
            .field("encoded", &self.encoded)
            .field("reused", &self.reused)
            .finish()
    }
}

impl Default for TokenCache {
    fn default() -> Self {
        Self::with_capacity(CAPACITY_BYTES)
    }
}

fn key(tenant: TenantId, text: &str) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(tenant.0.to_le_bytes());
    h.update(text.as_bytes());
    h.finalize().into()
}

impl TokenCache {
    /// A cache of at most `bytes` of ids.
    pub fn with_capacity(bytes: u64) -> Self {
        Self {
            cache: quick_cache::sync::Cache::with_weighter(
                (bytes / 1024).max(16) as usize,
                bytes,
                Bytes,
            ),
            encoded: AtomicU64::new(0),
            reused: AtomicU64::new(0),
        }
    }

    /// The ids of `text` for a turn of `tenant` in `session` (its cache key; `None`: outside a
    /// session): the tenant's cached ones, or `encode(text)`'s, kept for the next time.
    pub fn get_or_encode<E>(
        &self,
        tenant: TenantId,
        session: Option<u64>,
        text: &str,
        encode: impl FnOnce(&str) -> Result<Vec<u32>, E>,
    ) -> Result<Arc<[u32]>, E> {
        let key = key(tenant, text);
        if let Some(e) = self.cache.get(&key) {
            self.reused.fetch_add(1, Ordering::Relaxed);
            e.used_by(session);
            return Ok(e.ids.clone());
        }
        let ids: Arc<[u32]> = encode(text)?.into();
        self.encoded.fetch_add(1, Ordering::Relaxed);
        let owners = match session {
            Some(s) => Owners::Sessions(vec![s]),
            None => Owners::Tenant,
        };
        self.cache.insert(
            key,
            Arc::new(Entry {
                ids: ids.clone(),
                tenant,
                owners: Mutex::new(owners),
            }),
        );
        Ok(ids)
    }

    /// Forgets what `tenant`'s sessions with `session & mask == value` used (a mask of 0: every
    /// text of the tenant): an entry goes when no other session of the tenant used it.
    pub fn forget(&self, tenant: TenantId, mask: u64, value: u64) {
        self.cache.retain(|_, e| {
            if e.tenant != tenant {
                return true;
            }
            if mask == 0 {
                return false;
            }
            let mut o = e
                .owners
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            match &mut *o {
                Owners::Tenant => true,
                Owners::Sessions(v) => {
                    v.retain(|s| s & mask != value);
                    !v.is_empty()
                }
            }
        });
    }

    /// Segments tokenized and segments whose ids were reused, since the start.
    pub fn counts(&self) -> (u64, u64) {
        (
            self.encoded.load(Ordering::Relaxed),
            self.reused.load(Ordering::Relaxed),
        )
    }

    /// Registers the counters.
    pub fn register(&self, reg: &mut prometheus_client::registry::Registry) {
        let (encoded, reused) = self.counts();
        reg.register(
            "engram_prompt_segments",
            "Prompt segments by how their token ids were found: tokenized, or reused from an earlier turn",
            crate::metrics::counters("ids", [("tokenized", encoded), ("reused", reused)]),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: TenantId = TenantId(1);

    #[test]
    fn a_text_is_tokenized_once_and_the_cache_stays_within_its_bytes() {
        let cache = TokenCache::with_capacity(64 * 1024);
        let calls = std::cell::Cell::new(0);
        let encode = |t: &str| {
            calls.set(calls.get() + 1);
            Ok::<_, ()>(t.bytes().map(u32::from).collect())
        };
        let a = cache.get_or_encode(T, Some(1), "hello", encode).unwrap();
        let b = cache.get_or_encode(T, Some(2), "hello", encode).unwrap();
        assert_eq!((a.as_ref(), calls.get()), (b.as_ref(), 1));
        assert_eq!(cache.counts(), (1, 1));
        cache.get_or_encode(T, None, "world", encode).unwrap();
        assert_eq!(calls.get(), 2);
        // An encoder's error is passed on and nothing is kept.
        assert_eq!(
            cache.get_or_encode(T, None, "bad", |_| Err::<Vec<u32>, _>(7)),
            Err(7)
        );
        assert_eq!(cache.counts(), (2, 1));
        // Far more than it holds: the weight stays bounded.
        for i in 0..10_000 {
            cache
                .get_or_encode(T, None, &format!("text number {i}"), encode)
                .unwrap();
        }
        assert!(
            cache.cache.weight() <= 64 * 1024,
            "{}",
            cache.cache.weight()
        );
    }

    #[test]
    fn another_tenant_never_finds_a_tenant_s_text() {
        let cache = TokenCache::default();
        let calls = std::cell::Cell::new(0);
        let encode = |t: &str| {
            calls.set(calls.get() + 1);
            Ok::<_, ()>(t.bytes().map(u32::from).collect())
        };
        cache.get_or_encode(T, Some(1), "a secret", encode).unwrap();
        cache
            .get_or_encode(TenantId(2), Some(1), "a secret", encode)
            .unwrap();
        assert_eq!(calls.get(), 2, "each tenant tokenizes its own copy");
        assert_eq!(cache.counts(), (2, 0));
    }

    #[test]
    fn deleting_a_session_forgets_the_texts_only_it_used() {
        let cache = TokenCache::default();
        let calls = std::cell::Cell::new(0);
        let encode = |t: &str| {
            calls.set(calls.get() + 1);
            Ok::<_, ()>(t.bytes().map(u32::from).collect())
        };
        let get = |tenant, session, text| {
            cache.get_or_encode(tenant, session, text, encode).unwrap();
        };
        get(T, Some(0xa1), "alice only");
        get(T, Some(0xa1), "shared layer");
        get(T, Some(0xb2), "shared layer");
        get(T, None, "the tenant's");
        get(TenantId(2), Some(0xa1), "alice only");
        assert_eq!(calls.get(), 4);
        cache.forget(T, u64::MAX, 0xa1);
        // Alice's own text is tokenized again; the rest is still there.
        get(T, Some(0xb2), "shared layer");
        get(T, Some(0xb2), "the tenant's");
        get(TenantId(2), Some(0xa1), "alice only");
        assert_eq!(calls.get(), 4);
        get(T, Some(0xb2), "alice only");
        assert_eq!(calls.get(), 5);
        // More sessions than it names: the entry is the tenant's, kept until the tenant goes.
        for s in 0..=OWNERS as u64 {
            get(T, Some(0x100 + s), "popular");
        }
        cache.forget(T, u64::MAX, 0x100);
        get(T, Some(1), "popular");
        assert_eq!(calls.get(), 6);
        cache.forget(T, 0, 0);
        get(T, Some(1), "popular");
        get(T, Some(1), "the tenant's");
        get(TenantId(2), Some(0xa1), "alice only");
        assert_eq!(calls.get(), 8, "tenant 2 kept its own");
    }
}
