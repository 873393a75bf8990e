//! The codecs of a store's two streams: [`StreamCodecs`] (`tq4`, or `tq6o1/tq5` for keys and
//! values apart) and the engine's defaults per device. Codec names themselves parse in kvcore
//! ([`CodecKind`]'s `FromStr` and `Display`).

use engram_kvcore::CodecKind;
use serde::{Deserialize, Serialize};

use crate::error::{EngineError, EngineResult};

/// The codec names [`parse_codec`] knows (kvcore's [`engram_kvcore::CODEC_NAMES`]).
pub use engram_kvcore::CODEC_NAMES;

/// `f32`, `f16`, `q8`, `tq2` to `tq6` (TurboQuant at 2 to 6 bits), or `tqBoN` (TurboQuant at
/// `B` bits with an outlier split of `N` coordinates per row, `N` 1 to 4); an unknown name is
/// [`EngineError::InvalidConfig`] on the field `codec`.
pub fn parse_codec(s: &str) -> EngineResult<CodecKind> {
    s.parse().map_err(
        |e: engram_kvcore::UnknownCodec| EngineError::InvalidConfig {
            field: "codec",
            reason: e.to_string(),
        },
    )
}

/// The codec of the keys and the codec of the values: `tq4` (both), or `q8/tq4` (keys q8,
/// values tq4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct StreamCodecs {
    /// The keys' codec.
    pub key: CodecKind,
    /// The values' codec.
    pub value: CodecKind,
}

impl StreamCodecs {
    /// The built-in default on the CPU: keys at TurboQuant-6 with one outlier per row stored
    /// apart (`tq6o1`), values at TurboQuant-5 (5.94 bits per element at head_dim 64; on
    /// SmolLM2-135M's 16K-token corpus KL 0.0071 nats against exact KV, where `tq6/tq5` gives
    /// 0.0093 and TQ4 0.094, `docs/kv-fidelity.md`). With the default key scales it holds the
    /// same budget on Qwen2.5-Coder-0.5B (0.0051 on the 16K corpus); Gemma-3-270M reads 0.0138
    /// there (5.61 bits at head_dim 256), over it. A test holds SmolLM2 to the 0.01-nat budget.
    pub const CPU_DEFAULT: StreamCodecs = StreamCodecs {
        key: CodecKind::TurboQuantSplit {
            bits: 6,
            outliers: 1,
        },
        value: CodecKind::TurboQuant { bits: 5 },
    };

    /// The built-in default on `device`: [`Self::CPU_DEFAULT`] on the CPU, TurboQuant-4 for both
    /// streams on CUDA (its decode kernel reads 4-bit codes only).
    pub fn default_for(device: crate::EngineDevice) -> Self {
        match device {
            crate::EngineDevice::Cpu => Self::CPU_DEFAULT,
            crate::EngineDevice::Cuda { .. } => Self::both(CodecKind::TQ4),
        }
    }

    /// `spec` ([`Self::parse`]), or the device's default ([`Self::default_for`]) when `spec` is
    /// empty.
    pub fn parse_or_default(spec: &str, device: crate::EngineDevice) -> EngineResult<Self> {
        if spec.trim().is_empty() {
            Ok(Self::default_for(device))
        } else {
            Self::parse(spec)
        }
    }

    /// The same codec for both streams.
    pub fn both(kind: CodecKind) -> Self {
        Self {
            key: kind,
            value: kind,
        }
    }

    /// `CODEC` or `KEY_CODEC/VALUE_CODEC`. An outlier split (`tqBoN`) is a key codec: the
    /// values name their own (`tq6o1/tq5`).
    pub fn parse(s: &str) -> EngineResult<Self> {
        let codecs = match s.split_once('/') {
            Some((k, v)) => Self {
                key: parse_codec(k)?,
                value: parse_codec(v)?,
            },
            None => parse_codec(s).map(Self::both)?,
        };
        if codecs.value.outliers() > 0 {
            return Err(EngineError::InvalidConfig {
                field: "codec",
                reason: format!(
                    "`{}` is an outlier split, a key codec: name the values' codec after a \
                     slash, such as tq6o1/tq5",
                    codecs.value
                ),
            });
        }
        Ok(codecs)
    }

    /// Stored bits per element of keys and values together, norms included.
    pub fn bits_per_element(&self, head_dim: usize) -> f64 {
        0.5 * (self.key.bits_per_element(head_dim) + self.value.bits_per_element(head_dim))
    }

    /// The values' codec where it differs from the keys' (`EngineConfig::value_codec`).
    pub fn value_override(&self) -> Option<CodecKind> {
        (self.value != self.key).then_some(self.value)
    }
}

impl From<CodecKind> for StreamCodecs {
    fn from(kind: CodecKind) -> Self {
        Self::both(kind)
    }
}

impl std::fmt::Display for StreamCodecs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.key == self.value {
            write!(f, "{}", self.key)
        } else {
            write!(f, "{}/{}", self.key, self.value)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use engram_kvcore::MAX_OUTLIERS;

    #[test]
    fn stream_codecs_parse_and_label() {
        let s = StreamCodecs::parse("q8/tq5").unwrap();
        assert_eq!(
            (s.key, s.value),
            (CodecKind::Q8, CodecKind::TurboQuant { bits: 5 })
        );
        assert_eq!(s.to_string(), "q8/tq5");
        assert_eq!(s.bits_per_element(64), (8.25 + 5.25) / 2.0);
        assert_eq!(s.value_override(), Some(CodecKind::TurboQuant { bits: 5 }));
        let one = StreamCodecs::parse("tq6").unwrap();
        assert_eq!(one, StreamCodecs::both(CodecKind::TurboQuant { bits: 6 }));
        assert_eq!(one.to_string(), "tq6");
        assert_eq!(one.value_override(), None);
        for bad in ["q8/", "/tq4", "q8/tq4/f16", "tq7", ""] {
            assert!(StreamCodecs::parse(bad).is_err(), "{bad}");
        }
        // Outlier splits: every name prints back as itself, out-of-range ones are refused.
        let split = StreamCodecs::parse("tq6o1/tq5").unwrap();
        assert_eq!(
            split.key,
            CodecKind::TurboQuantSplit {
                bits: 6,
                outliers: 1
            }
        );
        assert_eq!(split.to_string(), "tq6o1/tq5");
        assert_eq!(split.bits_per_element(64), (6.625 + 5.25) / 2.0);
        for bits in 2..=6u8 {
            for outliers in 1..=MAX_OUTLIERS {
                let name = format!("tq{bits}o{outliers}");
                assert_eq!(parse_codec(&name).unwrap().to_string(), name);
            }
        }
        for bad in [
            "tq6o0", "tq6o5", "tq7o1", "tq6o", "tqo1", "tq6o12", "tq+6", "tq06",
        ] {
            assert!(parse_codec(bad).is_err(), "{bad}");
        }
        // A key codec only.
        for bad in ["tq6o1", "tq5/tq6o1"] {
            assert!(StreamCodecs::parse(bad).is_err(), "{bad}");
        }
    }
}
