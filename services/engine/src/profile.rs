//! A calibrated KV profile: the codec per layer and stream for one model, as `engram calibrate
//! kv` (`calibrate.rs`) measured and allocated it, read by the engine at start
//! (`EngineConfig::layer_codecs`) and by down-tiering (`KvProfile::reduced_codecs`).

use std::path::Path;

use engram_kvcore::{CodecKind, KvShape, LayerCodecs};
use serde::{Deserialize, Serialize};

use crate::error::{EngineError, EngineResult, io_error};
use crate::hex::Hex32;
use engram_model::Llama;

/// Version of the profile file.
pub const PROFILE_FORMAT: u32 = 1;

/// Profiles that ship with the engine, one per checkpoint whose device default misses the
/// fidelity budget (KL ≤ 0.01 nats on the eval corpus at ≤ 6 bits an element): the SHA-256 of
/// the file they were calibrated for (the model's fingerprint, checked against the profile's
/// own when it loads), its name, and the profile. `EngineConfig::built_in_profile` uses them;
/// `docs/kv-fidelity.md` has each one's command and figures.
const BUILT_IN: &[(&str, &str, &str)] = &[(
    "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    "gemma-3-270m-q4_k_m.gguf",
    include_str!("../profiles/gemma-3-270m-q4_k_m.json"),
)];

/// Keys or values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stream {
    /// The keys.
    Key,
    /// The values.
    Value,
}

/// What one choice costs: the KL of storing one stream of one layer in one codec.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Sensitivity {
    /// The layer.
    pub layer: usize,
    /// The stream.
    pub stream: Stream,
    /// The codec.
    pub codec: CodecKind,
    /// Mean KL (nats) against exact KV on the calibration text.
    pub kl_nats: f64,
}

/// The text a profile was calibrated on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CalibrationText {
    /// The path given.
    pub path: String,
    /// SHA-256 of the text read.
    pub sha256: Hex32,
    /// Predictions scored per run.
    pub tokens: usize,
}

/// A calibrated codec per layer and stream for one model (see the module docs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KvProfile {
    /// [`PROFILE_FORMAT`].
    pub format: u32,
    /// SHA-256 of the model's files ([`Llama::fingerprint`]).
    pub model: Hex32,
    /// The KL budget it was allocated for.
    pub budget_kl: f64,
    /// The calibration text.
    pub calibration: CalibrationText,
    /// The sum of the chosen contributions.
    pub predicted_kl: f64,
    /// The allocation's KL measured as a whole on the calibration text.
    pub measured_kl: f64,
    /// Stored bits per element over every layer and stream.
    pub bits_per_element: f64,
    /// Allocation rounds taken.
    pub rounds: usize,
    /// The codecs.
    pub codecs: LayerCodecs,
    /// Every measured contribution (kept for down-tiering decisions and for review).
    pub sensitivity: Vec<Sensitivity>,
}

impl KvProfile {
    /// Reads a profile and checks that it was calibrated for `model`.
    pub fn load(path: &Path, model: &Llama) -> EngineResult<Self> {
        let bytes = std::fs::read(path).map_err(io_error(path))?;
        let profile: Self =
            serde_json::from_slice(&bytes).map_err(|e| EngineError::InvalidConfig {
                field: "kv_profile",
                reason: format!("{}: {e}", path.display()),
            })?;
        profile.check(model)?;
        Ok(profile)
    }

    /// The profile built in for `model`'s checkpoint ([`BUILT_IN`]), if it has one; a
    /// checkpoint without one parses nothing.
    pub fn built_in(model: &Llama) -> EngineResult<Option<Self>> {
        let sha = Hex32(model.fingerprint()).to_hex();
        match BUILT_IN.iter().find(|(hex, _, _)| *hex == sha) {
            Some(&(_, name, json)) => {
                let profile = Self::parse_built_in(name, json)?;
                profile.check(model)?;
                Ok(Some(profile))
            }
            None => Ok(None),
        }
    }

    /// The checkpoints with a built-in profile, every profile parsed: (file name, the SHA-256
    /// its profile names).
    pub fn built_in_names() -> EngineResult<Vec<(&'static str, Hex32)>> {
        BUILT_IN
            .iter()
            .map(|&(_, name, json)| Ok((name, Self::parse_built_in(name, json)?.model)))
            .collect()
    }

    fn parse_built_in(name: &str, json: &str) -> EngineResult<Self> {
        serde_json::from_str(json).map_err(|e| EngineError::InvalidConfig {
            field: "kv_profile",
            reason: format!("the built-in profile of {name}: {e}"),
        })
    }

