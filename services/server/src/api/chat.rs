//! A chat turn as the OpenAI-style routes run it, whatever their wire format (chat completions,
//! Anthropic messages, responses): the conversation normalized to [`Msg`]s, the agent a
//! `model` names (or the tenant's default one), the session a `user` names, the request's
//! system text and tools as one stable segment, the constraint compiled, the turn prepared —
//! then the caller generates or streams it in its own framing.

use std::sync::Arc;

use engram_context::{Speaker, Turn as Said};
use engram_engine::SamplingParams;
use engram_store::Tenant;
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::api::history;
use crate::api::stream::Job;
use crate::api::tools::{self, Tools};
use crate::error::ApiError;
use crate::state::{AppState, SessionSlot};
use crate::turn::{Generated, Log, Turn, Turned, generate, session_key};

/// A message with its content as text.
#[derive(Debug, Clone, PartialEq)]
pub struct Msg {
    /// `system`, `developer`, `user`, `assistant` or `tool`.
    pub role: String,
    /// Its text.
    pub content: Option<String>,
    /// An assistant message's calls, as OpenAI writes them (`[{id, type, function: {name,
    /// arguments}}]`).
    pub tool_calls: Option<Value>,
}

/// Messages a chat request may carry at most.
pub const MAX_MESSAGES: usize = 1024;
/// Bytes of text one message may carry at most (a system prompt included).
pub const MAX_MESSAGE_BYTES: usize = 256 * 1024;
/// The name of the agent a `model` that names none of the tenant's agents selects.
pub const DEFAULT_AGENT: &str = "default";
/// Bytes a `user` may hold at most.
pub const MAX_USER_BYTES: usize = 256;
/// Stop sequences a request may give at most (OpenAI's bound).
pub const MAX_STOP: usize = 4;

/// 400 unless `messages` has at most [`MAX_MESSAGES`] messages of at most
/// [`MAX_MESSAGE_BYTES`] each: what one request may ask the service to tokenize and hold.
pub fn check_messages(messages: &[Msg]) -> Result<(), ApiError> {
    if messages.len() > MAX_MESSAGES {
        return Err(ApiError::invalid(format!(
            "`messages` may hold at most {MAX_MESSAGES} messages"
        )));
    }
    if messages.iter().any(|m| {
        m.content
            .as_ref()
            .is_some_and(|c| c.len() > MAX_MESSAGE_BYTES)
    }) {
        return Err(ApiError::invalid(format!(
            "a message may hold at most {} KiB of text",
            MAX_MESSAGE_BYTES / 1024
        )));
    }
    Ok(())
}

/// The session a request's `user` names, and the label it is stored with: a valid session name
/// is itself (no label); any other string of 1–256 bytes is `u-` and the first 40 hex digits of
/// its SHA-256, labelled with the string. A name that starts with `u-` is hashed too, so no
/// `user` can name the session another `user` string hashes to.
pub fn session_of_user(user: &str) -> Result<(String, Option<String>), ApiError> {
    if !user.starts_with("u-") && crate::turn::check_name("user", user).is_ok() {
        return Ok((user.to_string(), None));
    }
    if user.is_empty() || user.len() > MAX_USER_BYTES {
        return Err(ApiError::invalid(format!(
            "`user` must be 1 to {MAX_USER_BYTES} bytes"
        )));
    }
    let h = Sha256::digest(user.as_bytes());
    let hex: String = h[..20].iter().map(|b| format!("{b:02x}")).collect();
    Ok((format!("u-{hex}"), Some(user.to_string())))
}

/// The agent `model` names (its name or id), else the tenant's default agent, created with no
/// layers on first use (two requests racing to create it both get the one stored).
pub async fn agent_for(
    state: &AppState,
    tenant: &Tenant,
    model: &str,
) -> Result<engram_store::Agent, ApiError> {
    use engram_store::StoreError;
    let found = |r: Result<engram_store::Agent, StoreError>| match r {
        Ok(a) => Ok(Some(a)),
        Err(StoreError::NotFound { .. }) => Ok(None),
        Err(e) => Err(ApiError::from(e)),
    };
    if let Some(a) = found(state.agents.agent(&state.store, &tenant.id, model).await)? {
        return Ok(a);
    }
    if let Some(a) = found(
        state
            .agents
            .agent(&state.store, &tenant.id, DEFAULT_AGENT)
            .await,
    )? {
        return Ok(a);
    }
    match state
        .store
        .create_agent(
            &tenant.id,
            DEFAULT_AGENT,
            engram_store::MemoryScope::default(),
        )
        .await
    {
        Ok(a) => Ok(a),
        Err(StoreError::Conflict { .. }) => Ok(state
            .agents
            .agent(&state.store, &tenant.id, DEFAULT_AGENT)
            .await?),
        Err(e) => Err(e.into()),
    }
}

