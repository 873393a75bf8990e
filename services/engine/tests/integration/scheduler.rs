//! The engine thread: streams, batching, stops, cancellation and the bounded queue.

use std::time::{Duration, Instant};

use engram_engine::{
    Engine, EngineConfig, EngineError, FinishReason, GenerateRequest, SamplingParams, SequenceSpec,
    StreamEvent, argmax,
};
use engram_kvcore::{CodecKind, TenantId};

use crate::common::{chat, core, core_with};

struct Outcome {
    tokens: Vec<u32>,
    text: String,
    reason: FinishReason,
    completion: usize,
}

fn collect(rx: flume::Receiver<StreamEvent>) -> Outcome {
    let (mut tokens, mut text) = (Vec::new(), String::new());
    for ev in rx.iter() {
        match ev {
            StreamEvent::Started(_) => {}
            StreamEvent::Delta {
                tokens: t, text: s, ..
            } => {
                tokens.extend(t);
                text.push_str(&s);
            }
            StreamEvent::Done { reason, usage, .. } => {
                return Outcome {
                    tokens,
                    text,
                    reason,
                    completion: usage.completion_tokens,
                };
            }
            StreamEvent::Failed(e) => panic!("request failed: {e}"),
        }
    }
    panic!("stream ended without Done");
}

fn request(user: &str, sampling: SamplingParams) -> GenerateRequest {
    GenerateRequest {
        spec: SequenceSpec::plain(chat(user), TenantId(1)),
        sampling,
    }
}

/// Greedy tokens of `user` decoded alone on an EngineCore.
fn alone(codec: CodecKind, user: &str, n: usize) -> Vec<u32> {
    let mut core = core(codec);
    let (id, _) = core
        .start(SequenceSpec::plain(chat(user), TenantId(1)))
        .unwrap();
    let mut logits = core.prefill(id).unwrap();
    let mut out = Vec::new();
    for _ in 0..n {
        let t = argmax(&logits);
        if core.tokenizer().stop_ids().contains(&t) {
            break;
        }
        out.push(t);
        logits = core.decode(&[(id, t)]).unwrap().remove(0);
    }
    out
}

/// Largest gap, in logits, between the token `batched` chose and the best token of the same
/// sequence decoded alone, teacher-forced on `batched`. Zero when both pick the same tokens; a
/// small positive gap is a near-tie that the batched matrix products (a different summation
/// order on some CPUs) resolved the other way.
fn worst_gap_alone(codec: CodecKind, user: &str, batched: &[u32]) -> f32 {
    let mut core = core(codec);
    let (id, _) = core
        .start(SequenceSpec::plain(chat(user), TenantId(1)))
        .unwrap();
    let mut logits = core.prefill(id).unwrap();
    let mut worst = 0.0f32;
    for &t in batched {
        let best = logits[argmax(&logits) as usize];
        worst = worst.max(best - logits[t as usize]);
        logits = core.decode(&[(id, t)]).unwrap().remove(0);
    }
    worst
}

/// Batching changes the order of floating-point sums in the matrix products (by CPU: the gemm
/// kernels block differently for 1 and 3 rows). With exact KV (f32) that is noise far below a
/// logit gap; with TurboQuant-4 such noise can move a K/V coordinate across a codebook
/// threshold, so the TQ4 run gets a looser near-tie bound.
#[test]
fn concurrent_requests_are_batched_and_match_running_alone() {
    for (codec, bound) in [(CodecKind::F32, 1e-2f32), (CodecKind::TQ4, 0.5)] {
        batched_matches_alone(codec, bound);
    }
}

fn batched_matches_alone(codec: CodecKind, bound: f32) {
    let engine = Engine::spawn(core(codec)).unwrap();
    let prompts = [
        "What is the capital of France?",
        "Name three colours.",
        "Say hello in Spanish.",
    ];
    let rxs: Vec<_> = prompts
        .iter()
        .map(|p| {
            engine
                .submit(request(p, SamplingParams::greedy(12)))
                .unwrap()
        })
        .collect();
    let outs: Vec<Outcome> = rxs.into_iter().map(collect).collect();
    for (p, o) in prompts.iter().zip(&outs) {
        // Same greedy path as alone, up to near-ties: every batched token is within `bound`
        // of the best logit of the sequence run alone (logits here span tens of units).
        if o.tokens != alone(codec, p, 12) {
            let gap = worst_gap_alone(codec, p, &o.tokens);
            assert!(
                gap < bound,
                "{codec:?} {p}: batched token {gap} below the best alone"
            );
        }
        assert_eq!(o.completion, o.tokens.len());
        assert_eq!(o.text, engine.tokenizer().decode(&o.tokens).unwrap());
    }
    assert!(outs[0].text.contains("Paris"), "{}", outs[0].text);
}

