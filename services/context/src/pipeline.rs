//! Building the prompt: layers fitted to their budgets, then ordered by volatility so that a
//! turn reuses everything the previous turns computed.
//!
//! The exact order, each piece a [`Segment`] tagged with its source layer, framed by the
//! model's [`ChatFormat`] (its own chat template, split per role; ChatML shown here, the
//! fallback):
//! 1. `<|im_start|>system\n`, then every **stable** layer present, in the fixed order axioms,
//!    identity, rules, capabilities, soul (then any other layer an operator marked stable, in
//!    [`LayerKind::ALL`] order), each as `## Title\n{text}\n\n`;
//! 2. the **slow** layers (partner, neurons) in the same form, closing the system message with
//!    `<|im_end|>\n`;
//! 3. the conversation so far, `<|im_start|>user\n…<|im_end|>\n<|im_start|>assistant\n…<|im_end|>\n`
//!    per turn (its oldest turns left out when a [`Fit`] says it would overflow);
//! 4. the **volatile** block: `<|im_start|>system\n` with the memories recalled for this message
//!    first, then system state, current time, affect and awareness, `<|im_end|>\n` — the only
//!    part that depends on the message or changes every turn;
//! 5. the new user message and `<|im_start|>assistant\n`.
//!
//! Nothing that depends on the message sits before the conversation — slow layers are fitted
//! without it, like stable ones — so steps 1–3 are a prefix that only grows: turn N's prompt
//! shares with turn N−1's everything up to the end of the conversation both contain. (The turn
//! just finished followed the old volatile block when it was computed; a caller that wants it
//! reused too prefills the canonical prefix — steps 1–3 — once the turn ends.)
//!
//! **Fitting** ([`ContextRequest::fit`]): the layers get at most half the model's context (their
//! claims scaled down together when they sum to more: a stable layer claims the lesser of its
//! budget and what its text takes whole, any other layer its budget; with the memory graph on,
//! the memories layer counts with its standard budget even when absent, since recall may add
//! it), so that the same layers are fitted the same way every turn. The conversation gets a steady window: the context less the
//! layers' budgets and an eighth kept for the message and the reply. When the conversation
//! outgrows the window, its oldest turns leave in one step, until it holds half the window, so
//! the prefix then stays put for many turns; where the window starts is a function of the
//! conversation alone (each step replayed from the first turn), so every build of a session
//! agrees on it. A turn whose own message and reply need more leaves more of the oldest turns
//! out for itself; a prompt that does not fit even without history is
//! [`ContextError::Overflow`].
//!
//! The stable prefix's hash is SHA-256 over step 1's text; an edit to a stable layer changes it.
//! Stable and slow layers over their budget are fitted without the user's message (importance
//! tags and position only), so the prefix never depends on what the user just asked; the
//! volatile ones use the overlap with the message too (see [`crate::synth`]).

use std::borrow::Cow;

use engram_kvcore::SourceLayer;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::TokenCounter;
use crate::chat::{ChatFormat, FrameRole};
use crate::layers::{Layer, LayerKind, Volatility};
use crate::synth::{content_tokens, synthesize};

/// Errors of the context pipeline.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ContextError {
    /// Two layers of the same kind.
    #[error("the agent has two `{kind:?}` layers")]
    DuplicateLayer {
        /// The kind.
        kind: LayerKind,
    },
    /// An importance outside 0..=1.
    #[error("layer `{kind:?}` has importance {value}, outside 0..=1")]
    InvalidImportance {
        /// The kind.
        kind: LayerKind,
        /// The value.
        value: f32,
    },
    /// The new user message is empty.
    #[error("the user message is empty")]
    EmptyMessage,
    /// The prompt without any history, with the reply, is longer than the model's context.
    #[error(
        "the prompt needs {needed} tokens with the reply and no history, more than the model's \
         context of {context}"
    )]
    Overflow {
        /// Tokens of the layers, the message and the reply.
        needed: usize,
        /// The model's context.
        context: usize,
    },
}

/// Who spoke a turn of the conversation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Speaker {
    /// The user.
    User,
    /// The agent.
    Assistant,
    /// A tool's result (rendered with the `tool` role).
    Tool,
    /// System text inside the conversation: an instruction or an event injected between turns
    /// (rendered with the `system` role).
    System,
}

