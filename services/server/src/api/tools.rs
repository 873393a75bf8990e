//! Tool calling and structured output on the OpenAI routes: the tool definitions as the model's
//! own template writes them into the system message (a generic form for a template without a
//! tool branch), the calls parsed out of the reply, and the grammar a call or an answer is held
//! to (`engram-grammar`).
//!
//! The call syntax is the one Qwen2.5 (and Hermes-style templates) use, and the generic form
//! asks for: `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`, one block per call.
//! - `tool_choice: "auto"` (the default with tools): the reply is free; the blocks in it are
//!   the calls, the text before them the content.
//! - `"required"`, or a named function: the reply is constrained to calls (one, or with
//!   `parallel_tool_calls` one or more) whose arguments validate against the function's
//!   `parameters` schema, so that even a small model's call parses.
//! - `"none"`: the tools are not offered (not written into the prompt) and nothing is parsed.
//!
//! `response_format` `json_object` / `json_schema` constrain the answer to JSON (any object, or
//! one that validates against the schema).

use engram_engine::Constraint;
use engram_engine::chat_template::python_json;
use engram_grammar::{Grammars, Tool};
use serde_json::{Value, json};

use crate::error::ApiError;

/// The opening tag of a tool call.
pub const CALL_OPEN: &str = "<tool_call>\n";
/// Its closing tag.
pub const CALL_CLOSE: &str = "\n</tool_call>";

fn unsupported(what: impl Into<String>) -> ApiError {
    ApiError::new(
        actix_web::http::StatusCode::BAD_REQUEST,
        "unsupported_parameter",
        what,
    )
}

/// Tools offered at most, and bytes of their definitions.
pub const MAX_TOOLS: usize = 128;

/// What a request asks of tools.
#[derive(Debug, Clone, PartialEq)]
pub enum Choice {
    /// No tools offered (none given, or `tool_choice: "none"`).
    Off,
    /// The model may call one.
    Auto,
    /// The model must call one or more (`required`), or this one (a named function).
    Forced(Option<String>),
}

/// A request's tools, as checked.
#[derive(Debug, Clone)]
pub struct Tools {
    /// The definitions as the client sent them (`{"type": "function", "function": {…}}`).
    pub defs: Vec<Value>,
    /// Each function's name and parameters.
    pub functions: Vec<Tool>,
    /// What the model may or must do.
    pub choice: Choice,
    /// More than one call in one reply.
    pub parallel: bool,
}

