//! The grammars against real vocabularies (`make models`, `make models-test`): what a mask lets
//! through parses and validates, whatever the logits say.

use std::path::PathBuf;

use engram_engine::{Constraint, Sampler, SamplingParams, TextTokenizer};
use engram_grammar::{Grammars, Tool};
use serde_json::{Value, json};

fn model(name: &str) -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models")
        .join(name);
    assert!(
        p.is_file(),
        "{} is missing: `make models models-test` fetches it",
        p.display()
    );
    p
}

fn grammars(name: &str) -> (TextTokenizer, Grammars) {
    let tok = TextTokenizer::for_model(&model(name)).unwrap();
    // The logits row may be longer than the vocabulary (padding): 64 rows more here.
    let rows = tok.vocab_size() + 64;
    let g = Grammars::new(&tok, rows).unwrap();
    (tok, g)
}

/// Generates under `c` from seeded random logits (a model that knows nothing) until the
/// constraint is finished or a stop token comes; answers the text.
fn run(tok: &TextTokenizer, rows: usize, c: &mut dyn Constraint, seed: u64) -> String {
    let mut s = Sampler::new(SamplingParams {
        temperature: 1.0,
        seed,
        ..SamplingParams::default()
    });
    let mut rng = engram_kvcore::SplitMix64::new(seed ^ 0x5eed);
    let mut out = Vec::new();
    for _ in 0..400 {
        let logits: Vec<f32> = (0..rows)
            .map(|_| (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 8.0)
            .collect();
        let t = s.sample_constrained(&logits, Some(c)).unwrap();
        if tok.stop_ids().contains(&t) {
            break;
        }
        assert!((t as usize) < tok.vocab_size(), "padding row {t} allowed");
        out.push(t);
        if c.finished() {
            break;
        }
    }
    tok.decode(&out).unwrap()
}

fn weather_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "city": {"enum": ["Paris", "Lyon", "Nice"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "metric": {"type": "boolean"}
        },
        "required": ["city", "days", "metric"],
        "additionalProperties": false
    })
}

fn check_weather(v: &Value) {
    let o = v.as_object().unwrap();
    assert_eq!(o.len(), 3, "{v}");
    assert!(
        ["Paris", "Lyon", "Nice"].contains(&o["city"].as_str().unwrap()),
        "{v}"
    );
    let d = o["days"].as_i64().unwrap();
    assert!((1..=7).contains(&d), "{v}");
    assert!(o["metric"].is_boolean(), "{v}");
}

#[test]
fn random_logits_under_a_schema_give_valid_json_on_every_vocabulary() {
    for name in [
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "gemma-3-270m-q4_k_m.gguf",
    ] {
        let (tok, g) = grammars(name);
        let rows = tok.vocab_size() + 64;
        for seed in 0..3 {
            let mut c = g.json_schema(&weather_schema()).unwrap();
            let text = run(&tok, rows, &mut c, seed);
            let v: Value = serde_json::from_str(&text)
                .unwrap_or_else(|e| panic!("{name}: {text:?} does not parse: {e}"));
            check_weather(&v);
            // The compact form: one space after `:` and `,`, no other whitespace.
            assert!(!text.contains('\n') && !text.contains("  "), "{text:?}");
        }
    }
}

#[test]
fn a_forced_tool_call_is_a_parsable_call_of_an_offered_function() {
    let (tok, g) = grammars("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
    let rows = tok.vocab_size() + 64;
    let tools = [
        Tool {
            name: "weather".into(),
            parameters: weather_schema(),
        },
        Tool {
            name: "add".into(),
            parameters: json!({
                "type": "object",
                "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                               "b": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["a", "b"], "additionalProperties": false
            }),
        },
    ];
    let mut names = std::collections::HashSet::new();
    for seed in 0..6 {
        let mut c = g
            .tool_calls(&tools, false, "<tool_call>\n", "\n</tool_call>")
            .unwrap();
        let text = run(&tok, rows, &mut c, seed);
        let body = text
            .strip_prefix("<tool_call>\n")
            .and_then(|t| t.strip_suffix("\n</tool_call>"))
            .unwrap_or_else(|| panic!("{text:?} is not one call"));
        let call: Value = serde_json::from_str(body).unwrap();
        let name = call["name"].as_str().unwrap().to_string();
        match name.as_str() {
            "weather" => check_weather(&call["arguments"]),
            "add" => {
                let a = &call["arguments"];
                assert!(a["a"].as_i64().unwrap() <= 9 && a["b"].as_i64().unwrap() <= 9);
            }
            other => panic!("called {other}"),
        }
        names.insert(name);
    }
    // Random logits reach both functions over six seeds (each seed is fixed: not flaky).
    assert_eq!(names.len(), 2, "{names:?}");
}

#[test]
fn the_grammar_accepts_a_call_and_refuses_a_wrong_one() {
    let (tok, g) = grammars("SmolLM2-135M-Instruct.Q4_1.gguf");
    let tools = [Tool {
        name: "weather".into(),
        parameters: weather_schema(),
    }];
    let good = "<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Lyon\", \"days\": 3, \"metric\": true}}\n</tool_call>";
    let mut c = g
        .tool_calls(&tools, true, "<tool_call>\n", "\n</tool_call>")
        .unwrap();
    assert_eq!(c.accepts(&tok.encode(good).unwrap()), Ok(true));
    // Two calls with `parallel`.
    let two = format!("{good}\n{good}");
    let mut c = g
        .tool_calls(&tools, true, "<tool_call>\n", "\n</tool_call>")
        .unwrap();
    assert_eq!(c.accepts(&tok.encode(&two).unwrap()), Ok(true));
    // Not without it.
    let mut c = g
        .tool_calls(&tools, false, "<tool_call>\n", "\n</tool_call>")
        .unwrap();
    assert_eq!(c.accepts(&tok.encode(&two).unwrap()), Ok(false));
    for bad in [
        good.replace("Lyon", "Rome"),
        good.replace("\"days\": 3", "\"days\": 9"),
        good.replace("weather", "forecast"),
    ] {
        let mut c = g
            .tool_calls(&tools, false, "<tool_call>\n", "\n</tool_call>")
            .unwrap();
        assert_eq!(c.accepts(&tok.encode(&bad).unwrap()), Ok(false), "{bad}");
    }
    // A schema that is not one.
    assert!(g.json_schema(&json!([1, 2])).is_err());
}
