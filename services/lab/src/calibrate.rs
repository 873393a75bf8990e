//! `engram calibrate kv`: a precision allocator that meets a KL budget at the fewest bytes.
//!
//! 1. **Measure.** Calibration text is teacher-forced through the engine's real path once with
//!    exact (f32) KV — the reference — and once per (layer, stream, candidate codec) with that one
//!    stream of that one layer stored in the candidate codec and everything else exact. Each run's
//!    mean KL against the reference is that choice's contribution ([`Sensitivity`]).
//! 2. **Allocate.** Every (layer, stream) starts at the cheapest candidate. While the predicted
//!    KL — the sum of the chosen contributions, which the ablations in `docs/kv-fidelity.md`
//!    found additive across layers — is over the budget, the upgrade that removes the most KL per
//!    added byte is taken (greedy distortion per byte).
//! 3. **Check.** The allocation is run as a whole on the calibration text; if the measured KL
//!    is over the budget, the allocation is redone with the budget scaled down by the
//!    overshoot (at most [`MAX_ROUNDS`] times), and the profile records both figures.
//!
//! The result is a [`KvProfile`]: a small JSON file keyed by the model's fingerprint, loaded by
//! `serve`, `bench` and `eval` (`EngineConfig::layer_codecs`), and part of the KV fingerprint
//! through the codecs it sets. Cost: one forward pass over `max_tokens` tokens per measured
//! choice — every candidate for keys, every candidate but the outlier splits (a key codec) for
//! values — plus the reference and one per round.

use std::path::PathBuf;

use engram_kvcore::{CodecKind, LayerCodecs};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::eval::{read_corpus, score_configs};
use engram_engine::Llama;
use engram_engine::TextTokenizer;
pub use engram_engine::profile::{CalibrationText, KvProfile, PROFILE_FORMAT, Sensitivity, Stream};
use engram_engine::profile::{Options, allocate};
use engram_engine::{EngineConfig, Hex32, KeyCentering};
use engram_engine::{EngineError, EngineResult};

/// The calibration text used when none is given: the first 14 KB of this project's README as
/// of 2026-11-25 (d6449c1), frozen — technical English with commands, tables and code, unlike the
/// licence texts `engram eval kv` scores on by default.
pub const BUILTIN_TEXT: &str = include_str!("../data/calibration.md");

/// How profiles name [`BUILTIN_TEXT`].
pub const BUILTIN_NAME: &str = "built-in (README of d6449c1, 14 KB)";

/// Allocation rounds at most (the first and its corrections).
pub const MAX_ROUNDS: usize = 3;

/// Calibration options.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CalibrateOptions {
    /// Calibration text: a file, or a directory read in name order; `None`, the built-in text
    /// ([`BUILTIN_TEXT`]). Never the evaluation corpus.
    pub text: Option<PathBuf>,
    /// Predictions scored per run.
    pub max_tokens: usize,
    /// Window length in tokens.
    pub window: usize,
    /// Prefill chunk in tokens.
    pub chunk: usize,
    /// Codecs a stream may take (outlier splits: keys only). By default TurboQuant at 3 to 6
    /// bits, TurboQuant at 5 and 6 bits with one outlier per key row stored apart, and Q8.
    pub candidates: Vec<CodecKind>,
    /// Mean KL (nats) the whole allocation may cost on the calibration text.
    pub budget_kl: f64,
    /// Key centering of every run.
    pub key_centering: KeyCentering,
    /// Runs computed in lockstep with one reference run (bounds memory).
    pub group: usize,
    /// Contributions measured before (an earlier profile's, on the same text): step 1 is
    /// skipped and `candidates` ignored, so another budget costs only the checks.
    pub measured: Option<Vec<Sensitivity>>,
}

impl Default for CalibrateOptions {
    fn default() -> Self {
        Self {
            text: None,
            max_tokens: 1024,
            window: 1024,
            chunk: 256,
            candidates: [3, 4, 5, 6]
                .map(|bits| CodecKind::TurboQuant { bits })
                .into_iter()
                .chain([5, 6].map(|bits| CodecKind::TurboQuantSplit { bits, outliers: 1 }))
                .chain([CodecKind::Q8])
                .collect(),
            budget_kl: 0.01,
            key_centering: KeyCentering::default(),
            group: 12,
            measured: None,
        }
    }
}

