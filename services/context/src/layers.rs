//! Prompt layers, their default budgets and how volatile each one is.

use engram_kvcore::SourceLayer;
use serde::{Deserialize, Serialize};

/// The kinds of layer an agent has (a subset of the KV source layers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum LayerKind {
    /// Non-negotiable principles.
    Axioms,
    /// Who the agent is.
    Identity,
    /// System knowledge and rules.
    Rules,
    /// Tools and skills.
    Capabilities,
    /// Character.
    Soul,
    /// What the agent knows about its conversation partner.
    Partner,
    /// Learned associations.
    Neurons,
    /// Recalled memories.
    Memories,
    /// Live system state.
    SystemState,
    /// The clock.
    CurrentTime,
    /// Mood.
    Affect,
    /// Situational awareness.
    Awareness,
}

/// How often a layer changes, which decides where it sits in the prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Volatility {
    /// Changes only when an operator edits it: first, in a fixed order, hashed and pinned.
    Stable,
    /// Changes between sessions or every few turns: after the stable prefix.
    Slow,
    /// Changes every turn: in the trailing block just before the new user message.
    Volatile,
}

impl LayerKind {
    /// The name as it is stored and as the API spells it (serde's `snake_case`).
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Axioms => "axioms",
            Self::Identity => "identity",
            Self::Rules => "rules",
            Self::Capabilities => "capabilities",
            Self::Soul => "soul",
            Self::Partner => "partner",
            Self::Neurons => "neurons",
            Self::Memories => "memories",
            Self::SystemState => "system_state",
            Self::CurrentTime => "current_time",
            Self::Affect => "affect",
            Self::Awareness => "awareness",
        }
    }

    /// The kind [`LayerKind::as_str`] names, if any.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.as_str() == name)
    }

    /// Every kind, in prompt order within its volatility class.
    pub const ALL: [Self; 12] = [
        Self::Axioms,
        Self::Identity,
        Self::Rules,
        Self::Capabilities,
        Self::Soul,
        Self::Partner,
        Self::Neurons,
        Self::Memories,
        Self::SystemState,
        Self::CurrentTime,
        Self::Affect,
        Self::Awareness,
    ];

    /// The KV source layer blocks of this layer are tagged with.
    pub fn source(self) -> SourceLayer {
        match self {
            Self::Axioms => SourceLayer::Axioms,
            Self::Identity => SourceLayer::Identity,
            Self::Rules => SourceLayer::Rules,
            Self::Capabilities => SourceLayer::Capabilities,
            Self::Soul => SourceLayer::Soul,
            Self::Partner => SourceLayer::Partner,
            Self::Neurons => SourceLayer::Neurons,
            Self::Memories => SourceLayer::Memories,
            Self::SystemState => SourceLayer::SystemState,
            Self::CurrentTime => SourceLayer::CurrentTime,
            Self::Affect => SourceLayer::Affect,
            Self::Awareness => SourceLayer::Awareness,
        }
    }

    /// Default volatility: axioms, identity, rules, capabilities and soul are stable; partner,
    /// neurons and memories slow; system state, time, affect and awareness volatile.
    pub fn default_volatility(self) -> Volatility {
        match self {
            Self::Axioms | Self::Identity | Self::Rules | Self::Capabilities | Self::Soul => {
                Volatility::Stable
            }
            Self::Partner | Self::Neurons => Volatility::Slow,
            // Recalled for each message: after the conversation, so it never invalidates it.
            Self::Memories
            | Self::SystemState
            | Self::CurrentTime
            | Self::Affect
            | Self::Awareness => Volatility::Volatile,
        }
    }

    /// The heading the layer gets in the prompt.
    pub fn title(self) -> &'static str {
        match self {
            Self::Axioms => "Axioms",
            Self::Identity => "Identity",
            Self::Rules => "Rules",
            Self::Capabilities => "Capabilities",
            Self::Soul => "Soul",
            Self::Partner => "Partner",
            Self::Neurons => "Neurons",
            Self::Memories => "Memories",
            Self::SystemState => "System state",
            Self::CurrentTime => "Current time",
            Self::Affect => "Affect",
            Self::Awareness => "Awareness",
        }
    }
}

/// Token budgets per layer kind.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Budgets(Vec<(LayerKind, usize)>);

impl Budgets {
    /// The defaults: axioms 200, identity 300, rules 600, capabilities 1,500, soul 300,
    /// partner 2,000, system state 800, current time 80, neurons 1,600, memories 1,100,
    /// affect 250, awareness 400.
    pub fn standard() -> Self {
        use LayerKind::*;
        Self(vec![
            (Axioms, 200),
            (Identity, 300),
            (Rules, 600),
            (Capabilities, 1_500),
            (Soul, 300),
            (Partner, 2_000),
            (Neurons, 1_600),
            (Memories, 1_100),
            (SystemState, 800),
            (CurrentTime, 80),
            (Affect, 250),
            (Awareness, 400),
        ])
    }

    /// The budgets when the compressed tier is active: neurons 8,000, memories 6,000,
    /// partner 4,000, system state 2,000, awareness 1,200; the rest as standard.
    pub fn expanded() -> Self {
        use LayerKind::*;
        let mut b = Self::standard();
        for (kind, tokens) in [
            (Neurons, 8_000),
            (Memories, 6_000),
            (Partner, 4_000),
            (SystemState, 2_000),
            (Awareness, 1_200),
        ] {
            b.set(kind, tokens);
        }
        b
    }

    /// The budget of `kind`.
    pub fn get(&self, kind: LayerKind) -> usize {
        self.0
            .iter()
            .find(|(k, _)| *k == kind)
            .map_or(0, |&(_, t)| t)
    }

    /// Sets the budget of `kind`.
    pub fn set(&mut self, kind: LayerKind, tokens: usize) {
        match self.0.iter_mut().find(|(k, _)| *k == kind) {
            Some(entry) => entry.1 = tokens,
            None => self.0.push((kind, tokens)),
        }
    }
}

/// One layer of an agent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Layer {
    /// Its kind.
    pub kind: LayerKind,
    /// Its text; one line per fact (see the synthesizer).
    pub content: String,
    /// Token budget.
    pub budget: usize,
    /// Where it sits (an operator may mark any layer stable).
    pub volatility: Volatility,
    /// Importance of its blocks in the KV cache, 0..=1.
    pub importance: f32,
    /// Marked public by the operator: when it and every layer before it are public, its KV
    /// blocks are shared across tenants (see [`crate::BuiltContext::public_segments`]).
    #[serde(default)]
    pub public: bool,
}

impl Layer {
    /// A layer with the standard budget and default volatility.
    pub fn new(kind: LayerKind, content: impl Into<String>) -> Self {
        Self {
            kind,
            content: content.into(),
            budget: Budgets::standard().get(kind),
            volatility: kind.default_volatility(),
            importance: match kind.default_volatility() {
                Volatility::Stable => 0.9,
                Volatility::Slow => 0.6,
                Volatility::Volatile => 0.3,
            },
            public: false,
        }
    }
}

#[cfg(test)]
mod names {
    use super::LayerKind;

    #[test]
    fn a_kind_s_name_is_its_serde_name_and_parses_back() {
        for k in LayerKind::ALL {
            let serde_name = serde_json::to_value(k).ok();
            assert_eq!(
                serde_name.as_ref().and_then(|v| v.as_str()),
                Some(k.as_str())
            );
            assert_eq!(LayerKind::parse(k.as_str()), Some(k));
        }
        assert_eq!(LayerKind::parse("Axioms"), None);
        assert_eq!(LayerKind::parse(""), None);
    }
}
