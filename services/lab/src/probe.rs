//! KV ablations for the fidelity harness: which part of the cache is sensitive to quantization.
//!
//! A [`KvProbe`] makes the engine pass K and V through *separate* codecs (a round trip: encode,
//! decode) before storing them exactly in an F32 store, optionally only in a range of layers and
//! sparing the first positions. The stored values are then exactly what a store with those codecs
//! would return, so `engram eval kv --probe k=tq4,v=f32` measures keys alone, `layers=10-19` one
//! band of layers, `exact_first=16` the value of keeping attention-sink tokens exact.
//! Two key codecs are measured this way before any kernel is written for them: `qjl=1` adds
//! TurboQuant-prod's 1-bit QJL sketch of the key residual (unbiased scores), `outliers=N` keeps
//! each key row's N largest channels at 8 bits beside the codec.
//! A probe is an instrument: it costs an encode and decode per row and is never used to serve.

use std::ops::RangeInclusive;

use engram_engine::parse_codec;
use engram_kvcore::{Codec, CodecKind, DEFAULT_ROTATION_SEED, Rows, SplitMix64};
use half::f16;
use serde::{Deserialize, Serialize};

use engram_engine::{EngineError, EngineResult};

/// An ablation (see the module docs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KvProbe {
    /// Codec the keys go through.
    pub keys: CodecKind,
    /// Codec the values go through.
    pub values: CodecKind,
    /// Layers affected (all when `None`).
    pub layers: Option<RangeInclusive<usize>>,
    /// Positions below this stay exact.
    pub exact_first: usize,
    /// Keys add a 1-bit QJL sketch of their residual (TurboQuant-prod): `sign(S r)` and `‖r‖`
    /// for a fixed Gaussian `S`, decoded as `x̂ + ‖r‖·√(π/2)/d · Sᵀ sign(S r)`, whose inner
    /// product with any query is an unbiased estimate of the exact one. Costs `1 + 16/d` bits.
    #[serde(default)]
    pub key_qjl: bool,
    /// Each key row's this many largest-magnitude channels are stored at 8 bits (absmax scale,
    /// f16) with their indices, the rest through the key codec. Costs `N·(8 + log2 d)/d + 16/d`
    /// bits.
    #[serde(default)]
    pub key_outliers: usize,
    /// Keys quantized per channel (KIVI-style) instead of per row: over each group of this many
    /// consecutive positions, every channel of every head gets its own f16 minimum and step and
    /// `key_channel_bits`-bit codes (0: off). Costs `bits + 32/group` bits. Groups are formed
    /// from the rows of one forward call, so it is meaningful only for teacher-forced runs whose
    /// chunks hold whole groups (`eval kv --greedy-prompts 0`).
    #[serde(default)]
    pub key_channel_bits: u8,
    /// Positions per group of [`Self::key_channel_bits`] (default 16, one block).
    #[serde(default)]
    pub key_channel_group: usize,
}

/// The engine calls a probe through the model's tap.
impl engram_engine::KvTap for KvProbe {
    fn apply(
        &self,
        layer: usize,
        positions: &[usize],
        head_dim: usize,
        k: &mut [f32],
        v: &mut [f32],
    ) -> engram_model::ModelResult<()> {
        KvProbe::apply(self, layer, positions, head_dim, k, v).map_err(|e| match e {
            EngineError::Kv(e) => engram_model::ModelError::Kv(e),
            other => engram_model::ModelError::InvalidConfig {
                field: "probe",
                reason: other.to_string(),
            },
        })
    }
}

/// Seed of the QJL sketch matrix.
const QJL_SEED: u64 = 0x514a_4c5f_5345_4544;

