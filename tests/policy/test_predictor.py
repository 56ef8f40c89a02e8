"""The shared success predictor: featurizers, fitting, replay, checkpoints, scores.

The synthetic trees below have a V that a predictor can only learn from the tokens: a prompt
holds a difficulty marker that sets the starting logit, and every observation holds a GOOD or
BAD marker that moves it. Filler tokens are random, so no two prompts share a token history.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from trace_core.algo.prefix import TrainingRows, training_rows
from trace_core.algo.shape import PRIOR_WORTH
from trace_core.algo.tree import RolloutTree, TreeBuilder, TreeInfo
from trace_core.policy.featurizer import EXTRA_FEATURES, EmbeddingFeaturizer, HashedNgramFeaturizer
from trace_core.policy.format import TurnFormat
from trace_core.policy.predictor import (
    CONFIG_FILE,
    EARLIER,
    REPLAY_FILE,
    ROOT_FILE,
    WEIGHTS_FILE,
    PredictorConfig,
    SharedPredictor,
)
from trace_core.policy.predictor_scores import evaluate_predictor
from trace_core.policy.tokenizer import build_word_tokenizer
from trace_core.rollout.predictor import ConstantPredictor

TURN = 3  # the turn-end token, as <|im_end|> in the tiny word tokenizer
DIFFICULTY = (8, 9, 10)  # prompt markers: starting logits +1.5, 0, −1.5
GOOD, BAD = 6, 7  # observation markers: logit +1.2 / −1.2
FILLER = (20, 60)


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def synthetic_tree(prompt_id: str, rng: np.random.Generator) -> RolloutTree:
    """3 root rollouts of 3 turns, then 2 continuations from the first rollout's first turn."""
    level = int(rng.integers(3))
    prompt = [*rng.integers(*FILLER, size=5), DIFFICULTY[level], *rng.integers(*FILLER, size=5)]
    builder = TreeBuilder(TreeInfo(prompt_id=prompt_id), prompt_tokens=[*prompt, TURN])
    logits = {0: 1.5 * (1 - level)}

    def rollout(parent: int, first_turn: int, *, branch: bool) -> None:
        node, logit = parent, logits[parent]
        for turn in range(first_turn, 3):
            good = rng.random() < _sigmoid(logit)
            logit += 1.2 if good else -1.2
            node = builder.add_turn(
                node,
                gen_tokens=[*rng.integers(*FILLER, size=4), TURN],
                obs_tokens=[*rng.integers(*FILLER, size=2), GOOD if good else BAD, TURN],
                branch=branch and turn == first_turn,
            )
            logits[node] = logit
        builder.set_reward(node, float(rng.random() < _sigmoid(logit)))

    for _ in range(3):
        rollout(0, 0, branch=False)
    for _ in range(2):
        rollout(1, 1, branch=True)  # node 1: the first rollout's first turn
    return builder.build()


