//! Choosing the next token: greedy, or temperature with top-k and top-p (nucleus) filtering,
//! from a seeded generator so that a seed reproduces a run.
//!
//! Order of operations: temperature scales the logits; top-k keeps the k largest; softmax;
//! top-p keeps the smallest prefix (by descending probability) whose mass reaches p; draw.
//! Cost: O(vocab) for greedy, O(vocab · log vocab) when sampling.

use engram_kvcore::SplitMix64;
use serde::{Deserialize, Serialize};

use crate::error::{EngineError, EngineResult};

/// How to generate.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// 0 = greedy (argmax); otherwise logits are divided by it.
    pub temperature: f32,
    /// Keep only the k most likely tokens (0 = no limit).
    pub top_k: usize,
    /// Keep the most likely tokens up to this probability mass (1 = no limit).
    pub top_p: f32,
    /// Seed of the draw.
    pub seed: u64,
    /// Tokens to generate at most.
    pub max_tokens: usize,
    /// Generation ends when the text ends with one of these (they are not returned).
    pub stop: Vec<String>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
            max_tokens: 256,
            stop: Vec::new(),
        }
    }
}

impl SamplingParams {
    /// Greedy decoding of at most `max_tokens`.
    pub fn greedy(max_tokens: usize) -> Self {
        Self {
            max_tokens,
            ..Self::default()
        }
    }

    /// Rejects out-of-range values.
    pub fn validate(&self) -> EngineResult<()> {
        let bad = |field, reason: &str| {
            Err(EngineError::InvalidSampling {
                field,
                reason: reason.to_string(),
            })
        };
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return bad("temperature", "must be a finite number ≥ 0");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", "must be in (0, 1]");
        }
        if self.max_tokens == 0 {
            return bad("max_tokens", "must be at least 1");
        }
        if self.stop.iter().any(String::is_empty) {
            return bad("stop", "stop sequences must not be empty");
        }
        Ok(())
    }
}

/// A sampler with its own random stream.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: SplitMix64,
}

impl Sampler {
    /// A sampler for validated `params`.
    pub fn new(params: SamplingParams) -> Self {
        let rng = SplitMix64::new(params.seed);
        Self { params, rng }
    }

    /// The parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token from one row of logits.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.params.temperature == 0.0 {
            return argmax(logits);
        }
        let inv_t = 1.0 / self.params.temperature;
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, l)| l.is_finite())
            .map(|(i, &l)| (i as u32, l * inv_t))
            .collect();
        if cand.is_empty() {
            return argmax(logits);
        }
        cand.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if self.params.top_k > 0 {
            cand.truncate(self.params.top_k);
        }
        let max = cand[0].1;
        let mut total = 0.0f64;
        for c in &mut cand {
            c.1 = (c.1 - max).exp();
            total += f64::from(c.1);
        }
        if self.params.top_p < 1.0 {
            let mut mass = 0.0f64;
            let mut keep = cand.len();
            for (i, c) in cand.iter().enumerate() {
                mass += f64::from(c.1) / total;
                if mass >= f64::from(self.params.top_p) {
                    keep = i + 1;
                    break;
                }
            }
            cand.truncate(keep);
            total = cand.iter().map(|c| f64::from(c.1)).sum();
        }
        // Uniform in [0, total) from the top 53 bits.
        let u = (self.rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * total;
        let mut acc = 0.0f64;
        for c in &cand {
            acc += f64::from(c.1);
            if u < acc {
                return c.0;
            }
        }
        cand[cand.len() - 1].0
    }
}

/// Index of the largest logit (the first one on ties).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_maximum() {
        let mut s = Sampler::new(SamplingParams::greedy(1));
        assert_eq!(s.sample(&[0.1, 3.0, 3.0, -1.0]), 1);
    }

    #[test]
    fn top_k_one_is_greedy_at_any_temperature() {
        let mut s = Sampler::new(SamplingParams {
            temperature: 5.0,
            top_k: 1,
            ..SamplingParams::default()
        });
        for _ in 0..50 {
            assert_eq!(s.sample(&[0.0, 1.0, 0.5, 0.9]), 1);
        }
    }

    #[test]
    fn top_p_keeps_only_the_nucleus() {
        // Probabilities ≈ 0.84, 0.11, 0.04, 0.01: p = 0.9 keeps the first two.
        let logits = [4.0, 2.0, 1.0, -0.5];
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_p: 0.9,
            seed: 3,
            ..SamplingParams::default()
        });
        let mut seen = [0usize; 4];
        for _ in 0..2000 {
            seen[s.sample(&logits) as usize] += 1;
        }
        assert_eq!((seen[2], seen[3]), (0, 0), "{seen:?}");
        assert!(seen[1] > 100, "{seen:?}");
    }

    #[test]
    fn temperature_sampling_follows_the_distribution_and_the_seed() {
        let logits = [0.0f32, (3.0f32).ln()]; // p = 0.25, 0.75
        let params = SamplingParams {
            temperature: 1.0,
            seed: 11,
            ..SamplingParams::default()
        };
        let draw = |p: SamplingParams| {
            let mut s = Sampler::new(p);
            (0..4000).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        let a = draw(params.clone());
        assert_eq!(a, draw(params.clone()), "same seed, same draws");
        let ones = a.iter().filter(|&&t| t == 1).count() as f64 / 4000.0;
        assert!((ones - 0.75).abs() < 0.03, "{ones}");
        let other = draw(SamplingParams { seed: 12, ..params });
        assert_ne!(a, other);
    }

    #[test]
    fn bad_parameters_are_rejected() {
        for p in [
            SamplingParams {
                temperature: -1.0,
                ..SamplingParams::default()
            },
            SamplingParams {
                top_p: 0.0,
                ..SamplingParams::default()
            },
            SamplingParams {
                max_tokens: 0,
                ..SamplingParams::default()
            },
            SamplingParams {
                stop: vec![String::new()],
                ..SamplingParams::default()
            },
        ] {
            assert!(matches!(
                p.validate(),
                Err(EngineError::InvalidSampling { .. })
            ));
        }
    }
}