impl KvProbe {
    /// Parses `k=tq4,v=f32,layers=10-19,exact_first=16` (every part optional; codecs default to
    /// f32, i.e. exact).
    pub fn parse(spec: &str) -> EngineResult<Self> {
        let bad = |reason: String| EngineError::InvalidConfig {
            field: "probe",
            reason,
        };
        let mut probe = Self {
            keys: CodecKind::F32,
            values: CodecKind::F32,
            layers: None,
            exact_first: 0,
            key_qjl: false,
            key_outliers: 0,
            key_channel_bits: 0,
            key_channel_group: 16,
        };
        for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, value) = part
                .split_once('=')
                .ok_or_else(|| bad(format!("`{part}` is not key=value")))?;
            match key {
                "k" => probe.keys = parse_codec(value)?,
                "v" => probe.values = parse_codec(value)?,
                "layers" => {
                    let (a, b) = value.split_once('-').unwrap_or((value, value));
                    let (a, b) = (a.parse::<usize>(), b.parse::<usize>());
                    match (a, b) {
                        (Ok(a), Ok(b)) if a <= b => probe.layers = Some(a..=b),
                        _ => return Err(bad(format!("layers `{value}` is not A-B"))),
                    }
                }
                "exact_first" => {
                    probe.exact_first = value
                        .parse()
                        .map_err(|_| bad(format!("exact_first `{value}` is not a count")))?;
                }
                "qjl" => {
                    probe.key_qjl = match value {
                        "1" | "on" => true,
                        "0" | "off" => false,
                        _ => return Err(bad(format!("qjl `{value}` is not 1 or 0"))),
                    };
                }
                "outliers" => {
                    probe.key_outliers = value
                        .parse()
                        .map_err(|_| bad(format!("outliers `{value}` is not a count")))?;
                }
                "chanq" => {
                    probe.key_channel_bits = value
                        .parse()
                        .ok()
                        .filter(|b| (2..=8).contains(b))
                        .ok_or_else(|| bad(format!("chanq `{value}` is not 2 to 8 bits")))?;
                }
                "chang" => {
                    probe.key_channel_group = value
                        .parse()
                        .ok()
                        .filter(|&g| g > 0)
                        .ok_or_else(|| bad(format!("chang `{value}` is not a group size")))?;
                }
                other => {
                    return Err(bad(format!(
                        "unknown key `{other}` (k, v, layers, exact_first, qjl, outliers, chanq, \
                         chang)"
                    )));
                }
            }
        }
        Ok(probe)
    }

    /// A short name for reports: `k:tq4/v:f32/layers:10-19/exact_first:16`.
    pub fn label(&self) -> String {
        let mut s = format!("k:{}/v:{}", self.keys, self.values);
        if let Some(r) = &self.layers {
            s.push_str(&format!("/layers:{}-{}", r.start(), r.end()));
        }
        if self.exact_first > 0 {
            s.push_str(&format!("/exact_first:{}", self.exact_first));
        }
        if self.key_qjl {
            s.push_str("/qjl");
        }
        if self.key_outliers > 0 {
            s.push_str(&format!("/outliers:{}", self.key_outliers));
        }
        if self.key_channel_bits > 0 {
            s.push_str(&format!(
                "/chanq:{}x{}",
                self.key_channel_bits, self.key_channel_group
            ));
        }
        s
    }

    /// Mean stored bits per element of K and V in affected layers.
    pub fn bits_per_element(&self, head_dim: usize) -> f64 {
        let d = head_dim as f64;
        let mut keys = self.keys.bits_per_element(head_dim);
        if self.key_qjl {
            keys += 1.0 + 16.0 / d;
        }
        if self.key_outliers > 0 {
            keys += (self.key_outliers as f64 * (8.0 + d.log2().ceil()) + 16.0) / d;
        }
        if self.key_channel_bits > 0 {
            keys = f64::from(self.key_channel_bits) + 32.0 / self.key_channel_group.max(1) as f64;
        }
        (keys + self.values.bits_per_element(head_dim)) / 2.0
    }

    /// Applies the round trips to one layer's new rows (`[rows, kv_heads, head_dim]`) at
    /// `positions` (one per row).
    pub fn apply(
        &self,
        layer: usize,
        positions: &[usize],
        head_dim: usize,
        k: &mut [f32],
        v: &mut [f32],
    ) -> EngineResult<()> {
        if self.layers.as_ref().is_some_and(|r| !r.contains(&layer)) {
            return Ok(());
        }
        let width = k.len() / positions.len().max(1);
        if self.key_channel_bits > 0 {
            channel_quantize(
                k,
                positions,
                width,
                self.key_channel_bits,
                self.key_channel_group.max(1),
                self.exact_first,
            );
        }
        let sketch = self
            .key_qjl
            .then(|| SplitMix64::new(QJL_SEED).gaussian_vec(head_dim * head_dim));
        for (is_key, kind, rows) in [(true, self.keys, k), (false, self.values, v)] {
            if is_key && self.key_channel_bits > 0 {
                continue;
            }
            let extras = is_key && (self.key_qjl || self.key_outliers > 0);
            if kind == CodecKind::F32 && !extras {
                continue;
            }
            let codec = Codec::new(kind, head_dim, DEFAULT_ROTATION_SEED)?;
            let (mut code, mut norm) =
                (vec![0u8; codec.code_bytes()], vec![0u8; codec.norm_bytes()]);
            let mut exact = vec![0.0f32; head_dim];
            for (token, &pos) in rows.chunks_exact_mut(width).zip(positions) {
                if pos < self.exact_first {
                    continue;
                }
                for row in token.chunks_exact_mut(head_dim) {
                    exact.copy_from_slice(row);
                    let outliers = if is_key {
                        split_outliers(row, self.key_outliers)
                    } else {
                        Vec::new()
                    };
                    codec.encode(Rows::F32(row), &mut code, &mut norm)?;
                    codec.decode(&code, &norm, row)?;
                    for &(j, value) in &outliers {
                        row[j] = value;
                    }
                    if let (true, Some(s)) = (is_key, &sketch) {
                        add_qjl(row, &exact, s);
                    }
                }
            }
        }
        Ok(())
    }
}

