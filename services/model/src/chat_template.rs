//! A model's chat template (Jinja, from GGUF `tokenizer.chat_template` or
//! `tokenizer_config.json`), rendered with `minijinja` and split into the per-role pieces the
//! prompt is built from ([`ChatFormat`]).
//!
//! The split: the template renders marker conversations (system, user, assistant, system,
//! user; a tool result; each alone at the end), and the text between markers gives each role's
//! header and trailer, what comes before the first message and the reply's header. The pieces
//! are then checked: framing the probe conversation with them must give exactly what the
//! template renders. A template that frames a message by what comes later (one that merges
//! consecutive messages, say) fails the check and the caller falls back to ChatML, with a
//! warning naming why.

use engram_context::{ChatFormat, FormatSource, FrameRole, Wrap};
use minijinja::{Environment, Error, ErrorKind, Value, context};

/// Why a template could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    /// The template does not parse or fails to render a probe conversation.
    #[error("the chat template does not render: {0}")]
    Render(String),
    /// The template's output cannot be cut into per-message pieces.
    #[error("the chat template cannot be split into per-message pieces: {0}")]
    Split(String),
}

/// Probe contents: plain ASCII, unchanged by `trim` or case-preserving filters.
fn marker(i: usize) -> String {
    format!("ENGRAMPROBE{i}Q")
}

/// A template ready to render.
pub struct Template {
    env: Environment<'static>,
    bos: String,
    eos: String,
}

impl std::fmt::Debug for Template {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Template")
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .finish_non_exhaustive()
    }
}

fn role_name(role: FrameRole) -> &'static str {
    match role {
        FrameRole::System => "system",
        FrameRole::User => "user",
        FrameRole::Assistant => "assistant",
        FrameRole::Tool => "tool",
    }
}

impl Template {
    /// Parses `source` with Python-compatible string methods (`.strip()`, `.startswith()`…),
    /// `raise_exception` and a fuel limit (a template cannot loop forever).
    pub fn new(source: &str, bos: &str, eos: &str) -> Result<Self, TemplateError> {
        let mut env = Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_fuel(Some(1_000_000));
        env.add_function("raise_exception", |msg: String| -> Result<Value, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        // Python's `json.dumps` form (`", "` and `": "`), as Hugging Face renders templates:
        // the tool definitions read as the model saw them in training.
        env.add_filter("tojson", |v: Value| -> Result<Value, Error> {
            let json = serde_json::to_value(&v)
                .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
            Ok(Value::from_safe_string(python_json(&json)))
        });
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| TemplateError::Render(e.to_string()))?;
        Ok(Self {
            env,
            bos: bos.into(),
            eos: eos.into(),
        })
    }

    /// Renders `messages`, with the reply's header when `generate`.
    pub fn render(
        &self,
        messages: &[(FrameRole, &str)],
        generate: bool,
    ) -> Result<String, TemplateError> {
        let messages: Vec<Value> = messages
            .iter()
            .map(|(role, content)| {
                context! {
                    role => role_name(*role),
                    content => *content,
                }
            })
            .collect();
        let t = self
            .env
            .get_template("chat")
            .map_err(|e| TemplateError::Render(e.to_string()))?;
        t.render(context! {
            messages => messages,
            add_generation_prompt => generate,
            bos_token => self.bos.as_str(),
            eos_token => self.eos.as_str(),
        })
        .map_err(|e| TemplateError::Render(e.to_string()))
    }

    /// What the template adds to the first system message's content when `tools` (OpenAI
    /// tool definitions) are offered: the text after the content, before the message's end.
    /// `None` when the template has no tool branch (its output does not change) or puts the
    /// tools anywhere else.
    pub fn tools_suffix(
        &self,
        tools: &[serde_json::Value],
        system_post: &str,
    ) -> Result<Option<String>, TemplateError> {
        let m = marker(7);
        let t = self
            .env
            .get_template("chat")
            .map_err(|e| TemplateError::Render(e.to_string()))?;
        let render = |with: Option<&[serde_json::Value]>| {
            let messages = vec![context! { role => "system", content => m.as_str() }];
            t.render(context! {
                messages => messages,
                tools => with.map(|t| Value::from(minijinja::value::Serde(t))),
                add_generation_prompt => false,
                bos_token => self.bos.as_str(),
                eos_token => self.eos.as_str(),
            })
            .map_err(|e| TemplateError::Render(e.to_string()))
        };
        let plain = render(None)?;
        let with = render(Some(tools))?;
        if with == plain {
            return Ok(None);
        }
        let (Some((pre, _)), Some((with_pre, after))) =
            (plain.split_once(m.as_str()), with.split_once(m.as_str()))
        else {
            return Ok(None);
        };
        if pre != with_pre {
            return Ok(None);
        }
        Ok(after
            .strip_suffix(system_post)
            .filter(|suffix| !suffix.is_empty())
            .map(str::to_string))
    }

