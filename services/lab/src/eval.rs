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
//! - `top1_agreement`: share of positions where both argmaxes agree;
//! - `greedy_agreement`: from 20 prompts cut evenly from the corpus, 64 tokens generated greedily
//!   with the codec and with the reference; the share equal position by position.
//!
//! [`KvProbe`] rows (ablations: keys or values alone, a band of layers, exact first tokens) follow
//! the codecs.
//!
//! Cost: (codecs + probes + 1) forward passes over `max_tokens` tokens.

use std::path::{Path, PathBuf};

use candle_core::{D, Tensor};
use engram_kvcore::{CodecKind, LayerCodecs, TenantId};
use serde::{Deserialize, Serialize};

use crate::probe::KvProbe;
use engram_engine::StreamCodecs;
use engram_engine::TextTokenizer;
use engram_engine::{EngineConfig, EngineCore, KeyCentering, PrefixReuse, SequenceSpec};
use engram_engine::{EngineResult, io_error};
use engram_engine::{Llama, LogitRows};

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
    /// Codecs compared with it (keys and values alike, or one per stream).
    pub codecs: Vec<StreamCodecs>,
    /// Per-layer allocations compared with it (label, codecs), after the codecs: calibrated
    /// profiles.
    pub profiles: Vec<(String, LayerCodecs)>,
    /// Ablations compared with it (after the profiles).
    pub probes: Vec<KvProbe>,
    /// Key centering of every run, the reference's included.
    pub key_centering: KeyCentering,
    /// Prompts of the greedy-continuation check (0: off), cut evenly from the corpus.
    pub greedy_prompts: usize,
    /// Tokens of each such prompt.
    pub greedy_prompt_tokens: usize,
    /// Tokens each run generates greedily from each prompt.
    pub greedy_tokens: usize,
}

impl Default for EvalOptions {
    fn default() -> Self {
        Self {
            corpus: PathBuf::from(DEFAULT_CORPUS),
            max_tokens: 16_384,
            window: 2_048,
            chunk: 256,
            reference: CodecKind::F32,
            codecs: [
                CodecKind::F16,
                CodecKind::Q8,
                CodecKind::TurboQuant { bits: 4 },
                CodecKind::TurboQuant { bits: 3 },
                CodecKind::TurboQuant { bits: 2 },
            ]
            .map(StreamCodecs::both)
            .to_vec(),
            profiles: Vec::new(),
            probes: Vec::new(),
            key_centering: KeyCentering::default(),
            greedy_prompts: 20,
            greedy_prompt_tokens: 128,
            greedy_tokens: 64,
        }
    }
}

/// One codec's figures (the JSON line of `engram eval kv --json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CodecReport {
    /// `f16`, `q8`, `tq4`, … or `KEYS/VALUES` (`q8/tq4`)
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
    /// Share of greedily generated tokens equal, position by position, to those generated
    /// with the reference from the same prompts (`None` with the check off).
    pub greedy_agreement: Option<f64>,
}

#[derive(Debug, Default, Clone)]
pub(crate) struct Sums {
    pub(crate) kl: f64,
    pub(crate) nll: f64,
    pub(crate) agree: usize,
    pub(crate) n: usize,
}

impl Sums {
    /// Mean KL(reference ‖ this run) in nats.
    pub(crate) fn kl_nats(&self) -> f64 {
        self.kl / self.n.max(1) as f64
    }
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
    progress: impl FnMut(&str),
) -> EngineResult<Vec<CodecReport>> {
    let text = read_corpus(&opts.corpus)?;
    let tokens = tokenizer.encode(&text)?;
    let window = opts.window.clamp(2, model.config().context_length);
    // The engines hold what the longest sequence scored needs, not the model's own context
    // (a 32K-context model's f32 reference would need gigabytes of hot tier per engine).
    let needed = window.max(opts.greedy_prompt_tokens + opts.greedy_tokens);
    let scoped = |m: &Llama| {
        let tokens = needed.min(m.config().context_length);
        m.clone().with_context_length(tokens)
    };
    let model = &scoped(model)?;
    let scoped_others = others
        .iter()
        .map(|&(label, m)| Ok((label, scoped(m)?)))
        .collect::<EngineResult<Vec<_>>>()?;
    let others: Vec<(&str, &Llama)> = scoped_others.iter().map(|(l, m)| (*l, m)).collect();
    let others = others.as_slice();
    let head_dim = model.config().head_dim;
    let base = EngineConfig {
        key_centering: opts.key_centering,
        prefill_chunk: opts.chunk,
        cold_bytes: 0,
        ..EngineConfig::default()
    };
    let with = |k: StreamCodecs| EngineConfig {
        codec: k.key,
        value_codec: k.value_override(),
        ..base.clone()
    };
    // (label, bits per element, engine options, model) of every row; the reference first.
    type Run<'a> = (String, f64, EngineConfig, &'a Llama);
    let codecs =
        || std::iter::once(StreamCodecs::both(opts.reference)).chain(opts.codecs.iter().copied());
    let runs: Vec<Run<'_>> = codecs()
        .map(|k| (k.to_string(), k.bits_per_element(head_dim), with(k), model))
        .chain(opts.profiles.iter().map(|(label, codecs)| {
            let config = EngineConfig {
                layer_codecs: Some(codecs.clone()),
                ..base.clone()
            };
            (
                label.clone(),
                codecs.bits_per_element(head_dim),
                config,
                model,
            )
        }))
        .chain(opts.probes.iter().map(|p| {
            let config = EngineConfig {
                probe: Some(engram_engine::Tap(std::sync::Arc::new(p.clone()))),
                ..with(StreamCodecs::both(CodecKind::F32))
            };
            (p.label(), p.bits_per_element(head_dim), config, model)
        }))
        .chain(others.iter().flat_map(|&(label, other)| {
            codecs().map(move |k| {
                (
                    format!("{k}+{label}"),
                    k.bits_per_element(head_dim),
                    with(k),
                    other,
                )
            })
        }))
        .collect();
    let configs: Vec<(EngineConfig, &Llama)> =
        runs.iter().map(|(_, _, c, m)| (c.clone(), *m)).collect();
    let sums = score_configs(
        tokenizer,
        &tokens,
        window,
        opts.max_tokens,
        &configs,
        progress,
    )?;
    let greedy = greedy_agreement(tokenizer, &tokens, opts, &configs)?;
    let ref_ppl = (sums[0].nll / sums[0].n.max(1) as f64).exp();
    Ok(runs
        .iter()
        .zip(&sums)
        .enumerate()
        .map(|(i, ((label, bits, _, _), s))| {
            let n = s.n.max(1) as f64;
            let ppl = (s.nll / n).exp();
            CodecReport {
                codec: label.clone(),
                bits_per_element: *bits,
                kl_nats: s.kl_nats(),
                ppl,
                ppl_delta_rel: ppl / ref_ppl - 1.0,
                top1_agreement: s.agree as f64 / n,
                tokens: s.n,
                greedy_agreement: greedy.as_ref().map(|g| g[i]),
            }
        })
        .collect())
}

