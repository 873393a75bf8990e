//! A resent history against a session's log (issue 67, item 4): a client that names a session
//! with `user` and resends the conversation may have edited a message, regenerated a reply or
//! dropped a tool output. The two are compared entry by entry, as conversation (who said it,
//! the text, the tool calls: not the bytes, since the model's own call `{"name":"f",…}` comes
//! back from the client as `{"name": "f", …}`):
//!
//! - nothing resent, or exactly the log: the turn goes on from the log;
//! - the log, then messages it lacks (tool results, turns said elsewhere): those are logged
//!   with the turn, before its message;
//! - a history that leaves the log: the log forks where they part. The session keeps the
//!   common part and goes on with what the client sent; the old branch is kept whole, as a
//!   session of its own. The prompt's common prefix is still cached (blocks are found by
//!   content), which the answer's `cached_tokens` shows.
//!
//! A client that sends a window of the conversation (its oldest messages trimmed) is matched
//! where its first message is found in the log.

use engram_context::{Speaker, Turn as Said};
use engram_store::Role;
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::api::tools;
use crate::error::ApiError;
use crate::turn::{Log, Turn, log_of};

/// Brings a `user` session's log in line with the history a request resent (see the module
/// docs), forking it when they part; answers the log the turn goes on from and the resent
/// entries it lacks, which the turn logs before its message. Runs while the turn holds its
/// session.
pub async fn follow(turn: &Turn, sent: &[Said]) -> Result<(Log, Vec<Said>), ApiError> {
    let Some(session) = turn.session.as_deref() else {
        return Ok((Log::default(), sent.to_vec()));
    };
    let store = &turn.state.store;
    let mut rows = store.turns(&turn.agent.id, session).await?;
    let log = log_of(&rows);
    if sent.is_empty() {
        return Ok((log, Vec::new()));
    }
    // The log's conversation: its turns' entries and what earlier requests resent, not what
    // an orchestrator injected (no client resends that), nor system text.
    let conversation: Vec<(i64, Said)> = rows
        .iter()
        .enumerate()
        .filter(|(i, _)| !log.injected.contains(&(i + 1)))
        .filter_map(|(_, t)| {
            let speaker = match t.role {
                Role::User => Speaker::User,
                Role::Assistant => Speaker::Assistant,
                Role::Tool => Speaker::Tool,
                Role::System | Role::Event => return None,
            };
            let text = t.text.clone();
            Some((t.seq, Said { speaker, text }))
        })
        .collect();
    let said: Vec<Said> = conversation.iter().map(|(_, s)| s.clone()).collect();
    let (log, new) = match match_history(&said, sent) {
        Matched::Extends { new } => (log, new),
        Matched::Forks { keep, new } => {
            // The old branch is kept whole under a name no `user` maps to (a hashed name is
            // `u-` and 40 hex digits; a `user` starting with `u-` is hashed).
            let from_seq = conversation.get(keep).map_or(i64::MAX, |(seq, _)| *seq);
            let now = engram_memory::now_ms();
            let h = Sha256::digest(session.as_bytes());
            let hex: String = h[..20].iter().map(|b| format!("{b:02x}")).collect();
            let branch = format!("u-{hex}-{now}");
            let name = match &turn.session_label {
                Some(l) => l.clone(),
                None => store
                    .session_label(&turn.agent.id, session)
                    .await?
                    .unwrap_or_else(|| session.to_string()),
            };
            let label = format!("{name} (before entry {} changed)", keep + 1);
            let dropped = store
                .branch_session(
                    &turn.tenant.id,
                    &turn.agent.id,
                    session,
                    &branch,
                    &label,
                    from_seq,
                )
                .await?;
            tracing::info!(
                session,
                branch,
                kept = keep,
                dropped,
                "a resent history left the session's log: forked"
            );
            // The session's log is what the branch did not drop.
            rows.retain(|t| t.seq < from_seq);
            (log_of(&rows), new)
        }
    };
    Ok((log, sent[new..].to_vec()))
}

/// An entry as compared.
#[derive(Debug, PartialEq)]
struct Entry {
    speaker: Speaker,
    text: String,
    calls: Vec<(String, Value)>,
}

fn entry(s: &Said) -> Entry {
    // Calls the model wrote without tags are calls too (the client resends them as calls).
    let (text, calls) = match tools::parse_calls(&s.text) {
        (text, calls) if !calls.is_empty() => (text, calls),
        (text, _) => match tools::bare_calls(&text, None) {
            Some(calls) => (String::new(), calls),
            None => (text, Vec::new()),
        },
    };
    Entry {
        speaker: s.speaker,
        text: text.trim().to_string(),
        calls: calls
            .into_iter()
            .map(|c| {
                let args = serde_json::from_str(&c.arguments).unwrap_or(Value::String(c.arguments));
                (c.name, args)
            })
            .collect(),
    }
}

/// How a resent history stands to the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Matched {
    /// The log as it is, then the resent entries from `new` on (none when the history is the
    /// log, or nothing was resent).
    Extends {
        /// The first resent entry the log lacks.
        new: usize,
    },
    /// The log's first `keep` conversation entries, then the resent entries from `new` on.
    Forks {
        /// Conversation entries of the log kept.
        keep: usize,
        /// The first resent entry after the common part.
        new: usize,
    },
}