/// `stop`: absent, a string or a list of at most [`MAX_STOP`] strings.
pub fn stop_of(stop: &Option<Value>) -> Result<Vec<String>, ApiError> {
    let bad = || ApiError::invalid("`stop` must be a string or a list of strings");
    match stop {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![s.clone()]),
        Some(Value::Array(a)) if a.len() > MAX_STOP => Err(ApiError::invalid(format!(
            "`stop` may hold at most {MAX_STOP} sequences"
        ))),
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| v.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(bad),
        Some(_) => Err(bad()),
    }
}

/// `logit_bias`: token ids (decimal strings) below `vocab` to biases.
pub fn logit_bias_of(bias: &Option<Value>, vocab: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    let Some(map) = bias.as_ref().filter(|b| !b.is_null()) else {
        return Ok(Vec::new());
    };
    let map = map
        .as_object()
        .ok_or_else(|| ApiError::invalid("`logit_bias` must map token ids to numbers"))?;
    map.iter()
        .map(|(k, v)| {
            let id: u32 = k
                .parse()
                .ok()
                .filter(|&id: &u32| (id as usize) < vocab)
                .ok_or_else(|| {
                    ApiError::invalid(format!(
                        "`logit_bias`: `{k}` is not a token id below {vocab}"
                    ))
                })?;
            let b = v
                .as_f64()
                .ok_or_else(|| ApiError::invalid("`logit_bias` values must be numbers"))?;
            Ok((id, b as f32))
        })
        .collect()
}

/// An earlier `user`, `assistant` or `tool` message as a turn of the conversation; an
/// assistant's tool calls follow its text as `<tool_call>` blocks, written as the model
/// writes them (Python's JSON form).
pub fn said(m: &Msg) -> Option<Said> {
    let speaker = match m.role.as_str() {
        "user" => Speaker::User,
        "assistant" => Speaker::Assistant,
        "tool" => Speaker::Tool,
        _ => return None,
    };
    let mut text = m.content.clone().unwrap_or_default();
    if let Some(Value::Array(calls)) = &m.tool_calls {
        for call in calls {
            let f = &call["function"];
            let args = match &f["arguments"] {
                Value::String(s) => serde_json::from_str(s).unwrap_or(Value::String(s.clone())),
                other => other.clone(),
            };
            let mut line = serde_json::Map::new();
            line.insert("name".into(), f["name"].clone());
            line.insert("arguments".into(), args);
            let body = engram_engine::chat_template::python_json(&Value::Object(line));
            text.push_str(&format!(
                "\n{}{body}{}",
                tools::CALL_OPEN,
                tools::CALL_CLOSE
            ));
        }
    }
    Some(Said {
        speaker,
        text: text.trim_start().to_string(),
    })
}

/// The key a stateless conversation's KV is filed (and shadowed) under: the agent's and the
/// conversation's first user message. A client session of the same name would only share the
/// shadow's chain record: blocks are found by their content hash, never by this key.
fn conversation_key(turn: &Turn, messages: &[Msg]) -> engram_kvcore::SessionId {
    let first = messages
        .iter()
        .find(|m| m.role == "user")
        .and_then(|m| m.content.as_deref())
        .unwrap_or_default();
    let h = Sha256::digest(first.as_bytes());
    let hex: String = h[..16].iter().map(|b| format!("{b:02x}")).collect();
    session_key(&turn.agent, &format!("\0conversation/{hex}"))
}