def synthetic_trees(count: int, seed: int, tag: str) -> list[RolloutTree]:
    rng = np.random.default_rng(seed)
    return [synthetic_tree(f"{tag}-{i}", rng) for i in range(count)]


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """A 258→16→1 MLP is all overhead across threads: on a busy CPU, 1 thread is 4× faster."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


SMALL = PredictorConfig(turn_token=TURN, buckets=128, hidden=16, epochs=15, batch_size=128)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- featurizers ---------------------------------------------------------------------------------
def test_hashed_features_shape_determinism_and_order() -> None:
    phi = HashedNgramFeaturizer(turn_token=TURN, buckets=64, ngram=3, recent=4, depth_scale=4.0)
    prefixes = [[5, 6, TURN, 7], [7, 6, 5], [], [5, 6, TURN, 7]]
    x = phi.features(prefixes)
    assert x.shape == (4, 64 * 2 + EXTRA_FEATURES) == (4, phi.dim)
    assert x.dtype == torch.float32
    assert torch.equal(x[0], x[3])  # same prefix, same row
    assert torch.equal(phi.features(prefixes[::-1]), x.flip(0))  # rows do not depend on the batch
    assert not torch.equal(x[0], x[1])
    assert torch.equal(x[2], torch.zeros(phi.dim))  # empty: no n-grams, depth 0, log1p(0) = 0
    # Depth: one turn token over depth_scale 4.
    assert x[0, -2].item() == pytest.approx(0.25)
    # Each n-gram block has unit norm.
    assert torch.linalg.norm(x[0, :64]).item() == pytest.approx(1.0, abs=1e-6)
    assert torch.linalg.norm(x[0, 64:128]).item() == pytest.approx(1.0, abs=1e-6)
    # Bigrams see order: [1, 2] and [2, 1] share unigrams only.
    ab, ba = HashedNgramFeaturizer(TURN, 4096, ngram=2, recent=0).features([[1, 2], [2, 1]])
    assert not torch.equal(ab, ba)
    assert HashedNgramFeaturizer(TURN, 64, recent=0).dim == 64 + EXTRA_FEATURES


def test_hashed_buckets_are_pinned() -> None:
    """Saved predictors depend on the hash: a change here silently breaks every checkpoint."""
    phi = HashedNgramFeaturizer(turn_token=TURN, buckets=1024, ngram=2, recent=0)
    x = phi.features([[11, 12]])[0, :1024]
    assert torch.nonzero(x).flatten().tolist() == PINNED_BUCKETS


PINNED_BUCKETS = [387, 480, 666]  # unigrams 11, 12 and the bigram (11, 12)


# --- fitting -------------------------------------------------------------------------------------
def test_unfitted_predictor_answers_one_half(tmp_path: Path) -> None:
    state = torch.random.get_rng_state()
    predictor = SharedPredictor(SMALL, generator=generator(0))
    assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG is left alone
    assert np.array_equal(predictor.predict([[1, 2], [TURN]]), [0.5, 0.5])
    assert predictor.predict([]).shape == (0,)
    predictor.save(tmp_path)  # nothing to replay yet
    loaded = SharedPredictor.load(tmp_path)
    assert loaded.fits == 0 and loaded.replay_rows == 0
    assert np.array_equal(loaded.predict([[1, 2]]), [0.5])


def test_fit_learns_the_signal_and_beats_the_constant_on_unseen_prefixes() -> None:
    train, held = synthetic_trees(300, 0, "train"), synthetic_trees(100, 1, "held")
    predictor = SharedPredictor(SMALL, generator=generator(0))
    fit = predictor.fit(train, generator(1))
    assert fit.rows == len(training_rows(train)) and fit.replayed_rows == 0
    assert fit.loss_after < 0.8 * fit.loss_before

    report = evaluate_predictor(predictor, train, held)
    assert report.seen_excluded == 0  # random filler: every held-out history is new
    assert report.roots.nodes == 100
    assert report.prefixes.nodes == 100 * (2 * 3 + 2)  # 3 rollouts × 2 inner turns, + 2 branch
    for scores in (report.roots, report.prefixes):
        assert scores.brier < scores.brier_constant
        assert scores.auc > 0.65 and scores.auc_constant == 0.5
        assert scores.brier_skill > 0.05


def test_each_fit_first_scores_the_predictor_on_the_rows_it_has_not_seen() -> None:
    """The skill a fit reports is that of the predictor before it, on the new trees: what
    ranked them. Nothing before the first fit; after it, the root signal (the difficulty
    token) and the prefix signal (the observations) forecast new trees better than the
    constant, and by exactly the Brier score ``evaluate_predictor`` gives."""
    first, second = synthetic_trees(300, 0, "first"), synthetic_trees(100, 1, "second")
    predictor = SharedPredictor(SMALL, generator=generator(0))
    fit = predictor.fit(first, generator(1))
    assert math.isnan(fit.root_skill) and math.isnan(fit.prefix_skill)
    report = evaluate_predictor(predictor, first, second)
    fit = predictor.fit(second, generator(2))
    assert fit.root_skill == pytest.approx(report.roots.brier_skill, abs=1e-6)
    assert fit.prefix_skill == pytest.approx(report.prefixes.brier_skill, abs=1e-6)
    assert fit.root_auc == pytest.approx(report.roots.auc, abs=1e-6)
    assert fit.root_skill > 0.05 and fit.prefix_skill > 0.05 and fit.root_auc > 0.65
    again = predictor.fit(second, generator(3))  # every row replayed: nothing left to score
    assert math.isnan(again.root_skill) and math.isnan(again.root_auc)


@pytest.mark.parametrize("seed", [0, 1])
def test_prompts_get_a_head_of_their_own(seed: int) -> None:
    """40 trees, as an iteration of the loop gives: 40 root rows beside 320 prefix rows. The
    shared MLP (the default config, decayed hard) then barely separates the prompts' three
    difficulty levels (skill ≈ 0.00); the root head, fitted on the roots alone, does (≈ 0.17,
    seeds 0–2), and stage 1 reads it. Without it, prompts go through the shared head."""
    train, held = synthetic_trees(40, seed, "train"), synthetic_trees(100, 9, "held")
    skill = {}
    for root_head in (True, False):
        predictor = SharedPredictor(
            PredictorConfig(turn_token=TURN, root_head=root_head), generator=generator(0)
        )
        predictor.fit(train, generator(1))
        skill[root_head] = evaluate_predictor(predictor, train, held).roots.brier_skill
        prompts = training_rows(held).select(training_rows(held).depth == 0).prefixes
        shared = predictor.predict(prompts)
        assert np.array_equal(predictor.predict_roots(prompts), shared) != root_head
    assert skill[True] > 0.1 and skill[False] < 0.05


def test_fit_is_deterministic_given_generators() -> None:
    trees = synthetic_trees(40, 2, "t")
    a, b = (SharedPredictor(SMALL, generator=generator(0)) for _ in range(2))
    a.fit(trees, generator(5))
    b.fit(trees, generator(5))
    prefixes = training_rows(trees).prefixes
    assert np.array_equal(a.predict(prefixes), b.predict(prefixes))


def test_replay_keeps_the_newest_rows_up_to_its_bound() -> None:
    first, second = synthetic_trees(20, 3, "a"), synthetic_trees(20, 4, "b")
    rows_first, rows_second = len(training_rows(first)), len(training_rows(second))
    bound = rows_second + 10
    predictor = SharedPredictor(
        PredictorConfig(turn_token=TURN, buckets=32, hidden=0, epochs=1, replay_rows=bound),
        generator=generator(0),
    )
    assert predictor.fit(first, generator(1)).replayed_rows == 0
    assert predictor.replay_rows == rows_first
    fit = predictor.fit(second, generator(1))
    assert fit.replayed_rows == rows_first and fit.rows == rows_second
    assert predictor.replay_rows == bound  # the oldest rows of the first fit went
    last = predictor.fit(training_rows(first).select(np.arange(5)), generator(1))
    assert last.replayed_rows == bound


def test_uniform_weighting_ignores_leaf_counts() -> None:
    # One row per node; V̂ = 1 on a node with 9 leaves, 0 on a node with 1 leaf, same features.
    rows = TrainingRows([[1], [1]], np.array([1.0, 0.0]), np.array([9.0, 1.0]), np.zeros(2, int))
    fitted = {}
    for weighting in ("leaves", "uniform"):
        config = PredictorConfig(turn_token=TURN, buckets=8, hidden=0, epochs=300, lr=0.05,
                             weight_decay=0.0, weighting=weighting)  # fmt: skip
        predictor = SharedPredictor(config, generator=generator(0))
        predictor.fit(rows, generator(0))
        fitted[weighting] = float(predictor.predict([[1]])[0])
    # The weighted MSE is minimised by the weighted mean: 0.9 with leaf weights, 0.5 without.
    assert fitted["leaves"] == pytest.approx(0.9, abs=0.02)
    assert fitted["uniform"] == pytest.approx(0.5, abs=0.02)


# --- checkpoints ---------------------------------------------------------------------------------
def test_save_load_round_trip(tmp_path: Path) -> None:
    trees = synthetic_trees(30, 5, "t")
    predictor = SharedPredictor(SMALL, generator=generator(0))
    predictor.fit(trees, generator(1))
    predictor.save(tmp_path / "predictor")
    assert {p.name for p in (tmp_path / "predictor").iterdir()} == {
        WEIGHTS_FILE,
        CONFIG_FILE,
        ROOT_FILE,
        REPLAY_FILE,
    }
    meta = json.loads((tmp_path / "predictor" / CONFIG_FILE).read_text())
    assert meta["config"]["featurizer"] == "hashed" and meta["config"]["buckets"] == 128
    assert meta["featurizer"] == {"kind": "hashed", "dim": predictor.featurizer.dim}

    loaded = SharedPredictor.load(tmp_path / "predictor")
    held = training_rows(synthetic_trees(10, 6, "h")).prefixes
    assert np.array_equal(loaded.predict(held), predictor.predict(held))
    assert np.array_equal(loaded.predict_roots(held), predictor.predict_roots(held))
    assert loaded.config == predictor.config and loaded.fits == 1
    assert loaded.replay_rows == predictor.replay_rows
    # Both continue identically: same replayed rows, same weights, same generator.
    more = synthetic_trees(10, 7, "m")
    predictor.fit(more, generator(2))
    loaded.fit(more, generator(2))
    assert np.allclose(loaded.predict(held), predictor.predict(held), atol=1e-6)


def test_a_predictor_saved_under_the_earlier_file_names_still_loads(tmp_path: Path) -> None:
    """Runs stored before the rename hold ``value.safetensors`` and ``value.json``."""
    predictor = SharedPredictor(SMALL, generator=generator(0))
    predictor.fit(synthetic_trees(12, 5, "t"), generator(1))
    predictor.save(tmp_path)
    for name, before in EARLIER.items():
        (tmp_path / name).rename(tmp_path / before)
    held = training_rows(synthetic_trees(6, 6, "h")).prefixes
    assert np.array_equal(SharedPredictor.load(tmp_path).predict(held), predictor.predict(held))


def test_fit_measures_the_continuation_worth_and_keeps_it(tmp_path: Path) -> None:
    """ω (algo.shape) from the fitted trees, averaged with what came before, saved and loaded:
    the next rollout step's trace-auto reads it from the predictor folder."""
    builder = TreeBuilder(TreeInfo(prompt_id="p"), prompt_tokens=[FILLER[0], TURN])
    builder.set_predicted_v(0, 0.5)
    first = builder.add_turn(0, [FILLER[0], TURN])
    builder.set_reward(builder.add_turn(first, [FILLER[0], TURN]), 1.0)
    for _ in range(2):  # both continuations flip the won rollout: 2 flips where 1 was expected
        builder.set_reward(builder.add_turn(first, [FILLER[0], TURN], branch=True), 0.0)
    predictor = SharedPredictor(SMALL, generator=generator(0))
    assert predictor.continuation_worth == PRIOR_WORTH
    report = predictor.fit([builder.build()], generator(1))
    assert report.continuation_worth == predictor.continuation_worth == 0.5 * (PRIOR_WORTH + 2.0)
    predictor.save(tmp_path / "predictor")
    assert SharedPredictor.load(tmp_path / "predictor").continuation_worth == 1.25
    predictor.fit(synthetic_trees(4, 0, "s"), generator(2))  # no scored root: unchanged
    assert predictor.continuation_worth == 1.25


