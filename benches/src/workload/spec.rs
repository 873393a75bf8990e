//! Workload files: the schema, the built-in scenarios, and the plan a run follows (layers
//! resolved and generated, sessions expanded, the request order).

use engram_context::LayerKind;
use engram_kvcore::SplitMix64;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{Result, invalid};

/// How requests are released.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Arrival {
    /// As soon as a worker is free (closed loop, `concurrency` workers).
    #[default]
    Closed,
    /// Open loop: releases at exponential intervals of mean `1 / per_sec` seconds.
    Poisson {
        /// Mean releases per second.
        per_sec: f64,
        /// Seed of the intervals.
        #[serde(default)]
        seed: u64,
    },
}

/// In which order the turns of different sessions are sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Order {
    /// Turn 1 of every session, then turn 2 of every session, … (interleaved).
    #[default]
    RoundRobin,
    /// Every turn of the first session, then of the next, …
    Session,
}

/// What the history's assistant messages are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum History {
    /// The workload's scripted replies: identical prompts on every endpoint.
    #[default]
    Scripted,
    /// What the endpoint answered (prompts may then differ between endpoints).
    Own,
}

/// One layer of an agent: written out, or generated (`lines` lines of filler, `seed`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerSpec {
    /// `axioms`, `identity`, `rules`, `capabilities` or `soul` (the stable layers).
    pub kind: String,
    /// Text (one fact per line).
    #[serde(default)]
    pub content: String,
    /// Generated lines appended to `content` (about 16 tokens each).
    #[serde(default)]
    pub lines: usize,
    /// Seed of the generated lines.
    #[serde(default)]
    pub seed: u64,
}

/// An agent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentSpec {
    /// Name (the request's `model`).
    pub name: String,
    /// Layers, in any order (rendered in the fixed order).
    pub layers: Vec<LayerSpec>,
}

/// `count` sessions of one agent, each with the same number of turns.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SessionGroup {
    /// The agent's name.
    pub agent: String,
    /// Sessions in the group.
    #[serde(default = "one")]
    pub count: usize,
    /// The user messages, in order (with `generated_turns`: generated ones follow).
    #[serde(default)]
    pub turns: Vec<String>,
    /// Generated user messages after `turns`.
    #[serde(default)]
    pub generated_turns: usize,
    /// Seed of the generated messages (each session adds its index).
    #[serde(default)]
    pub seed: u64,
}

fn one() -> usize {
    1
}

fn default_max_tokens() -> usize {
    16
}

/// A workload (see the module docs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Workload {
    /// Short name (used in file names and the report).
    pub name: String,
    /// What it models.
    #[serde(default)]
    pub description: String,
    /// Tokens to generate per request.
    #[serde(default = "default_max_tokens")]
    pub max_tokens: usize,
    /// Requests in flight at most.
    #[serde(default = "one")]
    pub concurrency: usize,
    /// Release pattern.
    #[serde(default)]
    pub arrival: Arrival,
    /// Pause of a session between the end of a turn and its next turn, ms.
    #[serde(default)]
    pub think_ms: u64,
    /// Interleaving of sessions.
    #[serde(default)]
    pub order: Order,
    /// Assistant messages of the history.
    #[serde(default)]
    pub history: History,
    /// Restart the server (`--restart-cmd`) after this many requests.
    #[serde(default)]
    pub restart_after: Option<usize>,
    /// Agents.
    pub agents: Vec<AgentSpec>,
    /// Sessions.
    pub sessions: Vec<SessionGroup>,
}

/// The built-in scenarios: (a) multi-agent round-robin, (b) shared prefix, (c) restart, (d) cold
/// 4K prefills and decode at 4K, one stream, (e) the same with two streams, (f) session openers
/// of agents sharing a platform base and a bot base around their own identities (relocated
/// segment reuse), (g) the same with a follow-up turn, (h) a cold 16K prefill and decode at 16K.
pub const BUILTIN: [(&str, &str); 8] = [
    (
        "multi-agent",
        include_str!("../../workload/multi-agent.json"),
    ),
    (
        "shared-prefix",
        include_str!("../../workload/shared-prefix.json"),
    ),
    ("restart", include_str!("../../workload/restart.json")),
    ("decode-4k", include_str!("../../workload/decode-4k.json")),
    (
        "decode-4k-2",
        include_str!("../../workload/decode-4k-2.json"),
    ),
    (
        "shared-bases",
        include_str!("../../workload/shared-bases.json"),
    ),
    (
        "shared-bases-followup",
        include_str!("../../workload/shared-bases-followup.json"),
    ),
    ("decode-16k", include_str!("../../workload/decode-16k.json")),
];

