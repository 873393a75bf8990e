//! Constrained decoding: what a sequence may generate, as a grammar whose token masks the
//! engine's sampler applies ([`engram_engine::Constraint`]).
//!
//! The grammar engine is llguidance (the one llama.cpp, vLLM and SGLang use): a JSON schema,
//! or a Lark grammar that embeds JSON schemas, is compiled against the model's vocabulary, and
//! each step's mask says which tokens keep the text a prefix of the language. Built here:
//! - [`Grammars::json_schema`] (OpenAI `response_format: json_schema`) and
//!   [`Grammars::json_object`] (`json_object`: any object);
//! - [`Grammars::tool_calls`]: one call (or, with `parallel`, one or more) of the offered
//!   functions in the model's tool-call syntax (`<tool_call>\n{"name": …, "arguments": …}\n
//!   </tool_call>`), the arguments held to each function's parameter schema; a tag the
//!   vocabulary has as one special token (Qwen2.5's) is that token, as the model writes it.
//!
//! JSON is generated in one compact form (`", "` and `": "` separators, no other whitespace):
//! a small model cannot then spend its tokens on whitespace, and the text parses.
//!
//! The vocabulary's bytes come from the tokenizer's `tokenizer.json` form (byte-level BPE or
//! SentencePiece with byte fallback); rows of the model's logits past the tokenizer's
//! vocabulary (padding) are never allowed.

use std::sync::Arc;

use engram_engine::Constraint;
use engram_model::TextTokenizer;
use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::{Value, json};
use toktrie::{InferenceCapabilities, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

/// Why a constraint could not be built.
#[derive(Debug, Clone, thiserror::Error)]
pub enum GrammarError {
    /// The tokenizer's vocabulary could not be turned into bytes.
    #[error("the model's vocabulary cannot be used for constrained decoding: {0}")]
    Vocabulary(String),
    /// The schema or grammar is invalid (or unsatisfiable).
    #[error("invalid schema: {0}")]
    Schema(String),
}

/// The vocabulary as llguidance sees it: the token trie and our tokenizer.
struct Vocabulary {
    trie: TokTrie,
    tokenizer: TextTokenizer,
}

impl TokenizerEnv for Vocabulary {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        let text = String::from_utf8_lossy(s);
        self.tokenizer.encode(&text).unwrap_or_default()
    }
}

/// The bytes of every token of `tokenizer`, `rows` of them (the model's logits row; tokens
/// past the tokenizer's are empty and never allowed).
fn token_bytes(tokenizer: &TextTokenizer, rows: usize) -> Result<Vec<Vec<u8>>, GrammarError> {
    let bad = |e: String| GrammarError::Vocabulary(e);
    let text = tokenizer.to_json().map_err(|e| bad(e.to_string()))?;
    let json: Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    // llguidance asserts on vocabularies it does not expect: a refusal, not a crash.
    let words = std::panic::catch_unwind(|| {
        llguidance::token_bytes_from_tokenizer_json(&json).map_err(|e| e.to_string())
    })
    .map_err(|_| bad("the vocabulary's form is not one llguidance reads".into()))?
    .map_err(bad)?;
    if words.len() > rows {
        return Err(bad(format!(
            "the tokenizer has {} tokens, the model's logits {rows}",
            words.len()
        )));
    }
    let mut words = words;
    words.resize(rows, Vec::new());
    Ok(words)
}

/// What every constraint of one model shares: the vocabulary compiled once.
pub struct Grammars {
    factory: ParserFactory,
    rows: usize,
    tokenizer: TextTokenizer,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars")
            .field("rows", &self.rows)
            .finish_non_exhaustive()
    }
}

/// A function a tool call may name, and its parameters' JSON schema.
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    /// The function's name.
    pub name: String,
    /// Its `parameters` schema (an object schema; `{}` allows any object).
    pub parameters: Value,
}