    /// Refuses a profile of another format, another model or another layer count.
    pub fn check(&self, model: &Llama) -> EngineResult<()> {
        let bad = |reason: String| EngineError::InvalidConfig {
            field: "kv_profile",
            reason,
        };
        if self.format != PROFILE_FORMAT {
            return Err(bad(format!(
                "profile format {} (this build reads {PROFILE_FORMAT})",
                self.format
            )));
        }
        if self.model != Hex32(model.fingerprint()) {
            return Err(bad("the profile was calibrated for another model".into()));
        }
        if self.codecs.layers() != model.config().num_layers {
            return Err(bad(format!(
                "{} layers in the profile, {} in the model",
                self.codecs.layers(),
                model.config().num_layers
            )));
        }
        Ok(())
    }

    /// The narrower codecs down-tiering re-encodes cold blocks to (`EngineConfig::down_tier`):
    /// for each layer and stream, the measured choices no wider than the profile's own codec,
    /// allocated as calibration allocates (greedy distortion per byte from the cheapest) until
    /// the predicted KL of a cache wholly in them is within `budget_kl`. Returns the codecs and
    /// that predicted KL. Errors when the budget is not positive, or a stream's own codec was
    /// not measured (a profile this build did not write).
    pub fn reduced_codecs(
        &self,
        shape: &KvShape,
        budget_kl: f64,
    ) -> EngineResult<(LayerCodecs, f64)> {
        let bad = |reason: String| EngineError::InvalidConfig {
            field: "down_tier",
            reason,
        };
        if budget_kl.is_nan() || budget_kl <= 0.0 {
            return Err(bad(format!("budget_kl {budget_kl} must be positive")));
        }
        let d = shape.head_dim;
        let width = |c: CodecKind| c.code_bytes(d) + c.norm_bytes();
        let mut slots = Vec::with_capacity(2 * self.codecs.layers());
        for layer in 0..self.codecs.layers() {
            let own = [
                (Stream::Key, self.codecs.keys()[layer]),
                (Stream::Value, self.codecs.values()[layer]),
            ];
            for (stream, codec) in own {
                let measured = self
                    .sensitivity
                    .iter()
                    .filter(|s| s.layer == layer && s.stream == stream);
                if !measured.clone().any(|s| s.codec == codec) {
                    return Err(bad(format!(
                        "the profile has no measured KL for its own codec {codec} at layer \
                         {layer}"
                    )));
                }
                let mut choices: Vec<(usize, f64, CodecKind)> = measured
                    .filter(|s| width(s.codec) <= width(codec))
                    .map(|s| (width(s.codec), s.kl_nats, s.codec))
                    .collect();
                choices.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)));
                slots.push(Options { choices });
            }
        }
        let (pick, predicted) = allocate(&slots, budget_kl);
        let chosen = |stream: usize| -> Vec<CodecKind> {
            (0..self.codecs.layers())
                .map(|l| slots[2 * l + stream].choices[pick[2 * l + stream]].2)
                .collect()
        };
        let codecs = LayerCodecs::per_stream(shape, chosen(0), chosen(1))?;
        Ok((codecs, predicted))
    }

    /// Writes the profile as pretty JSON.
    pub fn save(&self, path: &Path) -> EngineResult<()> {
        let body = serde_json::to_vec_pretty(self).map_err(|e| EngineError::InvalidConfig {
            field: "kv_profile",
            reason: e.to_string(),
        })?;
        std::fs::write(path, body).map_err(io_error(path))
    }
}

/// One (layer, stream)'s measured options, cheapest first.
#[derive(Debug, Clone)]
pub struct Options {
    /// `(bytes per row, kl, codec)`, ascending bytes.
    pub choices: Vec<(usize, f64, CodecKind)>,
}

/// Greedy distortion-per-byte allocation (module docs, step 2): the chosen index per slot and
/// the predicted KL. Slots that cannot meet the budget end at their best choice.
pub fn allocate(slots: &[Options], budget: f64) -> (Vec<usize>, f64) {
    let mut pick = vec![0usize; slots.len()];
    let mut total: f64 = slots.iter().map(|s| s.choices[0].1).sum();
    while total > budget {
        // The upgrade with the largest KL removed per added byte.
        let mut best: Option<(f64, usize, usize)> = None;
        for (i, slot) in slots.iter().enumerate() {
            let (bytes, kl, _) = slot.choices[pick[i]];
            for (j, &(b, k, _)) in slot.choices.iter().enumerate().skip(pick[i] + 1) {
                let gain = kl - k;
                if gain <= 0.0 || b <= bytes {
                    continue;
                }
                let rate = gain / (b - bytes) as f64;
                if best.is_none_or(|(r, _, _)| rate > r) {
                    best = Some((rate, i, j));
                }
            }
        }
        let Some((_, i, j)) = best else { break };
        total += slots[i].choices[j].1 - slots[i].choices[pick[i]].1;
        pick[i] = j;
    }
    (pick, total)
}
