//! Integration tests of engram-engine, on the real SmolLM2-135M-Instruct (`make models`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod calibrate;
mod common;
mod downtier;
mod embed;
mod eval;
mod eviction;
mod fuse;
mod fuse_serving;
mod prefix;
mod relocate;
mod relocate_serving;
mod reserve;
mod safetensors;
mod scheduler;
mod shadow;
mod tokenizer;
