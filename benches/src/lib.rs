//! Engram benchmarks; see `benches/`.
