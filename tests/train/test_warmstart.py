"""Warm start: demonstration sequences and their loss masks, the SFT trainer, the whole run.

The worked example lays one two-turn calc demo out by hand from ``TurnFormat``; the property
checks read any demo back out of its sequence (the masked runs are the agent's turns, the rest
is what the env said) and replay it. Nothing here asserts on how long anything took.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from trace_core.envs.base import DemoSuite, Task, replay
from trace_core.envs.calc import CalcSuite
from trace_core.envs.multihop import MultihopSuite
from trace_core.policy.format import TurnFormat
from trace_core.policy.model import TinyPolicyConfig, create_policy, load_checkpoint
from trace_core.policy.sft import SFTConfig, sft_train
from trace_core.policy.tokenizer import build_word_tokenizer
from trace_core.train.warmstart import (
    RECORD,
    WarmstartConfig,
    WarmstartMismatch,
    WarmstartReport,
    demonstration_sequences,
    stored_warmstart,
    synthetic_suite,
    warmstart,
)

SMALL = TinyPolicyConfig(
    hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64
)
CALC_LABELS = [f"ops={o},digits={d}" for o in (1, 2, 3) for d in (1, 2, 3)]


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread: on a shared CPU, idle OpenMP workers cost more than they give."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


class CarefulCalc(CalcSuite):
    """The calc suite with demonstrations that never slip: each demo is the task's reference."""

    def mistake_rate_for(self, task: Task) -> float:
        return 0.0


def runs(mask: np.ndarray) -> list[tuple[bool, int, int]]:
    """Maximal runs of equal mask values as (value, start, stop)."""
    edges = [0, *(np.flatnonzero(np.diff(mask.astype(np.int8))) + 1).tolist(), len(mask)]
    return [(bool(mask[a]), a, b) for a, b in itertools.pairwise(edges)]


# --- demonstration_sequences ---------------------------------------------------------------------


def test_worked_demo_sequence_and_mask() -> None:
    suite = CarefulCalc(seed=0, train_size=9, eval_size=9)
    fmt = TurnFormat(build_word_tokenizer(suite.vocabulary()))
    task = suite.tasks("train")[0]
    assert task.prompt == (
        "cal has 42 cards . he keeps one of every 7 . how many cards does he have ?"
    )
    assert task.reference == ("calc[42/7]", "answer[6]")

    sequences, masks, success = demonstration_sequences(
        suite, [task], fmt, np.random.default_rng(0)
    )
    prompt = fmt.prompt_ids(task.prompt)
    calc, obs, answer = (
        fmt.action_ids("calc[42/7]"),
        fmt.observation_ids("= 6"),
        fmt.action_ids("answer[6]"),
    )
    # prompt: <|im_start|> user \n (3) + 19 words and 18 spaces, "42" being two digits (38)
    #         + <|im_end|> \n <|im_start|> assistant \n (5)                      = 46 tokens
    # calc[42/7]<|im_end|>: calc [ 4 2 / 7 ] <|im_end|>                           =  8
    # observation: \n <|im_start|> user \n = _ 6 <|im_end|> \n <|im_start|> assistant \n = 12
    # answer[6]<|im_end|>: answer [ 6 ] <|im_end|>                                =  5
    # No observation after the answer: the episode is over.           46 + 8 + 12 + 5 = 71
    assert (len(prompt), len(calc), len(obs), len(answer)) == (46, 8, 12, 5)
    assert sequences[0].dtype == np.int32 and masks[0].dtype == np.bool_
    assert sequences[0].tolist() == prompt + calc + obs + answer
    assert masks[0].tolist() == [False] * 46 + [True] * 8 + [False] * 12 + [True] * 5
    assert success == {"ops=1,digits=1": 1.0}


def test_careful_demos_succeed_on_every_difficulty() -> None:
    suite = CarefulCalc(seed=0, train_size=18, eval_size=9)
    fmt = TurnFormat(build_word_tokenizer(suite.vocabulary()))
    tasks = suite.tasks("train")
    sequences, masks, success = demonstration_sequences(suite, tasks, fmt, np.random.default_rng(1))
    assert success == dict.fromkeys(CALC_LABELS, 1.0)
    for task, seq, mask in zip(tasks, sequences, masks, strict=True):
        # Learned tokens are exactly the reference turns, each with its action-end token.
        learned = seq[mask].tolist()
        assert learned == [i for a in task.reference for i in fmt.action_ids(a)]


