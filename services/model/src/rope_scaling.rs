//! RoPE scalings as per-frequency divisors of the plain inverse frequencies
//! ([`crate::ModelConfig::rope_freq_factors`]), read from GGUF metadata or a `config.json`.

use std::fs::File;
use std::io::BufReader;

use candle_core::Device;
use candle_core::quantized::gguf_file::Content;

use crate::arch::{Arch, RopeScaling};
use crate::error::{ModelError, ModelResult, metadata};
use crate::gguf::{md_f64, md_string};

/// A `config.json` `rope_scaling` as per-frequency divisors (`None`: plain RoPE, for `null`,
/// absent, or a type of `default`); a kind the family does not run is refused.
pub(crate) fn hf_rope_scaling(
    scaling: Option<&serde_json::Value>,
    arch: &Arch,
    head_dim: usize,
    theta: f64,
) -> ModelResult<Option<Vec<f32>>> {
    let Some(v) = scaling.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let kind = ["rope_type", "type"]
        .iter()
        .find_map(|k| v.get(k).and_then(|t| t.as_str()))
        .unwrap_or("unknown");
    let num = |key: &str| -> ModelResult<f64> {
        v.get(key)
            .and_then(serde_json::Value::as_f64)
            .ok_or_else(|| metadata(&format!("rope_scaling.{key}")))
    };
    let refused = || ModelError::UnsupportedRopeScaling {
        kind: kind.to_string(),
    };
    match kind {
        "default" => Ok(None),
        "linear" if arch.runs(RopeScaling::Linear) => {
            Ok(Some(vec![num("factor")? as f32; head_dim / 2]))
        }
        "llama3" if arch.runs(RopeScaling::Llama3) => Ok(Some(llama3_factors(
            head_dim,
            theta,
            num("factor")?,
            num("low_freq_factor")?,
            num("high_freq_factor")?,
            num("original_max_position_embeddings")?,
        ))),
        _ => Err(refused()),
    }
}

/// Llama 3.1's RoPE scaling as divisors of the plain inverse frequencies: wavelengths shorter
/// than `original / high` keep theirs, longer than `original / low` are divided by `factor`, and
/// between them the inverse frequency is the blend `(1 − s)·f/factor + s·f` with
/// `s = (original / wavelength − low) / (high − low)`.
pub(crate) fn llama3_factors(
    head_dim: usize,
    theta: f64,
    factor: f64,
    low: f64,
    high: f64,
    original: f64,
) -> Vec<f32> {
    (0..head_dim / 2)
        .map(|i| {
            let inv = theta.powf(-2.0 * i as f64 / head_dim as f64);
            let wavelength = std::f64::consts::TAU / inv;
            let divisor = if wavelength < original / high {
                1.0
            } else if wavelength > original / low {
                factor
            } else {
                let s = (original / wavelength - low) / (high - low);
                1.0 / ((1.0 - s) / factor + s)
            };
            divisor as f32
        })
        .collect()
}

/// A GGUF's RoPE scaling as per-frequency divisors: `<arch>.rope.scaling.type` `linear` (with
/// its `factor`), or the divisors llama.cpp stores for Llama 3.1-style models
/// (`rope_freqs.weight`, `head_dim / 2` values); `none` or absent is plain RoPE. A kind the
/// family does not run (`yarn`) is refused.
pub(crate) fn gguf_rope_scaling(
    ct: &Content,
    arch: &Arch,
    head_dim: usize,
    f: &mut BufReader<File>,
) -> ModelResult<Option<Vec<f32>>> {
    let kind = md_string(ct, &arch.key("rope.scaling.type")).unwrap_or_else(|_| "none".into());
    let refused = |kind: &str| ModelError::UnsupportedRopeScaling {
        kind: kind.to_string(),
    };
    let linear = match kind.as_str() {
        "none" => None,
        "linear" if arch.runs(RopeScaling::Linear) => {
            let key = arch.key("rope.scaling.factor");
            Some(md_f64(ct, &key)? as f32)
        }
        other => return Err(refused(other)),
    };
    let freqs = match ct.tensor_infos.get("rope_freqs.weight") {
        None => None,
        Some(_) if !arch.runs(RopeScaling::Llama3) => return Err(refused("rope_freqs")),
        Some(info) => {
            if info.shape.dims() != [head_dim / 2] {
                return Err(ModelError::TensorShape {
                    name: "rope_freqs.weight".into(),
                    expected: (head_dim / 2).to_string(),
                    got: info.shape.dims().to_vec(),
                });
            }
            let t = ct.tensor(f, "rope_freqs.weight", &Device::Cpu)?;
            Some(t.dequantize(&Device::Cpu)?.to_vec1::<f32>()?)
        }
    };
    Ok(match (linear, freqs) {
        (Some(l), Some(mut f)) => {
            f.iter_mut().for_each(|x| *x *= l);
            Some(f)
        }
        (Some(l), None) => Some(vec![l; head_dim / 2]),
        (None, f) => f,
    })
}
