//! The KV fidelity harness behind `engram eval kv`: teacher-forced next-token evaluation of each
//! codec against an exact reference, over real text.
//!
//! The corpus is tokenized once and cut into consecutive windows of up to `window` tokens; a
//! window of `w` tokens scores `w − 1` predictions, and windows are taken until `max_tokens`
//! predictions are scored. Every codec (and the reference, F32 KV by default) runs the same
//! windows through the engine's real path — K/V written to blocks, prefill chunks reading them
//! back — in lockstep, chunk by chunk, so no logits need to be kept beyond one chunk. Per codec:
//! - `kl_nats`: mean over positions of KL(reference ‖ codec) of the next-token distributions;
//! - `ppl`: exp of the mean negative log-likelihood of the actual next tokens;
//! - `ppl_delta_rel`: `ppl / ppl_reference − 1`;
//! - `top1_agreement`: share of positions where both argmaxes agree.
//!
//! [`KvProbe`] rows (ablations: keys or values alone, a band of layers, exact first tokens) follow
//! the codecs.
//!
//! Cost: (codecs + probes + 1) forward passes over `max_tokens` tokens.

use std::path::{Path, PathBuf};

use candle_core::{D, Tensor};
use engram_kvcore::{CodecKind, TenantId};
use serde::{Deserialize, Serialize};

use crate::core::{EngineConfig, EngineCore, KeyCentering, PrefixReuse, SequenceSpec};
use crate::error::{EngineResult, io_error};
use crate::model::{Llama, LogitRows};
use crate::probe::KvProbe;
use crate::tokenizer::TextTokenizer;

/// Where the default corpus lives on Debian and Ubuntu.
pub const DEFAULT_CORPUS: &str = "/usr/share/common-licenses";

/// Harness options.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalOptions {
    /// A text file, or a directory whose files are read in name order.
    pub corpus: PathBuf,
    /// Predictions scored at most.
    pub max_tokens: usize,
    /// Window length in tokens.
    pub window: usize,
    /// Prefill chunk in tokens.
    pub chunk: usize,
    /// The exact reference codec.
    pub reference: CodecKind,
    /// Codecs compared with it.
    pub codecs: Vec<CodecKind>,
    /// Ablations compared with it (after the codecs).
    pub probes: Vec<KvProbe>,
    /// Key centering of every run, the reference's included.
    pub key_centering: KeyCentering,
}

impl Default for EvalOptions {
    fn default() -> Self {
        Self {
            corpus: PathBuf::from(DEFAULT_CORPUS),
            max_tokens: 16_384,
            window: 2_048,
            chunk: 256,
            reference: CodecKind::F32,
            codecs: vec![
                CodecKind::F16,
                CodecKind::Q8,
                CodecKind::TurboQuant { bits: 4 },
                CodecKind::TurboQuant { bits: 3 },
                CodecKind::TurboQuant { bits: 2 },
            ],
            probes: Vec::new(),
            key_centering: KeyCentering::default(),
        }
    }
}

/// One codec's figures (the JSON line of `engram eval kv --json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CodecReport {
    /// `f16`, `q8`, `tq4`, …
    pub codec: String,
    /// Stored bits per K/V element, norms included.
    pub bits_per_element: f64,
    /// Mean KL(reference ‖ codec) in nats.
    pub kl_nats: f64,
    /// Perplexity of the actual next tokens.
    pub ppl: f64,
    /// Relative perplexity change against the reference.
    pub ppl_delta_rel: f64,
    /// Share of positions whose argmax matches the reference's.
    pub top1_agreement: f64,
    /// Positions scored.
    pub tokens: usize,
}

#[derive(Debug, Default, Clone)]
struct Sums {
    kl: f64,
    nll: f64,
    agree: usize,
    n: usize,
}