@pytest.mark.parametrize(
    "suite",
    [
        CalcSuite(seed=0, train_size=45, eval_size=9),
        MultihopSuite(seed=0, entities=40, train_size=30, eval_size=6),
    ],
    ids=["calc", "multihop"],
)
def test_any_demo_reads_back_from_its_sequence(suite: DemoSuite) -> None:
    """With slips: the masked runs decode to turns that, replayed, give the unmasked runs."""
    fmt = TurnFormat(build_word_tokenizer(suite.vocabulary()))
    tasks = suite.tasks("train")
    sequences, masks, success = demonstration_sequences(suite, tasks, fmt, np.random.default_rng(2))
    assert len(sequences) == len(masks) == len(tasks)
    rewards: dict[str, list[float]] = {}
    for task, seq, mask in zip(tasks, sequences, masks, strict=True):
        assert seq.shape == mask.shape
        parts = runs(mask)
        # prompt, then (action, observation) pairs, ending on an action.
        assert [value for value, _, _ in parts] == [i % 2 == 1 for i in range(len(parts))]
        assert seq[: parts[0][2]].tolist() == fmt.prompt_ids(task.prompt)
        actions = []
        for value, a, b in parts[1::2]:
            turn = seq[a:b].tolist()
            assert value and turn[-1] == fmt.end_of_turn_id
            assert fmt.end_of_turn_id not in turn[:-1]  # one action per run
            actions.append(fmt.decode_action(turn))
        observations, last = replay(suite.make_env(), task, actions)
        assert last is not None and last.done  # a demo plays to the end of its episode
        said = [seq[a:b].tolist() for _, a, b in parts[2::2]]
        assert said == [fmt.observation_ids(o) for o in observations[1:-1]]
        rewards.setdefault(task.difficulty, []).append(last.reward)
    assert success == {k: pytest.approx(float(np.mean(v))) for k, v in sorted(rewards.items())}
    assert list(success) == sorted({t.difficulty for t in tasks})


# --- sft_train -----------------------------------------------------------------------------------

TOK = build_word_tokenizer(["the quick brown fox jumps over the lazy dog"])  # 57 tokens


def test_sft_memorises_a_few_sequences() -> None:
    rng = np.random.default_rng(0)
    sequences = [rng.integers(4, len(TOK), size=12).astype(np.int32) for _ in range(4)]
    masks = [np.r_[np.zeros(3, bool), np.ones(9, bool)] for _ in range(4)]
    model = create_policy(TOK, SMALL, seed=0)
    seen: list[tuple[int, float]] = []
    config = SFTConfig(steps=60, batch_size=4, warmup=5, lr=1e-2)
    losses = sft_train(
        model, sequences, masks, config, TOK.pad_token_id, lambda s, x: seen.append((s, x))
    )
    assert seen == list(enumerate(losses)) and len(losses) == 60
    # A random policy over the 59-token vocabulary starts near ln 59 ≈ 4.1; the 4 × 9 learned
    # targets are then memorised (about 0.03 after 60 steps; a quarter of the start is plenty).
    first, last = float(np.mean(losses[:5])), float(np.mean(losses[-5:]))
    assert len(TOK) == 59
    assert first > 3.0 and last < 0.25 * first, (first, last)
    assert not model.training  # left in eval mode


def test_masked_positions_do_not_contribute() -> None:
    """Two sequences (right-padded together), each learning one token: the loss is the mean
    cross-entropy of those two predictions, each computed by hand from its own forward pass."""
    model = create_policy(TOK, SMALL, seed=3)
    a = np.array([5, 9, 7, 11, 6, 8, 10], np.int32)  # learns a[3] = 11 from a[:3]
    b = np.array([12, 4, 13, 6], np.int32)  # learns b[2] = 13 from b[:2]
    mask_a = np.zeros(7, bool)
    mask_a[3] = True
    mask_b = np.zeros(4, bool)
    mask_b[2] = True

    def ce(seq: np.ndarray, at: int) -> float:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([seq.tolist()])).logits[0]  # (T, V)
        return float(F.cross_entropy(logits[at - 1 : at], torch.tensor([int(seq[at])])))

    expected = (ce(a, 3) + ce(b, 2)) / 2
    losses = sft_train(
        model, [a, b], [mask_a, mask_b], SFTConfig(steps=1, batch_size=2), TOK.pad_token_id
    )
    assert losses[0] == pytest.approx(expected, rel=1e-5)