impl Speaker {
    /// The role it is framed with and the source layer its blocks carry.
    fn role(self) -> (SourceLayer, FrameRole) {
        match self {
            Self::User => (SourceLayer::UserTurn, FrameRole::User),
            Self::Assistant => (SourceLayer::AssistantTurn, FrameRole::Assistant),
            // A tool's result is input to the model, like the user's words.
            Self::Tool => (SourceLayer::UserTurn, FrameRole::Tool),
            // Injected text is input too; its KV ages with the conversation.
            Self::System => (SourceLayer::UserTurn, FrameRole::System),
        }
    }
}

/// One message of the conversation so far.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Turn {
    /// Who.
    pub speaker: Speaker,
    /// What.
    pub text: String,
}

/// What to build.
#[derive(Debug, Clone, Copy)]
pub struct ContextRequest<'a> {
    /// The agent's layers (any order).
    pub layers: &'a [Layer],
    /// The conversation so far.
    pub history: &'a [Turn],
    /// The new user message.
    pub user_message: &'a str,
    /// Who says it: the user, or a tool whose result the model answers next (`Assistant`
    /// and `System` render as the user).
    pub message_speaker: Speaker,
    /// The model's context and the reply's tokens: with it, budgets are fitted and the
    /// conversation windowed so that both fit (see the module docs); without it, everything is
    /// built as given.
    pub fit: Option<Fit>,
    /// How the model frames messages (its chat template, or [`crate::CHATML`]).
    pub format: &'a ChatFormat,
    /// The request's own system text (an OpenAI request's system and developer messages, the
    /// tool definitions): a stable segment after the stable layers, as written — never cut or
    /// spilled; a prompt that cannot hold it is [`ContextError::Overflow`].
    pub instructions: &'a str,
}

/// What a prompt and its reply must fit in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fit {
    /// Tokens of the model's context.
    pub context: usize,
    /// Tokens the reply may generate.
    pub reply: usize,
    /// Whether recall may add a memories layer (the memory graph is on): an absent memories
    /// layer's standard budget is then kept free for it.
    pub recall: bool,
}

/// How a build was fitted into a [`Fit`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct FitReport {
    /// The layers' budgets were multiplied by this (1 when they fit in half the context).
    pub scale: f64,
    /// Tokens the conversation's steady window holds.
    pub window: usize,
    /// Turns of the conversation left out of the prompt, oldest first.
    pub dropped_turns: usize,
    /// Tokens of the prompt, counted segment by segment.
    pub prompt_tokens: usize,
}

/// A tagged piece of the prompt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Segment {
    /// Which source layer its KV blocks belong to.
    pub source: SourceLayer,
    /// Importance of those blocks.
    pub importance: f32,
    /// Its place in the volatility order.
    pub volatility: Volatility,
    /// Its text.
    pub text: String,
    /// From a layer the operator marked public (the opening header counts as public).
    #[serde(default)]
    pub public: bool,
}

/// What the synthesizer did to one layer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct LayerReport {
    /// The layer.
    pub kind: LayerKind,
    /// Its budget.
    pub budget: usize,
    /// Tokens kept.
    pub tokens: usize,
    /// Lines spilled to working memory.
    pub spilled: Vec<String>,
}

/// A built prompt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BuiltContext {
    /// The prompt, in order.
    pub segments: Vec<Segment>,
    /// Bytes of the stable prefix (step 1) at the start of the prompt text.
    pub stable_prefix_len: usize,
    /// SHA-256 of the stable prefix text.
    pub stable_prefix_hash: [u8; 32],
    /// Per-layer reports, in prompt order.
    pub layers: Vec<LayerReport>,
    /// How the prompt was fitted, when the request asked.
    #[serde(default)]
    pub fit: Option<FitReport>,
}

impl BuiltContext {
    /// The whole prompt text.
    pub fn text(&self) -> String {
        self.segments.iter().map(|s| s.text.as_str()).collect()
    }

    /// How many leading segments are public: the opening header and the public layers up to
    /// the first one that is not. Only these may share KV blocks across tenants, since a
    /// block's hash chains over everything before it.
    pub fn public_segments(&self) -> usize {
        let n = self.segments.iter().take_while(|s| s.public).count();
        // The header alone shares nothing worth a block.
        if n <= 1 { 0 } else { n }
    }

    /// The stable prefix hash in hex.
    pub fn stable_prefix_hex(&self) -> String {
        self.stable_prefix_hash
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }
}