impl Workload {
    /// A built-in scenario (`a`/`multi-agent`, `b`/`shared-prefix`, `c`/`restart`,
    /// `d`/`decode-4k`, `e`/`decode-4k-2`, `f`/`shared-bases`, `g`/`shared-bases-followup`,
    /// `h`/`decode-16k`) or a file.
    pub fn load(name_or_path: &str) -> Result<Self> {
        let builtin = match name_or_path {
            "a" => Some(BUILTIN[0].1),
            "b" => Some(BUILTIN[1].1),
            "c" => Some(BUILTIN[2].1),
            "d" => Some(BUILTIN[3].1),
            "e" => Some(BUILTIN[4].1),
            "f" => Some(BUILTIN[5].1),
            "g" => Some(BUILTIN[6].1),
            "h" => Some(BUILTIN[7].1),
            n => BUILTIN.iter().find(|(b, _)| *b == n).map(|(_, t)| *t),
        };
        let text = match builtin {
            Some(t) => t.to_string(),
            None => std::fs::read_to_string(name_or_path)
                .map_err(|e| invalid(format!("{name_or_path}: {e}")))?,
        };
        let w: Self =
            serde_json::from_str(&text).map_err(|e| invalid(format!("{name_or_path}: {e}")))?;
        w.plan()?;
        Ok(w)
    }

    /// Resolves layers, sessions and the request order; checks every reference.
    pub fn plan(&self) -> Result<Plan> {
        if self.agents.is_empty() || self.sessions.is_empty() {
            return Err(invalid("needs at least one agent and one session group"));
        }
        if self.concurrency == 0 || self.max_tokens == 0 {
            return Err(invalid("concurrency and max_tokens must be positive"));
        }
        if let Arrival::Poisson { per_sec, .. } = self.arrival
            && !(per_sec > 0.0 && per_sec.is_finite())
        {
            return Err(invalid("arrival.per_sec must be positive"));
        }
        let mut agents = Vec::new();
        for a in &self.agents {
            if agents.iter().any(|p: &PlannedAgent| p.name == a.name) {
                return Err(invalid(format!("agent {:?} twice", a.name)));
            }
            agents.push(plan_agent(a)?);
        }
        let mut sessions = Vec::new();
        for (g, group) in self.sessions.iter().enumerate() {
            let agent = agents
                .iter()
                .position(|a| a.name == group.agent)
                .ok_or_else(|| invalid(format!("session group {g}: no agent {:?}", group.agent)))?;
            if group.turns.len() + group.generated_turns == 0 {
                return Err(invalid(format!("session group {g}: no turns")));
            }
            for i in 0..group.count {
                let mut rng = SplitMix64::new(group.seed.wrapping_add(i as u64 * 0x9E37));
                let mut turns: Vec<(String, String)> = group
                    .turns
                    .iter()
                    .map(|t| (t.clone(), scripted_reply(t)))
                    .collect();
                for _ in 0..group.generated_turns {
                    let t = generated_question(&mut rng);
                    let r = scripted_reply(&t);
                    turns.push((t, r));
                }
                sessions.push(PlannedSession {
                    id: format!("{}-g{g}-{i}", group.agent),
                    agent,
                    turns,
                });
            }
        }
        let longest = sessions.iter().map(|s| s.turns.len()).max().unwrap_or(0);
        let mut schedule = Vec::new();
        match self.order {
            Order::RoundRobin => {
                for t in 0..longest {
                    for (s, sess) in sessions.iter().enumerate() {
                        if t < sess.turns.len() {
                            schedule.push((s, t));
                        }
                    }
                }
            }
            Order::Session => {
                for (s, sess) in sessions.iter().enumerate() {
                    schedule.extend((0..sess.turns.len()).map(|t| (s, t)));
                }
            }
        }
        if let Some(r) = self.restart_after
            && (r == 0 || r >= schedule.len())
        {
            return Err(invalid(format!(
                "restart_after must be within 1..{}",
                schedule.len()
            )));
        }
        Ok(Plan {
            agents,
            sessions,
            schedule,
        })
    }
}

