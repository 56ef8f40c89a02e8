#!/usr/bin/env bash
# GPU check: does the policy run on this machine's GPU, and how fast? On a randomly initialised
# model of SmolLM2-135M's shape (--shape qwen3-0.6b for Qwen3-0.6B's) it times
#   ray_engine    TorchEngine in a Ray actor given one GPU (Ray started in this process): tokens/s
#                 and the device the actor reports;
#   ray_update    one policy update on Ray Train with use_gpu=True (bf16 autocast): seconds and
#                 peak GPU memory;
#   local_engine  TorchEngine in this process, bf16 on CUDA: tokens/s, for comparison;
# prints one line per check and writes the figures as JSON (--output, default build/gpu-check.json).
#
# On the GPU machine, from the repository root:
#     bash scripts/gpu_check.sh [--shape qwen3-0.6b] [--output build/gpu-check.json]
# It needs Python >= 3.11 with a CUDA build of torch, and transformers, tokenizers, safetensors,
# numpy, pyarrow and ray[train]; the project itself need not be installed (the repository is put
# on PYTHONPATH here). Another interpreter: PYTHON=/path/to/python bash scripts/gpu_check.sh.
# Without a GPU (CI): bash scripts/gpu_check.sh --device cpu --small --output /tmp/gpu-check.json
#
# Exit status: 0 every check passed; 1 a check failed (its traceback and a FAIL line are
# printed, the other checks still run); 2 a missing import, no CUDA device, or a bad option.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"

if ! command -v "$python" >/dev/null 2>&1; then
    echo "gpu-check: no Python interpreter '$python' (set PYTHON=/path/to/python)" >&2
    exit 2
fi

# Every import the checks need, tried before any work: one line naming what is missing (exit 2).
# Then the checks run in the same interpreter, so nothing is imported twice.
exec "$python" - "$@" <<'EOF'
import importlib
import sys

if sys.version_info < (3, 11):
    print(f"gpu-check: Python {sys.version.split()[0]} is too old; 3.11 or newer is needed",
          file=sys.stderr)
    sys.exit(2)
missing = []
for name in (
    "torch", "numpy", "transformers", "tokenizers", "safetensors", "pyarrow", "ray",
    "ray.train.torch",
):
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
EOF
