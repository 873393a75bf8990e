//! Text ↔ token ids, and the ChatML template SmolLM2 was tuned on.
//!
//! The tokenizer comes from `tokenizer.json` when the model ships one, and is otherwise built
//! from a GGUF file's metadata (`tokenizer.ggml.*`): a byte-level BPE over its vocabulary and
//! merges, pre-tokenized as `Sequence[Digits(individual), ByteLevel(add_prefix_space = false)]`
//! with a byte-level decoder, token types 3 (control) and 4 (user-defined) registered as special
//! tokens. Built that way it round-trips text exactly (candle's GGUF tokenizer adds a space).

use std::fs::File;
use std::io::BufReader;
use std::path::Path;

use std::sync::Arc;

use candle_core::quantized::gguf_file::{Content, Value};
use engram_context::ChatFormat;
use tokenizers::SplitDelimiterBehavior;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BPE, Merges, Vocab};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, Tokenizer};

use crate::error::{ModelError, ModelResult, io_error, metadata};

/// Llama 3's pre-tokenizer split (contractions, letters, 1–3 digits, punctuation, newlines,
/// spaces), as its `tokenizer.json` writes it.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen2's: Llama 3's with single digits.
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The pre-tokenizer a GGUF's `tokenizer.ggml.pre` names (byte-level BPE models); another
/// name is refused rather than tokenized with the wrong split.
pub(crate) fn pre_tokenizer(name: &str) -> ModelResult<PreTokenizerWrapper> {
    // Untrimmed offsets: a token's byte range covers its leading space.
    let byte_level = |regex: bool| ByteLevel::new(false, false, regex);
    let split = |pattern: &str| -> ModelResult<PreTokenizerWrapper> {
        Ok(Split::new(
            SplitPattern::Regex(pattern.to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(tok_err)?
        .into())
    };
    Ok(match name {
        // SmolLM's: each digit alone, then GPT-2's split.
        "smollm" => Sequence::new(vec![Digits::new(true).into(), byte_level(true).into()]).into(),
        "gpt2" | "default" => byte_level(true).into(),
        "llama3" | "llama-bpe" | "llama-v3" => {
            Sequence::new(vec![split(LLAMA3_SPLIT)?, byte_level(false).into()]).into()
        }
        "qwen2" => Sequence::new(vec![split(QWEN2_SPLIT)?, byte_level(false).into()]).into(),
        other => {
            return Err(ModelError::Tokenizer {
                reason: format!(
                    "GGUF pre-tokenizer `{other}` (tokenizer.ggml.pre) is not supported \
                     (smollm, gpt2, default, llama-bpe, qwen2); add a tokenizer.json beside \
                     the model"
                ),
            });
        }
    })
}

/// A GGUF's chat template and its BOS and EOS token texts.
fn gguf_template(ct: &Content) -> (Option<String>, String, String) {
    let template = match ct.metadata.get("tokenizer.chat_template") {
        Some(Value::String(s)) => Some(s.clone()),
        _ => None,
    };
    let token = |key: &str| -> String {
        let id = crate::gguf::md_usize(ct, key).ok();
        match (id, ct.metadata.get("tokenizer.ggml.tokens")) {
            (Some(id), Some(Value::Array(items))) => match items.get(id) {
                Some(Value::String(s)) => s.clone(),
                _ => String::new(),
            },
            _ => String::new(),
        }
    };
    (
        template,
        token("tokenizer.ggml.bos_token_id"),
        token("tokenizer.ggml.eos_token_id"),
    )
}

/// `tokenizer_config.json`'s chat template (a string, or the entry named `default` of a list)
/// and its BOS and EOS texts (strings or `{"content": …}`); nothing when there is no file.
fn config_template(path: &Path) -> ModelResult<(Option<String>, String, String)> {
    if !path.is_file() {
        return Ok((None, String::new(), String::new()));
    }
    let text = std::fs::read_to_string(path).map_err(io_error(path))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| ModelError::Tokenizer {
        reason: format!("{}: {e}", path.display()),
    })?;
    let template = match &v["chat_template"] {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Array(list) => list
            .iter()
            .find(|t| t["name"] == "default")
            .or_else(|| list.first())
            .and_then(|t| t["template"].as_str())
            .map(str::to_string),
        _ => None,
    };
    let token = |key: &str| -> String {
        match &v[key] {
            serde_json::Value::String(s) => s.clone(),
            other => other["content"].as_str().unwrap_or_default().to_string(),
        }
    };
    Ok((template, token("bos_token"), token("eos_token")))
}

/// A token's `start..end` byte range in the text it came from.
pub type ByteSpan = (usize, usize);

/// A tokenizer plus the ids generation stops at and the model's message framing.
#[derive(Debug, Clone)]
pub struct TextTokenizer {
    /// Shared by the clones (the engine thread's and the server's): a 151K-token vocabulary
    /// and its merges are tens of MB.
    inner: Arc<Tokenizer>,
    stop_ids: Vec<u32>,
    format: Arc<ChatFormat>,
    /// Prepended to a text by the callers that frame whole texts (see [`Self::bos`]).
    bos: Option<u32>,
    /// The model's chat template, when its pieces frame the prompt (for its tool branch).
    template: Option<Arc<crate::chat_template::Template>>,
}

fn tok_err(e: impl std::fmt::Display) -> ModelError {
    ModelError::Tokenizer {
        reason: e.to_string(),
    }
}

/// GGUF token types that are special (control and user-defined).
const SPECIAL_TOKEN_TYPES: [i32; 2] = [3, 4];

/// `tokenizer.ggml.token_type` (all normal, type 1, when absent).
fn token_types(ct: &Content, n: usize) -> Vec<i32> {
    match ct.metadata.get("tokenizer.ggml.token_type") {
        Some(Value::Array(items)) => items.iter().map(|v| v.to_i32().unwrap_or(1)).collect(),
        _ => vec![1; n],
    }
}

/// Registers the pieces of the special types ([`SPECIAL_TOKEN_TYPES`]) as special tokens.
fn add_special_tokens(inner: &mut Tokenizer, tokens: &[String], types: &[i32]) -> ModelResult<()> {
    let special: Vec<AddedToken> = tokens
        .iter()
        .zip(types)
        .filter(|(_, t)| SPECIAL_TOKEN_TYPES.contains(t))
        .map(|(s, _)| AddedToken::from(s.clone(), true))
        .collect();
    inner.add_special_tokens(special).map_err(tok_err)?;
    Ok(())
}

impl TextTokenizer {
    /// The tokenizer for a model path: `tokenizer.json` inside a directory, a `tokenizer.json`
    /// beside a GGUF file, else the GGUF metadata.
    ///
    /// The chat template comes from the GGUF metadata (`tokenizer.chat_template`) or the
    /// directory's `tokenizer_config.json`; a model without one, or whose template cannot be
    /// split into per-message pieces (logged as a warning), is framed with ChatML.
    pub fn for_model(path: &Path) -> ModelResult<Self> {
        let beside = if path.is_dir() {
            path.join("tokenizer.json")
        } else {
            path.with_file_name("tokenizer.json")
        };
        let gguf = if path.is_dir() {
            None
        } else {
            let mut f = BufReader::new(File::open(path).map_err(io_error(path))?);
            Some(Content::read(&mut f)?)
        };
        let mut me = match &gguf {
            Some(ct) if !beside.is_file() => Self::from_gguf_content(ct)?,
            _ => Self::from_json_file(&beside)?,
        };
        let (mut template, bos, eos) = match &gguf {
            Some(ct) => gguf_template(ct),
            None => config_template(&path.join("tokenizer_config.json"))?,
        };
        if template.is_none()
            && let Some(ct) = &gguf
            && let Ok(name) = crate::gguf::md_string(ct, "general.architecture")
            && let Ok(arch) = crate::arch::Arch::by_gguf(&name)
        {
            template = arch.fallback_template.map(str::to_string);
        }
        let (format, why) = crate::chat_template::format_for(template.as_deref(), &bos, &eos);
        if let Some(why) = why {
            tracing::warn!("{}: {why}; messages are framed with ChatML", path.display());
        }
        if format.source == engram_context::FormatSource::Model
            && let Some(source) = &template
        {
            me.template = crate::chat_template::Template::new(source, &bos, &eos)
                .ok()
                .map(Arc::new);
        }
        me.format = Arc::new(format);
        Ok(me)
    }

    /// How the model frames messages.
    pub fn chat_format(&self) -> &ChatFormat {
        &self.format
    }

    /// Reads a Hugging Face `tokenizer.json`.
    pub fn from_json_file(path: &Path) -> ModelResult<Self> {
        if !path.is_file() {
            return Err(ModelError::Io {
                path: path.to_path_buf(),
                source: std::io::Error::from(std::io::ErrorKind::NotFound),
            });
        }
        let inner = Tokenizer::from_file(path).map_err(tok_err)?;
        Ok(Self::with_stops(inner))
    }

    /// Builds the tokenizer from a GGUF file's metadata.
    pub fn from_gguf(path: &Path) -> ModelResult<Self> {
        let mut f = BufReader::new(File::open(path).map_err(io_error(path))?);
        let ct = Content::read(&mut f)?;
        Self::from_gguf_content(&ct)
    }

    fn from_gguf_content(ct: &Content) -> ModelResult<Self> {
        let strings = |key: &str| -> ModelResult<Vec<String>> {
            match ct.metadata.get(key) {
                Some(Value::Array(items)) => items
                    .iter()
                    .map(|v| match v {
                        Value::String(s) => Ok(s.clone()),
                        _ => Err(metadata(key)),
                    })
                    .collect(),
                _ => Err(metadata(key)),
            }
        };
        let model = crate::gguf::md_string(ct, "tokenizer.ggml.model")?;
        if model == "llama" {
            return Self::sentencepiece(ct, &strings("tokenizer.ggml.tokens")?);
        }
        if model != "gpt2" {
            return Err(ModelError::Tokenizer {
                reason: format!(
                    "GGUF tokenizer model `{model}` (byte-level BPE `gpt2` and SentencePiece \
                     `llama` are supported)"
                ),
            });
        }
        let tokens = strings("tokenizer.ggml.tokens")?;
        let merges: Merges = strings("tokenizer.ggml.merges")?
            .into_iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| metadata("tokenizer.ggml.merges"))
            })
            .collect::<ModelResult<_>>()?;
        let types = token_types(ct, tokens.len());
        let vocab: Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(tok_err)?;
        let mut inner = Tokenizer::new(bpe);
        let pre = match ct.metadata.get("tokenizer.ggml.pre") {
            Some(Value::String(s)) => s.as_str(),
            _ => "default",
        };
        inner.with_pre_tokenizer(Some(pre_tokenizer(pre)?));
        inner.with_decoder(Some(ByteLevelDecoder::default()));
        add_special_tokens(&mut inner, &tokens, &types)?;
        let mut me = Self::with_stops(inner);
        if let Ok(eos) = crate::gguf::md_usize(ct, "tokenizer.ggml.eos_token_id") {
            let eos = eos as u32;
            if !me.stop_ids.contains(&eos) {
                me.stop_ids.push(eos);
            }
        }
        Ok(me)
    }

    /// A SentencePiece model as GGUF stores it (`tokenizer.ggml.model = llama`: pieces with
    /// `▁` for spaces, their scores, byte pieces `<0xNN>`): a BPE whose merges are every split
    /// of a piece into two pieces, ranked by the whole piece's score (highest first, as
    /// SentencePiece's and llama.cpp's merging picks the best-scoring pair), with byte fallback;
    /// spaces become `▁` (and one is prepended when `add_space_prefix` says so); control and
    /// user-defined pieces are special tokens. The BOS is prepended by [`Self::bos`]'s users.
    fn sentencepiece(ct: &Content, tokens: &[String]) -> ModelResult<Self> {
        let n = tokens.len();
        let scores: Vec<f32> = match ct.metadata.get("tokenizer.ggml.scores") {
            Some(Value::Array(items)) => items.iter().map(|v| v.to_f32().unwrap_or(0.0)).collect(),
            _ => return Err(metadata("tokenizer.ggml.scores")),
        };
        let types = token_types(ct, n);
        if scores.len() != n || types.len() != n {
            return Err(metadata("tokenizer.ggml.scores"));
        }
        // Type 1 is a normal piece, 6 a byte; only those take part in merges.
        let mergeable = |i: usize| types[i] == 1 || types[i] == 6;
        let vocab: Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let mut ranked: Vec<(f32, u32, u32, u32)> = Vec::new();
        for (i, piece) in tokens.iter().enumerate() {
            if !mergeable(i) || piece.chars().nth(1).is_none() {
                continue;
            }
            for (k, _) in piece.char_indices().skip(1) {
                let (a, b) = (&piece[..k], &piece[k..]);
                if let (Some(&ia), Some(&ib)) = (vocab.get(a), vocab.get(b))
                    && mergeable(ia as usize)
                    && mergeable(ib as usize)
                {
                    ranked.push((scores[i], i as u32, ia, ib));
                }
            }
        }
        // Highest score first; for one piece, the split with the better-ranked left part.
        ranked.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)).then(x.2.cmp(&y.2)));
        let merges: Merges = ranked
            .iter()
            .map(|&(_, _, a, b)| (tokens[a as usize].clone(), tokens[b as usize].clone()))
            .collect();
        let mut builder = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .byte_fallback(true)
            .fuse_unk(true);
        if let Ok(unk) = crate::gguf::md_usize(ct, "tokenizer.ggml.unknown_token_id")
            && let Some(t) = tokens.get(unk)
        {
            builder = builder.unk_token(t.clone());
        }
        let mut inner = Tokenizer::new(builder.build().map_err(tok_err)?);
        let space =
            tokenizers::normalizers::replace::Replace::new(" ", "\u{2581}").map_err(tok_err)?;
        let prefix = matches!(
            ct.metadata.get("tokenizer.ggml.add_space_prefix"),
            Some(Value::Bool(true))
        );
        let normalizer: tokenizers::NormalizerWrapper = if prefix {
            tokenizers::normalizers::Sequence::new(vec![
                tokenizers::normalizers::prepend::Prepend::new("\u{2581}".into()).into(),
                space.into(),
            ])
            .into()
        } else {
            space.into()
        };
        inner.with_normalizer(Some(normalizer)).map_err(tok_err)?;
        let unspace =
            tokenizers::normalizers::replace::Replace::new("\u{2581}", " ").map_err(tok_err)?;
        inner.with_decoder(Some(tokenizers::decoders::sequence::Sequence::new(vec![
            tokenizers::DecoderWrapper::Replace(unspace),
            tokenizers::decoders::byte_fallback::ByteFallback::new().into(),
            tokenizers::decoders::fuse::Fuse::new().into(),
        ])));
        add_special_tokens(&mut inner, tokens, &types)?;
        let mut me = Self::with_stops(inner);
        // Only the model's own ends: ChatML's names are ordinary pieces here (Gemma's `</s>` is
        // an HTML tag).
        me.stop_ids.clear();
        for key in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"] {
            if let Ok(id) = crate::gguf::md_usize(ct, key)
                && !me.stop_ids.contains(&(id as u32))
            {
                me.stop_ids.push(id as u32);
            }
        }
        if let Some(id) = me.inner.token_to_id("<end_of_turn>")
            && !me.stop_ids.contains(&id)
        {
            me.stop_ids.push(id);
        }
        if matches!(
            ct.metadata.get("tokenizer.ggml.add_bos_token"),
            Some(Value::Bool(true))
        ) {
            me.bos = crate::gguf::md_usize(ct, "tokenizer.ggml.bos_token_id")
                .ok()
                .map(|id| id as u32);
        }
        Ok(me)
    }

    /// The id a model's text starts with when its tokenizer says to add one (SentencePiece
    /// models such as Gemma: `<bos>`); `None` when the template or nothing adds it.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    fn with_stops(inner: Tokenizer) -> Self {
        let stop_ids = ["<|im_end|>", "<|endoftext|>", "</s>", "<|eot_id|>"]
            .iter()
            .filter_map(|t| inner.token_to_id(t))
            .collect();
        Self {
            inner: Arc::new(inner),
            stop_ids,
            format: Arc::new(ChatFormat::chatml()),
            bos: None,
            template: None,
        }
    }

    /// Token ids of `text`; special tokens written in the text (`<|im_start|>`) are recognized.
    pub fn encode(&self, text: &str) -> ModelResult<Vec<u32>> {
        Ok(self.encode_with_offsets(text)?.0)
    }

    /// Token ids of `text` and each token's byte range in it.
    pub fn encode_with_offsets(&self, text: &str) -> ModelResult<(Vec<u32>, Vec<ByteSpan>)> {
        let enc = self.inner.encode(text, false).map_err(tok_err)?;
        Ok((enc.get_ids().to_vec(), enc.get_offsets().to_vec()))
    }

    /// Text of `ids`, special tokens included.
    pub fn decode(&self, ids: &[u32]) -> ModelResult<String> {
        self.inner.decode(ids, false).map_err(tok_err)
    }

    /// Ids that end generation (`<|im_end|>`, `<|endoftext|>`, the GGUF EOS).
    pub fn stop_ids(&self) -> &[u32] {
        &self.stop_ids
    }

    /// Vocabulary size, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// What the model's own chat template adds to the system message for `tools` (OpenAI tool
    /// definitions), when it has a tool branch; `None` otherwise (the caller then writes the
    /// tools in the generic form).
    pub fn tools_suffix(&self, tools: &[serde_json::Value]) -> Option<String> {
        let t = self.template.as_ref()?;
        match t.tools_suffix(tools, &self.format.system.post) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("the chat template's tool branch does not render: {e}");
                None
            }
        }
    }

    /// The tokenizer as a Hugging Face `tokenizer.json` text.
    pub fn to_json(&self) -> ModelResult<String> {
        self.inner.to_string(false).map_err(tok_err)
    }

    /// Writes the tokenizer as a Hugging Face `tokenizer.json`.
    pub fn save_json(&self, path: &Path) -> ModelResult<()> {
        self.inner.save(path, false).map_err(tok_err)
    }
}