def test_a_learned_token_alone_carries_the_gradient() -> None:
    """Changing a masked token *after* the learned one changes nothing: same loss, same update."""
    seq = np.array([5, 9, 7, 11, 6, 8], np.int32)
    mask = np.array([False, False, False, True, False, False])
    other = seq.copy()
    other[4:] = [12, 13]  # masked, and later than the learned position 3
    updated = []
    for s in (seq, other):
        model = create_policy(TOK, SMALL, seed=1)
        loss = sft_train(model, [s], [mask], SFTConfig(steps=1, warmup=1), TOK.pad_token_id)
        updated.append((loss[0], [p.detach().clone() for p in model.parameters()]))
    (loss_a, params_a), (loss_b, params_b) = updated
    assert loss_a == loss_b
    assert all(torch.equal(x, y) for x, y in zip(params_a, params_b, strict=True))


def test_sft_rejects_mismatched_masks() -> None:
    model = create_policy(TOK, SMALL, seed=0)
    seqs = [np.arange(4, 9, dtype=np.int32), np.arange(4, 9, dtype=np.int32)]
    masks = [np.ones(5, bool), np.ones(4, bool)]
    with pytest.raises(ValueError, match="sequence 1: 5 tokens but 4 mask entries"):
        sft_train(model, seqs, masks, SFTConfig(steps=1), TOK.pad_token_id)
    with pytest.raises(ValueError, match="one loss mask per sequence"):
        sft_train(model, seqs, masks[:1], SFTConfig(steps=1), TOK.pad_token_id)
    with pytest.raises(ValueError, match="at least one sequence"):
        sft_train(model, [], [], SFTConfig(steps=1), TOK.pad_token_id)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"steps": 0}, "steps and batch_size"),
        ({"batch_size": 0}, "steps and batch_size"),
        ({"lr": 0.0}, "lr must be > 0"),
        ({"lr": math.nan}, "lr must be > 0"),
    ],
)
def test_sft_config_rejects_bad_values(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SFTConfig(**kwargs)  # type: ignore[arg-type]


# --- the whole warm start ------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    out: Path
    report: WarmstartReport
    losses: list[float]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    out = tmp_path_factory.mktemp("warmstart") / "policy"
    config = WarmstartConfig(
        task="calc",
        output=out,
        demos=200,
        sft=SFTConfig(steps=15, batch_size=8),
        policy=SMALL,
        eval_tasks=9,
        eval_samples=2,
    )
    losses: list[float] = []
    report = warmstart(config, progress=lambda step, loss: losses.append(loss))
    return Run(out, report, losses)


def test_warmstart_report(tiny_run: Run) -> None:
    report = tiny_run.report
    assert report.task == "calc" and report.checkpoint == str(tiny_run.out)
    assert report.steps == 15 and len(tiny_run.losses) == 15
    assert report.final_loss == pytest.approx(np.mean(tiny_run.losses))  # last 20 steps: all 15
    assert report.train_seconds >= 0
    # 200 demos drawn from 2000 train tasks cover all nine difficulties.
    assert list(report.demo_success) == CALC_LABELS
    # The demos' success is that of the very demos trained on: warmstart draws the 200 train
    # tasks, then their slips, from one default_rng(seed); replayed here, the same rates.
    rng = np.random.default_rng(0)
    suite = CalcSuite(seed=0)
    fmt = TurnFormat(build_word_tokenizer(suite.vocabulary()))
    picked = [suite.tasks("train")[i] for i in rng.integers(0, 2000, size=200)]
    assert report.demo_success == demonstration_sequences(suite, picked, fmt, rng)[2]
    # Slips rise with difficulty: (1 − 0.02)² = 0.96 of the easiest demos succeed, (1 − 0.6)⁴
    # = 0.03 of the hardest (measured on these 200: 30/31 and 2/20).
    easiest, hardest = report.demo_success["ops=1,digits=1"], report.demo_success["ops=3,digits=3"]
    assert easiest > 0.9 and hardest < 0.2
    # 9 eval tasks are one per difficulty, 2 samples each: every rate is 0, 1/2 or 1.
    assert list(report.success) == CALC_LABELS
    assert all(v in (0.0, 0.5, 1.0) for v in report.success.values())


def test_warmstart_checkpoint_loads(tiny_run: Run) -> None:
    assert {"config.json", "model.safetensors"} <= {p.name for p in tiny_run.out.iterdir()}
    model, tokenizer = load_checkpoint(tiny_run.out)
    fmt = TurnFormat(tokenizer)
    suite = CalcSuite(seed=0)
    task = suite.tasks("eval")[0]
    ids = fmt.prompt_ids(task.prompt)
    # The saved tokenizer covers the suite: questions, actions and observations round-trip.
    question = fmt.encode(task.prompt)
    assert tokenizer.unk_token_id not in question and tokenizer.decode(question) == task.prompt
    for action in task.reference:
        assert fmt.decode_action(fmt.action_ids(action)) == action
    assert tokenizer.decode(fmt.encode("= 627585")) == "= 627585"
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tokenizer))