/// An agent with its layers resolved.
#[derive(Debug, Clone)]
pub struct PlannedAgent {
    /// Name.
    pub name: String,
    /// `(kind, text)` in prompt order.
    pub layers: Vec<(LayerKind, String)>,
    /// The system message: every layer as Engram renders a stable layer.
    pub system: String,
}

/// A session with its turns `(user message, scripted reply)`.
#[derive(Debug, Clone)]
pub struct PlannedSession {
    /// Session id.
    pub id: String,
    /// Index into [`Plan::agents`].
    pub agent: usize,
    /// Turns.
    pub turns: Vec<(String, String)>,
}

/// A resolved workload.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Agents.
    pub agents: Vec<PlannedAgent>,
    /// Sessions.
    pub sessions: Vec<PlannedSession>,
    /// Requests in release order: `(session, turn)`.
    pub schedule: Vec<(usize, usize)>,
}

fn plan_agent(a: &AgentSpec) -> Result<PlannedAgent> {
    let mut layers: Vec<(LayerKind, String)> = Vec::new();
    for l in &a.layers {
        let kind: LayerKind = serde_json::from_value(Value::String(l.kind.clone()))
            .map_err(|_| invalid(format!("agent {:?}: unknown layer {:?}", a.name, l.kind)))?;
        if !matches!(
            kind,
            LayerKind::Axioms
                | LayerKind::Identity
                | LayerKind::Rules
                | LayerKind::Capabilities
                | LayerKind::Soul
        ) {
            return Err(invalid(format!(
                "agent {:?}: layer {:?}: only the stable layers (axioms … soul) render the same \
                 on every endpoint",
                a.name, l.kind
            )));
        }
        if layers.iter().any(|(k, _)| *k == kind) {
            return Err(invalid(format!("agent {:?}: {:?} twice", a.name, l.kind)));
        }
        let mut text = l.content.trim().to_string();
        let mut rng = SplitMix64::new(l.seed);
        for _ in 0..l.lines {
            if !text.is_empty() {
                text.push('\n');
            }
            text.push_str(&filler_line(&mut rng));
        }
        if text.is_empty() {
            return Err(invalid(format!(
                "agent {:?}: empty {:?} layer",
                a.name, l.kind
            )));
        }
        layers.push((kind, text));
    }
    layers.sort_by_key(|(k, _)| LayerKind::ALL.iter().position(|x| x == k));
    let system = layers
        .iter()
        .map(|(k, t)| format!("## {}\n{t}\n\n", k.title()))
        .collect();
    Ok(PlannedAgent {
        name: a.name.clone(),
        layers,
        system,
    })
}

const WORDS: [&str; 64] = [
    "account",
    "agent",
    "answer",
    "archive",
    "balance",
    "batch",
    "budget",
    "cache",
    "client",
    "contract",
    "customer",
    "daily",
    "data",
    "deadline",
    "delivery",
    "detail",
    "document",
    "error",
    "escalate",
    "estimate",
    "feature",
    "forecast",
    "invoice",
    "issue",
    "ledger",
    "limit",
    "log",
    "manager",
    "meeting",
    "metric",
    "monthly",
    "note",
    "order",
    "owner",
    "partner",
    "payment",
    "plan",
    "policy",
    "priority",
    "project",
    "quarter",
    "record",
    "refund",
    "region",
    "release",
    "report",
    "request",
    "review",
    "risk",
    "schedule",
    "service",
    "shipment",
    "status",
    "summary",
    "supplier",
    "support",
    "task",
    "team",
    "ticket",
    "update",
    "vendor",
    "version",
    "warehouse",
    "weekly",
];

const VERBS: [&str; 16] = [
    "must",
    "should",
    "never",
    "always",
    "may",
    "will",
    "cannot",
    "needs to",
    "prefers to",
    "tends to",
    "is able to",
    "has to",
    "ought to",
    "is expected to",
    "is allowed to",
    "tries to",
];

const TOPICS: [&str; 16] = [
    "the refund policy",
    "late shipments",
    "the quarterly forecast",
    "an unpaid invoice",
    "the escalation rules",
    "a supplier delay",
    "the weekly report",
    "a failed payment",
    "the release schedule",
    "a budget limit",
    "the support backlog",
    "a contract renewal",
    "the data retention policy",
    "a warehouse audit",
    "a priority ticket",
    "the monthly summary",
];

