//! Token ids of prompt segments, kept across turns: a session's prompt is the same segments
//! turn after turn (stable layers, each earlier turn, the slow layers) plus a few new ones, so
//! a turn tokenizes only its new text — its message, the previous reply, a changed layer — and
//! finds every other segment's ids here. Keyed by the SHA-256 of the segment's text (the
//! tokenizer is the server's one), bounded by the bytes of the ids it holds (least recently
//! used leave first); a restart starts it empty.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use sha2::{Digest, Sha256};

/// Bytes of token ids the cache holds at most (about 8 M tokens).
pub const CAPACITY_BYTES: u64 = 32 << 20;

#[derive(Debug, Clone, Copy)]
struct Bytes;

impl quick_cache::Weighter<[u8; 32], Arc<[u32]>> for Bytes {
    fn weight(&self, _: &[u8; 32], ids: &Arc<[u32]>) -> u64 {
        // The key and the entry's own overhead count too, so empty texts are not free.
        64 + 4 * ids.len() as u64
    }
}

/// Segment texts' token ids, shared by every turn.
pub struct TokenCache {
    cache: quick_cache::sync::Cache<[u8; 32], Arc<[u32]>, Bytes>,
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

    /// The ids of `text`: the cached ones, or `encode(text)`'s, kept for the next time.
    pub fn get_or_encode<E>(
        &self,
        text: &str,
        encode: impl FnOnce(&str) -> Result<Vec<u32>, E>,
    ) -> Result<Arc<[u32]>, E> {
        let key: [u8; 32] = Sha256::digest(text.as_bytes()).into();
        if let Some(ids) = self.cache.get(&key) {
            self.reused.fetch_add(1, Ordering::Relaxed);
            return Ok(ids);
        }
        let ids: Arc<[u32]> = encode(text)?.into();
        self.encoded.fetch_add(1, Ordering::Relaxed);
        self.cache.insert(key, ids.clone());
        Ok(ids)
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

    #[test]
    fn a_text_is_tokenized_once_and_the_cache_stays_within_its_bytes() {
        let cache = TokenCache::with_capacity(64 * 1024);
        let calls = std::cell::Cell::new(0);
        let encode = |t: &str| {
            calls.set(calls.get() + 1);
            Ok::<_, ()>(t.bytes().map(u32::from).collect())
        };
        let a = cache.get_or_encode("hello", encode).unwrap();
        let b = cache.get_or_encode("hello", encode).unwrap();
        assert_eq!((a.as_ref(), calls.get()), (b.as_ref(), 1));
        assert_eq!(cache.counts(), (1, 1));
        cache.get_or_encode("world", encode).unwrap();
        assert_eq!(calls.get(), 2);
        // An encoder's error is passed on and nothing is kept.
        assert_eq!(
            cache.get_or_encode("bad", |_| Err::<Vec<u32>, _>(7)),
            Err(7)
        );
        assert_eq!(cache.counts(), (2, 1));
        // Far more than it holds: the weight stays bounded.
        for i in 0..10_000 {
            cache
                .get_or_encode(&format!("text number {i}"), encode)
                .unwrap();
        }
        assert!(
            cache.cache.weight() <= 64 * 1024,
            "{}",
            cache.cache.weight()
        );
    }
}
