//! Choosing the next token: greedy, or temperature with top-k, top-p (nucleus) and min-p
//! filtering, from a seeded generator so that a seed reproduces a run.
//!
//! Order of operations: a constraint's mask (tokens it forbids get −∞); `logit_bias` is added;
//! the presence and frequency penalties are subtracted for tokens already generated (OpenAI's
//! definitions: `presence` once for any token seen, `frequency` times its count); greedy takes
//! the largest; otherwise temperature scales the logits, top-k keeps the k largest, softmax,
//! min-p drops tokens below `min_p` times the largest probability, top-p keeps the smallest
//! prefix (by descending probability) whose mass reaches p; draw. Log probabilities, when
//! asked, are the model's own (a log-softmax of the logits before any of these steps).
//! Cost: O(vocab) for greedy, O(vocab · log vocab) when sampling; the penalties and the bias
//! copy the row once.

use std::collections::HashMap;

use engram_kvcore::SplitMix64;
use serde::{Deserialize, Serialize};

use crate::error::{EngineError, EngineResult};

/// Most alternatives a token's log probabilities may list (OpenAI's bound).
pub const MAX_TOP_LOGPROBS: usize = 20;

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
    /// Drop tokens less likely than this fraction of the most likely one (0 = no limit).
    pub min_p: f32,
    /// Subtracted once from the logit of every token generated so far (−2 to 2).
    pub presence_penalty: f32,
    /// Subtracted from a token's logit times its count so far (−2 to 2).
    pub frequency_penalty: f32,
    /// Added to the logits of these tokens (−100 to 100).
    pub logit_bias: Vec<(u32, f32)>,
    /// Log probabilities of each generated token and of this many most likely alternatives
    /// (0 to [`MAX_TOP_LOGPROBS`]); `None`: not computed.
    pub logprobs: Option<usize>,
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
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            logprobs: None,
            seed: 0,
            max_tokens: 256,
            stop: Vec::new(),
        }
    }
}

/// A generated token's log probability and the most likely alternatives at its step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprob {
    /// The token.
    pub token: u32,
    /// Its log probability under the model.
    pub logprob: f32,
    /// The most likely tokens at this step, most likely first, with theirs.
    pub top: Vec<(u32, f32)>,
}

/// What a sequence's decoding is constrained to (a grammar, a JSON schema): the sampler asks
/// it which tokens may come next and tells it which one did. Implemented outside the engine
/// (the server's grammar crate); the engine only applies it.
pub trait Constraint: Send {
    /// Sets the logits of the tokens that may not come next to −∞. An error ends the sequence.
    fn mask(&mut self, logits: &mut [f32]) -> Result<(), String>;
    /// Advances past `token` (one the mask allowed). An error ends the sequence.
    fn commit(&mut self, token: u32) -> Result<(), String>;
    /// Whether the constrained text is complete and nothing more may follow: the sequence ends
    /// as if it had sampled a stop token.
    fn finished(&self) -> bool;
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
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p", "must be in [0, 1]");
        }
        for (field, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return bad(field, "must be in [-2, 2]");
            }
        }
        if self
            .logit_bias
            .iter()
            .any(|(_, b)| !(-100.0..=100.0).contains(b))
        {
            return bad("logit_bias", "biases must be in [-100, 100]");
        }
        if self.logprobs.is_some_and(|n| n > MAX_TOP_LOGPROBS) {
            return bad("top_logprobs", "must be at most 20");
        }
        Ok(())
    }
}

/// A sampler with its own random stream and the counts of the tokens it generated.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: SplitMix64,
    /// Tokens generated so far and how often (for the penalties).
    counts: HashMap<u32, u32>,
}

impl Sampler {
    /// A sampler for validated `params`.
    pub fn new(params: SamplingParams) -> Self {
        let rng = SplitMix64::new(params.seed);
        Self {
            params,
            rng,
            counts: HashMap::new(),
        }
    }

