"""AdamW's state as safetensors, so that a resumed run continues the same update and nothing
ever unpickles it.

    save_optimizer(optimizer, "run/iterations/0003/optimizer.safetensors")
    load_optimizer(make_optimizer(model, config), "run/iterations/0003/optimizer.safetensors")
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from trace_core.policy.checkpoint import check_safetensors


def save_optimizer(optimizer: torch.optim.Optimizer, path: str | Path) -> None:
    """AdamW's moments and step counts as tensors; the hyper-parameters in the metadata."""
    state = optimizer.state_dict()
    write_optimizer_file(path, state["state"], state["param_groups"])


def load_optimizer(optimizer: torch.optim.Optimizer, path: str | Path) -> None:
    """AdamW moments ``save_optimizer`` wrote; a missing, damaged or foreign file is named."""
    state, groups = read_optimizer_file(path)
    try:
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    except (KeyError, TypeError, ValueError, RuntimeError) as err:
        raise ValueError(
            f"{path}: not this policy's optimizer state ({type(err).__name__}: {err})"
        ) from None


OptimizerState = dict[int, dict[str, torch.Tensor]]
"""Per parameter index (the optimizer's order), its slots: ``step``, ``exp_avg``, ..."""


def write_optimizer_file(
    path: str | Path, state: Mapping[int, Mapping[str, object]], groups: list[dict[str, Any]]
) -> None:
    """An optimizer's ``state_dict()`` parts as one safetensors file."""
    tensors = {
        f"state.{index}.{key}": value if torch.is_tensor(value) else torch.tensor(value)
        for index, slots in state.items()
        for key, value in slots.items()
    }
    meta = {"param_groups": json.dumps(groups)}
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(path), meta)


def read_optimizer_file(path: str | Path) -> tuple[OptimizerState, list[dict[str, Any]]]:
    """(state, param_groups) of a file ``write_optimizer_file`` wrote; a missing, damaged or
    foreign file is named."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no optimizer state (a run's optimizer.safetensors)")
    check_safetensors(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            groups = json.loads((f.metadata() or {})["param_groups"])
            for group in groups:  # JSON turned tuples (AdamW's betas) into lists
                group.update(
                    {k: tuple(v) for k, v in group.items() if isinstance(v, list) and k != "params"}
                )
            state: OptimizerState = {}
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                _, index, key = name.split(".", 2)
                state.setdefault(int(index), {})[key] = f.get_tensor(name)
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(
            f"{path}: not this policy's optimizer state ({type(err).__name__}: {err})"
        ) from None
    return state, groups