/// A chat request, whatever its wire format.
#[derive(Debug)]
pub struct ChatInput {
    /// The agent's name or id, or any other name (the default agent).
    pub model: String,
    /// The conversation; the last message is the user's or a tool's.
    pub messages: Vec<Msg>,
    /// The session, if any.
    pub user: Option<String>,
    /// Whether the messages before the last are new to the session (a Responses chain's
    /// input items) rather than its conversation resent (a chat request's history).
    pub appends: bool,
    /// The tools offered and the choice.
    pub tools: Tools,
    /// `response_format` (OpenAI's form), if any.
    pub response_format: Option<Value>,
    /// Sampling and stopping (`logit_bias` checked against the vocabulary by the caller).
    pub sampling: SamplingParams,
    /// Choices to generate (1 to [`MAX_CHOICES`]); the first is the session's.
    pub n: usize,
}

/// Choices one request may ask for at most.
pub const MAX_CHOICES: usize = 8;

/// A turn ready to generate: run it with [`run`] or stream it (`stream::pump`).
pub struct Prepared {
    /// The turn.
    pub turn: Turn,
    /// The message it answers.
    pub message: String,
    /// Its built prompt.
    pub turned: Turned,
    /// What to generate.
    pub job: Job,
    /// The generation slot and the session's, held until the turn is recorded.
    pub held: (crate::limits::GenerationSlot, Option<SessionSlot>),
    /// The other choices' jobs (`n` > 1): the same prompt, each with its own seed (the
    /// request's plus its index) and constraint.
    pub more: Vec<Job>,
}

/// Checks the request and prepares its turn (see the module docs): every refusal comes before
/// anything is stored, but for the default agent's creation.
pub async fn prepare(
    state: Arc<AppState>,
    tenant: Tenant,
    input: ChatInput,
) -> Result<Prepared, ApiError> {
    let ChatInput {
        model,
        messages,
        user,
        appends,
        tools,
        response_format,
        sampling,
        n,
    } = input;
    check_messages(&messages)?;
    if !(1..=MAX_CHOICES).contains(&n) {
        return Err(ApiError::invalid(format!("`n` must be 1 to {MAX_CHOICES}")));
    }
    let json_answer = response_format
        .as_ref()
        .is_some_and(|f| !f.is_null() && f.get("type").and_then(Value::as_str) != Some("text"));
    if json_answer && tools.offered() {
        return Err(ApiError::invalid(
            "`response_format` other than text cannot be combined with offered `tools`",
        ));
    }
    let Some((last, earlier)) = messages.split_last() else {
        return Err(ApiError::invalid("`messages` is empty"));
    };
    if !matches!(
        (last.role.as_str(), &last.content),
        ("user" | "tool", Some(_))
    ) {
        return Err(ApiError::invalid(
            "the last message must be the user's or a tool's, with text content",
        ));
    }
    sampling.validate().map_err(ApiError::from)?;
    // The grammar is compiled before anything is stored: a bad schema is a 400 with nothing
    // recorded.
    let constrain = || {
        if tools.constraint_needed() {
            let grammars = tools::grammars(&state)?;
            tools.constraint(&grammars)
        } else {
            tools::response_format(response_format.as_ref(), || tools::grammars(&state))
        }
    };
    let constraint = constrain()?;
    let more_constraints = (1..n).map(|_| constrain()).collect::<Result<Vec<_>, _>>()?;
    let session = user.as_deref().map(session_of_user).transpose()?;
    let agent = agent_for(&state, &tenant, &model).await?;
    let mut turn = Turn::of(
        state,
        tenant,
        agent,
        session.as_ref().map(|(name, _)| name.as_str()),
    )
    .await?;
    turn.session_label = session.and_then(|(_, label)| label);
    let system: Vec<&str> = messages
        .iter()
        .filter(|m| m.role == "system" || m.role == "developer")
        .filter_map(|m| m.content.as_deref())
        .collect();
    let tools_text = match turn.state.engine() {
        Ok(engine) => tools.system_text(engine.tokenizer()),
        Err(_) => String::new(),
    };
    let system = system.join("\n");
    let instructions: Vec<&str> = [system.trim(), tools_text.trim_start()]
        .into_iter()
        .filter(|t| !t.is_empty())
        .collect();
    turn.set_instructions(instructions.join("\n\n"));
    let message = last.content.clone().unwrap_or_default();
    if last.role == "tool" {
        // A tool's result, which the model answers next.
        turn.message_speaker = Speaker::Tool;
    }
    turn.reply = sampling.max_tokens;
    // A `user` session runs one turn at a time, as on the native route.
    let session_slot = turn.hold_session().await?;
    let slot = turn.state.limits.begin_generation(&turn.tenant.id)?;
    let turned = if turn.session.is_some() {
        turn.admit(&message).await?;
        // The resent history against the log: what the log lacks is logged with the turn;
        // where they part, the log forks (`api/history.rs`).
        let sent: Vec<Said> = earlier.iter().filter_map(said).collect();
        let stored = if appends {
            turn.preface = sent;
            turn.history().await?
        } else {
            let (stored, preface) = history::follow(&turn, &sent).await?;
            turn.preface = preface;
            stored
        };
        // Those entries are in the prompt now, logged with the turn.
        let now = engram_memory::now_ms();
        let mut log = stored.clone();
        for t in &turn.preface {
            log.said.push(t.clone());
            log.created.push(now);
        }
        // What the cache lost (of the stored log) is replayed while the memories are
        // recalled.
        turn.prepare(Some(&stored), log, &message).await?
    } else {
        turn.state.engine()?;
        // A stateless conversation's KV is filed under a key of its first user message.
        turn.kv_session = Some(conversation_key(&turn, &messages));
        let log = Log::unstored(earlier.iter().filter_map(said).collect());
        let started = std::time::Instant::now();
        let turned = turn.context(log, &message).await?;
        turn.prepare_ms = started.elapsed().as_secs_f64() * 1e3;
        turned
    };
    let spec = turn.spec(&turned.built, |_| true)?;
    let more = more_constraints
        .into_iter()
        .zip(1u64..)
        .map(|(constraint, i)| Job {
            spec: spec.clone(),
            sampling: SamplingParams {
                seed: sampling.seed.wrapping_add(i),
                ..sampling.clone()
            },
            constraint,
        })
        .collect();
    Ok(Prepared {
        turn,
        message,
        turned,
        job: Job {
            spec,
            sampling,
            constraint,
        },
        held: (slot, session_slot),
        more,
    })
}

