//! What constrained decoding costs a token: the mask and the commit of a JSON schema and of a
//! forced tool call, over the model's vocabulary, timed step by step under seeded random logits
//! (the model's own time per token is not in it: compare with its TPOT).
//!
//! usage: cargo run --release -p engram-grammar --example mask_cost -- MODEL.gguf [STEPS]

use std::time::Instant;

use engram_engine::{Constraint, Sampler, SamplingParams, TextTokenizer};
use engram_grammar::{Grammars, Tool};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = args.next().ok_or("usage: mask_cost MODEL.gguf [STEPS]")?;
    let steps: usize = args.next().map_or(Ok(2000), |s| s.parse())?;
    let tok = TextTokenizer::for_model(std::path::Path::new(&path))?;
    let rows = tok.vocab_size();
    let t = Instant::now();
    let g = Grammars::new(&tok, rows)?;
    println!(
        "vocabulary {rows} tokens compiled in {:.1} ms",
        t.elapsed().as_secs_f64() * 1e3
    );
    let schema = engram_grammar::example_schema();
    let tools = [Tool {
        name: "forecast".into(),
        parameters: schema.clone(),
    }];
    let mut rng = engram_kvcore::SplitMix64::new(7);
    for what in ["json_schema", "tool_call"] {
        let (mut n, mut spent, mut worst) = (0usize, 0f64, 0f64);
        let mut seed = 0;
        while n < steps {
            let mut c: Box<dyn Constraint> = match what {
                "json_schema" => Box::new(g.json_schema(&schema)?),
                _ => Box::new(g.tool_calls(&tools, false, "<tool_call>\n", "\n</tool_call>")?),
            };
            let mut s = Sampler::new(SamplingParams {
                temperature: 1.0,
                seed,
                ..SamplingParams::default()
            });
            seed += 1;
            for _ in 0..400 {
                let logits: Vec<f32> = (0..rows)
                    .map(|_| (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 8.0)
                    .collect();
                // The unconstrained draw's own cost is not the constraint's.
                let mut plain = Sampler::new(SamplingParams {
                    temperature: 1.0,
                    seed,
                    ..SamplingParams::default()
                });
                let t0 = Instant::now();
                plain.sample(&logits);
                let base = t0.elapsed().as_secs_f64();
                let t1 = Instant::now();
                let tok_id = s.sample_constrained(&logits, Some(c.as_mut()))?;
                let cost = (t1.elapsed().as_secs_f64() - base).max(0.0);
                spent += cost;
                worst = f64::max(worst, cost);
                n += 1;
                if c.finished() || tok.stop_ids().contains(&tok_id) {
                    break;
                }
            }
        }
        println!(
            "{what}: {n} tokens, {:.1} µs a token on average over the unconstrained draw, worst {:.0} µs",
            spent / n as f64 * 1e6,
            worst * 1e6
        );
    }
    Ok(())
}
