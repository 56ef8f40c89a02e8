"""Which engine samples the rollouts, and how many of them: a config value, importable without
torch, so it travels in the training config through every pipeline step (``train.config``)
and the KFP UI can set it (the run parameters ``engine``, ``rollout_workers`` and
``gpus_per_worker``; the other fields in ``settings_json``: ``{"engine": {"tensor_parallel":
2}}``). ``rollout.engines.open_engine`` turns it into an ``Engine``.

    EngineConfig()                                        # one TorchEngine in this process
    EngineConfig(workers=2)                               # two TorchEngine Ray actors
    EngineConfig("vllm", workers=4, gpus_per_worker=1)    # vLLM on four GPU actors
"""

from __future__ import annotations

from dataclasses import dataclass

ENGINES = ("torch", "hf", "vllm")
DEVICES = ("auto", "cpu", "cuda")
DRIVERS = ("async", "lock-step", "continuous")
VLLM_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EngineConfig:
    engine: str = "torch"
    """torch (our decode loop with a prefix cache), hf (Hugging Face generate, the baseline) or
    vllm (needs the vllm extra; GPU image)."""
    workers: int = 0
    """Ray engine actors (0: one engine in this process)."""
    gpus_per_worker: float = 0.0
    """GPUs each Ray engine actor asks for (0: CPU actors)."""
    threads_per_worker: int = 1
    """Torch threads of each Ray engine actor (its CPU request)."""
    tensor_parallel: int = 1
    """vLLM tensor-parallel size: GPUs one vLLM engine spans. Above 1 (with
    ``gpus_per_worker`` 1), each engine actor holds ``tensor_parallel`` GPUs itself, one per
    rank (``engine_gpus``): Ray gives one actor's devices on one node, its bundle of the run's
    placement group beside the trainers' (``rollout.placement``), and vLLM's ranks run as
    processes of that actor (its multiprocessing executor). It needs a pod with that many
    GPUs: the RayCluster's GPU worker group (``manifests/``), one pod per node holding its
    ``gpus_per_node``."""
    gpus_per_node: int = 8
    """GPUs of the pod an engine lands on (the RayCluster's GPU group: one pod per 8-GPU node).
    A ``tensor_parallel`` above it is refused before any work: such an engine would
    wait for a node that never comes. A setting rather than a look at the cluster, because a
    group that scales from zero shows no node until something asks for one."""
    memory_fraction: float = 0.0
    """vLLM's gpu_memory_utilization: the share of a GPU its weights and KV cache may take.
    0 (auto): 0.9 of what the engine owns, so engines sharing a GPU (``gpus_per_worker`` below
    1) split it: two at 0.5 each take 0.45 of it apiece (``vllm_memory_fraction``)."""
    max_model_len: int = 0
    """vLLM: the longest sequence an engine holds, prompt and sample (0: the model's own);
    lower it to fit a long-context model's KV cache on a small GPU."""
    kv_cache_gib: float = 0.0
    """vLLM: KV-cache size in GiB, instead of ``memory_fraction`` of the GPU (0: from
    ``memory_fraction`` on GPUs; on CPU, each engine actor takes a quarter of the memory its
    node has free at start, split over the engines of its pool that fit on that node, at most
    4 GiB: ``ray_worker.cpu_kv_cache_bytes``)."""
    ready_timeout_s: float = 1800.0
    """How long a Ray engine pool waits for its actors to start before it gives up. On a
    cluster that covers a GPU node scaled from zero (minutes), the image pull (≈10 GB), the
    policy's download (16 GB at 8B) and vLLM's compilation and CUDA graphs: 30 min by default,
    20 at the least for such a start."""
    call_timeout_s: float = 3600.0
    """How long a Ray engine pool waits for its actors to answer a call once started (a
    sub-batch, a turn, a weight load) before it stops the run with one line naming them: an
    actor alive but stuck (a deadlocked engine, a frozen node) would hang it forever. Above the
    longest call, a restart after a fault included (``ready_timeout_s``): 1 h by default."""
    dtype: str = "auto"
    """vLLM: the engine's weights and arithmetic: auto (vLLM's choice: bfloat16 for a float32
    checkpoint), float32, bfloat16 or float16. The update's old_logprobs=auto recomputes π_old
    when they differ from the trainer's."""
    eager: bool = False
    """vLLM: no CUDA graphs and no torch.compile: starts in seconds instead of a minute,
    decodes slower on GPU. For tests and short runs."""
    device: str = "auto"
    """In-process engines: auto (CUDA when this process has a GPU), cpu or cuda."""
    max_rows: int = 256
    """Torch engine: sequences decoded at once (more run in turn)."""
    cache_tokens: int = 65_536
    """Torch engine: token slots of its prefix-cache KV pool, allocated at start. A slot holds
    layers × 2 × kv_heads × head_dim values: 2 KB for the tiny policy, 45 KB for SmolLM2-135M
    in fp32, 144 KB for an 8B Qwen3 in bf16; the longest prompt of a call must fit in half."""
    keep_alive_s: float = 0.0
    """Pipeline steps sent to a Ray cluster (``ray_address``): the engine actors outlive the
    step's Ray job, named after the run, and the run's next rollout or evaluation loads its
    new weights into them (vLLM in place) instead of starting engines again; the final
    evaluation stops them, and an actor left without a call for this many seconds (a run that
    failed) stops itself. Set it above the longest update (the gap between two rollouts).
    While kept, the actors hold their GPUs: the run's trainer actors need GPUs of their
    own. A pipeline run's trainer actors hold the same lease (``train.lease``; a running step
    renews it). 0: every step starts and stops its own engines."""
    driver: str = "auto"
    """Ray engine pools: how ``grow_trees`` drives the workers. continuous: each turn joins its
    engine's running batch as soon as its env step is done and comes back the step it
    finishes (``rollout.ray_continuous``; TorchEngine and vLLM actors); async: each worker's
    sub-batch of turns comes back as soon as it is done, and the turns they free go out at
    once; lock-step: one engine call per turn-step, every worker waiting for the slowest.
    auto: continuous, and async for HF engines (``generate`` has no running batch)."""
    max_num_seqs: int = 0
    """vLLM: sequences its scheduler runs at once, the rows of its running batch (0: vLLM's
    default for the device). ``max_rows`` is the torch engine's."""
    max_num_batched_tokens: int = 0
    """vLLM: tokens its scheduler puts in one step, prefills and decodes together (0: vLLM's
    default for the device; on CPU at least the longest sequence, whose prefill runs whole)."""

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}; got {self.engine!r}")
        if self.driver not in ("auto", *DRIVERS):
            allowed = ", ".join(("auto", *DRIVERS))
            raise ValueError(f"driver must be one of {allowed}; got {self.driver!r}")
        if self.driver == "continuous" and self.engine == "hf":
            raise ValueError("driver continuous needs a running batch: engine hf runs async")
        if self.max_num_seqs < 0 or self.max_num_batched_tokens < 0:
            raise ValueError(
                f"max_num_seqs and max_num_batched_tokens must be >= 0 (0: vLLM's default), got "
                f"{self.max_num_seqs} and {self.max_num_batched_tokens}"
            )
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}; got {self.device!r}")
        if self.workers < 0:
            raise ValueError(f"workers must be >= 0, got {self.workers}")
        if self.gpus_per_worker < 0:
            raise ValueError(f"gpus_per_worker must be >= 0, got {self.gpus_per_worker}")
        if self.gpus_per_worker and not self.workers:
            raise ValueError("gpus_per_worker needs workers >= 1 (it sizes Ray engine actors)")
        if self.threads_per_worker < 1 or self.tensor_parallel < 1:
            raise ValueError("threads_per_worker and tensor_parallel must be >= 1")
        if self.max_rows < 1 or self.cache_tokens < 2:
            raise ValueError(
                f"max_rows must be >= 1 and cache_tokens >= 2, got {self.max_rows} and "
                f"{self.cache_tokens}"
            )
        if self.max_model_len < 0 or self.max_model_len == 1:
            raise ValueError(
                f"max_model_len must be 0 (the model's) or >= 2, got {self.max_model_len}"
            )
        if self.dtype not in VLLM_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(VLLM_DTYPES)}; got {self.dtype!r}")
        if not self.kv_cache_gib >= 0:
            raise ValueError(f"kv_cache_gib must be >= 0, got {self.kv_cache_gib}")
        if not self.keep_alive_s >= 0:
            raise ValueError(f"keep_alive_s must be >= 0, got {self.keep_alive_s}")
        if self.keep_alive_s and not self.workers:
            raise ValueError("keep_alive_s needs workers >= 1 (it keeps Ray engine actors)")
        if not 0 <= self.memory_fraction <= 1:
            raise ValueError(
                f"memory_fraction must be 0 (auto) or in (0, 1], got {self.memory_fraction}"
            )
        if not self.ready_timeout_s > 0:
            raise ValueError(f"ready_timeout_s must be > 0, got {self.ready_timeout_s}")
        if not self.call_timeout_s > 0:
            raise ValueError(f"call_timeout_s must be > 0, got {self.call_timeout_s}")
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be >= 1, got {self.gpus_per_node}")
        if self.engine == "vllm" and self.tensor_parallel > self.gpus_per_node:
            raise ValueError(
                f"tensor_parallel {self.tensor_parallel} needs {self.tensor_parallel} GPUs on "
                f"one node; the largest GPU pod has {self.gpus_per_node} (gpus_per_node): "
                f"lower tensor_parallel, or raise gpus_per_node with the pods' GPUs"
            )
        if self.tensor_parallel > 1 and self.gpus_per_worker not in (0, 1):
            raise ValueError(
                f"tensor_parallel {self.tensor_parallel} gives each rank one whole GPU: "
                f"gpus_per_worker must be 0 (CPU) or 1, got {self.gpus_per_worker}"
            )

    @property
    def engine_gpus(self) -> float:
        """GPUs each Ray engine actor holds (``engine_gpus``)."""
        return engine_gpus(self.engine, self.tensor_parallel, self.gpus_per_worker)

    def vllm_memory_fraction(self) -> float:
        """``memory_fraction``, or for 0 (auto) 0.9 of the GPU share each engine owns."""
        if self.memory_fraction:
            return self.memory_fraction
        return 0.9 * min(1.0, self.gpus_per_worker or 1.0)

    @property
    def pool_driver(self) -> str:
        """The driver of a Ray pool: ``driver``, with auto resolved."""
        if self.driver != "auto":
            return self.driver
        return "async" if self.engine == "hf" else "continuous"

    def vllm_kwargs(self) -> dict[str, int | None]:
        """``max_model_len``, ``kv_cache_bytes`` and the scheduler's limits as the vLLM engines
        take them (None: vLLM's)."""
        return {
            "max_model_len": self.max_model_len or None,
            "kv_cache_bytes": int(self.kv_cache_gib * 2**30) or None,
            "max_num_seqs": self.max_num_seqs or None,
            "max_num_batched_tokens": self.max_num_batched_tokens or None,
        }


def engine_gpus(engine: str, tensor_parallel: int, gpus_per_worker: float) -> float:
    """GPUs one Ray engine actor holds: a tensor-parallel vLLM engine on GPUs its
    ``tensor_parallel`` (one per rank, all on its node), any other ``gpus_per_worker``."""
    if engine == "vllm" and tensor_parallel > 1 and gpus_per_worker > 0:
        return float(tensor_parallel)
    return float(gpus_per_worker)