/// Generates a prepared turn to the end and records it; answers the turn and the reply.
pub async fn run(p: Prepared) -> Result<(Turn, Generated), ApiError> {
    let (turn, mut choices) = run_choices(p).await?;
    let first = choices.swap_remove(0);
    Ok((turn, first))
}

/// [`run`] for every choice: the first is recorded (the session's reply); the prompt is
/// prefilled once and the choices decode together over its blocks. The first choice's usage
/// tells what the cache held when the request came.
pub async fn run_choices(p: Prepared) -> Result<(Turn, Vec<Generated>), ApiError> {
    let Prepared {
        turn,
        message,
        turned,
        job,
        held,
        more,
    } = p;
    let choices = if more.is_empty() {
        vec![generate(&turn.state, job.spec, job.sampling, job.constraint).await?]
    } else {
        let arrival = crate::turn::prefill(&turn.state, job.spec.clone()).await?;
        let runs = std::iter::once(job)
            .chain(more)
            .map(|j| generate(&turn.state, j.spec, j.sampling, j.constraint));
        let mut all = futures_util::future::try_join_all(runs).await?;
        all[0].usage.cached_tokens = arrival.cached_tokens;
        all
    };
    turn.observe(&choices[0]);
    // No `Idempotency-Key` here (the native route has it): nothing is stored with the turn.
    turn.record(&message, &turned, &choices[0], "").await?;
    drop(held);
    Ok((turn, choices))
}

#[cfg(test)]
mod tests {
    use super::session_of_user;

    #[test]
    fn a_user_string_names_its_own_session_and_never_another_s() {
        assert_eq!(
            session_of_user("alice").unwrap(),
            ("alice".to_string(), None)
        );
        let (mail, label) = session_of_user("alice@example.com").unwrap();
        assert!(mail.starts_with("u-") && mail.len() == 42, "{mail}");
        assert_eq!(label.as_deref(), Some("alice@example.com"));
        // The hashed name sent as a `user` is hashed again: it cannot reach that session.
        let (again, label) = session_of_user(&mail).unwrap();
        assert_ne!(again, mail);
        assert_eq!(label.as_deref(), Some(mail.as_str()));
        assert!(session_of_user("").is_err());
        assert!(session_of_user(&"x".repeat(257)).is_err());
        assert!(session_of_user(&"é".repeat(128)).is_ok());
    }
}
