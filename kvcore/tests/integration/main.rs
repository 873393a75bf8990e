//! Integration tests of engram-kvcore through its public API.