def test_warmstart_tokenizer_knows_the_turn_layout(tiny_run: Run) -> None:
    _, tokenizer = load_checkpoint(tiny_run.out)
    fmt = TurnFormat(tokenizer)
    task = CalcSuite(seed=0).tasks("eval")[0]
    layout = fmt.prompt_ids(task.prompt) + fmt.observation_ids("= 6")
    assert tokenizer.unk_token_id not in layout
    assert tokenizer.decode(fmt.prompt_ids(task.prompt)) == (
        f"<|im_start|>user\n{task.prompt}<|im_end|>\n<|im_start|>assistant\n"
    )


def test_warmstart_config_names_the_synthetic_tasks() -> None:
    with pytest.raises(
        ValueError, match=r"synthetic task \(calc, calc-mix, multihop\), got 'nope'"
    ):
        WarmstartConfig(task="nope")
    with pytest.raises(ValueError, match="got 'bfcl'"):
        synthetic_suite("bfcl")
    with pytest.raises(ValueError, match="demos, eval_samples and eval_tasks must be >= 1"):
        WarmstartConfig(demos=0)
    assert isinstance(synthetic_suite("multihop"), MultihopSuite)


# --- a pretrained init: its own template, reference solutions, the update's memory controls -------
def test_sft_in_passes_gives_the_one_pass_gradient() -> None:
    from trace_core.policy.sft import _accumulate, _batch

    suite = CalcSuite(seed=0, train_size=20, eval_size=2)
    tokenizer = build_word_tokenizer(suite.vocabulary())
    fmt = TurnFormat(tokenizer)
    sequences, masks, _ = demonstration_sequences(
        suite, suite.tasks("train")[:8], fmt, np.random.default_rng(0)
    )
    model = create_policy(tokenizer, TinyPolicyConfig(), seed=0)
    index = np.arange(8)
    ids, attention, targets = _batch(sequences, masks, index, tokenizer.pad_token_id)
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
    torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    ).backward()
    whole = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    _accumulate(model, sequences, masks, index, tokenizer.pad_token_id, budget=120)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, whole[name], atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("positions_read", [True, False])
def test_sft_rows_give_the_padded_batch_loss_and_gradient(positions_read: bool) -> None:
    """The batch packed into shared rows gives the loss and gradient of the padded batch's full
    logits; a model that ignores ``position_ids`` (so would let packed sequences see each other)
    is caught, and gets one sequence a row, with the same loss and gradient."""
    from trace_core.policy.sft import (
        _batch,
        _keeps_packed_sequences_apart,
        _rows,
        _targets,
        _token_mean_loss,
    )

    suite = CalcSuite(seed=0, train_size=20, eval_size=2)
    tokenizer = build_word_tokenizer(suite.vocabulary())
    fmt = TurnFormat(tokenizer)
    sequences, masks, _ = demonstration_sequences(
        suite, suite.tasks("train")[:12], fmt, np.random.default_rng(0)
    )
    model = create_policy(tokenizer, TinyPolicyConfig(), seed=0)
    index = np.random.default_rng(1).permutation(12)
    ids, attention, targets = _batch(sequences, masks, index, tokenizer.pad_token_id)
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
    expected = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    expected.backward()
    whole = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    if not positions_read:
        decoder = model.base_model
        forward = decoder.forward
        decoder.forward = lambda *args, position_ids=None, **kwargs: forward(*args, **kwargs)

    tokens = [np.asarray(seq, dtype=np.int64) for seq in sequences]
    together = _keeps_packed_sequences_apart(model, tokens[0])
    assert together == positions_read
    wanted = [_targets(seq, mask) for seq, mask in zip(tokens, masks, strict=True)]
    rows, positions, row_targets = _rows(tokens, wanted, index, tokenizer.pad_token_id, together)
    assert len(rows) < len(index) if together else len(rows) == len(index)
    assert rows.shape[1] == max(len(seq) for seq in sequences)
    assert (row_targets != -100).sum() == (targets != -100).sum()
    loss = _token_mean_loss(model, rows, positions, row_targets)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    loss.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, whole[name], atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.slow