/// Options every generated JSON value is compiled with (see the module docs).
fn compact() -> Value {
    json!({
        "whitespace_flexible": false,
        "item_separator": ", ",
        "key_separator": ": ",
        "lenient": true,
    })
}

/// `schema` with the compact options, as an object schema (`true` or `{}` allow any value).
fn with_options(schema: &Value) -> Result<Value, GrammarError> {
    let mut s = match schema {
        Value::Object(o) => Value::Object(o.clone()),
        Value::Bool(true) => json!({}),
        _ => {
            return Err(GrammarError::Schema(
                "a schema must be a JSON object".into(),
            ));
        }
    };
    s["x-guidance"] = compact();
    Ok(s)
}

/// A Lark string literal of `text`.
fn lark_literal(text: &str) -> String {
    serde_json::to_string(text).unwrap_or_else(|_| "\"\"".into())
}

impl Grammars {
    /// Compiles the vocabulary of `tokenizer` for a model whose logits have `rows` entries;
    /// the tokenizer's first stop id is the end of a constrained answer.
    pub fn new(tokenizer: &TextTokenizer, rows: usize) -> Result<Self, GrammarError> {
        let words = token_bytes(tokenizer, rows)?;
        let eos =
            tokenizer.stop_ids().first().copied().ok_or_else(|| {
                GrammarError::Vocabulary("the tokenizer has no stop token".into())
            })?;
        let rows32 = u32::try_from(rows).map_err(|_| {
            GrammarError::Vocabulary(format!("{rows} tokens do not fit a 32-bit id"))
        })?;
        let trie = TokTrie::from(&TokRxInfo::new(rows32, eos), &words)
            .with_eos_tokens(tokenizer.stop_ids());
        let env: TokEnv = Arc::new(Vocabulary {
            trie,
            tokenizer: tokenizer.clone(),
        });
        let mut factory = ParserFactory::new(
            &env,
            InferenceCapabilities::default(),
            &llguidance::earley::SlicedBiasComputer::general_slices(),
        )
        .map_err(|e| GrammarError::Vocabulary(e.to_string()))?;
        factory.quiet();
        Ok(Self {
            factory,
            rows,
            tokenizer: tokenizer.clone(),
        })
    }

    fn build(&self, grammar: TopLevelGrammar) -> Result<Guided, GrammarError> {
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| GrammarError::Schema(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(GrammarError::Schema(e));
        }
        Ok(Guided {
            matcher,
            rows: self.rows,
        })
    }

    /// Any JSON object (OpenAI's `json_object`).
    pub fn json_object(&self) -> Result<Guided, GrammarError> {
        self.json_schema(&json!({"type": "object"}))
    }

    /// A JSON value that validates against `schema` (OpenAI's `json_schema`).
    pub fn json_schema(&self, schema: &Value) -> Result<Guided, GrammarError> {
        self.build(TopLevelGrammar::from_json_schema(with_options(schema)?))
    }

