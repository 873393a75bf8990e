//! Building the prompt: layers fitted to their budgets, then ordered by volatility so that a
//! turn reuses everything the previous turns computed.
//!
//! The exact order (ChatML), each piece a [`Segment`] tagged with its source layer:
//! 1. `<|im_start|>system\n`, then every **stable** layer present, in the fixed order axioms,
//!    identity, rules, capabilities, soul (then any other layer an operator marked stable, in
//!    [`LayerKind::ALL`] order), each as `## Title\n{text}\n\n`;
//! 2. the **slow** layers (partner, neurons, memories) in the same form, closing the system
//!    message with `<|im_end|>\n`;
//! 3. the conversation so far, `<|im_start|>user\n…<|im_end|>\n<|im_start|>assistant\n…<|im_end|>\n`
//!    per turn;
//! 4. the **volatile** block: `<|im_start|>system\n` with system state, current time, affect and
//!    awareness, `<|im_end|>\n` — the only part that changes every turn;
//! 5. the new user message and `<|im_start|>assistant\n`.
//!
//! Nothing that changes per turn sits before the conversation, so turn N's prompt shares with
//! turn N−1's everything up to the end of the conversation both contain. (The turn just finished
//! followed the old volatile block when it was computed; a caller that wants it reused too
//! prefills the canonical prefix — steps 1–3 — once the turn ends.)
//!
//! The stable prefix's hash is SHA-256 over step 1's text; an edit to a stable layer changes it.
//! Stable layers over their budget are fitted without the user's message (importance tags and
//! position only), so the prefix never depends on what the user just asked; the other layers
//! use the overlap with the message too (see [`crate::synth`]).

use engram_kvcore::SourceLayer;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::TokenCounter;
use crate::layers::{Layer, LayerKind, Volatility};
use crate::synth::synthesize;

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
}

/// Who spoke a turn of the conversation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Speaker {
    /// The user.
    User,
    /// The agent.
    Assistant,
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
    let of_class = |v: Volatility| {
        let mut ls: Vec<&Layer> = req.layers.iter().filter(|l| l.volatility == v).collect();
        ls.sort_by_key(|l| LayerKind::ALL.iter().position(|k| *k == l.kind));
        ls
    };
    let mut segments = Vec::new();
    let mut reports = Vec::new();
    let mut push_layer = |segments: &mut Vec<Segment>, l: &Layer| {
        // A stable layer is fitted without the user's message, so its text (and the prefix
        // hash) depends on its content alone and its KV is reused turn after turn.
        let turn = if l.volatility == Volatility::Stable {
            ""
        } else {
            req.user_message
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
    segments.push(Segment {
        public: true,
        ..header(
            SourceLayer::Axioms,
            Volatility::Stable,
            "<|im_start|>system\n",
        )
    });
    for l in of_class(Volatility::Stable) {
        push_layer(&mut segments, l);
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
    segments.push(header(
        SourceLayer::Memories,
        Volatility::Slow,
        "<|im_end|>\n",
    ));
    for t in req.history {
        let (source, role) = match t.speaker {
            Speaker::User => (SourceLayer::UserTurn, "user"),
            Speaker::Assistant => (SourceLayer::AssistantTurn, "assistant"),
        };
        segments.push(Segment {
            source,
            importance: 0.5,
            volatility: Volatility::Slow,
            text: format!("<|im_start|>{role}\n{}<|im_end|>\n", t.text),
            public: false,
        });
    }
    let volatile = of_class(Volatility::Volatile);
    if !volatile.is_empty() {
        segments.push(header(
            SourceLayer::SystemState,
            Volatility::Volatile,
            "<|im_start|>system\n",
        ));
        for l in volatile {
            push_layer(&mut segments, l);
        }
        segments.push(header(
            SourceLayer::SystemState,
            Volatility::Volatile,
            "<|im_end|>\n",
        ));
    }
    segments.push(Segment {
        source: SourceLayer::UserTurn,
        importance: 0.5,
        volatility: Volatility::Volatile,
        text: format!(
            "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n",
            req.user_message
        ),
        public: false,
    });
    Ok(BuiltContext {
        segments,
        stable_prefix_len,
        stable_prefix_hash,
        layers: reports,
    })
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
            layers: &layers,
            history: &history,
            user_message: "what do I like?",
        };
        let built = build(&req, &Chars).unwrap();
        let text = built.text();
        let at = |needle: &str| text.find(needle).unwrap();
        assert!(at("## Axioms") < at("## Identity"));
        assert!(at("## Identity") < at("## Memories"));
        assert!(at("## Memories") < at("<|im_start|>user\nhi"));
        assert!(at("<|im_start|>assistant\nhello") < at("## Current time"));
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
                layers: &agent("09:00"),
                history: &[],
                user_message: "q1",
            },
            &Chars,
        )
        .unwrap();
        let b = build(
            &ContextRequest {
                layers: &agent("09:05"),
                history: &[],
                user_message: "q1",
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
                layers: &edited,
                history: &[],
                user_message: "q1",
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
                layers: &layers,
                history: &[],
                user_message: "tell me memory line 42",
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
            layers: &dup,
            history: &[],
            user_message: "x",
        };
        assert!(matches!(
            build(&req, &Chars),
            Err(ContextError::DuplicateLayer {
                kind: LayerKind::Soul
            })
        ));
        let req = ContextRequest {
            layers: &[],
            history: &[],
            user_message: "  ",
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
                layers: &layers,
                history: &[],
                user_message: "hi",
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
                layers: &layers,
                history: &[],
                user_message: msg,
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
}