/// Builds the prompt (see the module docs).
pub fn build(
    req: &ContextRequest<'_>,
    counter: &dyn TokenCounter,
) -> Result<BuiltContext, ContextError> {
    if req.user_message.trim().is_empty() {
        return Err(ContextError::EmptyMessage);
    }
    let mut seen = Vec::new();
    for l in req.layers {
        if seen.contains(&l.kind) {
            return Err(ContextError::DuplicateLayer { kind: l.kind });
        }
        if !(0.0..=1.0).contains(&l.importance) {
            return Err(ContextError::InvalidImportance {
                kind: l.kind,
                value: l.importance,
            });
        }
        seen.push(l.kind);
    }
    let (fitted, scale) = match req.fit {
        Some(fit) => fitted_layers(req.layers, fit, counter),
        None => (Cow::Borrowed(req.layers), 1.0),
    };
    let of_class = |v: Volatility| {
        let mut ls: Vec<&Layer> = fitted.iter().filter(|l| l.volatility == v).collect();
        ls.sort_by_key(|l| LayerKind::ALL.iter().position(|k| *k == l.kind));
        ls
    };
    let mut segments = Vec::new();
    let mut reports = Vec::new();
    let mut push_layer = |segments: &mut Vec<Segment>, l: &Layer| {
        // Stable and slow layers are fitted without the user's message, so their text (and the
        // prefix hash) depends on their content alone and their KV is reused turn after turn.
        let turn = if l.volatility == Volatility::Volatile {
            req.user_message
        } else {
            ""
        };
        let s = synthesize(&l.content, l.budget, turn, counter);
        reports.push(LayerReport {
            kind: l.kind,
            budget: l.budget,
            tokens: s.tokens,
            spilled: s.spilled,
        });
        if !s.text.is_empty() {
            segments.push(Segment {
                source: l.kind.source(),
                importance: l.importance,
                volatility: l.volatility,
                text: format!("## {}\n{}\n\n", l.kind.title(), s.text),
                public: l.public,
            });
        }
    };
    let header = |source, volatility, text: &str| Segment {
        source,
        importance: 1.0,
        volatility,
        text: text.to_string(),
        public: false,
    };
    let format = req.format;
    segments.push(Segment {
        public: true,
        ..header(
            SourceLayer::Axioms,
            Volatility::Stable,
            &format.first_system_pre,
        )
    });
    for l in of_class(Volatility::Stable) {
        push_layer(&mut segments, l);
    }
    if !req.instructions.is_empty() {
        segments.push(header(
            SourceLayer::Rules,
            Volatility::Stable,
            req.instructions,
        ));
    }
    let stable_prefix_len: usize = segments.iter().map(|s| s.text.len()).sum();
    let stable_prefix_hash: [u8; 32] = {
        let mut h = Sha256::new();
        segments.iter().for_each(|s| h.update(s.text.as_bytes()));
        h.finalize().into()
    };
    for l in of_class(Volatility::Slow) {
        push_layer(&mut segments, l);
    }
    // The system message's end belongs to the layer before it.
    let last = segments.last().map_or(SourceLayer::Axioms, |s| s.source);
    segments.push(header(last, Volatility::Slow, &format.system.post));
    let conversation = segments.len();
    let turns: Vec<Segment> = req
        .history
        .iter()
        .map(|t| {
            let (source, role) = t.speaker.role();
            Segment {
                source,
                importance: 0.5,
                volatility: Volatility::Slow,
                text: format.message(role, &t.text),
                public: false,
            }
        })
        .collect();
    let volatile = of_class(Volatility::Volatile);
    if !volatile.is_empty() {
        segments.push(header(
            SourceLayer::SystemState,
            Volatility::Volatile,
            &format.system.pre,
        ));
        for l in volatile {
            push_layer(&mut segments, l);
        }
        segments.push(header(
            SourceLayer::SystemState,
            Volatility::Volatile,
            &format.system.post,
        ));
    }
    segments.push(Segment {
        source: SourceLayer::UserTurn,
        importance: 0.5,
        volatility: Volatility::Volatile,
        text: format!(
            "{}{}",
            format.message(
                match req.message_speaker {
                    Speaker::Tool => FrameRole::Tool,
                    Speaker::User | Speaker::Assistant | Speaker::System => FrameRole::User,
                },
                req.user_message
            ),
            format.generation
        ),
        public: false,
    });
    let (first, fit) = match req.fit {
        None => (0, None),
        Some(fit) => {
            let costs: Vec<usize> = turns.iter().map(|t| counter.count(&t.text)).collect();
            let fixed: usize = segments.iter().map(|s| counter.count(&s.text)).sum();
            let layers: usize =
                fitted.iter().map(|l| l.budget).sum::<usize>() + absent_memories(&fitted);
            // The request's own system text takes its room from the window, every turn alike.
            let instructions = counter.count(req.instructions);
            let window = fit
                .context
                .saturating_sub(layers.min(fit.context / 2) + instructions + fit.context / 8);
            let mut first = window_start(&costs, req.history, window);
            // This turn's own message and reply may need more: leave more out, for it only.
            let mut used: usize = costs[first..].iter().sum();
            while fixed + used + fit.reply > fit.context && first < costs.len() {
                let next = next_user_turn(req.history, first + 1);
                used -= costs[first..next].iter().sum::<usize>();
                first = next;
            }
            if fixed + used + fit.reply > fit.context {
                return Err(ContextError::Overflow {
                    needed: fixed + fit.reply,
                    context: fit.context,
                });
            }
            let report = FitReport {
                scale,
                window,
                dropped_turns: first,
                prompt_tokens: fixed + used,
            };
            (first, Some(report))
        }
    };
    let tail = segments.split_off(conversation);
    segments.extend(turns.into_iter().skip(first));
    segments.extend(tail);
    Ok(BuiltContext {
        segments,
        stable_prefix_len,
        stable_prefix_hash,
        layers: reports,
        fit,
    })
}

