//! `/readyz`'s view of the database: one ping a second at most, shared by every caller.

/// How long a database ping's answer serves `/readyz`, ms.
pub const READY_TTL_MS: u64 = 1_000;

/// The last database ping's answer, shared by `/readyz` callers: at most one ping runs per
/// [`READY_TTL_MS`] whatever the request rate (the others answer from the last result), so the
/// probe cannot be turned into database load.
#[derive(Debug, Default)]
pub struct ReadyCache {
    /// 0: never asked; 1: the database answered; 2: it did not.
    state: std::sync::atomic::AtomicU8,
    /// When it was asked, ms on the process' clock.
    at_ms: std::sync::atomic::AtomicU64,
    /// A ping is running.
    asking: std::sync::atomic::AtomicBool,
    /// Pings sent (tests read it).
    pings: std::sync::atomic::AtomicU64,
}

impl ReadyCache {
    /// Whether the database answers: the last answer while it is fresh (or while another
    /// caller asks again), else a ping now.
    pub async fn database(&self, store: &engram_store::Store, now_ms: u64) -> bool {
        use std::sync::atomic::Ordering::{AcqRel, Acquire, Release};
        let state = self.state.load(Acquire);
        let fresh = now_ms.saturating_sub(self.at_ms.load(Acquire)) < READY_TTL_MS;
        if state != 0 && fresh {
            return state == 1;
        }
        if self
            .asking
            .compare_exchange(false, true, AcqRel, Acquire)
            .is_err()
            && state != 0
        {
            return state == 1;
        }
        self.pings.fetch_add(1, AcqRel);
        let ok = store.ping().await;
        self.state.store(if ok { 1 } else { 2 }, Release);
        self.at_ms.store(now_ms, Release);
        self.asking.store(false, Release);
        ok
    }

    /// Database pings sent since the start.
    pub fn pings(&self) -> u64 {
        self.pings.load(std::sync::atomic::Ordering::Acquire)
    }
}