/// Who speaks a chat message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// The system prompt.
    System,
    /// The user.
    User,
    /// The model.
    Assistant,
}

impl Role {
    fn frame(self) -> engram_context::FrameRole {
        match self {
            Self::System => engram_context::FrameRole::System,
            Self::User => engram_context::FrameRole::User,
            Self::Assistant => engram_context::FrameRole::Assistant,
        }
    }
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    /// The speaker.
    pub role: Role,
    /// The text.
    pub content: String,
}

impl ChatMessage {
    /// A message.
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        Self {
            role,
            content: content.into(),
        }
    }
}

/// ChatML: `<|im_start|>{role}\n{content}<|im_end|>\n` per message, then
/// `<|im_start|>assistant\n` when a reply is to be generated.
pub fn chatml(messages: &[ChatMessage], add_generation_prompt: bool) -> String {
    let framed: Vec<(engram_context::FrameRole, &str)> = messages
        .iter()
        .map(|m| (m.role.frame(), m.content.as_str()))
        .collect();
    engram_context::CHATML.render(&framed, add_generation_prompt)
}

/// Turns a growing list of generated ids into text pieces, holding back bytes of a character
/// that is not complete yet.
///
/// Incremental: each push decodes a short window — the ids since the last emitted piece and
/// the piece before them — not every id so far, so a reply of n tokens costs O(n) decoding,
/// not O(n²). The window starts where a previous piece ended (a character boundary), and the
/// new text is what decoding the whole window adds to decoding its emitted part, so decoders
/// that treat a sequence's first token specially (a leading space) apply it to both alike.
/// Should a decoder ever not extend its own prefix, the piece comes from decoding every id.
#[derive(Debug, Clone, Default)]
pub struct StreamDecoder {
    ids: Vec<u32>,
    /// The window: `ids[start..]`; `ids[start..read]` is emitted already.
    start: usize,
    read: usize,
    /// `decode(ids[start..read])`.
    prefix: String,
    /// Bytes emitted in all.
    emitted: usize,
}