/// The layers with their claims scaled so that they sum to at most half of the context (with
/// the memories layer's standard budget counted when it is absent and recall may add it), and
/// the scale. A stable layer claims the lesser of its budget and what its text takes whole;
/// slow and volatile layers claim their budgets, so that what they hold this turn (a recall, a
/// changed partner fact) never moves the stable layers' budgets and with them the prefix.
fn fitted_layers<'a>(
    layers: &'a [Layer],
    fit: Fit,
    counter: &dyn TokenCounter,
) -> (Cow<'a, [Layer]>, f64) {
    let claims: Vec<usize> = layers
        .iter()
        .map(|l| match l.volatility {
            Volatility::Stable => l.budget.min(content_tokens(&l.content, counter)),
            Volatility::Slow | Volatility::Volatile => l.budget,
        })
        .collect();
    let reserve = if fit.recall {
        absent_memories(layers)
    } else {
        0
    };
    let total: usize = claims.iter().sum::<usize>() + reserve;
    let share = fit.context / 2;
    if total <= share {
        return (Cow::Borrowed(layers), 1.0);
    }
    let scale = share as f64 / total as f64;
    let scaled = layers
        .iter()
        .zip(&claims)
        .map(|(l, &claim)| Layer {
            budget: (claim as f64 * scale).floor() as usize,
            ..l.clone()
        })
        .collect::<Vec<_>>();
    (Cow::Owned(scaled), scale)
}

/// The memories layer's standard budget when `layers` has none: recall may add it any turn, and
/// the window must not move when it does.
fn absent_memories(layers: &[Layer]) -> usize {
    if layers.iter().any(|l| l.kind == LayerKind::Memories) {
        0
    } else {
        crate::Budgets::standard().get(LayerKind::Memories)
    }
}

/// The first user turn at or after `from` (or the end).
fn next_user_turn(history: &[Turn], from: usize) -> usize {
    (from..history.len())
        .find(|&i| history[i].speaker == Speaker::User)
        .unwrap_or(history.len())
}

