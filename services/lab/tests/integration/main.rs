//! Integration tests of engram-lab, on the real SmolLM2-135M-Instruct (`make models`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

// The engine's test helpers (the model loaded once per binary), shared rather than copied.
#[allow(dead_code)]
#[path = "../../../engine/tests/integration/common.rs"]
mod common;

mod calibrate;
mod downtier;
mod eval;
mod relocate;
