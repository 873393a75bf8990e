//! End-to-end: the real `engram serve` app on a local port, over HTTP, against SQLite and
//! PostgreSQL (`ENGRAM_TEST_POSTGRES`, default `postgres://postgres@127.0.0.1:5432/test`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod admin_page;
mod archive;
mod bad_input;
mod bounds;
mod cache_files;
mod deletion;
mod deploy;
mod ecosystem;
mod export_memory;
mod failover;
mod fairness;
mod harness;
mod lifecycle;
mod memory;
mod models;
mod openai;
mod operators;
mod phases;
mod privacy;
mod probes;
mod remote_vectors;
mod reuse;
mod salt;
mod service;
mod sessions;
mod shadow;
mod storage;
mod supervision;
mod tenancy;
mod timing;
mod units;
mod workload;
