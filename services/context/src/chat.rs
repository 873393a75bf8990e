//! How the model frames messages: what comes before and after each role's content, before the
//! first message, and what asks for the assistant's reply. The prompt is built message by
//! message as cache segments, so a model's chat template (a Jinja program over the whole
//! conversation) is turned into these per-role pieces once, at load (the engine probes it with
//! marker messages and checks that the pieces re-render the template's own output); ChatML is
//! the fallback for models without a template.

use std::sync::LazyLock;

use serde::{Deserialize, Serialize};

/// What surrounds one role's content.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Wrap {
    /// Before the content.
    pub pre: String,
    /// After the content.
    pub post: String,
}

impl Wrap {
    fn new(pre: &str, post: &str) -> Self {
        Self {
            pre: pre.into(),
            post: post.into(),
        }
    }
}

/// Where a format came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FormatSource {
    /// The model's own chat template (GGUF `tokenizer.chat_template` or
    /// `tokenizer_config.json`).
    Model,
    /// ChatML, for a model that ships no template (or one that could not be split).
    ChatMl,
}

/// A model's message framing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatFormat {
    /// Everything before the first message's content when that message is a system message
    /// (as every prompt Engram builds starts): a BOS token when the template writes one, and a
    /// header that may differ from later system messages' (a preamble).
    pub first_system_pre: String,
    /// System messages.
    pub system: Wrap,
    /// User messages.
    pub user: Wrap,
    /// Assistant messages.
    pub assistant: Wrap,
    /// Tool results.
    pub tool: Wrap,
    /// What asks for the reply (the assistant's header).
    pub generation: String,
    /// Where it came from.
    pub source: FormatSource,
}

/// ChatML, shared.
pub static CHATML: LazyLock<ChatFormat> = LazyLock::new(ChatFormat::chatml);

/// A message's role, for framing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameRole {
    /// System.
    System,
    /// User.
    User,
    /// Assistant.
    Assistant,
    /// Tool.
    Tool,
}

impl ChatFormat {
    /// ChatML: `<|im_start|>{role}\n{content}<|im_end|>\n`, the reply after
    /// `<|im_start|>assistant\n`.
    pub fn chatml() -> Self {
        let wrap = |role: &str| Wrap::new(&format!("<|im_start|>{role}\n"), "<|im_end|>\n");
        Self {
            first_system_pre: "<|im_start|>system\n".into(),
            system: wrap("system"),
            user: wrap("user"),
            assistant: wrap("assistant"),
            tool: wrap("tool"),
            generation: "<|im_start|>assistant\n".into(),
            source: FormatSource::ChatMl,
        }
    }

    /// The wrap of `role`.
    pub fn wrap(&self, role: FrameRole) -> &Wrap {
        match role {
            FrameRole::System => &self.system,
            FrameRole::User => &self.user,
            FrameRole::Assistant => &self.assistant,
            FrameRole::Tool => &self.tool,
        }
    }

    /// One message, framed.
    pub fn message(&self, role: FrameRole, content: &str) -> String {
        let w = self.wrap(role);
        format!("{}{content}{}", w.pre, w.post)
    }

    /// A whole conversation, framed, with the reply's header when `generate` (a first system
    /// message gets [`Self::first_system_pre`]).
    pub fn render(&self, messages: &[(FrameRole, &str)], generate: bool) -> String {
        let mut s = String::new();
        for (i, (role, content)) in messages.iter().enumerate() {
            if i == 0 && *role == FrameRole::System {
                s.push_str(&self.first_system_pre);
                s.push_str(content);
                s.push_str(&self.system.post);
            } else {
                s.push_str(&self.message(*role, content));
            }
        }
        if generate {
            s.push_str(&self.generation);
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chatml_frames_each_role_and_the_reply_header() {
        let f = ChatFormat::chatml();
        assert_eq!(
            f.render(&[(FrameRole::System, "s"), (FrameRole::User, "u")], true),
            "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(
            f.message(FrameRole::Tool, "21"),
            "<|im_start|>tool\n21<|im_end|>\n"
        );
    }
}