#[test]
fn max_tokens_and_stop_sequences_end_generation() {
    let engine = Engine::spawn(core(CodecKind::TQ4)).unwrap();
    let o = collect(
        engine
            .submit(request("Count from one to ten.", SamplingParams::greedy(5)))
            .unwrap(),
    );
    assert_eq!((o.reason, o.completion), (FinishReason::Length, 5));

    let full = collect(
        engine
            .submit(request(
                "What is the capital of France?",
                SamplingParams::greedy(20),
            ))
            .unwrap(),
    );
    assert_eq!(full.reason, FinishReason::Stop, "{}", full.text);
    let cut = full.text.find(" Paris").expect("the answer names Paris");
    let stopped = collect(
        engine
            .submit(request(
                "What is the capital of France?",
                SamplingParams {
                    stop: vec![" Paris".into()],
                    ..SamplingParams::greedy(20)
                },
            ))
            .unwrap(),
    );
    assert_eq!(stopped.reason, FinishReason::Stop);
    assert_eq!(stopped.text, full.text[..cut]);
}

#[test]
fn a_caller_that_goes_away_cancels_its_sequence() {
    let engine = Engine::spawn(core(CodecKind::TQ4)).unwrap();
    let rx = engine
        .submit(request(
            "Write a long story about the sea.",
            SamplingParams::greedy(400),
        ))
        .unwrap();
    // Wait for the first text, then hang up.
    loop {
        match rx.recv_timeout(Duration::from_secs(60)).unwrap() {
            StreamEvent::Delta { .. } => break,
            StreamEvent::Started(_) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    drop(rx);
    let t = Instant::now();
    while engine.running() > 0 {
        assert!(t.elapsed() < Duration::from_secs(30), "not cancelled");
        std::thread::sleep(Duration::from_millis(20));
    }
    // The engine still serves.
    let o = collect(
        engine
            .submit(request("Say hi.", SamplingParams::greedy(3)))
            .unwrap(),
    );
    assert!(o.completion <= 3);
}

#[test]
fn a_full_queue_answers_overloaded_and_bad_requests_are_refused() {
    let engine = Engine::spawn(core_with(EngineConfig {
        max_running: 1,
        queue_capacity: 1,
        ..EngineConfig::default()
    }))
    .unwrap();
    let mut accepted = Vec::new();
    let mut overloaded = 0;
    for _ in 0..4 {
        match engine.submit(request("Tell me about whales.", SamplingParams::greedy(30))) {
            Ok(rx) => accepted.push(rx),
            Err(EngineError::Overloaded { capacity, .. }) => {
                assert_eq!(capacity, 1);
                overloaded += 1;
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert!(
        overloaded >= 1,
        "four requests into one slot and a queue of one"
    );
    assert!(accepted.len() <= 2);
    for rx in accepted {
        assert_eq!(collect(rx).completion, 30);
    }
    assert!(matches!(
        engine.submit(request(
            "x",
            SamplingParams {
                temperature: -1.0,
                ..SamplingParams::default()
            }
        )),
        Err(EngineError::InvalidSampling {
            field: "temperature",
            ..
        })
    ));
    assert!(matches!(
        engine.submit(request("x", SamplingParams::greedy(9000))),
        Err(EngineError::ContextOverflow { .. })
    ));
}

#[test]
fn sampling_with_a_seed_is_reproducible() {
    let engine = Engine::spawn(core(CodecKind::TQ4)).unwrap();
    let params = SamplingParams {
        temperature: 0.9,
        top_k: 40,
        top_p: 0.95,
        seed: 7,
        ..SamplingParams::greedy(16)
    };
    let a = collect(
        engine
            .submit(request("Invent a name for a cat.", params.clone()))
            .unwrap(),
    );
    let b = collect(
        engine
            .submit(request("Invent a name for a cat.", params))
            .unwrap(),
    );
    assert_eq!(a.tokens, b.tokens);
}

#[test]
fn a_long_prefill_does_not_stall_running_decodes() {
    let engine = Engine::spawn(core(CodecKind::TQ4)).unwrap();
    let a = engine
        .submit(request(
            "Count from one to fifty.",
            SamplingParams::greedy(60),
        ))
        .unwrap();
    // Let A reach decode, then collect its deltas' arrival times on a thread.
    loop {
        if let StreamEvent::Delta { .. } = a.recv().unwrap() {
            break;
        }
    }
    let watcher = std::thread::spawn(move || {
        let mut times = Vec::new();
        for ev in a.iter() {
            match ev {
                StreamEvent::Delta { .. } => times.push(Instant::now()),
                StreamEvent::Done { .. } => break,
                other => panic!("{other:?}"),
            }
        }
        times
    });
    // B: a 2,000-token prompt, prefilled in 256-token chunks.
    let mut long = crate::common::license_tokens(2000);
    long.extend(chat("Summarize."));
    let b = engine
        .submit(GenerateRequest {
            spec: SequenceSpec::plain(long, TenantId(2)),
            sampling: SamplingParams::greedy(2),
        })
        .unwrap();
    let mut admitted = None;
    let mut first = None;
    for ev in b.iter() {
        match ev {
            StreamEvent::Started(_) => admitted = Some(Instant::now()),
            StreamEvent::Delta { .. } if first.is_none() => first = Some(Instant::now()),
            StreamEvent::Done { .. } => break,
            _ => {}
        }
    }
    let (admitted, first) = (admitted.unwrap(), first.unwrap());
    let during = watcher
        .join()
        .unwrap()
        .into_iter()
        .filter(|&t| t > admitted && t < first)
        .count();
    // B's prompt goes in chunks of at most `step_tokens` − 1 while A decodes, each in the same
    // forward pass as one of A's tokens: 16 passes or more.
    assert!(
        during >= 10,
        "A produced {during} deltas during B's prefill"
    );
}

#[test]
fn one_step_carries_decodes_and_a_prompt_chunk_within_the_budget() {
    let start = |c: &mut engram_engine::EngineCore, tokens: Vec<u32>, t: u64| {
        c.start(SequenceSpec::plain(tokens, TenantId(t))).unwrap().0
    };
    let a_prompt = chat("Count from one to ten.");
    let mut b_prompt = crate::common::license_tokens(300);
    b_prompt.extend(chat("Summarize."));
    // The reference: each sequence on its own engine, in its own forward passes.
    let mut alone = core(CodecKind::F32);
    let a = start(&mut alone, a_prompt.clone(), 1);
    let tok = argmax(&alone.prefill(a).unwrap());
    let want_a = alone.decode(&[(a, tok)]).unwrap().remove(0);
    let b = start(&mut alone, b_prompt.clone(), 2);
    let want_b = alone.prefill(b).unwrap();

    let mut c = core(CodecKind::F32);
    let a = start(&mut c, a_prompt, 1);
    assert_eq!(argmax(&c.prefill(a).unwrap()), tok);
    let b = start(&mut c, b_prompt.clone(), 2);
    // A's token and 100 of B's prompt tokens in one forward pass.
    let out = c.step(&[(a, tok)], Some((b, 100))).unwrap();
    assert_eq!(out.decoded.len(), 1);
    let p = out.prefilled.unwrap();
    assert_eq!(
        (p.id, p.tokens, p.remaining),
        (b, 100, b_prompt.len() - 100)
    );
    assert!(p.logits.is_none());
    // Batched rows sum in another order: close, not bit-equal.
    let gap = crate::common::rel_l2(&out.decoded[0], &want_a);
    assert!(gap < 1e-3, "A's logits moved by {gap}");
    // Without decodes the chunk is `prefill_chunk`; the last one brings B's logits.
    let mut logits = None;
    while logits.is_none() {
        let out = c.step(&[], Some((b, usize::MAX))).unwrap();
        let p = out.prefilled.unwrap();
        assert!(p.tokens <= c.config().prefill_chunk);
        logits = p.logits;
    }
    let gap = crate::common::rel_l2(&logits.unwrap(), &want_b);
    assert!(gap < 1e-3, "B's logits moved by {gap}");
    // Nothing asked, nothing done; a prompt chunk of a sequence with none left is refused.
    assert_eq!(c.step(&[], None).unwrap(), Default::default());
    assert!(c.step(&[], Some((a, 10))).is_err());
    let tok_b = argmax(&want_b);
    let next = c.step(&[(b, tok_b)], None).unwrap();
    assert_eq!(next.decoded.len(), 1);
}