/// The greedy-continuation check: from `opts.greedy_prompts` prompts cut evenly from `tokens`,
/// each configuration generates `opts.greedy_tokens` tokens greedily; a configuration's figure
/// is the share of its tokens equal, position by position, to the first (reference)
/// configuration's. `None` with the check off or a corpus too short for one prompt.
fn greedy_agreement(
    tokenizer: &TextTokenizer,
    tokens: &[u32],
    opts: &EvalOptions,
    configs: &[(EngineConfig, &Llama)],
) -> EngineResult<Option<Vec<f64>>> {
    let (n, len, steps) = (
        opts.greedy_prompts,
        opts.greedy_prompt_tokens.max(1),
        opts.greedy_tokens,
    );
    if n == 0 || steps == 0 || tokens.len() < len {
        return Ok(None);
    }
    let stride = ((tokens.len() - len) / n).max(1);
    let mut equal = vec![0usize; configs.len()];
    let mut total = 0usize;
    let mut cores = configs
        .iter()
        .map(|(config, model)| EngineCore::new((*model).clone(), tokenizer.clone(), config.clone()))
        .collect::<EngineResult<Vec<_>>>()?;
    for p in 0..n {
        let start = (p * stride).min(tokens.len() - len);
        let prompt = &tokens[start..start + len];
        let mut generated: Vec<Vec<u32>> = Vec::with_capacity(cores.len());
        for core in cores.iter_mut() {
            let mut spec = SequenceSpec::plain(prompt.to_vec(), TenantId(0));
            spec.reuse = PrefixReuse::Disabled;
            let (id, _) = core.start(spec)?;
            let mut next = engram_engine::argmax(&core.prefill(id)?);
            let mut out = Vec::with_capacity(steps);
            out.push(next);
            while out.len() < steps {
                let logits = core.decode(&[(id, next)])?;
                next = engram_engine::argmax(logits.first().map_or(&[][..], Vec::as_slice));
                out.push(next);
            }
            core.finish(id)?;
            generated.push(out);
        }
        for (e, g) in equal.iter_mut().zip(&generated) {
            *e += g.iter().zip(&generated[0]).filter(|(a, b)| a == b).count();
        }
        total += steps;
    }
    Ok(Some(
        equal
            .iter()
            .map(|&e| e as f64 / total.max(1) as f64)
            .collect(),
    ))
}

/// Runs every configuration (the first is the reference) over the same windows of `tokens` in
/// lockstep, chunk by chunk, and sums each one's agreement with the reference.
pub(crate) fn score_configs(
    tokenizer: &TextTokenizer,
    tokens: &[u32],
    window: usize,
    max_tokens: usize,
    configs: &[(EngineConfig, &Llama)],
    mut progress: impl FnMut(&str),
) -> EngineResult<Vec<Sums>> {
    let mut cores = configs
        .iter()
        .map(|(config, model)| EngineCore::new((*model).clone(), tokenizer.clone(), config.clone()))
        .collect::<EngineResult<Vec<_>>>()?;
    let mut sums = vec![Sums::default(); cores.len()];
    let mut scored = 0;
    let mut start = 0;
    while scored < max_tokens && start + 1 < tokens.len() {
        let w = window
            .min(tokens.len() - start)
            .min(max_tokens - scored + 1);
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
    Ok(sums)
}

/// Adds the first `rows` rows of each codec's log-probabilities to the sums (index 0 is the
/// reference).
pub(crate) fn score(
    logs: &[Tensor],
    rows: usize,
    targets: &Tensor,
    sums: &mut [Sums],
) -> EngineResult<()> {
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