def test_load_rejects_what_it_cannot_read(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=CONFIG_FILE):
        SharedPredictor.load(tmp_path)
    SharedPredictor(SMALL, generator=generator(0)).save(tmp_path)
    meta = json.loads((tmp_path / CONFIG_FILE).read_text())
    (tmp_path / CONFIG_FILE).write_text(json.dumps({**meta, "format_version": 99}))
    with pytest.raises(ValueError, match="format_version"):
        SharedPredictor.load(tmp_path)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("featurizer", "bert"),
        ("weighting", "depth"),
        ("turn_token", -1),
        ("buckets", 0),
        ("ngram", 5),
        ("recent", -1),
        ("hidden", -2),
        ("epochs", 0),
        ("batch_size", 0),
        ("lr", 0.0),
        ("weight_decay", -1.0),
        ("replay_rows", -1),
        ("max_length", 4),
        ("depth_scale", math.inf),
    ],
)
def test_bad_config_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        PredictorConfig(**{"turn_token": TURN, field: value})  # type: ignore[arg-type]


def test_embedding_featurizer_needs_the_tokenizer() -> None:
    with pytest.raises(ValueError, match="tokenizer"):
        SharedPredictor(
            PredictorConfig(turn_token=TURN, featurizer="embedding"), generator=generator(0)
        )