impl Tools {
    /// Checks `tools`, `tool_choice` and `parallel_tool_calls`: 400 `invalid_request` for a
    /// malformed definition, a duplicate or unknown function name.
    pub fn parse(
        tools: Option<&Value>,
        choice: Option<&Value>,
        parallel: Option<bool>,
    ) -> Result<Self, ApiError> {
        let defs: Vec<Value> = match tools {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(a)) => a.clone(),
            Some(_) => return Err(ApiError::invalid("`tools` must be a list")),
        };
        if defs.len() > MAX_TOOLS {
            return Err(ApiError::invalid(format!(
                "`tools` may hold at most {MAX_TOOLS} functions"
            )));
        }
        let mut functions: Vec<Tool> = Vec::with_capacity(defs.len());
        for d in &defs {
            if d.get("type").and_then(Value::as_str) != Some("function") {
                return Err(ApiError::invalid(
                    "each tool must be `{\"type\": \"function\", \"function\": {…}}`",
                ));
            }
            let f = &d["function"];
            let Some(name) = f.get("name").and_then(Value::as_str) else {
                return Err(ApiError::invalid("a function needs a string `name`"));
            };
            let ok = (1..=64).contains(&name.len())
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
            if !ok {
                return Err(ApiError::invalid(format!(
                    "function name `{name}` must be 1–64 letters, digits, `_` or `-`"
                )));
            }
            if functions.iter().any(|t| t.name == name) {
                return Err(ApiError::invalid(format!(
                    "function `{name}` is given twice"
                )));
            }
            let parameters = match f.get("parameters") {
                None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
                Some(p @ Value::Object(_)) => p.clone(),
                Some(_) => {
                    return Err(ApiError::invalid(format!(
                        "the `parameters` of `{name}` must be a JSON schema object"
                    )));
                }
            };
            functions.push(Tool {
                name: name.to_string(),
                parameters,
            });
        }
        let choice = match choice {
            None | Some(Value::Null) => {
                if functions.is_empty() {
                    Choice::Off
                } else {
                    Choice::Auto
                }
            }
            Some(Value::String(s)) => match s.as_str() {
                "none" => Choice::Off,
                "auto" if functions.is_empty() => Choice::Off,
                "auto" => Choice::Auto,
                "required" => Choice::Forced(None),
                other => {
                    return Err(ApiError::invalid(format!(
                        "`tool_choice` `{other}`: none, auto, required or a function"
                    )));
                }
            },
            Some(v @ Value::Object(_)) => {
                let name = v["function"]["name"]
                    .as_str()
                    .or_else(|| v["name"].as_str())
                    .ok_or_else(|| ApiError::invalid("`tool_choice` names no function"))?;
                Choice::Forced(Some(name.to_string()))
            }
            Some(_) => {
                return Err(ApiError::invalid(
                    "`tool_choice` must be a string or an object",
                ));
            }
        };
        if let Choice::Forced(named) = &choice {
            if functions.is_empty() {
                return Err(ApiError::invalid(
                    "`tool_choice` asks for a call but no `tools` are given",
                ));
            }
            if let Some(n) = named
                && !functions.iter().any(|t| &t.name == n)
            {
                return Err(ApiError::invalid(format!(
                    "`tool_choice` names `{n}`, which is not among the `tools`"
                )));
            }
        }
        Ok(Self {
            defs,
            functions,
            choice,
            parallel: parallel.unwrap_or(true),
        })
    }

    /// Whether the reply is constrained to calls (`required` or a named function).
    pub fn constraint_needed(&self) -> bool {
        matches!(self.choice, Choice::Forced(_))
    }

    /// Whether the model is offered the tools (and its reply parsed for calls).
    pub fn offered(&self) -> bool {
        self.choice != Choice::Off
    }

    /// The names of the functions the reply may call (none when none are offered).
    pub fn names(&self) -> Vec<String> {
        if !self.offered() {
            return Vec::new();
        }
        self.functions.iter().map(|f| f.name.clone()).collect()
    }

    /// The text the system message gains: the model's template's tool branch, else the generic
    /// form ([`generic_suffix`]). Empty when no tools are offered.
    pub fn system_text(&self, tokenizer: &engram_engine::TextTokenizer) -> String {
        if !self.offered() {
            return String::new();
        }
        tokenizer
            .tools_suffix(&self.defs)
            .unwrap_or_else(|| generic_suffix(&self.defs))
    }

    /// The constraint on the reply: the calls, when a call is forced.
    pub fn constraint(&self, grammars: &Grammars) -> Result<Option<Box<dyn Constraint>>, ApiError> {
        let Choice::Forced(named) = &self.choice else {
            return Ok(None);
        };
        let offered: Vec<Tool> = match named {
            Some(n) => self
                .functions
                .iter()
                .filter(|t| &t.name == n)
                .cloned()
                .collect(),
            None => self.functions.clone(),
        };
        let g = grammars
            .tool_calls(
                &offered,
                self.parallel && named.is_none(),
                CALL_OPEN,
                CALL_CLOSE,
            )
            .map_err(|e| ApiError::invalid(format!("`tools`: {e}")))?;
        Ok(Some(Box::new(g)))
    }
}

