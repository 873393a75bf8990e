//! `[tiers]` and `[eviction]`: how cached blocks move between tiers.

use serde::{Deserialize, Serialize};

/// `[tiers]`: the tier bridge's loop (`enabled`, `interval_ms`, `active_window_secs`) and, in
/// the same table, the engine's own [`engram_engine::TierPolicy`] read as it is (thresholds as
/// shares of a tier's budget, `hot_budget_bytes`/`cold_budget_bytes`, weights, bounds,
/// `[tiers.costs]`), so a new knob there is a configuration key without a copy here. An unknown
/// key is refused by the policy's own type, naming what it takes.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TiersSection {
    /// Run the loop.
    pub enabled: bool,
    /// Milliseconds between cycles.
    pub interval_ms: u64,
    /// A session with a turn within this many seconds is active (its blocks are warmed).
    pub active_window_secs: u64,
    /// The bridge's policy.
    #[serde(flatten)]
    pub policy: engram_engine::TierPolicy,
}

impl Default for TiersSection {
    fn default() -> Self {
        Self {
            enabled: true,
            interval_ms: 1000,
            active_window_secs: 120,
            policy: engram_engine::TierPolicy::default(),
        }
    }
}

/// The loop's keys are taken out of the table and the rest is read as the policy itself
/// (serde's `flatten` would let an unknown key through: the policy's `deny_unknown_fields`
/// only sees the table whole).
impl<'de> Deserialize<'de> for TiersSection {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        fn take<T: serde::de::DeserializeOwned, E: Error>(
            table: &mut toml::Table,
            key: &str,
            default: T,
        ) -> Result<T, E> {
            match table.remove(key) {
                None => Ok(default),
                Some(v) => v
                    .try_into()
                    .map_err(|e| E::custom(format!("tiers.{key}: {e}"))),
            }
        }
        let mut table = toml::Table::deserialize(d)?;
        let defaults = Self::default();
        Ok(Self {
            enabled: take(&mut table, "enabled", defaults.enabled)?,
            interval_ms: take(&mut table, "interval_ms", defaults.interval_ms)?,
            active_window_secs: take(
                &mut table,
                "active_window_secs",
                defaults.active_window_secs,
            )?,
            policy: toml::Value::Table(table)
                .try_into()
                .map_err(|e| D::Error::custom(format!("tiers: {e}")))?,
        })
    }
}

/// `[eviction]`: the engine's own policy type, read as it is (`mode` is `attention` or
/// `priority`; the weights and counts as [`engram_engine::EvictionPolicy`] documents them), so a
/// new knob there is a configuration key without a copy here.
pub type EvictionSection = engram_engine::EvictionPolicy;
