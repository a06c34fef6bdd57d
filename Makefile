# Two commands on a fresh machine: `make run` and `make test`.
# Each creates (or reuses) the virtual environment in .venv, installs torch==2.13.0 first
# (a local CPU wheel on our machines; an unpinned torch pulls several GB of CUDA packages),
# then this package with its dev extras, then does its job.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvscope-installed

.PHONY: run demo test lint typecheck unit bench samples clean install

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check torch==2.13.0
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

# The main job: record a paced multi-turn run in the background and open the dashboard on it.
run: $(STAMP)
	$(BIN)/python -m kvscope.dashboard.launch

demo: $(STAMP)
	$(BIN)/kvscope demo

lint: $(STAMP)
	$(BIN)/ruff check .

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/pytest

test: lint typecheck unit

bench: $(STAMP)
	$(BIN)/python benchmarks/gen_traces.py
	$(BIN)/python benchmarks/bench_alloc.py
	$(BIN)/python benchmarks/bench_radix.py benchmarks/traces/shared_prefix.jsonl benchmarks/traces/multi_turn.jsonl
	$(BIN)/python benchmarks/bench_recorder.py
	$(BIN)/python benchmarks/bench_curve.py benchmarks/traces/multi_turn.jsonl benchmarks/traces/shared_prefix.jsonl

# Small captures anyone can open without an engine; deterministic for their seeds.
# The leaking run exits 1 (its leak check fails, as intended).
samples: $(STAMP)
	rm -f sample_runs/*.db sample_runs/*.db-wal sample_runs/*.db-shm
	$(BIN)/kvscope run --workload shared-prefix --num-requests 48 --capture sample_runs/shared-prefix.db
	$(BIN)/kvscope run --workload multi-turn --num-requests 32 --model tiny-swa --kv-tokens 2048 \
		--capture sample_runs/hybrid-swa.db
	$(BIN)/kvscope run --workload multi-turn --num-requests 32 --page-size 4 --kv-tokens 2048 \
		--inject leak-tail:0.3 --inject lock-leak:0.2 --inject double-free:0.3 --inject-seed 7 \
		--capture sample_runs/leaky.db || [ $$? -eq 1 ]

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache .hypothesis
