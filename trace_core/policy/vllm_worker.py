"""Methods mixed into vLLM's worker processes (``vllm.LLM(worker_extension_cls=...)``), called by
name through ``LLM.collective_rpc``: vLLM's own way to reach into its workers for RL weight
updates. Imported only inside those workers.

``reload_policy`` loads a new checkpoint of the same architecture in place (vLLM's
``reload_weights`` from a path), then repairs tied embeddings: vLLM 0.32's layer-wise reload
loads ``embed_tokens`` but, finding no ``lm_head`` tensor in a tied checkpoint, puts the *old*
head back (seen: "ParallelLMHead: Failed to load weights", and samples that match neither
policy). The head is copied from the new embeddings, so a reloaded engine samples what a fresh
one on the new checkpoint does.
"""

from __future__ import annotations

from typing import Any

UPSTREAM = ("vllm.v1.worker.gpu_worker.Worker.reload_weights",)
"""What the mixin calls on vLLM's worker (``policy.upstream``)."""


class PolicyReload:
    """Mixed into vLLM's ``Worker``: ``self`` has its ``model_runner`` and ``vllm_config``."""

    model_runner: Any
    vllm_config: Any

    def reload_policy(self, weights_path: str) -> None:
        import torch

        self.reload_weights(weights_path=weights_path)  # type: ignore[attr-defined]
        config = self.vllm_config.model_config.hf_text_config
        if not getattr(config, "tie_word_embeddings", False):
            return
        model = self.model_runner.get_model()
        head = model.get_submodule("lm_head")
        embed = model.get_submodule("model.embed_tokens")
        if head.weight is not embed.weight:
            with torch.no_grad():
                head.weight.copy_(embed.weight)