/// Takes the `n` largest-magnitude channels out of `row` (zeroed there) and returns them as
/// 8-bit values with an f16 absmax scale would decode them.
fn split_outliers(row: &mut [f32], n: usize) -> Vec<(usize, f32)> {
    if n == 0 {
        return Vec::new();
    }
    let mut order: Vec<usize> = (0..row.len()).collect();
    order.sort_by(|&a, &b| row[b].abs().total_cmp(&row[a].abs()));
    order.truncate(n.min(row.len()));
    let absmax = order.iter().fold(0.0f32, |m, &j| m.max(row[j].abs()));
    // The scale is stored as f16; its rounding (≤ 2⁻¹¹ relative) is left out of the round trip.
    let scale = absmax / 127.0;
    let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
    order
        .into_iter()
        .map(|j| {
            let q = (row[j] * inv).round().clamp(-127.0, 127.0);
            row[j] = 0.0;
            (j, q * scale)
        })
        .collect()
}

/// Quantizes `rows` (`[positions, width]`) per channel over runs of consecutive rows whose
/// positions share `pos / group`: each column gets an f16 minimum and step and `bits`-bit codes
/// (asymmetric, round to nearest). Positions below `exact_first` stay exact.
fn channel_quantize(
    rows: &mut [f32],
    positions: &[usize],
    width: usize,
    bits: u8,
    group: usize,
    exact_first: usize,
) {
    let levels = f32::from((1u16 << bits) - 1);
    let mut start = 0;
    while start < positions.len() {
        let g = positions[start] / group;
        let mut end = start + 1;
        while end < positions.len() && positions[end] / group == g {
            end += 1;
        }
        let run = &mut rows[start * width..end * width];
        if positions[start] >= exact_first {
            for c in 0..width {
                let (lo, hi) = run
                    .iter()
                    .skip(c)
                    .step_by(width)
                    .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &x| {
                        (a.min(x), b.max(x))
                    });
                let min = f16::from_f32(lo).to_f32();
                let step = f16::from_f32((hi - min) / levels).to_f32();
                let inv = if step > 0.0 { 1.0 / step } else { 0.0 };
                for x in run.iter_mut().skip(c).step_by(width) {
                    let q = ((*x - min) * inv).round().clamp(0.0, levels);
                    *x = min + q * step;
                }
            }
        }
        start = end;
    }
}