/// Reads the corpus: one file, or every regular file of a directory in name order (links to a
/// file already read are skipped), joined by blank lines.
pub fn read_corpus(path: &Path) -> EngineResult<String> {
    if !path.is_dir() {
        return std::fs::read_to_string(path).map_err(io_error(path));
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(path)
        .map_err(io_error(path))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    let mut seen = std::collections::HashSet::new();
    let mut text = String::new();
    for f in files {
        let real = std::fs::canonicalize(&f).map_err(io_error(&f))?;
        if !seen.insert(real) {
            continue;
        }
        let bytes = std::fs::read(&f).map_err(io_error(&f))?;
        text.push_str(&String::from_utf8_lossy(&bytes));
        text.push_str("\n\n");
    }
    Ok(text)
}

/// Runs the harness; `progress` hears one line per window. The reference's row comes first.
pub fn evaluate(
    model: &Llama,
    tokenizer: &TextTokenizer,
    opts: &EvalOptions,
    progress: impl FnMut(&str),
) -> EngineResult<Vec<CodecReport>> {
    evaluate_with(model, &[], tokenizer, opts, progress)
}

/// [`evaluate`], plus, for each `(label, model)` of `others` (the same checkpoint with other
/// weight numerics, say), a row for the reference codec and each codec run through that model
/// (labelled `codec+label`), all scored against `model`'s reference: what the other numerics
/// move on their own, and with each codec.
pub fn evaluate_with(
    model: &Llama,
    others: &[(&str, &Llama)],
    tokenizer: &TextTokenizer,
    opts: &EvalOptions,
    mut progress: impl FnMut(&str),
) -> EngineResult<Vec<CodecReport>> {
    let text = read_corpus(&opts.corpus)?;
    let tokens = tokenizer.encode(&text)?;
    let window = opts.window.clamp(2, model.config().context_length);
    let head_dim = model.config().head_dim;
    // (label, bits per element, codec, probe, model) of every row; the reference first.
    type Run<'a> = (String, f64, CodecKind, Option<KvProbe>, &'a Llama);
    let codecs = || std::iter::once(opts.reference).chain(opts.codecs.iter().copied());
    let runs: Vec<Run<'_>> = codecs()
        .map(|k| (k.to_string(), k.bits_per_element(head_dim), k, None, model))
        .chain(opts.probes.iter().map(|p| {
            (
                p.label(),
                p.bits_per_element(head_dim),
                CodecKind::F32,
                Some(p.clone()),
                model,
            )
        }))
        .chain(others.iter().flat_map(|&(label, other)| {
            codecs().map(move |k| {
                (
                    format!("{k}+{label}"),
                    k.bits_per_element(head_dim),
                    k,
                    None,
                    other,
                )
            })
        }))
        .collect();
    let mut cores = runs
        .iter()
        .map(|(_, _, codec, probe, model)| {
            let config = EngineConfig {
                codec: *codec,
                probe: probe.clone(),
                key_centering: opts.key_centering,
                prefill_chunk: opts.chunk,
                cold_bytes: 0,
                ..EngineConfig::default()
            };
            EngineCore::new((*model).clone(), tokenizer.clone(), config)
        })
        .collect::<EngineResult<Vec<_>>>()?;
    let mut sums = vec![Sums::default(); runs.len()];
    let mut scored = 0;
    let mut start = 0;
    while scored < opts.max_tokens && start + 1 < tokens.len() {
        let w = window
            .min(tokens.len() - start)
            .min(opts.max_tokens - scored + 1);
        let win = &tokens[start..start + w];
        let mut spec = SequenceSpec::plain(win.to_vec(), TenantId(0));
        spec.reuse = PrefixReuse::Disabled;
        let ids = cores
            .iter_mut()
            .map(|c| Ok(c.start(spec.clone())?.0))
            .collect::<EngineResult<Vec<_>>>()?;
        let mut pos = 0;
        while pos < w {
            let mut logs = Vec::with_capacity(cores.len());
            let mut n = 0;
            for (core, &id) in cores.iter_mut().zip(&ids) {
                let out = core.prefill_chunk(id, LogitRows::All)?;
                n = out.tokens;
                logs.push(candle_nn::ops::log_softmax(&out.logits, D::Minus1)?);
            }
            // Rows with a next token in the window.
            let rows = n.min(w - 1 - pos.min(w - 1));
            if rows > 0 {
                let targets =
                    Tensor::new(&win[pos + 1..pos + 1 + rows], &candle_core::Device::Cpu)?;
                score(&logs, rows, &targets, &mut sums)?;
            }
            pos += n;
        }
        for (core, id) in cores.iter_mut().zip(ids) {
            core.finish(id)?;
        }
        scored += w - 1;
        start += w;
        progress(&format!("scored {scored} tokens"));
    }
    let ref_ppl = (sums[0].nll / sums[0].n.max(1) as f64).exp();
    Ok(runs
        .iter()
        .zip(&sums)
        .map(|((label, bits, _, _, _), s)| {
            let n = s.n.max(1) as f64;
            let ppl = (s.nll / n).exp();
            CodecReport {
                codec: label.clone(),
                bits_per_element: *bits,
                kl_nats: s.kl / n,
                ppl,
                ppl_delta_rel: ppl / ref_ppl - 1.0,
                top1_agreement: s.agree as f64 / n,
                tokens: s.n,
            }
        })
        .collect())
}

/// Adds the first `rows` rows of each codec's log-probabilities to the sums (index 0 is the
/// reference).
fn score(logs: &[Tensor], rows: usize, targets: &Tensor, sums: &mut [Sums]) -> EngineResult<()> {
    let reference = logs[0].narrow(0, 0, rows)?;
    let p_ref = reference.exp()?;
    let ref_top: Vec<u32> = reference.argmax(D::Minus1)?.to_vec1()?;
    let idx = targets.unsqueeze(1)?;
    for (l, s) in logs.iter().zip(sums.iter_mut()) {
        let l = l.narrow(0, 0, rows)?;
        let kl: Vec<f32> = (&p_ref * (&reference - &l)?)?.sum(D::Minus1)?.to_vec1()?;
        let nll: Vec<f32> = l.gather(&idx, 1)?.squeeze(1)?.to_vec1()?;
        let top: Vec<u32> = l.argmax(D::Minus1)?.to_vec1()?;
        s.kl += kl.iter().map(|&v| f64::from(v.max(0.0))).sum::<f64>();
        s.nll -= nll.iter().map(|&v| f64::from(v)).sum::<f64>();
        s.agree += top.iter().zip(&ref_top).filter(|(a, b)| a == b).count();
        s.n += rows;
    }
    Ok(())
}