    /// The per-role pieces (see the module docs).
    pub fn format(&self) -> Result<ChatFormat, TemplateError> {
        use FrameRole::{Assistant, System, Tool, User};
        let m: Vec<String> = (0..6).map(marker).collect();
        let probe = [
            (System, m[0].as_str()),
            (User, m[1].as_str()),
            (Assistant, m[2].as_str()),
            (System, m[3].as_str()),
            (User, m[4].as_str()),
        ];
        let full = self.render(&probe, false)?;
        let with_reply = self.render(&probe, true)?;
        let generation = with_reply
            .strip_prefix(full.as_str())
            .ok_or_else(|| split("the reply's header is not appended at the end"))?
            .to_string();
        let gaps = gaps(&full, &probe.map(|(_, c)| c))?;
        let tail_of = |msgs: &[(FrameRole, &str)]| -> Result<String, TemplateError> {
            let out = self.render(msgs, false)?;
            let last = msgs.last().map_or("", |(_, c)| *c);
            out.rsplit_once(last)
                .map(|(_, t)| t.to_string())
                .ok_or_else(|| split("a message's content is missing"))
        };
        let system_post = tail_of(&probe[..1])?;
        let assistant_post = tail_of(&probe[..3])?;
        let user_post = gaps[5].clone();
        let cut = |gap: &str, post: &str, what: &str| -> Result<String, TemplateError> {
            gap.strip_prefix(post)
                .map(str::to_string)
                .ok_or_else(|| split(&format!("{what} does not follow the previous trailer")))
        };
        let user_pre = cut(&gaps[1], &system_post, "the user header")?;
        let assistant_pre = cut(&gaps[2], &user_post, "the assistant header")?;
        let system_pre = cut(&gaps[3], &assistant_post, "a later system header")?;
        let mut f = ChatFormat {
            first_system_pre: gaps[0].clone(),
            system: Wrap {
                pre: system_pre,
                post: system_post,
            },
            user: Wrap {
                pre: user_pre,
                post: user_post,
            },
            assistant: Wrap {
                pre: assistant_pre,
                post: assistant_post,
            },
            tool: Wrap {
                pre: String::new(),
                post: String::new(),
            },
            generation,
            source: FormatSource::Model,
        };
        // Tool results: their own framing when the template renders a `tool` message between
        // an assistant and a user message, else framed as the user's words.
        let tool_probe = [
            (System, m[0].as_str()),
            (User, m[1].as_str()),
            (Assistant, m[2].as_str()),
            (Tool, m[5].as_str()),
            (User, m[4].as_str()),
        ];
        f.tool = match self.render(&tool_probe, false) {
            Ok(out) => match gaps_of(&out, &tool_probe.map(|(_, c)| c)) {
                Some(g) => match (
                    g[3].strip_prefix(f.assistant.post.as_str()),
                    g[4].strip_suffix(f.user.pre.as_str()),
                ) {
                    (Some(pre), Some(post)) => Wrap {
                        pre: pre.to_string(),
                        post: post.to_string(),
                    },
                    _ => f.user.clone(),
                },
                None => f.user.clone(),
            },
            Err(_) => f.user.clone(),
        };
        // The check: the pieces frame the probes exactly as the template does.
        if f.render(&probe, true) != with_reply {
            return Err(split(
                "framing the probe with the pieces differs from the template",
            ));
        }
        if let Ok(out) = self.render(&tool_probe, true)
            && f.tool != f.user
            && f.render(&tool_probe, true) != out
        {
            return Err(split("a tool result is framed by what follows it"));
        }
        if gaps[4] != format!("{}{}", f.system.post, f.user.pre) {
            return Err(split("a user message after a later system message differs"));
        }
        Ok(f)
    }
}

/// `v` as Python's `json.dumps(v, ensure_ascii=False)` writes it: `", "` between items,
/// `": "` after keys, keys in their order.
pub fn python_json(v: &serde_json::Value) -> String {
    use serde_json::Value as J;
    let mut out = String::new();
    fn write(v: &J, out: &mut String) {
        match v {
            J::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    write(item, out);
                }
                out.push(']');
            }
            J::Object(map) => {
                out.push('{');
                for (i, (k, item)) in map.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    out.push_str(&J::String(k.clone()).to_string());
                    out.push_str(": ");
                    write(item, out);
                }
                out.push('}');
            }
            other => out.push_str(&other.to_string()),
        }
    }
    write(v, &mut out);
    out
}

