"""Engine actors that did not start, or restarted ones that did not come back: one line naming
the cause and the setting to change (``rollout.ray_pool``)."""

from __future__ import annotations

import re


class EngineStartError(RuntimeError):
    """Engine actors that did not start: one line naming the cause and the setting to change
    (the CLI prints it as its error; ``--debug`` shows the traceback)."""


HINTS = (
    (
        ("memory", "kv cache", "out of memory", "oom"),
        "lower kv_cache_gib (--kv-cache-gib) or memory_fraction (--memory-fraction)",
    ),
    (("no such file", "checkpoint", "config.json"), "check the policy checkpoint's path"),
    (("cuda", "nvidia", "no gpu"), "check gpus_per_worker and the nodes' GPUs"),
)
"""What to change, by words of the worker's error."""


def start_failure(worker: int, err: BaseException) -> str:
    """``err`` (an actor that died in its constructor, whose text holds the whole remote
    traceback) as one line: the worker, the last exception's line, and the setting to change."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    raised = [line for line in lines if re.match(r"^[\w.]+(Error|Exception)\b.*:", line)]
    cause = (raised or lines or [type(err).__name__])[-1]
    hint = next(
        (h for words, h in HINTS if any(w in cause.lower() for w in words)),
        "rerun with --debug for the worker's traceback",
    )
    return f"engine worker {worker} did not start: {cause}; {hint}"
