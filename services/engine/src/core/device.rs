//! Where the engine runs.

use serde::{Deserialize, Serialize};

use crate::error::{EngineError, EngineResult};

/// Where the engine runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum EngineDevice {
    /// The model and the hot tier in process memory.
    #[default]
    Cpu,
    /// The model on a CUDA device, the hot tier in its VRAM, the cold tier page-locked (needs a
    /// build with feature `cuda`).
    Cuda {
        /// Device ordinal.
        #[serde(default)]
        ordinal: usize,
    },
}

impl EngineDevice {
    /// The candle device (a CUDA device needs a build with feature `cuda`).
    pub fn candle(&self) -> EngineResult<candle_core::Device> {
        Ok(match *self {
            Self::Cpu => candle_core::Device::Cpu,
            Self::Cuda { ordinal } => candle_core::Device::new_cuda(ordinal)?,
        })
    }

    /// `cpu`, `cuda` (device 0) or `cuda:N`.
    pub fn parse(s: &str) -> EngineResult<Self> {
        let s = s.trim();
        let bad = || EngineError::InvalidConfig {
            field: "device",
            reason: format!("unknown device `{s}` (cpu, cuda, cuda:N)"),
        };
        match s {
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda { ordinal: 0 }),
            _ => match s.strip_prefix("cuda:") {
                Some(n) => n
                    .parse()
                    .map(|ordinal| Self::Cuda { ordinal })
                    .map_err(|_| bad()),
                None => Err(bad()),
            },
        }
    }
}
