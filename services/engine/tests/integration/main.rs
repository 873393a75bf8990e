//! Integration tests of engram-engine, on the real SmolLM2-135M-Instruct (`make models`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
mod embed;
mod eviction;
mod prefix;
mod profiles;
mod relocate_serving;
mod reserve;
mod safetensors;
mod scheduler;
mod shadow;
mod tokenizer;
