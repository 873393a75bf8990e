//! Fault injection for the supervision tests: a prompt holding a marker makes the engine panic
//! while serving it, or its thread end. Never configured in production.

use crate::error::{EngineError, EngineResult};

/// A fault the engine thread injects on purpose, to test how the service survives it: when a
/// prompt's text contains `marker`, the engine panics while serving it, or its thread ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineFault {
    /// Text that triggers the fault.
    pub marker: String,
    /// What happens.
    pub kind: FaultKind,
}

/// What an [`EngineFault`] does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// A panic while prefilling the request (the request fails; the engine goes on).
    Panic,
    /// The engine thread ends (as if it had died).
    Stop,
}

impl EngineFault {
    /// Parses `panic:MARKER` or `stop:MARKER`.
    pub fn parse(s: &str) -> EngineResult<Self> {
        let bad = || EngineError::InvalidConfig {
            field: "fault",
            reason: format!("`{s}`: expected panic:MARKER or stop:MARKER"),
        };
        let (kind, marker) = s.split_once(':').ok_or_else(bad)?;
        let kind = match kind {
            "panic" => FaultKind::Panic,
            "stop" => FaultKind::Stop,
            _ => return Err(bad()),
        };
        if marker.is_empty() {
            return Err(bad());
        }
        Ok(Self {
            marker: marker.to_string(),
            kind,
        })
    }
}
