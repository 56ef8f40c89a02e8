"""``HFGenerateEngine``: the ``Engine`` protocol on top of Hugging Face ``generate``.

The baseline for ``trace-rl bench engine`` and the oracle ``TorchEngine`` is tested against.
Every call left-pads the prompts, repeats each one ``n`` times and prefills all of it again:
no prefix reuse within or across calls. Sampling draws from torch's global generator (that is
how ``generate`` samples); the engine seeds it from ``seed`` inside ``fork_rng`` so the
caller's global random state is left as it was (an unseeded call draws a fresh seed).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import numpy as np
import torch
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel

from trace_core.policy.engine import Completion, EngineStats, SamplingParams, check_prompts
from trace_core.policy.sampling import prompt_seeds, request_seed

UPSTREAM = (
    "transformers.GenerationMixin",
    # generate passes input_ids and attention_mask on to the model's forward (Qwen3's here).
    "transformers.GenerationMixin.generate(generation_config)",
    "transformers.models.qwen3.modeling_qwen3.Qwen3ForCausalLM.forward(input_ids, attention_mask)",
    "transformers.GenerationConfig(do_sample, temperature, top_p, top_k, max_new_tokens, "
    "min_new_tokens, eos_token_id, pad_token_id, output_logits, return_dict_in_generate)",
    "transformers.GenerationConfig.eos_token_id",
    "transformers.PreTrainedModel.generation_config",
    "transformers.PreTrainedModel.config",
    "transformers.PreTrainedModel.device",
    "transformers.Qwen3Config.pad_token_id",  # a field of each model's config in transformers 5
    "transformers.generation.utils.GenerateDecoderOnlyOutput.sequences",
    "transformers.generation.utils.GenerateDecoderOnlyOutput.logits",
    "torch.random.fork_rng(devices)",
    "torch.inference_mode",
    "torch.manual_seed(seed, /)",
)
"""What this module calls and reads in transformers and torch (``policy.upstream``: entry syntax
there)."""


class HFGenerateEngine:
    def __init__(self, model: PreTrainedModel, pad_token_id: int | None = None) -> None:
        if not isinstance(model, GenerationMixin):
            raise TypeError(f"{type(model).__name__} has no generate(); pass a causal LM")
        self.model = model
        self._generate = model.generate
        pad = pad_token_id if pad_token_id is not None else model.config.pad_token_id
        self.pad_token_id = int(pad) if pad is not None else 0
        self.stats = EngineStats()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        seed: int | Sequence[int] | None = None,
    ) -> list[list[Completion]]:
        """``seed``: one for the call, or one per prompt; either way HF's ``generate`` draws
        the whole batch from one generator (seeded from them all), so unlike the other engines
        a prompt's samples depend on the rest of the call."""
        check_prompts(prompts)
        if not prompts:
            return []
        rows = [list(p) for p in prompts for _ in range(params.n)]
        width = max(len(r) for r in rows)
        device = self.model.device
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):  # left padding: every row ends at column width - 1
            ids[i, width - len(r) :] = torch.tensor(r)
            mask[i, width - len(r) :] = 1
        sample = params.temperature > 0
        config = GenerationConfig(
            do_sample=sample,
            temperature=params.temperature if sample else None,
            top_p=params.top_p if sample else None,
            top_k=0 if sample else None,  # generate's default top_k=50 would truncate
            max_new_tokens=params.max_tokens,
            min_new_tokens=0,
            eos_token_id=list(params.stop_token_ids) or None,
            pad_token_id=self.pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        # generate fills unset fields from the model's own config, whose eos_token_id would
        # stop rows we were told to run to max_tokens: blank it for the call.
        defaults = self.model.generation_config
        saved_eos, defaults.eos_token_id = defaults.eos_token_id, None
        try:
            with torch.inference_mode(), torch.random.fork_rng(devices=_rng_devices(device)):
                # fork_rng restores the global state afterwards, so an unseeded call still
                # needs a fresh seed or every such call would sample the same tokens.
                if seed is not None and not isinstance(seed, int):
                    seed = request_seed(*prompt_seeds(seed, len(prompts)))
                torch.manual_seed(seed if seed is not None else secrets.randbits(62))
                out = self._generate(
                    input_ids=ids.to(device),
                    attention_mask=mask.to(device),
                    generation_config=config,
                )
        finally:
            defaults.eos_token_id = saved_eos
        new = out.sequences[:, width:].cpu()  # (B, steps)
        logprobs = torch.stack(out.logits, dim=1).float().log_softmax(-1).cpu()  # (B, steps, V)
        stops = set(params.stop_token_ids)

        completions: list[Completion] = []
        for i in range(len(rows)):
            toks = new[i].tolist()
            stop_at = next((t + 1 for t, tok in enumerate(toks) if tok in stops), None)
            end = stop_at or len(toks)  # generate pads rows that stopped before the others
            lp = logprobs[i, torch.arange(end), new[i, :end]]
            completions.append(
                Completion(
                    token_ids=np.asarray(toks[:end], dtype=np.int32),
                    logprobs=lp.numpy().astype(np.float32),
                    finished=stop_at is not None,
                )
            )
        self.stats.calls += 1
        self.stats.prompt_tokens += sum(len(p) for p in prompts)
        self.stats.prefill_tokens += sum(len(r) for r in rows)
        self.stats.generated_tokens += sum(len(c.token_ids) for c in completions)
        return [completions[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]


def _rng_devices(device: torch.device) -> list[torch.device]:
    # fork_rng forks CPU always; CUDA only for the devices named.
    return [device] if device.type == "cuda" else []
