//! # engram-lab
//!
//! Engram's instruments, outside the serving binary: the KV fidelity harness ([`eval`], `eval
//! kv`), the precision allocator ([`calibrate`], `calibrate kv`), relocated segment reuse's
//! fidelity ([`relocation`], `eval kv --relocate`), the KV ablations ([`probe`], a tap on the
//! model's KV path), and the TTFT/decode and device-parity benchmarks ([`bench`], `engram-bench`
//! and `check device`). The `engram-lab` binary runs them; `engram eval|calibrate|check` hands
//! over to it.

#![forbid(unsafe_code)]

pub mod bench;
pub mod calibrate;
pub mod cli;
pub mod eval;
pub mod probe;
pub mod relocation;

pub use probe::KvProbe;