/// Calibrates a profile for `model` (module docs); `progress` hears one line per group of runs.
pub fn calibrate(
    model: &Llama,
    tokenizer: &TextTokenizer,
    opts: &CalibrateOptions,
    mut progress: impl FnMut(&str),
) -> EngineResult<KvProfile> {
    if opts.candidates.is_empty() || opts.budget_kl.is_nan() || opts.budget_kl <= 0.0 {
        return Err(EngineError::InvalidConfig {
            field: "calibrate",
            reason: "needs at least one candidate codec and a positive KL budget".into(),
        });
    }
    let text = match &opts.text {
        Some(path) => read_corpus(path)?,
        None => BUILTIN_TEXT.to_string(),
    };
    let tokens = tokenizer.encode(&text)?;
    let window = opts.window.clamp(2, model.config().context_length);
    // The engines hold one window, not the model's own context (see `eval`).
    let model = &model.clone().with_context_length(window)?;
    let shape = model.kv_shape(engram_kvcore::DEFAULT_BLOCK_SIZE)?;
    let d = shape.head_dim;
    let exact = vec![CodecKind::F32; shape.layers];
    let config_for = |codecs: LayerCodecs| EngineConfig {
        codec: CodecKind::F32,
        layer_codecs: Some(codecs),
        key_centering: opts.key_centering,
        prefill_chunk: opts.chunk,
        cold_bytes: 0,
        ..EngineConfig::default()
    };
    let reference = config_for(LayerCodecs::uniform(&shape, CodecKind::F32));
    // Every (layer, stream, codec) with the rest exact.
    let mut probes: Vec<(usize, Stream, CodecKind)> = Vec::new();
    for layer in 0..shape.layers {
        for stream in [Stream::Key, Stream::Value] {
            // An outlier split is a key codec.
            for &codec in &opts.candidates {
                if stream == Stream::Key || codec.outliers() == 0 {
                    probes.push((layer, stream, codec));
                }
            }
        }
    }
    if opts.measured.is_some() {
        probes.clear();
    }
    let mut sensitivity = opts.measured.clone().unwrap_or_default();
    for (g, group) in probes.chunks(opts.group.max(1)).enumerate() {
        let mut configs = vec![(reference.clone(), model)];
        for &(layer, stream, codec) in group {
            let (mut keys, mut values) = (exact.clone(), exact.clone());
            match stream {
                Stream::Key => keys[layer] = codec,
                Stream::Value => values[layer] = codec,
            }
            let codecs = LayerCodecs::per_stream(&shape, keys, values)?;
            configs.push((config_for(codecs), model));
        }
        let sums = score_configs(
            tokenizer,
            &tokens,
            window,
            opts.max_tokens,
            &configs,
            |_| {},
        )?;
        for (&(layer, stream, codec), s) in group.iter().zip(&sums[1..]) {
            sensitivity.push(Sensitivity {
                layer,
                stream,
                codec,
                kl_nats: s.kl_nats(),
            });
        }
        progress(&format!(
            "measured {} of {} choices",
            (g * opts.group.max(1) + group.len()).min(probes.len()),
            probes.len()
        ));
    }
    // Slots in (layer, stream) order: keys of layer l at 2l, values at 2l + 1.
    let mut slots: Vec<Options> = vec![
        Options {
            choices: Vec::new()
        };
        2 * shape.layers
    ];
    for s in &sensitivity {
        if s.layer >= shape.layers {
            return Err(EngineError::InvalidConfig {
                field: "calibrate",
                reason: format!("a measured layer {} of {}", s.layer, shape.layers),
            });
        }
        let slot = 2 * s.layer + usize::from(s.stream == Stream::Value);
        let bytes = s.codec.code_bytes(d) + s.codec.norm_bytes();
        slots[slot].choices.push((bytes, s.kl_nats, s.codec));
    }
    for slot in &mut slots {
        if slot.choices.is_empty() {
            return Err(EngineError::InvalidConfig {
                field: "calibrate",
                reason: "a layer's stream has no measured codec".into(),
            });
        }
        slot.choices
            .sort_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)));
    }
    let codecs_of = |pick: &[usize]| -> EngineResult<LayerCodecs> {
        let chosen = |stream: usize| -> Vec<CodecKind> {
            (0..shape.layers)
                .map(|l| {
                    let slot = &slots[2 * l + stream];
                    slot.choices[pick[2 * l + stream]].2
                })
                .collect()
        };
        Ok(LayerCodecs::per_stream(&shape, chosen(0), chosen(1))?)
    };
    let mut budget = opts.budget_kl;
    let mut rounds = 0;
    let (mut codecs, mut predicted, mut measured);
    loop {
        rounds += 1;
        let (pick, total) = allocate(&slots, budget);
        codecs = codecs_of(&pick)?;
        predicted = total;
        let sums = score_configs(
            tokenizer,
            &tokens,
            window,
            opts.max_tokens,
            &[
                (reference.clone(), model),
                (config_for(codecs.clone()), model),
            ],
            |_| {},
        )?;
        measured = sums[1].kl_nats();
        progress(&format!(
            "round {rounds}: {:.3} bits/element, predicted KL {predicted:.5}, measured {measured:.5}",
            codecs.bits_per_element(d)
        ));
        if measured <= opts.budget_kl || rounds >= MAX_ROUNDS || predicted <= 0.0 {
            break;
        }
        budget *= opts.budget_kl / measured;
    }
    let digest: [u8; 32] = Sha256::digest(text.as_bytes()).into();
    Ok(KvProfile {
        format: PROFILE_FORMAT,
        model: Hex32(model.fingerprint()),
        budget_kl: opts.budget_kl,
        calibration: CalibrationText {
            path: opts
                .text
                .as_ref()
                .map_or_else(|| BUILTIN_NAME.to_string(), |p| p.display().to_string()),
            sha256: Hex32(digest),
            tokens: opts.max_tokens.min(tokens.len().saturating_sub(1)),
        },
        predicted_kl: predicted,
        measured_kl: measured,
        bits_per_element: codecs.bits_per_element(d),
        rounds,
        codecs,
        sensitivity,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use engram_kvcore::KvShape;

    fn slot(choices: &[(usize, f64)]) -> Options {
        Options {
            choices: choices
                .iter()
                .map(|&(b, k)| (b, k, CodecKind::F16))
                .collect(),
        }
    }

    #[test]
    fn the_greedy_spends_bytes_where_they_remove_the_most_kl() {
        // Two slots: upgrading the first removes 0.5 per byte, the second 0.1.
        let slots = [slot(&[(10, 1.0), (12, 0.0)]), slot(&[(10, 1.0), (20, 0.0)])];
        let (pick, total) = allocate(&slots, 1.5);
        assert_eq!(pick, [1, 0]);
        assert!((total - 1.0).abs() < 1e-12);
        // A budget both must meet: both upgraded.
        assert_eq!(allocate(&slots, 0.5).0, [1, 1]);
        // A budget already met: nothing spent.
        assert_eq!(allocate(&slots, 5.0).0, [0, 0]);
        // An upgrade that measures worse (noise) is never taken; the budget is then missed.
        let noisy = [slot(&[(10, 1.0), (12, 1.2)])];
        let (pick, total) = allocate(&noisy, 0.5);
        assert_eq!(pick, [0]);
        assert!((total - 1.0).abs() < 1e-12);
        // A jump past a poor middle choice: 16 bytes for 0.9, 20 bytes for all of it.
        let skip = [slot(&[(10, 1.0), (16, 0.9), (20, 0.0)])];
        assert_eq!(allocate(&skip, 0.5).0, [2]);
    }
    #[test]
    fn down_tiering_narrows_the_streams_that_cost_least_within_the_looser_budget() {
        let (tq3, tq4, tq6) = (
            CodecKind::TurboQuant { bits: 3 },
            CodecKind::TurboQuant { bits: 4 },
            CodecKind::TurboQuant { bits: 6 },
        );
        let shape = KvShape::new(2, 1, 64).unwrap();
        // Layer 0's keys are sensitive, everything else cheap to narrow.
        let kl = |layer, stream, codec| match (layer, stream, codec) {
            (0, Stream::Key, c) if c == tq3 => 0.5,
            (0, Stream::Key, c) if c == tq4 => 0.2,
            (_, _, c) if c == tq3 => 0.02,
            (_, _, c) if c == tq4 => 0.01,
            _ => 0.001,
        };
        let mut sensitivity = Vec::new();
        for layer in 0..2 {
            for stream in [Stream::Key, Stream::Value] {
                for codec in [tq3, tq4, tq6, CodecKind::Q8] {
                    sensitivity.push(Sensitivity {
                        layer,
                        stream,
                        codec,
                        kl_nats: kl(layer, stream, codec),
                    });
                }
            }
        }
        let profile = KvProfile {
            format: PROFILE_FORMAT,
            model: Hex32([0; 32]),
            budget_kl: 0.01,
            calibration: CalibrationText {
                path: "test".into(),
                sha256: Hex32([0; 32]),
                tokens: 0,
            },
            predicted_kl: 0.004,
            measured_kl: 0.004,
            bits_per_element: 6.25,
            rounds: 1,
            // Layer 1's values already at TQ4: Q8 is wider and never chosen.
            codecs: LayerCodecs::per_stream(&shape, vec![tq6, tq6], vec![tq6, tq4]).unwrap(),
            sensitivity,
        };
        let (codecs, predicted) = profile.reduced_codecs(&shape, 0.1).unwrap();
        assert_eq!(codecs.keys(), [tq6, tq3]);
        assert_eq!(codecs.values(), [tq3, tq3]);
        assert!(
            (predicted - (0.001 + 0.02 * 3.0)).abs() < 1e-12,
            "{predicted}"
        );
        // A budget nothing narrower meets keeps the profile's codecs.
        let (same, _) = profile.reduced_codecs(&shape, 0.003).unwrap();
        assert_eq!(same, profile.codecs);
        assert!(profile.reduced_codecs(&shape, 0.0).is_err());
        let mut unmeasured = profile.clone();
        unmeasured.sensitivity.retain(|s| s.codec != tq6);
        assert!(unmeasured.reduced_codecs(&shape, 0.1).is_err());
    }
}