fn pick<'a>(rng: &mut SplitMix64, from: &[&'a str]) -> &'a str {
    from[(rng.next_u64() % from.len() as u64) as usize]
}

/// One line of filler: "The <w> <verb> <w> the <w> <w> …" (about 16 tokens).
fn filler_line(rng: &mut SplitMix64) -> String {
    let mut words = vec![
        "The".to_string(),
        pick(rng, &WORDS).to_string(),
        pick(rng, &WORDS).to_string(),
        pick(rng, &VERBS).to_string(),
    ];
    for i in 0..(6 + rng.next_u64() % 5) {
        if i == 2 {
            words.push("the".into());
        }
        words.push(pick(rng, &WORDS).to_string());
    }
    format!("{}.", words.join(" "))
}

fn generated_question(rng: &mut SplitMix64) -> String {
    const ASKS: [&str; 6] = [
        "What should I do about",
        "Summarize what you know about",
        "Which rule applies to",
        "Who owns",
        "Give me the next step for",
        "What is the risk with",
    ];
    format!("{} {}?", pick(rng, &ASKS), pick(rng, &TOPICS))
}

fn scripted_reply(question: &str) -> String {
    let topic = question.trim_end_matches('?');
    format!("Noted. I will follow the rules above for: {topic}.")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use serde_json::json;

    use super::*;

    #[test]
    fn the_builtin_scenarios_plan() {
        for (name, _) in BUILTIN {
            let w = Workload::load(name).unwrap();
            let p = w.plan().unwrap();
            assert!(!p.schedule.is_empty(), "{name}");
            // Every (session, turn) once, each session's turns in order.
            let mut seen = vec![0usize; p.sessions.len()];
            for &(s, t) in &p.schedule {
                assert_eq!(seen[s], t, "{name}");
                seen[s] += 1;
            }
        }
        let a = Workload::load("a").unwrap().plan().unwrap();
        assert_eq!(a.agents.len(), 5);
        // About 4K tokens of layered context per agent (~0.75 words per token).
        for agent in &a.agents {
            let words = agent.system.split_whitespace().count();
            assert!((2_800..4_200).contains(&words), "{words}");
        }
        assert!(Workload::load("c").unwrap().restart_after.is_some());
    }

    #[test]
    fn round_robin_interleaves_and_session_order_does_not() {
        let mut w = Workload::load("a").unwrap();
        let p = w.plan().unwrap();
        let first: Vec<usize> = p.schedule.iter().take(5).map(|&(s, _)| s).collect();
        assert_eq!(first, vec![0, 1, 2, 3, 4]);
        w.order = Order::Session;
        let p = w.plan().unwrap();
        assert_eq!(p.schedule[1], (0, 1));
    }

    #[test]
    fn bad_workloads_are_refused_with_a_reason() {
        let base = json!({
            "name": "t",
            "agents": [{"name": "x", "layers": [{"kind": "axioms", "content": "A."}]}],
            "sessions": [{"agent": "x", "turns": ["hi", "again"]}]
        });
        let with = |path: &str, v: Value| {
            let mut b = base.clone();
            *b.pointer_mut(path).unwrap() = v;
            b
        };
        for (bad, why) in [
            (with("/sessions/0/agent", json!("nobody")), "no agent"),
            (with("/agents/0/layers/0/kind", json!("memories")), "stable"),
            (
                with("/agents/0/layers/0/kind", json!("nope")),
                "unknown layer",
            ),
            (with("/agents/0/layers/0/content", json!("")), "empty"),
        ] {
            let w: Workload = serde_json::from_value(bad).unwrap();
            let e = w.plan().unwrap_err().to_string();
            assert!(e.contains(why), "{e}");
        }
        let mut w: Workload = serde_json::from_value(base).unwrap();
        w.restart_after = Some(2);
        assert!(w.plan().unwrap_err().to_string().contains("restart_after"));
        w.restart_after = None;
        w.concurrency = 0;
        assert!(w.plan().is_err());
        assert!(serde_json::from_value::<Workload>(json!({"name": "t", "agentz": []})).is_err());
    }
}