# --- scores --------------------------------------------------------------------------------------
def test_evaluate_predictor_labels_and_constant_by_hand() -> None:
    # Train: one tree, root with 2 rollouts of 2 turns: rewards 1 and 0.
    #   root V̂ = 1/2 (n=2); prefixes (depth 1): V̂ = 1 and 0 (n=1 each).
    train = TreeBuilder(TreeInfo(prompt_id="a"), prompt_tokens=[1])
    for r in (1.0, 0.0):
        first = train.add_turn(0, [2, TURN], [int(r) + 4])
        train.set_reward(train.add_turn(first, [2, TURN]), r)
    # Held out: the same prompt (so its root is seen), one rollout with reward 1, and a tree of
    # a new prompt whose root has 3 rollouts: 1, 1, 0.
    seen = TreeBuilder(TreeInfo(prompt_id="b"), prompt_tokens=[1])
    first = seen.add_turn(0, [2, TURN], [5])  # the history [1, 2, 3, 5] is a training row
    seen.set_reward(seen.add_turn(first, [2, TURN]), 1.0)
    new = TreeBuilder(TreeInfo(prompt_id="c"), prompt_tokens=[9])
    for r in (1.0, 1.0, 0.0):
        node = new.add_turn(0, [2, TURN], [6])
        new.set_reward(new.add_turn(node, [2, TURN]), r)
    held = [seen.build(), new.build()]
    report = evaluate_predictor(ConstantPredictor(0.75), [train.build()], held)
    assert report.train_rows == 3 and report.seen_excluded == 2  # the seen root and its prefix
    # Roots: only tree c's root, 3 pairs (labels 1, 1, 0) at V = 0.75.
    roots = report.roots
    assert (roots.nodes, roots.pairs, roots.success_rate) == (1, 3, pytest.approx(2 / 3))
    assert roots.brier == pytest.approx((2 * 0.25**2 + 0.75**2) / 3)
    assert roots.constant == 0.5  # training root V̂
    assert roots.brier_constant == pytest.approx(0.25)
    assert roots.auc == 0.5  # one node: all its pairs tie
    # Prefixes: tree c's three depth-1 nodes (one leaf each, identical histories [9, 2, 3, 6]
    # but three separate nodes); constant = leaf-weighted mean of training prefix targets = 1/2.
    assert (report.prefixes.nodes, report.prefixes.pairs) == (3, 3)
    assert report.prefixes.constant == 0.5
    assert report.prefixes.auc == 0.5  # same history, same forecast: all ties