/// The tool definitions in the generic form, for a template without a tool branch: the
/// functions one JSON object a line, and how to call them.
pub fn generic_suffix(defs: &[Value]) -> String {
    let lines: Vec<String> = defs.iter().map(python_json).collect();
    format!(
        "\n\n# Tools\n\nThese functions are available, one JSON definition per line:\n<tools>\n{}\n</tools>\n\n\
         To call a function, answer with a JSON object of its name and arguments in \
         <tool_call></tool_call> tags, one block per call:\n<tool_call>\n\
         {{\"name\": <function-name>, \"arguments\": <arguments-object>}}\n</tool_call>",
        lines.join("\n")
    )
}

/// A call parsed from a reply.
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    /// The function.
    pub name: String,
    /// Its arguments, as a JSON text.
    pub arguments: String,
}

/// The calls in `text` and the content before the first: every complete
/// `<tool_call>…</tool_call>` block whose body is a JSON object with a string `name` (its
/// `arguments` an object, or a JSON text of one, given back in Python's JSON form, as the
/// model writes it). A block that does not parse stays text.
pub fn parse_calls(text: &str) -> (String, Vec<Call>) {
    let open = CALL_OPEN.trim_end();
    let close = CALL_CLOSE.trim_start();
    let mut calls = Vec::new();
    let mut content = String::new();
    let mut rest = text;
    while let Some(at) = rest.find(open) {
        let after = &rest[at + open.len()..];
        let Some(end) = after.find(close) else { break };
        let body = after[..end].trim();
        match call_of(body) {
            Some(c) => {
                if calls.is_empty() {
                    content.push_str(&rest[..at]);
                }
                calls.push(c);
            }
            None => content.push_str(&rest[..at + open.len() + end + close.len()]),
        }
        rest = &after[end + close.len()..];
    }
    if calls.is_empty() {
        return (text.to_string(), calls);
    }
    // Text after the calls (whitespace, an end marker) is not content.
    (content.trim().to_string(), calls)
}

/// The calls in a reply to a request that offered the functions `names`: the tagged ones (see
/// [`parse_calls`]), else — a reply that is nothing but calls written without the tags, what
/// small models often write once no grammar holds them — one JSON object `{"name",
/// "arguments"}` naming an offered function, or a list of them, bare or in a code fence.
/// Anything else is text.
pub fn parse_reply(text: &str, names: &[String]) -> (String, Vec<Call>) {
    let (content, calls) = parse_calls(text);
    if !calls.is_empty() {
        return (content, calls);
    }
    match bare_calls(text, Some(names)) {
        Some(calls) => (String::new(), calls),
        None => (content, calls),
    }
}

/// The calls a reply is, written without tags (`names`: the functions it may call; `None`: any),
/// or `None` when it is not only calls.
pub fn bare_calls(text: &str, names: Option<&[String]>) -> Option<Vec<Call>> {
    let t = text.trim();
    let t = match t.strip_prefix("```") {
        Some(fenced) => fenced
            .trim_start_matches(|c: char| c.is_ascii_alphanumeric())
            .strip_suffix("```")?
            .trim(),
        None => t,
    };
    let v: Value = serde_json::from_str(t).ok()?;
    let items: Vec<&Value> = match &v {
        Value::Array(a) if !a.is_empty() => a.iter().collect(),
        Value::Object(_) => vec![&v],
        _ => return None,
    };
    items
        .into_iter()
        .map(|item| {
            // A bare object is a call only with its arguments spelled out.
            item.get("arguments").or_else(|| item.get("parameters"))?;
            let call = call_of_value(item)?;
            names.is_none_or(|n| n.contains(&call.name)).then_some(call)
        })
        .collect()
}

fn call_of(body: &str) -> Option<Call> {
    call_of_value(&serde_json::from_str(body).ok()?)
}

fn call_of_value(v: &Value) -> Option<Call> {
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = match v.get("arguments").or_else(|| v.get("parameters")) {
        None | Some(Value::Null) => "{}".to_string(),
        Some(Value::String(s)) => {
            let parsed: Value = serde_json::from_str(s).ok()?;
            parsed.is_object().then(|| python_json(&parsed))?
        }
        Some(a @ Value::Object(_)) => python_json(a),
        Some(_) => return None,
    };
    Some(Call { name, arguments })
}

