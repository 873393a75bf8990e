//! Integration tests of engram-kvcore through its public API.

mod attention;
mod codecs;
mod common;
mod errors;
mod eviction;
mod pins;
mod refcount;
mod tiers;