/// Adds the QJL estimate of the residual `exact − row` to `row` (see [`KvProbe::key_qjl`]);
/// `s` is the `d × d` sketch, row-major.
fn add_qjl(row: &mut [f32], exact: &[f32], s: &[f32]) {
    let d = row.len();
    let r: Vec<f32> = exact.iter().zip(row.iter()).map(|(e, x)| e - x).collect();
    // ‖r‖ is stored as f16; its rounding (≤ 2⁻¹¹ relative) is left out of the round trip.
    let norm = r.iter().map(|x| x * x).sum::<f32>().sqrt();
    if norm == 0.0 {
        return;
    }
    let w = norm * (std::f32::consts::PI / 2.0).sqrt() / d as f32;
    for s_i in s.chunks_exact(d) {
        let dot: f32 = s_i.iter().zip(&r).map(|(a, b)| a * b).sum();
        let sign = if dot >= 0.0 { w } else { -w };
        row.iter_mut().zip(s_i).for_each(|(x, a)| *x += sign * a);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_and_label() {
        let p = KvProbe::parse("k=tq4, layers=10-19,exact_first=16").unwrap();
        assert_eq!(p.keys, CodecKind::TQ4);
        assert_eq!(p.values, CodecKind::F32);
        assert_eq!(p.layers, Some(10..=19));
        assert_eq!(p.label(), "k:tq4/v:f32/layers:10-19/exact_first:16");
        assert_eq!(p.bits_per_element(64), (4.25 + 32.0) / 2.0);
        for bad in ["k=tq7", "layers=9-3", "nonsense", "w=f16"] {
            assert!(KvProbe::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_probe_rounds_only_what_it_names() {
        let p = KvProbe::parse("v=tq4,layers=1-1,exact_first=1").unwrap();
        let k0: Vec<f32> = (0..2 * 64).map(|i| (i as f32 * 0.37).sin()).collect();
        let (mut k, mut v) = (k0.clone(), k0.clone());
        p.apply(0, &[0, 1], 64, &mut k, &mut v).unwrap();
        assert_eq!((&k, &v), (&k0, &k0), "layer 0 is outside the probe");
        p.apply(1, &[0, 1], 64, &mut k, &mut v).unwrap();
        assert_eq!(k, k0, "keys stay exact");
        assert_eq!(v[..64], k0[..64], "position 0 is spared");
        assert_ne!(v[64..], k0[64..], "position 1's values went through TQ4");
    }

    #[test]
    fn key_extras_parse_count_their_bits_and_touch_keys_only() {
        let p = KvProbe::parse("k=tq4,v=tq4,qjl=1,outliers=4").unwrap();
        assert!(p.key_qjl);
        assert_eq!(p.key_outliers, 4);
        assert_eq!(p.label(), "k:tq4/v:tq4/qjl/outliers:4");
        let keys = 4.25 + 1.0 + 0.25 + (4.0 * 14.0 + 16.0) / 64.0;
        assert!((p.bits_per_element(64) - (keys + 4.25) / 2.0).abs() < 1e-12);
        // Per-channel keys: 4 bits and a 16-position group cost 4 + 32/16 bits per key element;
        // a column of a group is rebuilt within half a step.
        let p = KvProbe::parse("chanq=4,chang=16").unwrap();
        assert_eq!(p.label(), "k:f32/v:f32/chanq:4x16");
        assert!((p.bits_per_element(64) - (6.0 + 32.0) / 2.0).abs() < 1e-12);
        let mut k: Vec<f32> = (0..32 * 64)
            .map(|i| (i as f32 * 0.37).sin() * 3.0)
            .collect();
        let exact = k.clone();
        let positions: Vec<usize> = (0..32).collect();
        channel_quantize(&mut k, &positions, 64, 4, 16, 0);
        for (g, (a, b)) in k.chunks(16 * 64).zip(exact.chunks(16 * 64)).enumerate() {
            for c in 0..64 {
                let col = |x: &[f32]| x.iter().skip(c).step_by(64).copied().collect::<Vec<_>>();
                let (got, want) = (col(a), col(b));
                let range = want.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x))
                    - want.iter().fold(f32::INFINITY, |m, &x| m.min(x));
                for (x, y) in got.iter().zip(&want) {
                    assert!(
                        (x - y).abs() <= range / 15.0 * 0.5 + 1e-2,
                        "group {g} col {c}"
                    );
                }
            }
        }
        assert_ne!(k, exact);
        for bad in ["qjl=2", "outliers=x", "chanq=1", "chanq=9", "chang=0"] {
            assert!(KvProbe::parse(bad).is_err(), "{bad}");
        }
        // Outliers alone with exact keys otherwise: only the 8-bit rounding of the largest two.
        let p = KvProbe::parse("outliers=2").unwrap();
        let mut k: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin()).collect();
        k[5] = 9.0;
        k[40] = -7.3;
        let (k0, mut v) = (k.clone(), k.clone());
        p.apply(0, &[1], 64, &mut k, &mut v).unwrap();
        assert_eq!(v, k0, "values untouched");
        for (j, (a, b)) in k.iter().zip(&k0).enumerate() {
            if j == 5 || j == 40 {
                assert!((a - b).abs() <= 9.0 / 127.0 / 2.0 + 1e-6, "{j}: {a} vs {b}");
            } else {
                assert_eq!(a, b, "{j}");
            }
        }
    }

    #[test]
    fn the_qjl_sketch_makes_scores_unbiased() {
        // A reconstruction that shrinks the row (as an MSE codec does): the sketch of the
        // residual restores ⟨q, x⟩ on average over sketch matrices.
        let d = 64;
        let x: Vec<f32> = (0..d).map(|i| (i as f32 * 0.61).cos()).collect();
        let q: Vec<f32> = (0..d).map(|i| (i as f32 * 0.23).sin() + 0.5).collect();
        let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
        let exact = dot(&q, &x);
        let shrunk: Vec<f32> = x.iter().map(|v| 0.8 * v).collect();
        let trials = 4000;
        let mut mean = 0.0f64;
        for seed in 0..trials {
            let s = SplitMix64::new(seed).gaussian_vec(d * d);
            let mut row = shrunk.clone();
            add_qjl(&mut row, &x, &s);
            mean += f64::from(dot(&q, &row)) / trials as f64;
        }
        let biased = f64::from(dot(&q, &shrunk));
        assert!(
            (mean - f64::from(exact)).abs() < 0.05 * f64::from(exact).abs(),
            "mean {mean} exact {exact} (MSE alone {biased})"
        );
        assert!((biased - f64::from(exact)).abs() > 0.15 * f64::from(exact).abs());
    }
}