/// How many bytes at the end of `text` may begin a tool call's opening tag (held back from a
/// stream until the next token tells).
pub fn partial_open(text: &str) -> usize {
    let open = CALL_OPEN.trim_end();
    (1..open.len())
        .rev()
        .find(|&n| text.ends_with(&open[..n]))
        .unwrap_or(0)
}

/// A piece of a streamed reply, as the client should see it.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    /// Text of the answer.
    Text(String),
    /// A complete tool call and its index among the reply's calls.
    Call(usize, Call),
}

/// Splits a streamed reply into text and complete calls: text that may begin a call is held
/// back until the next tokens tell, a call until its closing tag; after the first call, only
/// text that is not whitespace is passed on.
#[derive(Debug, Default)]
pub struct Scanner {
    pending: String,
    /// Calls found so far.
    pub calls: usize,
    /// The functions offered: a reply that starts as JSON may be calls without tags (see
    /// [`parse_reply`]), and is held back until it ends.
    names: Vec<String>,
    /// Text was passed on.
    spoke: bool,
}

impl Scanner {
    /// A scanner of a reply to a request that offered the functions `names`.
    pub fn for_tools(names: Vec<String>) -> Self {
        Self {
            names,
            ..Self::default()
        }
    }

    /// Feeds `text` in; answers what of the reply is now known (`end`: all of it).
    pub fn feed(&mut self, text: &str, end: bool) -> Vec<Piece> {
        let out = self.scan(text, end);
        self.spoke |= out.iter().any(|p| matches!(p, Piece::Text(_)));
        out
    }

    fn scan(&mut self, text: &str, end: bool) -> Vec<Piece> {
        self.pending.push_str(text);
        // A reply that starts as JSON (or a code fence) may be bare calls: known at its end.
        let starts_json = self.pending.trim_start().starts_with(['{', '[', '`']);
        if self.calls == 0 && !self.spoke && !self.names.is_empty() && starts_json {
            if !end {
                return Vec::new();
            }
            if let Some(calls) = bare_calls(&self.pending, Some(&self.names)) {
                self.pending.clear();
                return calls
                    .into_iter()
                    .map(|c| {
                        self.calls += 1;
                        Piece::Call(self.calls - 1, c)
                    })
                    .collect();
            }
        }
        let mut out = Vec::new();
        let open = CALL_OPEN.trim_end();
        let close = CALL_CLOSE.trim_start();
        let text_piece = |t: String, calls: usize, out: &mut Vec<Piece>| {
            if !t.is_empty() && (calls == 0 || !t.trim().is_empty()) {
                out.push(Piece::Text(t));
            }
        };
        loop {
            let Some(at) = self.pending.find(open) else {
                let keep = if end { 0 } else { partial_open(&self.pending) };
                let upto = self.pending.len() - keep;
                let t: String = self.pending.drain(..upto).collect();
                text_piece(t, self.calls, &mut out);
                return out;
            };
            let t: String = self.pending.drain(..at).collect();
            text_piece(t, self.calls, &mut out);
            let Some(end_at) = self.pending.find(close) else {
                if end {
                    let t = std::mem::take(&mut self.pending);
                    text_piece(t, self.calls, &mut out);
                }
                return out;
            };
            let block: String = self.pending.drain(..end_at + close.len()).collect();
            match parse_calls(&block).1.into_iter().next() {
                Some(call) => {
                    out.push(Piece::Call(self.calls, call));
                    self.calls += 1;
                }
                None => text_piece(block, self.calls, &mut out),
            }
        }
    }
}

