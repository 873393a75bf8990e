//! Per-tenant fairness: a request rate (GCRA, `governor`) checked when a tenant authenticates,
//! and a bound on the generations one tenant runs at once. Both answer 429 `rate_limited` with
//! `Retry-After`. The engine itself admits waiting generations fairly across tenants (see
//! `engram_engine::Engine`), so the two together keep one tenant from taking every slot.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};

use governor::clock::{Clock, DefaultClock};
use governor::{Quota, RateLimiter};

use engram_config::LimitsSection;

/// Why a tenant's request was refused (`error.rs` answers 429 `rate_limited` with
/// `Retry-After`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum LimitError {
    /// Over its request rate.
    #[error("too many requests for this tenant; retry after the given seconds")]
    Rate {
        /// Seconds until a request is admitted again.
        retry_after_secs: u64,
    },
    /// Every generation slot of the tenant is in use.
    #[error("this tenant runs as many generations as it may at once; retry when one ends")]
    Generations,
}

type Keyed = RateLimiter<
    String,
    governor::state::keyed::HashMapStateStore<String>,
    DefaultClock,
    governor::middleware::NoOpMiddleware,
>;

type ByIp = RateLimiter<
    std::net::IpAddr,
    governor::state::keyed::HashMapStateStore<std::net::IpAddr>,
    DefaultClock,
    governor::middleware::NoOpMiddleware,
>;

/// The limits in force.
#[derive(Debug)]
pub struct Limits {
    rate: Option<Keyed>,
    lookups: Option<ByIp>,
    clock: DefaultClock,
    concurrent: u32,
    running: Arc<Mutex<HashMap<String, u32>>>,
}

/// A running generation's slot; dropping it frees the slot.
#[derive(Debug)]
pub struct GenerationSlot {
    tenant: String,
    running: Arc<Mutex<HashMap<String, u32>>>,
}

impl Drop for GenerationSlot {
    fn drop(&mut self) {
        if let Ok(mut r) = self.running.lock()
            && let Some(n) = r.get_mut(&self.tenant)
        {
            *n = n.saturating_sub(1);
            if *n == 0 {
                r.remove(&self.tenant);
            }
        }
    }
}

impl Limits {
    /// Limits as configured: the tenants' (`limits`) and the key lookups' per IP (`auth`).
    pub fn new(c: &LimitsSection, auth: &engram_config::AuthSection) -> Self {
        let rate = NonZeroU32::new(c.requests_per_sec).map(|per_sec| {
            let burst = NonZeroU32::new(c.burst).unwrap_or(per_sec);
            RateLimiter::hashmap(Quota::per_second(per_sec).allow_burst(burst))
        });
        let lookups = NonZeroU32::new(auth.lookups_per_ip_per_sec).map(|per_sec| {
            let burst = NonZeroU32::new(auth.lookup_burst).unwrap_or(per_sec);
            RateLimiter::hashmap(Quota::per_second(per_sec).allow_burst(burst))
        });
        Self {
            rate,
            lookups,
            clock: DefaultClock::default(),
            concurrent: c.concurrent_generations,
            running: Arc::default(),
        }
    }

    /// Counts one request of `tenant`; 429 when it is over its rate.
    pub fn check_rate(&self, tenant: &str) -> Result<(), LimitError> {
        let Some(rate) = &self.rate else {
            return Ok(());
        };
        rate.check_key(&tenant.to_string())
            .map_err(|not_until| self.refused(&not_until))
    }

    /// Counts one database lookup of a key for a client at `ip` (none known: not counted);
    /// 429 when the IP is over `auth.lookups_per_ip_per_sec`.
    pub fn check_lookup(&self, ip: Option<std::net::IpAddr>) -> Result<(), LimitError> {
        let (Some(lookups), Some(ip)) = (&self.lookups, ip) else {
            return Ok(());
        };
        lookups
            .check_key(&ip)
            .map_err(|not_until| self.refused(&not_until))
    }

    fn refused(
        &self,
        not_until: &governor::NotUntil<<DefaultClock as Clock>::Instant>,
    ) -> LimitError {
        let wait = not_until.wait_time_from(self.clock.now());
        LimitError::Rate {
            retry_after_secs: wait.as_secs() + u64::from(wait.subsec_nanos() > 0),
        }
    }

    /// Takes one of `tenant`'s generation slots; 429 when all are in use.
    pub fn begin_generation(&self, tenant: &str) -> Result<GenerationSlot, LimitError> {
        let mut r = self.running.lock().map_err(|_| LimitError::Generations)?;
        let n = r.entry(tenant.to_string()).or_insert(0);
        if self.concurrent > 0 && *n >= self.concurrent {
            return Err(LimitError::Generations);
        }
        *n += 1;
        Ok(GenerationSlot {
            tenant: tenant.to_string(),
            running: self.running.clone(),
        })
    }

    /// Forgets idle tenants' rate state (called now and then).
    pub fn shrink(&self) {
        if let Some(rate) = &self.rate {
            rate.retain_recent();
        }
        if let Some(lookups) = &self.lookups {
            lookups.retain_recent();
        }
    }
}