/// Where the steady window of `window` tokens starts, replayed from the first turn: each time
/// the conversation outgrows the window, its oldest turns leave (from a user turn on) until it
/// holds at most half of it. A function of the conversation alone, so every build agrees, and
/// the start moves in steps, each leaving room for many turns.
fn window_start(costs: &[usize], history: &[Turn], window: usize) -> usize {
    let (mut first, mut used) = (0, 0);
    for (i, &c) in costs.iter().enumerate() {
        used += c;
        if used > window {
            while used > window / 2 && first <= i {
                let next = next_user_turn(history, first + 1).min(i + 1);
                used -= costs[first..next].iter().sum::<usize>();
                first = next;
            }
        }
    }
    first
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Chars;
    impl TokenCounter for Chars {
        fn count(&self, text: &str) -> usize {
            text.len().div_ceil(4)
        }
    }

    fn agent(time: &str) -> Vec<Layer> {
        vec![
            Layer::new(LayerKind::CurrentTime, time),
            Layer::new(LayerKind::Memories, "the user likes tea"),
            Layer::new(LayerKind::Identity, "I am Engram's demo agent"),
            Layer::new(LayerKind::Axioms, "! be honest"),
            Layer::new(LayerKind::Affect, "calm"),
        ]
    }

    #[test]
    fn layers_are_ordered_by_volatility() {
        let layers = agent("2026-11-21 09:00");
        let history = [
            Turn {
                speaker: Speaker::User,
                text: "hi".into(),
            },
            Turn {
                speaker: Speaker::Assistant,
                text: "hello".into(),
            },
        ];
        let req = ContextRequest {
            instructions: "",
            format: &crate::CHATML,
            layers: &layers,
            history: &history,
            user_message: "what do I like?",
            fit: None,
            message_speaker: Speaker::User,
        };
        let built = build(&req, &Chars).unwrap();
        let text = built.text();
        let at = |needle: &str| text.find(needle).unwrap();
        assert!(at("## Axioms") < at("## Identity"));
        assert!(at("## Identity") < at("<|im_start|>user\nhi"));
        // Recalled memories depend on the message: after the conversation, first of the
        // volatile block.
        assert!(at("<|im_start|>assistant\nhello") < at("## Memories"));
        assert!(at("## Memories") < at("## Current time"));
        assert!(at("## Current time") < at("## Affect"));
        assert!(at("## Affect") < at("what do I like?"));
        assert!(text.ends_with("<|im_start|>assistant\n"));
        assert_eq!(
            &text[..built.stable_prefix_len],
            "<|im_start|>system\n## Axioms\n! be honest\n\n## Identity\nI am Engram's demo agent\n\n"
        );
        let sources: Vec<_> = built.segments.iter().map(|s| s.source).collect();
        assert!(sources.contains(&SourceLayer::CurrentTime));
        assert_eq!(built.layers.len(), 5);
    }

    #[test]
    fn only_the_volatile_block_changes_between_turns() {
        let a = build(
            &ContextRequest {
                instructions: "",
                format: &crate::CHATML,
                layers: &agent("09:00"),
                history: &[],
                user_message: "q1",
                fit: None,
                message_speaker: Speaker::User,
            },
            &Chars,
        )
        .unwrap();
        let b = build(
            &ContextRequest {
                instructions: "",
                format: &crate::CHATML,
                layers: &agent("09:05"),
                history: &[],
                user_message: "q1",
                fit: None,
                message_speaker: Speaker::User,
            },
            &Chars,
        )
        .unwrap();
        assert_eq!(a.stable_prefix_hash, b.stable_prefix_hash);
        let (ta, tb) = (a.text(), b.text());
        let common = ta
            .bytes()
            .zip(tb.bytes())
            .take_while(|(x, y)| x == y)
            .count();
        assert!(
            common >= ta.find("<|im_end|>").unwrap(),
            "the clock moved the prefix"
        );
        // Editing a stable layer changes the hash.
        let mut edited = agent("09:00");
        edited[3].content = "! be kind".into();
        let c = build(
            &ContextRequest {
                instructions: "",
                format: &crate::CHATML,
                layers: &edited,
                history: &[],
                user_message: "q1",
                fit: None,
                message_speaker: Speaker::User,
            },
            &Chars,
        )
        .unwrap();
        assert_ne!(a.stable_prefix_hash, c.stable_prefix_hash);
    }

    #[test]
    fn over_budget_layers_spill_and_bad_input_is_refused() {
        let mut layers = agent("now");
        layers[1].content = (0..50).map(|i| format!("memory line {i}\n")).collect();
        layers[1].budget = 20;
        let built = build(
            &ContextRequest {
                instructions: "",
                format: &crate::CHATML,
                layers: &layers,
                history: &[],
                user_message: "tell me memory line 42",
                fit: None,
                message_speaker: Speaker::User,
            },
            &Chars,
        )
        .unwrap();
        let mem = built
            .layers
            .iter()
            .find(|r| r.kind == LayerKind::Memories)
            .unwrap();
        assert!(mem.tokens <= 20);
        assert!(!mem.spilled.is_empty());
        assert!(
            built.text().contains("memory line 42"),
            "the relevant line is kept"
        );
        let dup = [
            Layer::new(LayerKind::Soul, "a"),
            Layer::new(LayerKind::Soul, "b"),
        ];
        let req = ContextRequest {
            instructions: "",
            format: &crate::CHATML,
            layers: &dup,
            history: &[],
            user_message: "x",
            fit: None,
            message_speaker: Speaker::User,
        };
        assert!(matches!(
            build(&req, &Chars),
            Err(ContextError::DuplicateLayer {
                kind: LayerKind::Soul
            })
        ));
        let req = ContextRequest {
            instructions: "",
            format: &crate::CHATML,
            layers: &[],
            history: &[],
            user_message: "  ",
            fit: None,
            message_speaker: Speaker::User,
        };
        assert_eq!(build(&req, &Chars), Err(ContextError::EmptyMessage));
    }

    #[test]
    fn only_a_leading_run_of_public_layers_is_public() {
        let public_run = |marks: &[LayerKind]| {
            let mut layers = agent("noon");
            layers.push(Layer::new(LayerKind::Rules, "answer briefly"));
            for l in &mut layers {
                l.public = marks.contains(&l.kind);
            }
            let req = ContextRequest {
                instructions: "",
                format: &crate::CHATML,
                layers: &layers,
                history: &[],
                user_message: "hi",
                fit: None,
                message_speaker: Speaker::User,
            };
            let built = build(&req, &Chars).unwrap();
            let n = built.public_segments();
            built.segments[..n]
                .iter()
                .map(|s| s.source)
                .collect::<Vec<_>>()
        };
        use LayerKind::*;
        use SourceLayer as S;
        // Header, axioms, identity; rules is not public, so nothing after it is either.
        assert_eq!(
            public_run(&[Axioms, Identity, Memories]),
            [S::Axioms, S::Axioms, S::Identity]
        );
        // Identity alone follows a private axioms layer: nothing is shared.
        assert!(public_run(&[Identity]).is_empty());
        assert!(public_run(&[]).is_empty());
    }

    #[test]
    fn an_over_budget_stable_layer_does_not_depend_on_the_message() {
        let mut layers = agent("noon");
        layers[3].content = (0..50).map(|i| format!("axiom number {i}\n")).collect();
        layers[3].budget = 20;
        let hash = |msg: &str| {
            let req = ContextRequest {
                instructions: "",
                format: &crate::CHATML,
                layers: &layers,
                history: &[],
                user_message: msg,
                fit: None,
                message_speaker: Speaker::User,
            };
            let built = build(&req, &Chars).unwrap();
            assert!(!built.layers[0].spilled.is_empty());
            built.stable_prefix_hash
        };
        assert_eq!(
            hash("what is axiom number 42?"),
            hash("and axiom number 7?")
        );
    }

    fn said(n: usize) -> Vec<Turn> {
        (0..n)
            .map(|i| Turn {
                speaker: if i % 2 == 0 {
                    Speaker::User
                } else {
                    Speaker::Assistant
                },
                text: format!("turn {i}: {}", "words of the conversation ".repeat(4)),
            })
            .collect()
    }

    #[test]
    fn slow_layers_do_not_depend_on_the_message() {
        let mut layers = agent("noon");
        let mut partner = Layer::new(LayerKind::Partner, "");
        partner.content = (0..50).map(|i| format!("partner fact {i}\n")).collect();
        partner.budget = 20;
        layers.push(partner);
        let history = said(2);
        let before_conversation = |msg: &str| {
            let built = build(
                &ContextRequest {
                    instructions: "",
                    format: &crate::CHATML,
                    layers: &layers,
                    history: &history,
                    user_message: msg,
                    fit: None,
                    message_speaker: Speaker::User,
                },
                &Chars,
            )
            .unwrap();
            let text = built.text();
            text[..text.find("<|im_start|>user").unwrap()].to_string()
        };
        assert_eq!(
            before_conversation("tell me partner fact 42"),
            before_conversation("tell me partner fact 7")
        );
    }

    /// 200 turns in a small context: every prompt and its reply fit, the window moves in a few
    /// steps, and between two steps each prompt starts with the previous one's prefix.
    #[test]
    fn a_long_conversation_is_windowed_in_steps_and_always_fits() {
        let fit = Fit {
            context: 2_000,
            reply: 100,
            recall: true,
        };
        let layers = agent("noon");
        let history = said(400);
        let (mut steps, mut last_dropped, mut last_prefix) = (0, 0, String::new());
        for n in (0..=400).step_by(2) {
            let built = build(
                &ContextRequest {
                    instructions: "",
                    format: &crate::CHATML,
                    layers: &layers,
                    history: &history[..n],
                    user_message: "and then?",
                    fit: Some(fit),
                    message_speaker: Speaker::User,
                },
                &Chars,
            )
            .unwrap();
            let report = built.fit.unwrap();
            assert!(
                report.prompt_tokens + fit.reply <= fit.context,
                "{report:?}"
            );
            let counted: usize = built.segments.iter().map(|s| Chars.count(&s.text)).sum();
            assert_eq!(counted, report.prompt_tokens);
            assert!(report.dropped_turns >= last_dropped);
            assert_eq!(
                report.dropped_turns % 2,
                0,
                "a window starts at a user turn"
            );
            let text = built.text();
            if report.dropped_turns == last_dropped {
                assert!(text.starts_with(&last_prefix), "turn {n}: the prefix moved");
            } else {
                steps += 1;
            }
            last_dropped = report.dropped_turns;
            // The canonical prefix: everything before the volatile block.
            last_prefix = built
                .segments
                .iter()
                .take_while(|s| s.volatility != Volatility::Volatile)
                .map(|s| s.text.as_str())
                .collect();
        }
        assert!(last_dropped > 0, "the window never moved");
        // Steps, not a slide: each one leaves room for several turns.
        assert!((2..=60).contains(&steps), "{steps} steps for 200 turns");
    }

    #[test]
    fn layers_over_half_the_context_are_scaled_and_a_message_too_long_is_refused() {
        let mut layers = agent("noon");
        layers[3].content = (0..400).map(|i| format!("axiom number {i}\n")).collect();
        layers[3].budget = 5_000;
        let fit = Fit {
            context: 2_000,
            reply: 100,
            recall: true,
        };
        let built = build(
            &ContextRequest {
                instructions: "",
                format: &crate::CHATML,
                layers: &layers,
                history: &said(6),
                user_message: "hi",
                fit: Some(fit),
                message_speaker: Speaker::User,
            },
            &Chars,
        )
        .unwrap();
        let report = built.fit.unwrap();
        assert!(report.scale < 1.0, "{report:?}");
        let layer_tokens: usize = built.layers.iter().map(|r| r.tokens).sum();
        assert!(layer_tokens <= fit.context / 2, "{layer_tokens}");
        assert!(report.prompt_tokens + fit.reply <= fit.context);
        let long = "word ".repeat(2_000);
        let err = build(
            &ContextRequest {
                instructions: "",
                format: &crate::CHATML,
                layers: &layers,
                history: &said(6),
                user_message: &long,
                fit: Some(fit),
                message_speaker: Speaker::User,
            },
            &Chars,
        )
        .unwrap_err();
        assert!(
            matches!(err, ContextError::Overflow { context: 2_000, .. }),
            "{err}"
        );
    }

    #[test]
    fn a_request_s_system_text_is_one_stable_segment_never_cut() {
        let layers = agent("09:00");
        // Far over the rules budget (600 tokens): ~2,500 tokens by this counter.
        let system = "Always answer in French. ".repeat(400);
        let fit = Fit {
            context: 8_192,
            reply: 256,
            recall: false,
        };
        let req = |instructions: &'static str, history: &'static [Turn]| ContextRequest {
            instructions,
            format: &crate::CHATML,
            layers: &[],
            history,
            user_message: "hi",
            fit: Some(fit),
            message_speaker: Speaker::User,
        };
        let system: &'static str = Box::leak(system.into_boxed_str());
        let mut with = req(system, &[]);
        with.layers = &layers;
        let built = build(&with, &Chars).unwrap();
        let seg = built
            .segments
            .iter()
            .find(|s| s.text == system)
            .expect("the system text is one segment, whole");
        assert_eq!(seg.volatility, Volatility::Stable);
        // After the stable layers, inside the stable prefix (so it is pinned with it).
        let text = built.text();
        assert!(text.find("## Identity").unwrap() < text.find(system).unwrap());
        assert!(built.stable_prefix_len >= text.find(system).unwrap() + system.len());
        let mut without = req("", &[]);
        without.layers = &layers;
        let plain = build(&without, &Chars).unwrap();
        assert_ne!(built.stable_prefix_hash, plain.stable_prefix_hash);
        // Nothing spilled: it is not a layer.
        assert!(built.layers.iter().all(|l| l.spilled.is_empty()));
        // The window gives it its room: the window shrinks by its size.
        let w = |b: &BuiltContext| b.fit.unwrap().window;
        assert_eq!(w(&plain) - w(&built), Chars.count(system));
        // A prompt that cannot hold it is an overflow, with the sizes.
        let huge: &'static str = Box::leak("x".repeat(40_000).into_boxed_str());
        let err = build(&req(huge, &[]), &Chars).unwrap_err();
        assert!(
            matches!(err, ContextError::Overflow { needed, context: 8_192 } if needed > 10_000),
            "{err}"
        );
    }

    #[test]
    fn stable_layers_that_fit_are_kept_whole_and_recall_keeps_its_budget_free() {
        // Five stable layers with budgets far over their text: one of ~900 tokens, four of
        // ~150 (1,500 in all) in a 4,000-token context (2,000 for the layers). Each claims what
        // it holds, so without the memory graph they are kept whole; with it, the memories
        // layer's standard budget (1,100) is kept free and the layers are scaled.
        let kinds = [
            LayerKind::Axioms,
            LayerKind::Identity,
            LayerKind::Rules,
            LayerKind::Capabilities,
            LayerKind::Soul,
        ];
        let layers: Vec<Layer> = kinds
            .iter()
            .enumerate()
            .map(|(k, &kind)| {
                let mut l = Layer::new(kind, "");
                let lines = if k == 0 { 90 } else { 15 };
                l.content = (0..lines)
                    .map(|i| format!("line {i:02} of layer {k} says a thing\n"))
                    .collect();
                l.budget = 65_536;
                l
            })
            .collect();
        assert!(layers.iter().all(|l| l.volatility == Volatility::Stable));
        let whole: usize = layers
            .iter()
            .map(|l| content_tokens(&l.content, &Chars))
            .sum();
        assert!((900..=2_000).contains(&whole), "{whole}");
        let with = |recall| {
            build(
                &ContextRequest {
                    instructions: "",
                    format: &crate::CHATML,
                    layers: &layers,
                    history: &[],
                    user_message: "hi",
                    fit: Some(Fit {
                        context: 4_000,
                        reply: 100,
                        recall,
                    }),
                    message_speaker: Speaker::User,
                },
                &Chars,
            )
            .unwrap()
        };
        let off = with(false);
        assert_eq!(off.fit.unwrap().scale, 1.0);
        assert!(
            off.layers.iter().all(|r| r.spilled.is_empty()),
            "{:?}",
            off.layers
        );
        assert_eq!(off.layers.iter().map(|r| r.tokens).sum::<usize>(), whole);
        let on = with(true);
        assert!(on.fit.unwrap().scale < 1.0);
        let kept: usize = on.layers.iter().map(|r| r.tokens).sum();
        // The layers' part of the share next to the 1,100 kept free for recall.
        assert!(
            kept < whole && kept <= 2_000 * whole / (whole + 1_100),
            "{kept}"
        );
        // Every layer keeps a share of what it holds: the small ones are not starved.
        assert!(on.layers.iter().all(|r| r.tokens > 0), "{:?}", on.layers);
    }

    #[test]
    fn tool_results_keep_the_tool_role_and_may_be_the_message() {
        let history = [
            Turn {
                speaker: Speaker::User,
                text: "weather in Paris?".into(),
            },
            Turn {
                speaker: Speaker::Tool,
                text: "sunny".into(),
            },
        ];
        let built = build(
            &ContextRequest {
                instructions: "",
                format: &crate::CHATML,
                layers: &agent("noon"),
                history: &history,
                user_message: "21 degrees",
                message_speaker: Speaker::Tool,
                fit: None,
            },
            &Chars,
        )
        .unwrap();
        let text = built.text();
        assert!(
            text.contains("<|im_start|>tool\nsunny<|im_end|>\n"),
            "{text}"
        );
        assert!(
            text.ends_with("<|im_start|>tool\n21 degrees<|im_end|>\n<|im_start|>assistant\n"),
            "{text}"
        );
    }
}
