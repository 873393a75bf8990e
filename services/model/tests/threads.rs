//! A forward gives the same bits on one thread as on several: each weight product, attention
//! head and activation slice is computed whole by one thread, in one order (decode attention
//! splits a KV head's keys over threads only past 2,048 keys: kvcore's tests check that split).
//! `make test` runs with `ENGRAM_THREADS=1` (one test process per core), so this test keeps the
//! split forward checked.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{GEMMA3_270M, Ours, QWEN_05B, checkpoint, corpus};
use engram_kvcore::CodecKind;

fn same_bits(file: &str, tokens: usize) {
    let mut ours = Ours::load(&checkpoint(file), CodecKind::F16);
    let text = ours.tokenizer.encode(&corpus()).unwrap();
    let text = &text[..tokens];
    let mut runs = Vec::new();
    for threads in [1, 2, 3] {
        ours.model = ours.model.clone().with_threads(threads);
        runs.push((
            threads,
            ours.teacher_forced(text, 96),
            ours.greedy(&text[..40], 8),
        ));
    }
    let (_, logits, greedy) = &runs[0];
    for (threads, other, other_greedy) in &runs[1..] {
        for (pos, (a, b)) in logits.iter().zip(other).enumerate() {
            let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(
                same,
                "{file}: position {pos}: logits on {threads} threads differ from one thread's"
            );
        }
        assert_eq!(
            greedy, other_greedy,
            "{file}: greedy tokens on {threads} threads"
        );
    }
}

#[test]
fn qwen2_gives_the_same_bits_on_one_two_and_three_threads() {
    same_bits(QWEN_05B, 200);
}

#[test]
fn gemma3_gives_the_same_bits_on_one_two_and_three_threads() {
    same_bits(GEMMA3_270M, 200);
}
