"""Shared by the loop and step tests: one random tiny calc policy per module (the parity task
is ``parity.py`` beside this file)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support import parity

from trace_core.envs.calc import CalcSuite
from trace_core.policy.model import create_policy, save_checkpoint
from trace_core.policy.tokenizer import build_word_tokenizer


@pytest.fixture(scope="module")
def init(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny calc policy (it will rarely answer right; the loop does not care)."""
    path = tmp_path_factory.mktemp("init") / "policy"
    tokenizer = build_word_tokenizer(CalcSuite(seed=0).vocabulary())
    save_checkpoint(create_policy(tokenizer, parity.SMALL, seed=0), tokenizer, path)
    return path


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One torch thread for a module's runs (its Ray actors take the other core)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
