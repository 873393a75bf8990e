//! Integration tests of engram-kvcore through its public API.

// A test crate: a failed unwrap is a failed assertion.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod attention;
mod codecs;
mod common;
mod downtier;
mod errors;
mod eviction;
mod pins;
mod refcount;
mod relocate;
mod shadow;
mod simd;
mod staged;
mod tiers;