    /// A tag of the tool-call syntax as a Lark sequence: its newlines as text, the tag itself as
    /// its token when the vocabulary has it as one special token (Qwen2.5's `<tool_call>`: the
    /// model writes the token, never the characters), else as text.
    fn lark_tag(&self, tag: &str) -> String {
        let core = tag.trim_matches('\n');
        let Some(at) = tag.find(core).filter(|_| !core.is_empty()) else {
            return lark_literal(tag);
        };
        let (lead, trail) = (&tag[..at], &tag[at + core.len()..]);
        let ids = self.tokenizer.encode(core).unwrap_or_default();
        let trie = self.factory.tok_env().tok_trie();
        let core = match ids.as_slice() {
            [id] if trie.is_special_token(*id) => format!("<[{id}]>"),
            _ => lark_literal(core),
        };
        [lead, "", trail]
            .iter()
            .enumerate()
            .filter_map(|(i, p)| match i {
                1 => Some(core.clone()),
                _ if p.is_empty() => None,
                _ => Some(lark_literal(p)),
            })
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// Calls of `tools` between `open` and `close` (the model's tool-call tags), one, or with
    /// `parallel` one or more separated by newlines: each a JSON object of a function's `name`
    /// and `arguments` that validate against its parameters.
    pub fn tool_calls(
        &self,
        tools: &[Tool],
        parallel: bool,
        open: &str,
        close: &str,
    ) -> Result<Guided, GrammarError> {
        if tools.is_empty() {
            return Err(GrammarError::Schema("no function to call".into()));
        }
        let calls: Vec<Value> = tools
            .iter()
            .map(|t| {
                let params = match &t.parameters {
                    Value::Null => json!({"type": "object"}),
                    Value::Object(_) => t.parameters.clone(),
                    _ => {
                        return Err(GrammarError::Schema(format!(
                            "the parameters of `{}` must be a JSON schema object",
                            t.name
                        )));
                    }
                };
                Ok(json!({
                    "type": "object",
                    "properties": {"name": {"const": t.name}, "arguments": params},
                    "required": ["name", "arguments"],
                    "additionalProperties": false,
                }))
            })
            .collect::<Result<_, _>>()?;
        let call = if calls.len() == 1 {
            calls.into_iter().next().unwrap_or_default()
        } else {
            json!({"anyOf": calls})
        };
        let schema = with_options(&call)?;
        let body =
            serde_json::to_string(&schema).map_err(|e| GrammarError::Schema(e.to_string()))?;
        let repeat = if parallel { " (\"\\n\" call)*" } else { "" };
        let lark = format!(
            "start: call{repeat}\ncall: {} %json {body} {}\n",
            self.lark_tag(open),
            self.lark_tag(close),
        );
        self.build(TopLevelGrammar::from_lark(lark))
    }
}

/// One sequence's constraint: llguidance's matcher over the grammar.
pub struct Guided {
    matcher: Matcher,
    rows: usize,
}

impl Guided {
    /// Whether `text`'s tokens (as `tokens`) are accepted, leaving the grammar complete: a test
    /// of the grammar without a model.
    pub fn accepts(&mut self, tokens: &[u32]) -> Result<bool, String> {
        for &t in tokens {
            if self.matcher.is_stopped() {
                // Complete before the tokens ran out: more than the grammar allows.
                return Ok(false);
            }
            let mask = self.matcher.compute_mask().map_err(|e| e.to_string())?;
            if !mask.is_allowed(t) {
                return Ok(false);
            }
            self.matcher.consume_token(t).map_err(|e| e.to_string())?;
        }
        if let Some(e) = self.matcher.get_error() {
            return Err(e);
        }
        Ok(self.matcher.is_stopped() || self.matcher.is_accepting().map_err(|e| e.to_string())?)
    }
}

impl Constraint for Guided {
    fn mask(&mut self, logits: &mut [f32]) -> Result<(), String> {
        let mask = self.matcher.compute_mask().map_err(|e| e.to_string())?;
        let n = self.rows.min(logits.len());
        for (i, l) in logits.iter_mut().enumerate().take(n) {
            if !mask.is_allowed(i as u32) {
                *l = f32::NEG_INFINITY;
            }
        }
        for l in logits.iter_mut().skip(n) {
            *l = f32::NEG_INFINITY;
        }
        Ok(())
    }

    fn commit(&mut self, token: u32) -> Result<(), String> {
        self.matcher.consume_token(token).map_err(|e| e.to_string())
    }

    fn finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}

/// A bounded JSON schema (an object of a string, an integer and a list, each bounded so that an
/// object ends): what `mask_cost` and `engram-bench ttft` constrain decoding to.
pub fn example_schema() -> Value {
    serde_json::json!({
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 24},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}
        },
        "required": ["city", "days", "tags"],
        "additionalProperties": false
    })
}
