"""Where a TorchEngine decode step's time goes: ``trace-rl bench engine --profile``.

One ``generate`` call of the bench's throughput workload runs under ``torch.profiler`` with
Python stacks, and every top-level torch operation (one the Python code called, not one
another operation ran inside itself) is put in one part of the step by the functions on its
stack:

* **matmuls**: the projections, the MLP and the head (``mm``, ``addmm`` in ``decode_step``;
  ``lm_logits``);
* **attention**: scores, softmax and weighted values (``baddbmm``, ``softmax``, ``bmm``);
* **norms** (``decoder.normalize``) and **rope** (``decoder.apply_rope``);
* **KV writes**: the step's new keys and values into the batch's buffer (``cat``,
  ``index_copy_``);
* **other decode ops**: the rest of ``decode_step`` (embedding, mask, views, SiLU);
* **sampling**: keyed uniforms, the inverse CDF and the logprobs (``sampling``);
* **bookkeeping**: the running batch's per-step state (positions, ended rows, output columns);
* **admission**: prompts prefilled through the prefix cache, gathered into the batch, their
  uniform tables (and the re-layouts that drop finished rows);
* **retirement**: answers read back and their sequences' KV copied into the prefix cache.

For each part: torch operations per decode step (a count, the same on every machine) and
their CPU time per step. ``outside_ops_us_per_step`` is the profiled call's wall time not
spent inside any operation: Python, argument parsing, and the profiler's own cost, which
inflates it (compare ``wall_us_per_step``, the same call timed without the profiler).
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Sequence

import torch
from torch.autograd.profiler_util import FunctionEvent

from trace_core.policy.engine import SamplingParams
from trace_core.policy.torch_engine import TorchEngine

PARTS = (
    "matmuls",
    "attention",
    "norms",
    "rope",
    "kv_writes",
    "other_decode_ops",
    "sampling",
    "bookkeeping",
    "admission",
    "retirement",
    "other",
)
"""The parts of a step, in the order the table prints them."""

_BY_FUNCTION = (  # the first of these, in this order, with a function on an op's stack
    ({"_retire", "_cache_generated"}, "retirement"),
    ({"_relayout", "_admit", "_admissions", "_prefill", "_buffer"}, "admission"),
    ({"sample", "_draw", "uniforms"}, "sampling"),
    ({"normalize"}, "norms"),
    ({"apply_rope"}, "rope"),
    ({"lm_logits"}, "matmuls"),
)
_IN_DECODE_STEP = {
    "aten::mm": "matmuls",
    "aten::addmm": "matmuls",
    "aten::baddbmm": "attention",
    "aten::bmm": "attention",
    "aten::softmax": "attention",
    "aten::index_copy_": "kv_writes",
    "aten::cat": "kv_writes",
}


def profile_generate(
    engine: TorchEngine,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    repeats: int = 3,
) -> dict[str, float]:
    """Profile one ``engine.generate(prompts, params)`` (see the module docstring); the
    prefix cache is cleared before each call, as ``bench engine`` does."""
    walls = []
    for seed in range(repeats + 1):  # call 0 warms up
        engine.clear_cache()
        start = time.perf_counter()
        engine.generate(prompts, params, seed=seed)
        walls.append(time.perf_counter() - start)
    steps_before = engine.stats.extra.get("decode_steps", 0.0)
    engine.clear_cache()
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, with_stack=True) as prof:
        start = time.perf_counter()
        engine.generate(prompts, params, seed=repeats + 1)
        profiled = time.perf_counter() - start
    steps = engine.stats.extra["decode_steps"] - steps_before
    calls: Counter[str] = Counter()
    micros: Counter[str] = Counter()
    for event in prof.events():
        part = _part(event)
        if part is not None:
            calls[part] += 1
            micros[part] += event.cpu_time_total
    out: dict[str, float] = {
        "decode_steps": float(steps),
        "wall_us_per_step": statistics.median(walls[1:]) / steps * 1e6,
        "profiled_us_per_step": profiled / steps * 1e6,
        "ops_per_step": sum(calls.values()) / steps,
        "outside_ops_us_per_step": (profiled * 1e6 - sum(micros.values())) / steps,
    }
    for part in PARTS:
        out[f"{part}_ops_per_step"] = calls[part] / steps
        out[f"{part}_us_per_step"] = micros[part] / steps
    return out


def _part(event: FunctionEvent) -> str | None:
    """The part of the step a top-level torch operation belongs to; None for anything else
    (a Python frame, or an operation run inside another)."""
    if not event.name.startswith("aten::"):
        return None
    functions = []
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return None  # run inside another operation: counted with it
        if "trace_core" in parent.name:  # "…/trace_core/policy/decoder.py(123): normalize"
            functions.append(parent.name.rsplit(": ", 1)[-1])
        parent = parent.cpu_parent
    for names, part in _BY_FUNCTION:
        if names.intersection(functions):
            return part
    if "decode_step" in functions:
        return _IN_DECODE_STEP.get(event.name, "other_decode_ops")
    if "_decode" in functions:
        return "bookkeeping"
    return "other"