/// Matches `sent` (the request's history before its message) against `log` (the session's
/// conversation entries, in order).
pub fn match_history(log: &[Said], sent: &[Said]) -> Matched {
    if sent.is_empty() {
        return Matched::Extends { new: 0 };
    }
    let log: Vec<Entry> = log.iter().map(entry).collect();
    let sent: Vec<Entry> = sent.iter().map(entry).collect();
    // Where the resent window starts in the log: the alignment that agrees longest (from the
    // log's start when the first messages agree).
    let run = |at: usize| {
        log[at..]
            .iter()
            .zip(&sent)
            .take_while(|(a, b)| a == b)
            .count()
    };
    let best = (0..log.len())
        .filter(|&at| log[at] == sent[0])
        .map(|at| (at, run(at)))
        .max_by_key(|&(at, n)| (n, std::cmp::Reverse(at)));
    match best {
        Some((at, n)) if at + n == log.len() => Matched::Extends { new: n },
        Some((at, n)) => Matched::Forks {
            keep: at + n,
            new: n,
        },
        // Nothing in common: the conversation the client sent replaces the log's (which is
        // kept as a branch).
        None if log.is_empty() => Matched::Extends { new: 0 },
        // Only tool results, none of them logged: the outputs of the log's last calls, sent
        // without the history.
        None if sent.iter().all(|e| e.speaker == Speaker::Tool) => Matched::Extends { new: 0 },
        None => Matched::Forks { keep: 0, new: 0 },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(speaker: Speaker, text: &str) -> Said {
        Said {
            speaker,
            text: text.to_string(),
        }
    }
    fn u(t: &str) -> Said {
        s(Speaker::User, t)
    }
    fn a(t: &str) -> Said {
        s(Speaker::Assistant, t)
    }

    #[test]
    fn the_log_itself_or_nothing_goes_on_from_the_log() {
        let log = [u("hi"), a("hello"), u("how are you?"), a("fine")];
        assert_eq!(match_history(&log, &[]), Matched::Extends { new: 0 });
        assert_eq!(match_history(&log, &log), Matched::Extends { new: 4 });
        assert_eq!(match_history(&[], &log), Matched::Extends { new: 0 });
        // Whitespace around a message is not a difference.
        let spaced = [u(" hi\n"), a("hello "), u("how are you?"), a("fine")];
        assert_eq!(match_history(&log, &spaced), Matched::Extends { new: 4 });
    }

    #[test]
    fn messages_after_the_log_are_new_and_an_edit_forks_where_it_is() {
        let log = [u("hi"), a("hello"), u("how are you?"), a("fine")];
        let more = [
            u("hi"),
            a("hello"),
            u("how are you?"),
            a("fine"),
            s(Speaker::Tool, "42"),
        ];
        assert_eq!(match_history(&log, &more), Matched::Extends { new: 4 });
        // An edited second question: the first exchange is kept.
        let edited = [u("hi"), a("hello"), u("how old are you?"), a("old")];
        assert_eq!(
            match_history(&log, &edited),
            Matched::Forks { keep: 2, new: 2 }
        );
        // A regenerated last reply (the client dropped it and resends the question).
        let regen = [u("hi"), a("hello"), u("how are you?")];
        assert_eq!(
            match_history(&log, &regen),
            Matched::Forks { keep: 3, new: 3 }
        );
        // A different conversation altogether.
        assert_eq!(
            match_history(&log, &[u("new topic")]),
            Matched::Forks { keep: 0, new: 0 }
        );
        // Tool results alone, without the history they answer: new.
        assert_eq!(
            match_history(&log, &[s(Speaker::Tool, "3")]),
            Matched::Extends { new: 0 }
        );
    }

    #[test]
    fn a_trimmed_window_is_matched_where_it_starts() {
        let log = [u("q1"), a("r1"), u("q2"), a("r2"), u("q3"), a("r3")];
        assert_eq!(
            match_history(&log, &[u("q2"), a("r2"), u("q3"), a("r3")]),
            Matched::Extends { new: 4 }
        );
        assert_eq!(
            match_history(&log, &[u("q2"), a("r2"), u("q3 edited")]),
            Matched::Forks { keep: 4, new: 2 }
        );
    }

    #[test]
    fn a_call_resent_in_another_json_spelling_is_the_same_call() {
        let open = tools::CALL_OPEN;
        let close = tools::CALL_CLOSE;
        let model = format!("{open}{{\"name\":\"add\",\"arguments\":{{\"a\":1,\"b\":2}}}}{close}");
        let client =
            format!("\n{open}{{\"name\": \"add\", \"arguments\": {{\"b\": 2, \"a\": 1}}}}{close}");
        let log = [u("add 1 and 2"), a(&model)];
        let sent = [u("add 1 and 2"), a(&client)];
        assert_eq!(match_history(&log, &sent), Matched::Extends { new: 2 });
        let other =
            format!("{open}{{\"name\": \"add\", \"arguments\": {{\"a\": 1, \"b\": 3}}}}{close}");
        assert_eq!(
            match_history(&log, &[u("add 1 and 2"), a(&other)]),
            Matched::Forks { keep: 1, new: 1 }
        );
    }
}