fn split(why: &str) -> TemplateError {
    TemplateError::Split(why.to_string())
}

/// The text before, between and after `contents` in `out` (`contents.len() + 1` pieces).
fn gaps_of(out: &str, contents: &[&str]) -> Option<Vec<String>> {
    let mut pieces = Vec::with_capacity(contents.len() + 1);
    let mut rest = out;
    for c in contents {
        let (before, after) = rest.split_once(c)?;
        pieces.push(before.to_string());
        rest = after;
    }
    pieces.push(rest.to_string());
    Some(pieces)
}

fn gaps(out: &str, contents: &[&str]) -> Result<Vec<String>, TemplateError> {
    gaps_of(out, contents).ok_or_else(|| split("a message's content is missing from the output"))
}

/// The format for a template source: its pieces, or ChatML with the reason it was not used.
pub fn format_for(source: Option<&str>, bos: &str, eos: &str) -> (ChatFormat, Option<String>) {
    let Some(source) = source else {
        return (ChatFormat::chatml(), None);
    };
    match Template::new(source, bos, eos).and_then(|t| t.format()) {
        Ok(f) => (f, None),
        Err(e) => (ChatFormat::chatml(), Some(e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SmolLM2-Instruct's template (a ChatML variant that adds a default system message).
    const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    /// A Llama-3-style template: a BOS, headers, `| trim` on contents, a first system message
    /// with its own preamble.
    const LLAMA3_STYLE: &str = "{{- bos_token }}{%- for message in messages %}{%- if loop.first and message['role'] == 'system' %}{{- '<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n\n' + message['content'] | trim + '<|eot_id|>' }}{%- else %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}";

    /// Gemma-style: no system role (raises), `model` instead of `assistant`.
    const NO_SYSTEM: &str = "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}{{ '<start_of_turn>' + message['role'] + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}";

    #[test]
    fn smollm2_s_template_splits_into_chatml() {
        let f = Template::new(SMOLLM2, "<|im_start|>", "<|im_end|>")
            .unwrap()
            .format()
            .unwrap();
        let chatml = ChatFormat::chatml();
        assert_eq!(
            (
                f.first_system_pre.as_str(),
                &f.system,
                &f.user,
                &f.assistant,
                &f.tool
            ),
            (
                chatml.first_system_pre.as_str(),
                &chatml.system,
                &chatml.user,
                &chatml.assistant,
                &chatml.tool
            )
        );
        assert_eq!(f.generation, chatml.generation);
        assert_eq!(f.source, FormatSource::Model);
    }

    #[test]
    fn a_llama3_style_template_gets_its_bos_headers_and_first_system_preamble() {
        let t = Template::new(LLAMA3_STYLE, "<|begin_of_text|>", "<|eot_id|>").unwrap();
        let f = t.format().unwrap();
        assert_eq!(
            f.first_system_pre,
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n\n"
        );
        assert_eq!(
            f.system.pre,
            "<|start_header_id|>system<|end_header_id|>\n\n"
        );
        assert_eq!(f.user.post, "<|eot_id|>");
        assert_eq!(f.tool.pre, "<|start_header_id|>tool<|end_header_id|>\n\n");
        assert_eq!(
            f.generation,
            "<|start_header_id|>assistant<|end_header_id|>\n\n"
        );
        // A real conversation framed by the pieces is what the template renders.
        let conv = [
            (FrameRole::System, "Be brief."),
            (FrameRole::User, "Hi"),
            (FrameRole::Assistant, "Hello!"),
            (FrameRole::User, "Name a colour."),
        ];
        assert_eq!(f.render(&conv, true), t.render(&conv, true).unwrap());
    }

    #[test]
    fn a_template_without_a_system_role_or_that_does_not_parse_falls_back_to_chatml() {
        let (f, why) = format_for(Some(NO_SYSTEM), "<bos>", "<eos>");
        assert_eq!(f, ChatFormat::chatml());
        assert!(why.unwrap().contains("System role not supported"));
        let (f, why) = format_for(Some("{% for %}"), "", "");
        assert_eq!(f.source, FormatSource::ChatMl);
        assert!(why.unwrap().contains("does not render"), "parse error");
        let (f, why) = format_for(None, "", "");
        assert_eq!((f.source, why), (FormatSource::ChatMl, None));
    }

    #[test]
    fn a_template_that_runs_away_is_stopped_by_its_fuel() {
        let forever =
            "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}";
        let err = Template::new(forever, "", "")
            .unwrap()
            .format()
            .unwrap_err();
        assert!(matches!(err, TemplateError::Render(_)), "{err}");
    }
}
