"""TorchEngine's continuous batch: requests join at step boundaries and leave the step they
finish, and what each samples does not depend on when it joined or what it ran beside."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trace_core.policy.continuous import ContinuousBatch, Request
from trace_core.policy.engine import SamplingParams
from trace_core.policy.model import TinyPolicyConfig, create_policy
from trace_core.policy.sampling import request_keys
from trace_core.policy.tokenizer import build_word_tokenizer
from trace_core.policy.torch_engine import TorchEngine

TOK = build_word_tokenizer(["the quick brown fox jumps over the lazy dog", "12 + 30 = 42"])
MODEL = create_policy(TOK, TinyPolicyConfig(), seed=0)
STOP = 5  # a token the tiny policy samples now and then: some rows stop early


def prompts_of(count: int, seed: int = 0) -> list[tuple[int, ...]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 12, (count,), generator=gen).tolist()
    return [tuple(torch.randint(6, len(TOK), (n,), generator=gen).tolist()) for n in lengths]


def requests(count: int, max_tokens: int = 12) -> list[Request]:
    params = SamplingParams(max_tokens=max_tokens, stop_token_ids=(STOP,))
    keys = request_keys(list(range(count)), 1)
    return [Request(p, params, k) for p, k in zip(prompts_of(count), keys, strict=True)]


def alone(request: Request) -> list[int]:
    batch = ContinuousBatch(TorchEngine(MODEL))
    batch.add(request, 0)
    (answer,) = [c for _ in range(request.params.max_tokens + 1) for _, c in batch.step()]
    return answer.token_ids.tolist()


def test_requests_joining_a_running_batch_sample_what_they_sample_alone() -> None:
    todo = requests(24)
    engine = TorchEngine(MODEL, max_batch=8)
    batch = ContinuousBatch(engine)
    answers: dict[int, list[int]] = {}
    in_flight = []
    # Eight now, the rest a few at a time while the first ones decode.
    for r in range(8):
        batch.add(todo[r], r)
    added = 8
    while batch.pending or added < len(todo):
        for tag, completion in batch.step():
            assert tag not in answers
            answers[tag] = completion.token_ids.tolist()
            assert len(completion.token_ids) <= todo[tag].params.max_tokens
            assert completion.finished == (completion.token_ids[-1] == STOP)
        if added < len(todo) and batch.steps % 3 == 0:
            batch.add(todo[added], added)
            added += 1
        in_flight.append(batch.running)
    assert sorted(answers) == list(range(len(todo)))
    assert any(a[-1] == STOP and len(a) < 12 for a in answers.values())  # some stopped early
    for r in range(0, len(todo), 5):
        assert answers[r] == alone(todo[r])
    assert max(in_flight) == 8  # never more rows than max_batch
    assert batch.row_steps / batch.steps > 4


def test_a_request_is_answered_the_step_it_finishes() -> None:
    """A short request beside long ones comes back as soon as its last token has run."""
    long = [Request(p, SamplingParams(max_tokens=20), k) for p, k in
            zip(prompts_of(3), request_keys([1, 2, 3], 1), strict=True)]  # fmt: skip
    short = Request(prompts_of(1, seed=5)[0], SamplingParams(max_tokens=2), 99)
    batch = ContinuousBatch(TorchEngine(MODEL))
    for r, request in enumerate([*long, short]):
        batch.add(request, r)
    first = batch.step() + batch.step()
    assert [tag for tag, _ in first] == [3] and len(first[0][1].token_ids) == 2
    assert batch.running == 3
    rest = [tag for _ in range(20) for tag, _ in batch.step()]
    assert sorted(rest) == [0, 1, 2] and not batch.pending


def test_a_request_joins_rows_that_have_run_past_the_longest_ones_end() -> None:
    """A long prompt with few tokens sets the batch's width and finishes first, too few rows
    to lay the batch out again; four short prompts with many tokens run on past that width,
    and a request added then, wider than the batch, joins them there."""
    gen = torch.Generator().manual_seed(3)
    lengths, tokens = (12, 2, 2, 2, 2, 5), (3, 14, 14, 14, 14, 14)
    prompts = [tuple(torch.randint(6, len(TOK), (n,), generator=gen).tolist()) for n in lengths]
    keys = request_keys(list(range(6)), 1)
    todo = [
        Request(p, SamplingParams(max_tokens=n), k)
        for p, n, k in zip(prompts, tokens, keys, strict=True)
    ]
    batch = ContinuousBatch(TorchEngine(MODEL, max_batch=8))
    for r in range(5):
        batch.add(todo[r], r)
    answers = {tag: c.token_ids.tolist() for _ in range(6) for tag, c in batch.step()}
    assert list(answers) == [0] and batch.running == 4
    batch.add(todo[5], 5)
    answers |= {tag: c.token_ids.tolist() for _ in range(20) for tag, c in batch.step()}
    assert sorted(answers) == list(range(6))
    assert all(answers[r] == alone(todo[r]) for r in range(6))


def test_rows_stay_full_while_requests_wait() -> None:
    """With more requests waiting than rows, every step runs max_batch rows but the last few
    (while the batch drains)."""
    todo = requests(40, max_tokens=6)
    batch = ContinuousBatch(TorchEngine(MODEL, max_batch=8))
    for r, request in enumerate(todo):
        batch.add(request, r)
    running = []
    while batch.pending:
        running.append(batch.running)
        batch.step()
    full = running[: len(running) - 6]
    assert np.mean([r == 8 for r in full]) >= 0.9, running


def test_requests_of_other_sampling_wait_for_the_batch_to_drain() -> None:
    hot = Request(prompts_of(1)[0], SamplingParams(max_tokens=3), 1)
    greedy = Request(prompts_of(1)[0], SamplingParams(max_tokens=3, temperature=0.0), 2)
    batch = ContinuousBatch(TorchEngine(MODEL))
    batch.add(hot, "hot")
    batch.add(greedy, "greedy")
    order = [tag for _ in range(10) for tag, _ in batch.step()]
    assert order == ["hot", "greedy"]
    with pytest.raises(ValueError, match="token ids must be in"):
        batch.add(Request((len(TOK) + 3,), SamplingParams(), 0))