# --- the embedding featurizer (loads all-MiniLM-L6-v2: ≈2 s a load) ------------------------------
@pytest.mark.slow
def test_embedding_featurizer_and_its_predictor_round_trip(tmp_path: Path) -> None:
    tail = " ".join(["the cat sat on the mat"] * 12)
    tokenizer = build_word_tokenizer(["a dog ran far away", tail, "= 42 error"])
    fmt = TurnFormat(tokenizer)
    phi = EmbeddingFeaturizer(tokenizer, fmt.end_of_turn_id, max_length=24)
    cat, dog = fmt.prompt_ids("the cat sat on the mat"), fmt.prompt_ids("a dog ran far away")
    turn = [*cat, *fmt.action_ids("= 42"), *fmt.observation_ids("error")]
    x = phi.features([cat, dog, turn, cat])
    assert x.shape == (4, 384 + EXTRA_FEATURES) == (4, phi.dim)
    assert torch.allclose(x[0], x[3], atol=1e-5)  # batch position and padding do not matter
    assert not torch.allclose(x[0], x[1], atol=1e-3)
    assert torch.allclose(torch.linalg.norm(x[:, :384], dim=1), torch.ones(4), atol=1e-5)
    assert x[2, -2] > x[0, -2]  # one more turn: deeper
    # Truncation from the left: histories that differ only before the last 24 MiniLM tokens
    # embed the same; the same two openings on a short history do not.
    a, b = fmt.prompt_ids(f"a dog {tail}"), fmt.prompt_ids(f"far away {tail}")
    y = phi.features([a, b])
    assert torch.allclose(y[0, :384], y[1, :384], atol=1e-5)
    short = phi.features([fmt.prompt_ids("a dog"), fmt.prompt_ids("far away")])
    assert not torch.allclose(short[0, :384], short[1, :384], atol=1e-3)

    # The predictor on top: fit, save, load with the tokenizer, same answers.
    config = PredictorConfig(
        turn_token=fmt.end_of_turn_id, featurizer="embedding", hidden=8, epochs=2
    )
    predictor = SharedPredictor(config, generator=generator(0), tokenizer=tokenizer)
    rows = [cat, dog, turn]
    predictor.fit(
        TrainingRows(rows, np.array([1.0, 0.0, 0.5]), np.ones(3), np.array([0, 0, 1])),
        generator(1),
    )
    predictor.save(tmp_path)
    meta = json.loads((tmp_path / CONFIG_FILE).read_text())
    assert meta["featurizer"]["model"] == "sentence-transformers/all-MiniLM-L6-v2"
    loaded = SharedPredictor.load(tmp_path, tokenizer=tokenizer)
    assert np.allclose(loaded.predict(rows), predictor.predict(rows), atol=1e-6)
