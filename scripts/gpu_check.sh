#!/usr/bin/env bash
# GPU check: what must hold for the policy on a GPU, stage by stage with pass/fail thresholds
# (trace_core/bench/gpu_check.py lists them): the environment and a bf16 matmul, fp32 master
# weights, the update at Qwen3-8B's layer shape against the memory estimate, π_old recompute,
# engine/trainer parity in bf16, decode against the HBM roofline, continuous batching against
# sub-batches, reload bandwidth, and the weight sync between a trainer process and an engine
# process sharing the GPU.
#
# On the GPU machine, from the repository root (391 s on one H200, docs/gpu/README.md):
#     bash scripts/gpu_check.sh [--json build/gpu-check.json] [--stages sync,update]
# Every stage on CPU at tiny shapes (CUDA-only thresholds report skip), as make test runs it:
#     bash scripts/gpu_check.sh --smoke --json build/gpu-check-smoke.json
# It needs Python >= 3.11 with torch, transformers, tokenizers, safetensors and numpy: no Ray, no
# vLLM, no network, no pretrained weights; the project itself need not be installed (the
# repository is put on PYTHONPATH here). Another interpreter: PYTHON=/path/to/python.
#
# Exit status: 0 no stage failed; 1 a stage failed (its reason is on its line and in the JSON);
# 2 a missing import, no GPU without --smoke, or a bad option.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"

if ! command -v "$python" >/dev/null 2>&1; then
    echo "gpu-check: no Python interpreter '$python' (set PYTHON=/path/to/python)" >&2
    exit 2
fi

# Every import the stages need, tried before any work: one line naming what is missing (exit 2).
# The program is given by -c, not on standard input: the sync stage's processes are spawned, and
# a spawned process re-reads its parent's main program from its file unless it came from -c.
exec "$python" -c "$(cat <<'PY'
import importlib
import sys

if sys.version_info < (3, 11):
    print(f"gpu-check: Python {sys.version.split()[0]} is too old; 3.11 or newer is needed",
          file=sys.stderr)
    sys.exit(2)
missing = []
for name in ("torch", "numpy", "transformers", "tokenizers", "safetensors"):
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as err:  # the module itself, or what it imports, is absent
        missing.append(name if err.name and name.startswith(err.name) else f"{name} ({err})")
    except Exception as err:  # a package that is there but fails while importing
        missing.append(f"{name} ({type(err).__name__}: {err})")
if missing:
    print(f"gpu-check: missing imports in {sys.executable}: {', '.join(missing)}",
          file=sys.stderr)
    sys.exit(2)

from trace_core.bench.gpu_check import main

sys.exit(main(sys.argv[1:]))
PY
)" "$@"