impl StreamDecoder {
    /// Adds one id; returns the new complete text, if any.
    pub fn push(&mut self, tok: &TextTokenizer, id: u32) -> ModelResult<String> {
        self.ids.push(id);
        let window = tok.decode(&self.ids[self.start..])?;
        if window.ends_with('\u{FFFD}') || window.len() <= self.prefix.len() {
            return Ok(String::new());
        }
        let piece = self.after_prefix(tok, &window)?;
        self.start = self.read;
        self.read = self.ids.len();
        self.prefix = tok.decode(&self.ids[self.start..self.read])?;
        Ok(piece)
    }

    /// At the end of a generation: the text held back so far (an incomplete UTF-8 sequence,
    /// decoded lossily), so that everything streamed equals the decode of every id.
    pub fn flush(&mut self, tok: &TextTokenizer) -> ModelResult<String> {
        let window = tok.decode(&self.ids[self.start..])?;
        let piece = self.after_prefix(tok, &window)?;
        self.start = self.ids.len();
        self.read = self.ids.len();
        self.prefix.clear();
        Ok(piece)
    }

    /// What `window` (the decode of `ids[start..]`) adds to the emitted prefix — or, should it
    /// not extend it, what the decode of every id adds to everything emitted; counted emitted.
    fn after_prefix(&mut self, tok: &TextTokenizer, window: &str) -> ModelResult<String> {
        let piece = match window.strip_prefix(self.prefix.as_str()) {
            Some(new) => new.to_string(),
            None => {
                let all = tok.decode(&self.ids)?;
                all.get(self.emitted..).unwrap_or_default().to_string()
            }
        };
        self.emitted += piece.len();
        Ok(piece)
    }