/// The model's vocabulary compiled for constrained decoding (built on the first request that
/// needs it: a 151K-token vocabulary takes a fraction of a second), or 503.
pub fn grammars(state: &crate::state::AppState) -> Result<std::sync::Arc<Grammars>, ApiError> {
    let engine = state.engine().map_err(ApiError::from)?;
    let built = state.grammars.get_or_init(|| {
        let rows = engine.model_config().vocab_size;
        Grammars::new(engine.tokenizer(), rows).map(std::sync::Arc::new)
    });
    built.clone().map_err(|e| {
        ApiError::new(
            actix_web::http::StatusCode::SERVICE_UNAVAILABLE,
            "grammar_unavailable",
            e.to_string(),
        )
    })
}

/// The constraint `response_format` asks for: `None` for text (or absent).
pub fn response_format(
    format: Option<&Value>,
    grammars: impl FnOnce() -> Result<std::sync::Arc<Grammars>, ApiError>,
) -> Result<Option<Box<dyn Constraint>>, ApiError> {
    let Some(f) = format.filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    let kind = f.get("type").and_then(Value::as_str).unwrap_or_default();
    let bad =
        |e: engram_grammar::GrammarError| ApiError::invalid(format!("`response_format`: {e}"));
    match kind {
        "text" => Ok(None),
        "json_object" => Ok(Some(Box::new(grammars()?.json_object().map_err(bad)?))),
        "json_schema" => {
            let schema = f
                .get("json_schema")
                .and_then(|s| s.get("schema"))
                .ok_or_else(|| {
                    ApiError::invalid("`response_format.json_schema.schema` is missing")
                })?;
            Ok(Some(Box::new(
                grammars()?.json_schema(schema).map_err(bad)?,
            )))
        }
        other => Err(unsupported(format!(
            "`response_format` `{other}`: text, json_object or json_schema"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_written_without_tags_are_calls_of_offered_functions_only() {
        let names = vec!["calculate".to_string(), "price".to_string()];
        let bare = r#"{"name": "calculate", "arguments": {"expression": "4*3"}}"#;
        let (content, calls) = parse_reply(bare, &names);
        assert_eq!(content, "");
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].name, "calculate");
        assert_eq!(calls[0].arguments, r#"{"expression": "4*3"}"#);
        // In a code fence, and a list of two.
        let fenced = "```json\n[{\"name\": \"price\", \"arguments\": {\"fruit\": \"apple\"}},                       {\"name\": \"price\", \"parameters\": {\"fruit\": \"pear\"}}]\n```";
        let (_, calls) = parse_reply(fenced, &names);
        assert_eq!(calls.len(), 2, "{calls:?}");
        assert_eq!(calls[1].arguments, r#"{"fruit": "pear"}"#);
        // Not a call: a function nobody offered, no arguments, text around the object, a JSON
        // answer.
        for text in [
            r#"{"name": "delete_all", "arguments": {}}"#,
            r#"{"name": "calculate"}"#,
            r#"Sure: {"name": "calculate", "arguments": {}}"#,
            r#"{"city": "Paris", "days": 3}"#,
        ] {
            let (content, calls) = parse_reply(text, &names);
            assert!(calls.is_empty(), "{text}");
            assert_eq!(content, text);
        }
        // A streamed bare call is held back to its end and comes as a call; a JSON answer that
        // is not one comes as text, whole.
        let mut sc = Scanner::for_tools(names.clone());
        assert!(sc.feed(r#"{"name": "calculate", "#, false).is_empty());
        let pieces = sc.feed(r#""arguments": {"expression": "1+1"}}"#, true);
        assert!(
            matches!(&pieces[..], [Piece::Call(0, c)] if c.name == "calculate"),
            "{pieces:?}"
        );
        let mut sc = Scanner::for_tools(names);
        assert!(sc.feed(r#"{"city": "#, false).is_empty());
        let pieces = sc.feed(r#""Paris"}"#, true);
        assert_eq!(
            pieces,
            vec![Piece::Text(r#"{"city": "Paris"}"#.to_string())]
        );
        // Without offered functions, JSON streams as it comes.
        let mut sc = Scanner::default();
        assert_eq!(sc.feed("{", false), vec![Piece::Text("{".to_string())]);
    }

    #[test]
    fn calls_are_parsed_out_of_a_reply_and_the_rest_is_content() {
        let text = "Let me look.\n<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"time\", \"arguments\": \"{\\\"tz\\\": \\\"CET\\\"}\"}\n</tool_call>";
        let (content, calls) = parse_calls(text);
        assert_eq!(content, "Let me look.");
        assert_eq!(
            calls,
            vec![
                Call {
                    name: "weather".into(),
                    arguments: "{\"city\": \"Paris\"}".into()
                },
                Call {
                    name: "time".into(),
                    arguments: "{\"tz\": \"CET\"}".into()
                },
            ]
        );
    }

    #[test]
    fn a_block_that_does_not_parse_stays_text() {
        let text = "<tool_call>\n{\"name\": oops}\n</tool_call>";
        assert_eq!(parse_calls(text), (text.to_string(), vec![]));
        assert_eq!(parse_calls("plain"), ("plain".to_string(), vec![]));
        // Unclosed: text.
        let open = "<tool_call>\n{\"name\": \"a\"";
        assert_eq!(parse_calls(open).1, vec![]);
    }

    #[test]
    fn the_start_of_a_tag_is_held_back() {
        assert_eq!(partial_open("Hello <tool"), 5);
        assert_eq!(partial_open("Hello <"), 1);
        assert_eq!(partial_open("Hello"), 0);
        assert_eq!(partial_open("<tool_call"), 10);
    }

    #[test]
    fn a_streamed_reply_splits_into_text_and_whole_calls() {
        let reply =
            "Sure. <tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}\n</tool_call>\n";
        // Fed a few bytes at a time, as tokens come.
        let mut sc = Scanner::default();
        let mut pieces = Vec::new();
        let bytes: Vec<char> = reply.chars().collect();
        for chunk in bytes.chunks(3) {
            pieces.extend(sc.feed(&chunk.iter().collect::<String>(), false));
        }
        pieces.extend(sc.feed("", true));
        let text: String = pieces
            .iter()
            .filter_map(|p| match p {
                Piece::Text(t) => Some(t.as_str()),
                Piece::Call(..) => None,
            })
            .collect();
        assert_eq!(text, "Sure. ");
        let calls: Vec<&Call> = pieces
            .iter()
            .filter_map(|p| match p {
                Piece::Call(_, c) => Some(c),
                Piece::Text(_) => None,
            })
            .collect();
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].arguments, "{\"a\": 1}");
        // An unclosed call at the end is text.
        let mut sc = Scanner::default();
        let out = sc.feed("<tool_call>\n{\"name\"", true);
        assert_eq!(out, vec![Piece::Text("<tool_call>\n{\"name\"".into())]);
    }

    #[test]
    fn choices_are_checked() {
        let tools = json!([{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]);
        let t = Tools::parse(Some(&tools), None, None).unwrap();
        assert_eq!(t.choice, Choice::Auto);
        let t = Tools::parse(Some(&tools), Some(&json!("required")), Some(false)).unwrap();
        assert_eq!((t.choice, t.parallel), (Choice::Forced(None), false));
        let named = json!({"type": "function", "function": {"name": "add"}});
        let t = Tools::parse(Some(&tools), Some(&named), None).unwrap();
        assert_eq!(t.choice, Choice::Forced(Some("add".into())));
        let other = json!({"type": "function", "function": {"name": "sub"}});
        assert!(Tools::parse(Some(&tools), Some(&other), None).is_err());
        assert!(Tools::parse(None, Some(&json!("required")), None).is_err());
        assert_eq!(
            Tools::parse(Some(&tools), Some(&json!("none")), None)
                .unwrap()
                .choice,
            Choice::Off
        );
        let twice = json!([tools[0], tools[0]]);
        assert!(Tools::parse(Some(&twice), None, None).is_err());
        assert!(Tools::parse(Some(&json!([{"type": "retrieval"}])), None, None).is_err());
    }
}
