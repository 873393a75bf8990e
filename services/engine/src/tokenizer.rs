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

use candle_core::quantized::gguf_file::{Content, Value};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BPE, Merges, Vocab};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, Tokenizer};

use crate::error::{EngineError, EngineResult, io_error, metadata};

/// A token's `start..end` byte range in the text it came from.
pub type ByteSpan = (usize, usize);

/// A tokenizer plus the ids generation stops at.
#[derive(Debug, Clone)]
pub struct TextTokenizer {
    inner: Tokenizer,
    stop_ids: Vec<u32>,
}

fn tok_err(e: impl std::fmt::Display) -> EngineError {
    EngineError::Tokenizer {
        reason: e.to_string(),
    }
}

/// GGUF token types that are special (control and user-defined).
const SPECIAL_TOKEN_TYPES: [i32; 2] = [3, 4];

impl TextTokenizer {
    /// The tokenizer for a model path: `tokenizer.json` inside a directory, a `tokenizer.json`
    /// beside a GGUF file, else the GGUF metadata.
    pub fn for_model(path: &Path) -> EngineResult<Self> {
        let beside = if path.is_dir() {
            path.join("tokenizer.json")
        } else {
            path.with_file_name("tokenizer.json")
        };
        if beside.is_file() || path.is_dir() {
            Self::from_json_file(&beside)
        } else {
            Self::from_gguf(path)
        }
    }

    /// Reads a Hugging Face `tokenizer.json`.
    pub fn from_json_file(path: &Path) -> EngineResult<Self> {
        if !path.is_file() {
            return Err(EngineError::Io {
                path: path.to_path_buf(),
                source: std::io::Error::from(std::io::ErrorKind::NotFound),
            });
        }
        let inner = Tokenizer::from_file(path).map_err(tok_err)?;
        Ok(Self::with_stops(inner))
    }

    /// Builds the tokenizer from a GGUF file's metadata.
    pub fn from_gguf(path: &Path) -> EngineResult<Self> {
        let mut f = BufReader::new(File::open(path).map_err(io_error(path))?);
        let ct = Content::read(&mut f)?;
        Self::from_gguf_content(&ct)
    }

    fn from_gguf_content(ct: &Content) -> EngineResult<Self> {
        let strings = |key: &str| -> EngineResult<Vec<String>> {
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
        if model != "gpt2" {
            return Err(EngineError::Tokenizer {
                reason: format!("GGUF tokenizer model `{model}` (only byte-level BPE `gpt2`)"),
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
            .collect::<EngineResult<_>>()?;
        let types: Vec<i32> = match ct.metadata.get("tokenizer.ggml.token_type") {
            Some(Value::Array(items)) => items.iter().map(|v| v.to_i32().unwrap_or(1)).collect(),
            _ => vec![1; tokens.len()],
        };
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
        inner.with_pre_tokenizer(Some(Sequence::new(vec![
            Digits::new(true).into(),
            // Untrimmed offsets: a token's byte range covers its leading space.
            ByteLevel::new(false, false, true).into(),
        ])));
        inner.with_decoder(Some(ByteLevelDecoder::default()));
        let special: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, t)| SPECIAL_TOKEN_TYPES.contains(t))
            .map(|(s, _)| AddedToken::from(s.clone(), true))
            .collect();
        inner.add_special_tokens(special).map_err(tok_err)?;
        let mut me = Self::with_stops(inner);
        if let Ok(eos) = crate::gguf::md_usize(ct, "tokenizer.ggml.eos_token_id") {
            let eos = eos as u32;
            if !me.stop_ids.contains(&eos) {
                me.stop_ids.push(eos);
            }
        }
        Ok(me)
    }

    fn with_stops(inner: Tokenizer) -> Self {
        let stop_ids = ["<|im_end|>", "<|endoftext|>", "</s>", "<|eot_id|>"]
            .iter()
            .filter_map(|t| inner.token_to_id(t))
            .collect();
        Self { inner, stop_ids }
    }

    /// Token ids of `text`; special tokens written in the text (`<|im_start|>`) are recognized.
    pub fn encode(&self, text: &str) -> EngineResult<Vec<u32>> {
        Ok(self.encode_with_offsets(text)?.0)
    }

    /// Token ids of `text` and each token's byte range in it.
    pub fn encode_with_offsets(&self, text: &str) -> EngineResult<(Vec<u32>, Vec<ByteSpan>)> {
        let enc = self.inner.encode(text, false).map_err(tok_err)?;
        Ok((enc.get_ids().to_vec(), enc.get_offsets().to_vec()))
    }

    /// Text of `ids`, special tokens included.
    pub fn decode(&self, ids: &[u32]) -> EngineResult<String> {
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

    /// Writes the tokenizer as a Hugging Face `tokenizer.json`.
    pub fn save_json(&self, path: &Path) -> EngineResult<()> {
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
    fn as_str(self) -> &'static str {
        match self {
            Self::System => "system",
            Self::User => "user",
            Self::Assistant => "assistant",
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
    let mut s = String::new();
    for m in messages {
        s.push_str("<|im_start|>");
        s.push_str(m.role.as_str());
        s.push('\n');
        s.push_str(&m.content);
        s.push_str("<|im_end|>\n");
    }
    if add_generation_prompt {
        s.push_str("<|im_start|>assistant\n");
    }
    s
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
    pub fn push(&mut self, tok: &TextTokenizer, id: u32) -> EngineResult<String> {
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
    pub fn flush(&mut self, tok: &TextTokenizer) -> EngineResult<String> {
        let window = tok.decode(&self.ids[self.start..])?;
        let piece = self.after_prefix(tok, &window)?;
        self.start = self.ids.len();
        self.read = self.ids.len();
        self.prefix.clear();
        Ok(piece)
    }

    /// What `window` (the decode of `ids[start..]`) adds to the emitted prefix — or, should it
    /// not extend it, what the decode of every id adds to everything emitted; counted emitted.
    fn after_prefix(&mut self, tok: &TextTokenizer, window: &str) -> EngineResult<String> {
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
    pub fn text(&self, tok: &TextTokenizer) -> EngineResult<String> {
        tok.decode(&self.ids)
    }
}