    /// Ids the next push decodes, less the new one: what a step costs, bounded by how many
    /// ids one character or one emitted piece spans, not by the reply's length.
    pub fn window(&self) -> usize {
        self.ids.len() - self.start
    }

    /// All text so far.
    pub fn text(&self, tok: &TextTokenizer) -> ModelResult<String> {
        tok.decode(&self.ids)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

    /// The digit pieces `name`'s pre-tokenizer cuts `text` into.
    fn digit_pieces(name: &str, text: &str) -> Vec<String> {
        let pre = pre_tokenizer(name).unwrap();
        let mut s = PreTokenizedString::from(text);
        pre.pre_tokenize(&mut s).unwrap();
        s.get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .map(|(p, _, _)| p.trim_start_matches('Ġ').to_string())
            .filter(|p| p.bytes().any(|b| b.is_ascii_digit()))
            .collect()
    }

    #[test]
    fn tokenizer_ggml_pre_picks_the_model_s_split_and_an_unknown_one_is_refused() {
        let text = "year 12345";
        assert_eq!(digit_pieces("smollm", text), ["1", "2", "3", "4", "5"]);
        assert_eq!(digit_pieces("llama-bpe", text), ["123", "45"]);
        assert_eq!(digit_pieces("qwen2", text), ["1", "2", "3", "4", "5"]);
        assert_eq!(digit_pieces("gpt2", text), ["12345"]);
        let err = pre_tokenizer("deepseek-llm").unwrap_err().to_string();
        assert!(
            err.contains("`deepseek-llm`") && err.contains("not supported"),
            "{err}"
        );
    }
}