    /// The parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Whether the logits change before the draw (bias or penalties).
    fn adjusts(&self) -> bool {
        !self.params.logit_bias.is_empty()
            || (!self.counts.is_empty()
                && (self.params.presence_penalty != 0.0 || self.params.frequency_penalty != 0.0))
    }

    /// Picks the next token from one row of logits.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        self.sample_constrained(logits, None)
            .unwrap_or_else(|_| argmax(logits))
    }

    /// Picks the next token from one row of logits, allowed by `constraint` when given (which
    /// is then advanced past it); counts it for the penalties.
    pub fn sample_constrained(
        &mut self,
        logits: &[f32],
        constraint: Option<&mut (dyn Constraint + '_)>,
    ) -> Result<u32, String> {
        let tok = match constraint {
            None if !self.adjusts() => self.draw(logits),
            None => {
                let mut row = logits.to_vec();
                self.adjust(&mut row);
                self.draw(&row)
            }
            Some(c) => {
                let mut row = logits.to_vec();
                c.mask(&mut row)?;
                if row.iter().all(|l| *l == f32::NEG_INFINITY) {
                    return Err("the constraint allows no token".into());
                }
                self.adjust(&mut row);
                let tok = self.draw(&row);
                c.commit(tok)?;
                tok
            }
        };
        *self.counts.entry(tok).or_default() += 1;
        Ok(tok)
    }

    /// Adds the bias and subtracts the penalties.
    fn adjust(&self, row: &mut [f32]) {
        for &(t, b) in &self.params.logit_bias {
            if let Some(l) = row.get_mut(t as usize) {
                *l += b;
            }
        }
        let (p, f) = (self.params.presence_penalty, self.params.frequency_penalty);
        if p != 0.0 || f != 0.0 {
            for (&t, &n) in &self.counts {
                if let Some(l) = row.get_mut(t as usize) {
                    *l -= p + f * n as f32;
                }
            }
        }
    }

    /// The draw over an adjusted row.
    fn draw(&mut self, logits: &[f32]) -> u32 {
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
        if self.params.min_p > 0.0 {
            // The largest weight is exp(0) = 1.
            let floor = self.params.min_p;
            let keep = cand.iter().take_while(|c| c.1 >= floor).count().max(1);
            cand.truncate(keep);
            total = cand.iter().map(|c| f64::from(c.1)).sum();
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

/// `token`'s log probability in `logits` (a log-softmax) and the `top` most likely tokens'
/// (most likely first, ties by id).
pub fn logprobs_of(logits: &[f32], token: u32, top: usize) -> TokenLogprob {
    let max = logits
        .iter()
        .copied()
        .filter(|l| l.is_finite())
        .fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits
        .iter()
        .filter(|l| l.is_finite())
        .map(|&l| f64::from(l - max).exp())
        .sum();
    let log_z = max + sum.ln() as f32;
    let lp = |t: u32| {
        logits
            .get(t as usize)
            .map_or(f32::NEG_INFINITY, |l| l - log_z)
    };
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(top + 1);
    if top > 0 {
        for (i, &l) in logits.iter().enumerate() {
            if best.len() == top && best.last().is_some_and(|b| b.1 >= l) {
                continue;
            }
            let at = best.iter().position(|b| b.1 < l).unwrap_or(best.len());
            best.insert(at, (i as u32, l));
            best.truncate(top);
        }
    }
    TokenLogprob {
        token,
        logprob: lp(token),
        top: best.into_iter().map(|(t, l)| (t, l - log_z)).collect(),
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
    fn logit_bias_and_penalties_move_the_choice() {
        // Greedy picks 1; a bias of −10 on it picks 2.
        let logits = [0.0, 3.0, 2.5, -1.0];
        let mut s = Sampler::new(SamplingParams {
            logit_bias: vec![(1, -10.0)],
            ..SamplingParams::greedy(4)
        });
        assert_eq!(s.sample(&logits), 2);
        // A presence penalty of 1 stops a greedy sampler repeating itself: 1, then 2 (3 − 1 <
        // 2.5), then 2 again would cost 1 too (2.5 − 1 < 2): 1 (3 − 1 = 2 > 1.5).
        let mut s = Sampler::new(SamplingParams {
            presence_penalty: 1.0,
            ..SamplingParams::greedy(4)
        });
        let picks: Vec<u32> = (0..3).map(|_| s.sample(&logits)).collect();
        assert_eq!(picks, vec![1, 2, 1]);
        // The frequency penalty grows with the count: 1, 2, then both seen once (2 vs 1.5): 1,
        // then 1 seen twice (3 − 2 = 1 < 1.5): 2.
        let mut s = Sampler::new(SamplingParams {
            frequency_penalty: 1.0,
            ..SamplingParams::greedy(4)
        });
        let picks: Vec<u32> = (0..4).map(|_| s.sample(&logits)).collect();
        assert_eq!(picks, vec![1, 2, 1, 2]);
    }

    #[test]
    fn min_p_drops_the_unlikely() {
        // p ≈ 0.66, 0.24, 0.09, 0.01: min_p 0.2 keeps tokens with p ≥ 0.13, the first two.
        let logits = [3.0f32, 2.0, 1.0, -1.0];
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            min_p: 0.2,
            seed: 5,
            ..SamplingParams::default()
        });
        let mut seen = [0usize; 4];
        for _ in 0..3000 {
            seen[s.sample(&logits) as usize] += 1;
        }
        assert_eq!((seen[2], seen[3]), (0, 0), "{seen:?}");
        assert!(seen[1] > 500, "{seen:?}");
    }

    #[test]
    fn logprobs_are_a_log_softmax_with_the_top_alternatives() {
        let logits = [1.0f32, 3.0, 2.0, f32::NEG_INFINITY];
        let l = logprobs_of(&logits, 2, 2);
        let z: f32 = logits.iter().map(|x| x.exp()).sum::<f32>().ln();
        assert!((l.logprob - (2.0 - z)).abs() < 1e-5, "{l:?}");
        assert_eq!(l.top.len(), 2);
        assert_eq!((l.top[0].0, l.top[1].0), (1, 2));
        assert!((l.top[0].1 - (3.0 - z)).abs() < 1e-5);
        let total: f32 = (0..4)
            .map(|t| logprobs_of(&logits, t, 0).logprob.exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-5, "{total}");
    }

    /// A constraint that allows only even tokens and ends after three.
    struct Even(usize);

    impl Constraint for Even {
        fn mask(&mut self, logits: &mut [f32]) -> Result<(), String> {
            logits
                .iter_mut()
                .skip(1)
                .step_by(2)
                .for_each(|l| *l = f32::NEG_INFINITY);
            Ok(())
        }
        fn commit(&mut self, token: u32) -> Result<(), String> {
            if token % 2 == 1 {
                return Err(format!("{token} was masked"));
            }
            self.0 += 1;
            Ok(())
        }
        fn finished(&self) -> bool {
            self.0 >= 3
        }
    }

    #[test]
    fn a_constraint_s_mask_holds_greedy_and_sampled_draws() {
        let logits = [0.0f32, 5.0, 1.0, 4.0, 0.5];
        for temperature in [0.0, 1.0, 3.0] {
            let mut s = Sampler::new(SamplingParams {
                temperature,
                seed: 9,
                ..SamplingParams::default()
            });
            let mut c = Even(0);
            for _ in 0..50 {
                let t = s.sample_constrained(&logits, Some(&mut c)).unwrap();
                assert_eq!(t % 2, 0, "temperature {temperature}");
            }
            assert!(c.finished());
        }
        // Greedy under the mask: the best even token.
        let mut s = Sampler::new(SamplingParams::greedy(1));
        assert_eq!(s.sample_constrained(&logits, Some(&mut Even(0))), Ok(2));
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
            SamplingParams {
                min_p: 1.5,
                ..SamplingParams::default()
            },
            SamplingParams {
                presence_penalty: 2.5,
                ..SamplingParams::default()
            },
            SamplingParams {
                logit_bias: vec![(0, 101.0)],
                ..SamplingParams::default()
            },
            SamplingParams {
                logprobs: Some(21),
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
