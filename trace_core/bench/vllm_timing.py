"""The vLLM side of ``trace-rl bench engine``: run in a Python that has vLLM (``.venv-vllm``).

    .venv-vllm/bin/python -m trace_core.bench.vllm_timing --checkpoint DIR \\
        --prompts prompts.json --max-tokens 64 --repeats 3 --json out.json

Times ``VLLMEngine.generate`` on the bench's prompts (a JSON list of token-id lists) the way
the bench times the other engines: the same sampling (one sample per prompt, temperature 1,
no stop token, exactly ``max_tokens`` tokens each), one warm-up run, then ``repeats`` runs with
the prefix cache reset before each, the best counting. Writes ``{"vllm_seconds",
"vllm_version", "tokens"}``. Only ``trace_core.policy``'s engine modules are imported, so it
runs in vLLM's own venv beside its pinned torch and transformers.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from trace_core.policy.engine import SamplingParams
from trace_core.policy.vllm_engine import VLLMEngine, VLLMOptions


def time_vllm(
    checkpoint: str, prompts: list[list[int]], max_tokens: int, repeats: int
) -> dict[str, object]:
    """Best seconds of ``repeats`` timed runs (after a warm-up) and what they produced."""
    import vllm

    params = SamplingParams(n=1, temperature=1.0, max_tokens=max_tokens)
    longest = max(len(p) for p in prompts) + max_tokens
    best = float("inf")
    engine = VLLMEngine(
        checkpoint,
        dtype="float32",  # as the other two engines run the tiny policy
        max_model_len=longest,
        options=VLLMOptions(max_num_seqs=max(len(prompts), 1), kv_cache_memory_bytes=256 * 2**20),
    )
    with engine:
        for run in range(repeats + 1):  # run 0 warms up
            engine.reset_prefix_cache()
            start = time.perf_counter()
            out = engine.generate(prompts, params, seed=run)
            seconds = time.perf_counter() - start
            made = sum(len(c.token_ids) for cs in out for c in cs)
            if made != len(prompts) * max_tokens:
                raise AssertionError(
                    f"vLLM produced {made} tokens, not {len(prompts) * max_tokens}"
                )
            if run:
                best = min(best, seconds)
    return {"vllm_seconds": best, "vllm_version": vllm.__version__, "tokens": made}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="HF checkpoint directory")
    parser.add_argument("--prompts", required=True, type=Path, help="JSON list of token-id lists")
    parser.add_argument("--max-tokens", required=True, type=int)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", required=True, type=Path, help="where to write the result")
    args = parser.parse_args()
    prompts = json.loads(args.prompts.read_text())
    if not isinstance(prompts, list) or not all(
        isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompts
    ):
        raise SystemExit(f"{args.prompts}: expected a JSON list of non-empty token-id lists")
    result = time_vllm(args.checkpoint, prompts, args.max_tokens, args.repeats)
    args.json.write_text(json.dumps(result) + "\n")


if __name__ == "__main__":  # vLLM starts processes: never at import
    main()
