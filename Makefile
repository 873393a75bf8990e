# Engram — developer entry points. `make help` lists them.
CARGO ?= cargo

.PHONY: help run test lint fmt-check clippy unit bench codec-report

help:
	@echo "make run           what runs today: the codec report (the service replaces it when it lands)"
	@echo "make test          fmt check, clippy -D warnings, every test of the workspace"
	@echo "make lint          fmt check + clippy only"
	@echo "make bench         criterion micro-benchmarks (release)"
	@echo "make codec-report  codec quality figures on the SmolLM2-135M shape (JSON lines)"

# Until `engram serve` exists, the one runnable program is the codec report.
run: codec-report

test: lint unit

lint: fmt-check clippy

fmt-check:
	$(CARGO) fmt --all -- --check

clippy:
	$(CARGO) clippy --workspace --all-targets -- -D warnings

# Libraries, binaries, integration tests, examples and doc tests. Benches are built by clippy
# above and run by `make bench`.
unit:
	$(CARGO) test --workspace --lib --bins --tests --examples
	$(CARGO) test --workspace --doc

bench:
	$(CARGO) bench -p engram-benches

codec-report:
	$(CARGO) run --release -p engram-kvcore --example codec_report
