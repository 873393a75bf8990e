//! The tier bridge's state outside the engine thread: which sessions are active, the policy the
//! engine's OODA cycle adapts (`EngineCore::tier_cycle`), and the recent cycles for the admin
//! endpoint. The service runs [`tier_cycle`] every `tiers.interval_ms`.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::{ChainKey, CycleReport, Engine, EngineError, TierPolicy};
use serde::Serialize;

/// Cycles of the tier bridge kept for the admin endpoint.
pub const TIER_HISTORY: usize = 32;

/// One tier-bridge cycle as the admin endpoint shows it.
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CycleRecord {
    /// When it ran, ms since the Unix epoch.
    pub at_unix_ms: u64,
    /// What it observed, decided and did.
    pub report: CycleReport,
}

/// The tier bridge's state: its policy (adapted over time), its recent cycles and totals.
#[derive(Debug)]
pub struct TierBridge {
    /// The policy in force.
    pub policy: Mutex<TierPolicy>,
    /// The last cycles, newest last.
    pub history: Mutex<VecDeque<CycleRecord>>,
    /// Cycles run, blocks spilled, warmed, removed, staged.
    pub totals: Mutex<[u64; 5]>,
    /// Sessions' last turn.
    pub activity: Mutex<HashMap<ChainKey, Instant>>,
}

impl TierBridge {
    /// A bridge with `policy`.
    pub fn new(policy: TierPolicy) -> Self {
        Self {
            policy: Mutex::new(policy),
            history: Mutex::new(VecDeque::new()),
            totals: Mutex::new([0; 5]),
            activity: Mutex::new(HashMap::new()),
        }
    }

    /// Notes a turn of a session.
    pub fn touch(&self, key: ChainKey) {
        if let Ok(mut a) = self.activity.lock() {
            a.insert(key, Instant::now());
        }
    }

    /// Forgets the activity of the sessions `gone` selects (deleted).
    pub fn forget(&self, gone: impl Fn(&ChainKey) -> bool) {
        if let Ok(mut a) = self.activity.lock() {
            a.retain(|k, _| !gone(k));
        }
    }

    /// Sessions with a turn within `window`; forgets older ones.
    pub fn active(&self, window: Duration) -> Vec<ChainKey> {
        let Ok(mut a) = self.activity.lock() else {
            return Vec::new();
        };
        a.retain(|_, t| t.elapsed() <= window);
        let mut keys: Vec<ChainKey> = a.keys().copied().collect();
        keys.sort();
        keys
    }

    /// Records a cycle.
    pub fn record(&self, report: CycleReport, policy: TierPolicy) {
        if let Ok(mut t) = self.totals.lock() {
            t[0] += 1;
            t[1] += report.spilled as u64;
            t[2] += report.warmed as u64;
            t[3] += report.removed as u64;
            t[4] += report.staged as u64;
        }
        if let Ok(mut p) = self.policy.lock() {
            *p = policy;
        }
        if let Ok(mut h) = self.history.lock() {
            if h.len() == TIER_HISTORY {
                h.pop_front();
            }
            h.push_back(CycleRecord {
                at_unix_ms: SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() as u64),
                report,
            });
        }
    }
}

/// Runs one tier-bridge cycle with the sessions active within `window` (an engine that drops
/// the command has stopped).
pub async fn tier_cycle(
    engine: &Engine,
    bridge: &TierBridge,
    window: Duration,
) -> Result<CycleReport, EngineError> {
    let policy = bridge.policy.lock().map(|p| p.clone()).unwrap_or_default();
    let active = bridge.active(window);
    let (report, policy) = engine
        .tier_cycle(policy, active)?
        .recv_async()
        .await
        .map_err(|_| EngineError::Stopped)??;
    bridge.record(report.clone(), policy);
    Ok(report)
}