def test_a_pretrained_init_warm_starts_with_its_template(tmp_path: Path) -> None:
    """A random Qwen3 over Qwen's real vocabulary stands in for a pretrained model: the warm
    start renders its turns with its template, learns from clean references in passes, and
    reports parse rate and success before and after."""
    from dataclasses import replace

    from support.models import qwen_tokenizer
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from trace_core.policy.model import load_checkpoint, save_checkpoint
    from trace_core.train.warmstart import PRETRAINED_SFT

    tokenizer = qwen_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    save_checkpoint(Qwen3ForCausalLM(config).eval(), tokenizer, tmp_path / "init")
    sft = replace(PRETRAINED_SFT, steps=3, batch_size=4, micro_tokens=300)
    report = warmstart(
        WarmstartConfig(task="calc", output=tmp_path / "out", demos=12, sft=sft, eval_tasks=3,
                        eval_samples=1, init=tmp_path / "init", max_tokens=8)
    )  # fmt: skip
    assert report.steps == 3 and np.isfinite(report.final_loss)
    assert report.demo_success and set(report.demo_success.values()) == {1.0}  # no slips
    assert report.parse_rate_before is not None and 0 <= report.parse_rate <= 1
    assert report.success_all_before is not None
    _, saved = load_checkpoint(tmp_path / "out")
    assert saved.chat_template == tokenizer.chat_template  # the model's own, kept


# --- a stored warm start is reused only for what it was made for -----------------------------
def recipe(out: Path, **changes: object) -> WarmstartConfig:
    """``tiny_run``'s config, with ``changes``."""
    base = {
        "task": "calc",
        "output": out,
        "demos": 200,
        "sft": SFTConfig(steps=15, batch_size=8),
        "policy": SMALL,
        "eval_tasks": 9,
        "eval_samples": 2,
    }
    return WarmstartConfig(**{**base, **changes})  # type: ignore[arg-type]


def test_a_warm_start_records_what_made_it(tiny_run: Run) -> None:
    record = json.loads((tiny_run.out / RECORD).read_text())
    assert record["format"] == "trace.warmstart/1" and record["task"] == "calc"
    assert record["sft"]["steps"] == 15 and record["demos"] == 200 and record["init"] is None
    assert record["report"]["steps"] == 15
    assert not tiny_run.out.with_name(f".{tiny_run.out.name}.partial").exists()


def test_the_same_recipe_reuses_the_stored_warm_start(tiny_run: Run) -> None:
    # The evaluation's settings change the report only: the weights are the same.
    stored = stored_warmstart(tiny_run.out, recipe(tiny_run.out, eval_tasks=3), "a test")
    assert stored == tiny_run.report


@pytest.mark.parametrize(
    ("changes", "held", "needed"),
    [
        ({"task": "calc-mix"}, "task calc", "task calc-mix"),
        ({"sft": SFTConfig(steps=30, batch_size=8)}, "sft.steps 15", "sft.steps 30"),
        ({"seed": 3, "demos": 100}, "seed 0, demos 200", "seed 3, demos 100"),
    ],
)
def test_another_recipe_is_refused_naming_the_difference(
    tiny_run: Run, changes: dict[str, object], held: str, needed: str
) -> None:
    with pytest.raises(WarmstartMismatch) as refused:
        stored_warmstart(tiny_run.out, recipe(tiny_run.out, **changes), "this comparison")
    message = str(refused.value)
    assert message == (
        f"{tiny_run.out} holds the warm start made with {held}; this comparison needs "
        f"{needed}: use another output folder, or remove {tiny_run.out}"
    )


def test_a_folder_without_a_record_is_neither_reused_nor_written_over(tmp_path: Path) -> None:
    folder = tmp_path / "policy"
    assert stored_warmstart(folder, recipe(folder), "a test") is None  # nothing there: make it
    folder.mkdir()
    assert stored_warmstart(folder, recipe(folder), "a test") is None  # empty: make it
    (folder / "config.json").write_text("{}")  # a policy of before the record, or a stranger's
    with pytest.raises(WarmstartMismatch, match=r"holds files but no warmstart\.json"):
        stored_warmstart(folder, recipe(folder), "a test")
    with pytest.raises(WarmstartMismatch, match="is not empty"):
        warmstart(recipe(folder))
    assert [p.name for p in folder.iterdir()] == ["config.json"]


def test_an_interrupted_warm_start_leaves_only_its_scratch_folder(tmp_path: Path) -> None:
    folder = tmp_path / "policy"
    config = recipe(folder, sft=SFTConfig(steps=2, batch_size=4), eval_tasks=1, eval_samples=1)

    def interrupt(what: str) -> None:  # the weights are written, the evaluation not run
        if what.startswith("evaluating the warm-started policy"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        warmstart(config, stage=interrupt)
    assert not folder.exists() and folder.with_name(".policy.partial").exists()
    assert stored_warmstart(folder, config, "a test") is None  # so the next one makes it
    report = warmstart(config)
    assert stored_warmstart(folder, config, "a test") == report
    assert not folder.with_name(".policy.partial").exists()
