"""The multihop suite: its world and questions, its env's search turns, demonstrations."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trace_core.envs.base import TURN_LIMIT, Step, Task, replay
from trace_core.envs.multihop import (
    RELATIONS,
    Chain,
    MultihopEnv,
    MultihopSuite,
    World,
    normalize_answer,
    question,
    reference,
    relation_chains,
)
from trace_core.envs.retrieval import SearchIndex, render


@pytest.fixture(scope="module")
def suite() -> MultihopSuite:
    return MultihopSuite(seed=0)


# A hand-written world: bo lin was born in kara, which is in vesta.
WORLD = World(
    entities={
        "person": ("bo lin", "mi sen"),
        "city": ("kara", "tovi"),
        "country": ("vesta",),
        "company": ("zelom",),
    },
    facts={
        ("bo lin", "born_in"): "kara",
        ("mi sen", "born_in"): "tovi",
        ("kara", "in_country"): "vesta",
        ("tovi", "in_country"): "vesta",
        ("vesta", "capital"): "kara",
        ("zelom", "founded_by"): "bo lin",
    },
)


def small_env(top_k: int = 2, max_turns: int = 8) -> MultihopEnv:
    index = SearchIndex(WORLD.passages())
    return MultihopEnv(lambda task: index, max_turns=max_turns, top_k=top_k)


TASK = Task("t", "what is the country of the birthplace of bo lin ?", "vesta", "hops=2", "train")


# --- normalize_answer ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "normal"),
    [
        # HotpotQA deletes punctuation rather than replacing it with a space, so the hyphen
        # joins the words: "the  eiffel-tower!" -> "the  eiffeltower" -> "eiffeltower".
        ("The  Eiffel-Tower!", "eiffeltower"),
        ("The  Eiffel Tower!", "eiffel tower"),
        ("An apple a day", "apple day"),
        ("  Bo   LIN. ", "bo lin"),
        ("Theatre", "theatre"),  # an article only as a whole word
        ("the", ""),
        ("U.S.A.", "usa"),
        ("1,000", "1000"),
    ],
)
def test_normalize_answer_worked_examples(text: str, normal: str) -> None:
    assert normalize_answer(text) == normal


# --- search --------------------------------------------------------------------------------------


def test_search_worked_example() -> None:
    env = small_env(top_k=2)
    env.reset(TASK)
    # "bo lin born" shares three words with the fact it asks for, two ("bo lin") with the founding
    # of zelom and only one ("born") with "mi sen was born in tovi"; all three are 6 words long.
    step = env.step("search[bo lin born]")
    assert step == Step("bo lin was born in kara .\nzelom was founded by bo lin .", False, 0.0)
    step = env.step("search[kara city]")
    assert step.observation.split("\n")[0] == "kara is a city in vesta ."
    assert env.step("answer[Vesta]") == Step("done", True, 1.0)


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_search_returns_top_k_passages(top_k: int) -> None:
    env = small_env(top_k=top_k)
    env.reset(TASK)
    assert len(env.step("search[kara]").observation.split("\n")) == top_k


def test_search_without_matches_says_so() -> None:
    env = small_env()
    env.reset(TASK)
    assert env.step("search[zzz qqq]").observation == "no results"
    assert env.step("search[a]").observation == "no results"  # one-letter words are not indexed
    assert env.step("search[]").observation == "error: empty query"


@pytest.mark.parametrize(
    ("action", "observation"),
    [
        ("calc[1+1]", "error: unknown tool calc . use search or answer"),
        ("search kara", "error: no action . end the turn with search[...] or answer[...]"),
        ("search[kara] now", "error: no action . end the turn with search[...] or answer[...]"),
    ],
)
def test_bad_actions_are_observations(action: str, observation: str) -> None:
    env = small_env()
    env.reset(TASK)
    assert env.step(action) == Step(observation, False, 0.0)


@pytest.mark.parametrize(
    ("answer", "reward"), [("vesta", 1.0), (" The Vesta. ", 1.0), ("kara", 0.0), ("", 0.0)]
)
def test_answer_reward_is_normalised_exact_match(answer: str, reward: float) -> None:
    env = small_env()
    env.reset(TASK)
    assert env.step(f"answer[{answer}]") == Step("done", True, reward)


def test_a_turn_over_the_limit_is_refused_and_the_episode_goes_on() -> None:
    index = SearchIndex(WORLD.passages())
    env = MultihopEnv(lambda task: index, max_action_chars=14)
    env.reset(TASK)
    refused = "error: action longer than 14 characters"
    assert env.step("so: answer[vesta]") == Step(refused, False, 0.0)  # 17 characters
    assert env.step("answer[vesta]") == Step("done", True, 1.0)
    with pytest.raises(ValueError, match="max_action_chars must be >= 1"):
        MultihopEnv(lambda task: index, max_action_chars=0)


def test_turn_limit_and_step_after_done() -> None:
    env = small_env(max_turns=2)
    with pytest.raises(ValueError, match="before reset"):
        env.step("search[kara]")
    env.reset(TASK)
    assert not env.step("search[kara]").done
    assert env.step("search[kara]") == Step(TURN_LIMIT, True, 0.0)
    with pytest.raises(ValueError, match="after the episode ended"):
        env.step("answer[vesta]")


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=80))
def test_no_agent_text_raises(action: str) -> None:
    env = small_env()
    env.reset(TASK)
    assert env.step(action).reward in (0.0, 1.0)


# --- the synthetic suite -------------------------------------------------------------------------


def test_every_scripted_search_finds_its_fact_first(suite: MultihopSuite) -> None:
    for task in suite.tasks("train") + suite.tasks("eval"):
        chain = suite.chain_of(task)
        path = suite.world.follow(chain.start, chain.relations)
        for turn, entity, relation in zip(task.reference[:-1], path, chain.relations, strict=False):
            top = suite.index.search(turn.removeprefix("search[").removesuffix("]"), 2)
            assert top[0] == suite.world.passage(entity, relation), (task, turn)
            assert top[1] != top[0]


def test_every_fact_is_found_first_by_name_and_keyword(suite: MultihopSuite) -> None:
    # Slipped demonstrations search entities no reference names; their facts rank first too.
    for subject, relation in suite.world.facts:
        top = suite.index.search(f"{subject} {RELATIONS[relation].keyword}", 1)
        assert top == [suite.world.passage(subject, relation)]


def test_corpus_is_the_worlds_passages_and_searches_the_same(suite: MultihopSuite) -> None:
    """A retrieval service over ``corpus()`` (its contents rendered) is the in-process index."""
    corpus = suite.corpus()
    assert len(corpus) == len(suite.world.facts) == len(suite.index.passages)
    assert corpus[0].id == "multihop-0-000000" and len({p.id for p in corpus}) == len(corpus)
    assert all(p.title == "" for p in corpus)
    served = SearchIndex([render(p.contents) for p in corpus])
    assert served.passages == suite.index.passages
    for task in suite.tasks("eval"):
        for turn in task.reference[:-1]:
            query = turn.removeprefix("search[").removesuffix("]")
            assert served.search(query, 3) == suite.index.search(query, 3)


def test_references_replay_to_reward_one(suite: MultihopSuite) -> None:
    env = suite.make_env()
    for task in suite.tasks("train")[:200] + suite.tasks("eval"):
        observations, last = replay(env, task, task.reference)
        assert last is not None and last.reward == 1.0, task
        assert len(observations) == len(task.reference) + 1 and observations[-1] == "done"


def test_question_worked_example() -> None:
    chain = Chain("bo lin", ("born_in", "in_country"))
    assert question(chain, "country") == "what is the country of the birthplace of bo lin ?"
    assert reference(WORLD, chain) == ("search[bo lin born]", "search[kara city]", "answer[vesta]")
    chain = Chain("zelom", ("founded_by", "born_in"))
    assert question(chain, "city") == "what is the birthplace of the founder of zelom ?"
    assert question(Chain("zelom", ("founded_by",)), "person") == "who is the founder of zelom ?"
    with pytest.raises(ValueError, match="a chain needs relations"):
        Chain("zelom", ("owns",))


def test_relation_chains_are_type_correct() -> None:
    assert relation_chains("country", 2) == [("capital", "in_country")]
    for kind in ("person", "city", "country", "company"):
        for chain in relation_chains(kind, 3):
            subject = kind
            for relation in chain:
                assert RELATIONS[relation].subject == subject
                subject = RELATIONS[relation].object


def test_splits_are_balanced_disjoint_and_unique(suite: MultihopSuite) -> None:
    train, eval_ = suite.tasks("train"), suite.tasks("eval")
    assert (len(train), len(eval_)) == (2000, 200)
    assert Counter(t.difficulty for t in eval_) == {"hops=2": 67, "hops=3": 67, "hops=4": 66}
    assert set(Counter(t.difficulty for t in train)) == {"hops=2", "hops=3", "hops=4"}
    prompts = [t.prompt for t in train + eval_]
    assert len(set(prompts)) == len(prompts)
    assert len({t.id for t in train + eval_}) == 2200
    for task in train[:30]:
        hops = int(task.difficulty.removeprefix("hops="))
        assert len(task.reference) == hops + 1
        assert task.prompt.count(" of ") == hops


def test_world_names_are_unique_and_not_template_words(suite: MultihopSuite) -> None:
    names = [
        n for kind in ("person", "city", "country", "company") for n in suite.world.entities[kind]
    ]
    assert len(names) == len(set(names)) == 150 + 50 + 50 + 10
    template_words = {w for r in RELATIONS.values() for w in r.template.split()}
    assert not {w for n in names for w in n.split()} & template_words


def test_world_rejects_facts_that_do_not_fit() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        World(WORLD.entities, {("kara", "born_in"): "tovi"})  # a city is not born
    with pytest.raises(ValueError, match="unique across kinds"):
        World({**WORLD.entities, "city": ("kara", "vesta")}, {})
    with pytest.raises(ValueError, match="exactly the kinds"):
        World({"person": ("bo lin",)}, {})


def test_generation_is_deterministic_by_seed() -> None:
    a, b, c = (MultihopSuite(seed=s, train_size=60, eval_size=30) for s in (2, 2, 3))
    assert a.tasks("train") == b.tasks("train") and a.tasks("eval") == b.tasks("eval")
    assert a.index.passages == b.index.passages
    assert a.tasks("train") != c.tasks("train")


def test_too_small_a_world_says_what_to_raise() -> None:
    with pytest.raises(ValueError, match="raise entities"):
        MultihopSuite(entities=15, train_size=2000)
    with pytest.raises(ValueError, match="at least 15 and at most 3000 people"):
        MultihopSuite(entities=5)
    with pytest.raises(ValueError, match="max_turns must be >= 5"):
        MultihopSuite(max_turns=4)


# --- demonstrations ------------------------------------------------------------------------------


def test_demonstrations_without_mistakes_are_the_reference(suite: MultihopSuite) -> None:
    rng = np.random.default_rng(0)
    for task in suite.tasks("train")[:100]:
        assert suite.demonstration(task, rng, 0.0) == task.reference


def test_demonstrations_with_mistakes_never_succeed(suite: MultihopSuite) -> None:
    env, rng = suite.make_env(), np.random.default_rng(1)
    for task in suite.tasks("train")[:200]:
        demo = suite.demonstration(task, rng, 1.0)
        _, last = replay(env, task, demo)
        assert last is not None and last.reward == 0.0, demo
        assert len(demo) == len(task.reference)
        # a slip changes entities, never the relation a search asks about
        keywords = [t.rsplit(" ", 1)[1] for t in task.reference[:-1]]
        assert [t.rsplit(" ", 1)[1] for t in demo[:-1]] == keywords


def test_slipped_searches_follow_what_they_saw(suite: MultihopSuite) -> None:
    env, rng = suite.make_env(), np.random.default_rng(2)
    kind_of = suite.world.kind_of
    slips = 0
    for task in suite.tasks("train")[:100]:
        relations = suite.chain_of(task).relations
        demo = suite.demonstration(task, rng, 0.5)
        observations, _ = replay(env, task, demo)
        searched = [t.removeprefix("search[").rsplit(" ", 1)[0] for t in demo[:-1]]
        for hop in range(1, len(searched)):
            # what the previous search returned on top, whichever entity it named
            found = suite.world.facts[(searched[hop - 1], relations[hop - 1])]
            assert f" {found} ." in observations[hop].split("\n")[0]
            # the next search follows it, or slips to another entity of the same kind
            assert searched[hop] == found or kind_of(searched[hop]) == kind_of(found)
            slips += searched[hop] != found
    assert slips > 20


@pytest.mark.slow
def test_mistake_rates_grow_with_hops(suite: MultihopSuite) -> None:
    rate = {t.difficulty: suite.mistake_rate_for(t) for t in suite.tasks("eval")}
    assert rate["hops=2"] < rate["hops=3"] < rate["hops=4"]
    env, rng = suite.make_env(), np.random.default_rng(3)
    wins: Counter[str] = Counter()
    for task in suite.tasks("train")[:600]:  # 200 per hop count
        _, last = replay(env, task, suite.demonstration(task, rng, suite.mistake_rate_for(task)))
        wins[task.difficulty] += int(last is not None and last.reward == 1.0)
    # expected (1 - rate) ** (hops + 1) of 200: 178, 104, 23; a standard error is at most 7
    assert wins["hops=2"] >= 160 and 70 <= wins["hops=3"] <= 140 and wins["hops=4"] <= 50


def test_demonstration_needs_a_search_reference(suite: MultihopSuite) -> None:
    with pytest.raises(ValueError, match="no scripted search demonstration"):
        suite.demonstration(TASK, np.random.default_rng(0), 0.0)
    foreign = Task("f", "q", "vesta", "hops=2", "train", ("search[bo lin born]", "answer[kara]"))
    with pytest.raises(ValueError, match="does not follow this suite's world"):
        suite.demonstration(foreign, np.random.default_rng(0), 0.0)


def test_vocabulary_covers_the_texts_and_stays_small(suite: MultihopSuite) -> None:
    texts = set(suite.vocabulary())
    for task in suite.tasks("eval"):
        assert task.prompt in texts and set(task.reference) <= texts
    assert set(suite.index.passages) <= texts
    words = {w for text in texts for w in re.findall(r"[a-z]+", text)}
    assert len(words) < 250, len(words)
