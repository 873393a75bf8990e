//! The extractive synthesizer: fits a layer to its token budget by keeping its best lines.
//!
//! A layer's content is a list of lines (blank lines are dropped). Each line gets a
//! deterministic score, the sum of:
//! - **importance tag**: +3 if the line starts with `!` or contains `[important]`;
//! - **overlap with the current user turn**: + the share of the line's words (lower-cased, letters
//!   and digits, at least 3 characters) that also occur in the user's message (0..=1);
//! - **position**: + 0.5 · (1 − i/n) for line `i` of `n` (earlier lines are usually more central).
//!
//! Lines are taken by descending score (ties: earlier first) while they fit the budget (a line
//! costs its tokens plus one for its newline); the kept lines are emitted **in their original
//! order**, and the rest is spilled (to the session's working memory) in original order.
//! Cost: O(lines · log lines) plus one token count per line.

use std::collections::HashSet;

use crate::TokenCounter;

/// A line with its score and cost.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoredLine {
    /// Index among the layer's non-blank lines.
    pub index: usize,
    /// The line.
    pub text: String,
    /// Its score.
    pub score: f64,
    /// Its tokens, newline included.
    pub tokens: usize,
}

/// What the synthesizer made of a layer.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Synthesis {
    /// The kept lines joined by newlines.
    pub text: String,
    /// Tokens of the kept lines (newlines included).
    pub tokens: usize,
    /// Lines that did not fit, in original order.
    pub spilled: Vec<String>,
}

fn words(text: &str) -> HashSet<String> {
    text.split(|c: char| !c.is_alphanumeric())
        .filter(|w| w.chars().count() >= 3)
        .map(str::to_lowercase)
        .collect()
}

/// The score of line `index` of `count` (see the module docs).
pub fn score_line(line: &str, index: usize, count: usize, user_words: &HashSet<String>) -> f64 {
    let tag = if line.trim_start().starts_with('!') || line.contains("[important]") {
        3.0
    } else {
        0.0
    };
    let own = words(line);
    let overlap = if own.is_empty() {
        0.0
    } else {
        own.intersection(user_words).count() as f64 / own.len() as f64
    };
    let position = 0.5 * (1.0 - index as f64 / count.max(1) as f64);
    tag + overlap + position
}

/// Tokens `content` takes when [`synthesize`] keeps it whole: each non-empty line and its
/// newline.
pub fn content_tokens(content: &str, counter: &dyn TokenCounter) -> usize {
    content_lines(content)
        .map(|l| line_tokens(l, counter))
        .sum()
}

/// The lines [`synthesize`] keeps or spills: the non-empty ones.
fn content_lines(content: &str) -> impl Iterator<Item = &str> {
    content.lines().filter(|l| !l.trim().is_empty())
}

/// Tokens one kept line takes: its text and its newline.
fn line_tokens(line: &str, counter: &dyn TokenCounter) -> usize {
    counter.count(line) + 1
}

/// Fits `content` into `budget` tokens (see the module docs).
pub fn synthesize(
    content: &str,
    budget: usize,
    user_turn: &str,
    counter: &dyn TokenCounter,
) -> Synthesis {
    let lines: Vec<&str> = content_lines(content).collect();
    let user_words = words(user_turn);
    let mut scored: Vec<ScoredLine> = lines
        .iter()
        .enumerate()
        .map(|(i, l)| ScoredLine {
            index: i,
            text: (*l).to_string(),
            score: score_line(l, i, lines.len(), &user_words),
            tokens: line_tokens(l, counter),
        })
        .collect();
    let total: usize = scored.iter().map(|s| s.tokens).sum();
    let mut keep = vec![total <= budget; scored.len()];
    if total > budget {
        let mut order: Vec<usize> = (0..scored.len()).collect();
        order.sort_by(|&a, &b| scored[b].score.total_cmp(&scored[a].score).then(a.cmp(&b)));
        let mut used = 0;
        for i in order {
            if used + scored[i].tokens <= budget {
                used += scored[i].tokens;
                keep[i] = true;
            }
        }
    }
    let mut out = Synthesis::default();
    let mut kept = Vec::new();
    for (s, k) in scored.iter_mut().zip(keep) {
        if k {
            out.tokens += s.tokens;
            kept.push(std::mem::take(&mut s.text));
        } else {
            out.spilled.push(std::mem::take(&mut s.text));
        }
    }
    out.text = kept.join("\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One token per word: enough to test selection.
    struct Words;
    impl TokenCounter for Words {
        fn count(&self, text: &str) -> usize {
            text.split_whitespace().count()
        }
    }

    #[test]
    fn everything_fits_unchanged() {
        let s = synthesize("a b\n\nc d e\n", 100, "", &Words);
        assert_eq!(s.text, "a b\nc d e");
        assert_eq!(s.tokens, 2 + 1 + 3 + 1);
        assert!(s.spilled.is_empty());
    }

    #[test]
    fn tagged_and_relevant_lines_win_and_order_is_kept() {
        let content = "the weather is mild today\n\
                       ! never share the admin password\n\
                       bananas are yellow fruit\n\
                       invoices are due on the first monday";
        // Budget for the two best lines (7 + 8 tokens).
        let s = synthesize(content, 15, "when are invoices due?", &Words);
        assert_eq!(
            s.text,
            "! never share the admin password\ninvoices are due on the first monday"
        );
        assert_eq!(
            s.spilled,
            vec!["the weather is mild today", "bananas are yellow fruit"]
        );
        assert_eq!(s.tokens, 15);
    }

    #[test]
    fn scores_are_deterministic_and_documented() {
        let user = words("Tell me about invoices");
        assert_eq!(score_line("! x", 0, 2, &user), 3.0 + 0.0 + 0.5);
        assert_eq!(score_line("invoices due", 1, 2, &user), 0.5 + 0.25);
        assert_eq!(score_line("", 1, 2, &user), 0.25);
    }

    #[test]
    fn a_zero_budget_spills_everything() {
        let s = synthesize("a\nb", 0, "", &Words);
        assert_eq!((s.text.as_str(), s.tokens), ("", 0));
        assert_eq!(s.spilled, vec!["a", "b"]);
    }
}
