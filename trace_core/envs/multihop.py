"""Multi-hop questions answered by searching passages with BM25.

One episode of the built-in suite (``MultihopSuite``), observations after ``->``:

    what is the country of the birthplace of bo lin ?
    search[bo lin born]   -> bo lin was born in kara .
                             bo lin lives in tovi .
    search[kara city]     -> kara is a city in vesoma .
                             the capital of vesoma is kara .
    answer[vesoma]        -> done            (reward 1)

The world is a seeded knowledge base of people, cities, countries and companies with names made
of syllables, and eight functional relations (born in, lives in, grew up in, works for, founded
by, based in, city in country, capital of). Every fact is one passage. A question follows a
chain of 2-4 relations from one entity ("hops=3"), phrased as nested "the <noun> of ...", and
each hop is found by searching the entity's name plus the relation's keyword, which ranks that
fact first (tests check it for every task). Texts are short and lower case so that a tiny
word-level policy can learn them from the scripted demonstrations (``demonstration``).

``MultihopEnv`` searches whatever index its caller gives each task (``retrieval.SearchIndex``,
or a retrieval service, ``remote.RemoteSearch``) and scores answers by HotpotQA's exact match
(``normalize_answer``); the HotpotQA suite (``hotpotqa``) runs in it too, each question over its
own paragraphs, with its own turn length limit (``max_action_chars``; ``MAX_ACTION_CHARS`` here).
With ``retriever_url`` the suite's questions search the service, which holds the world's
passages (``MultihopSuite.corpus``); the scripted demonstrations and the vocabulary read the
in-process index over the same passages, so they never wait on the service.
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from trace_core.envs.base import (
    DONE,
    TURN_LIMIT,
    EpisodeState,
    Split,
    Step,
    Task,
    ToolTimeout,
    bounded_call,
    parse_action,
    refuse_long,
)
from trace_core.envs.remote import RemoteSearch
from trace_core.envs.retrieval import Passage, Searcher, SearchIndex

NO_RESULTS = "no results"
NO_ACTION = "error: no action . end the turn with search[...] or answer[...]"
INSTRUCTIONS = (
    "Answer the question by searching a collection of passages. In each turn, think briefly, "
    "then end the turn with exactly one action: search[query] shows the best-matching "
    "passages; answer[text] gives the final answer (a name, as short as possible) and ends "
    "the episode. Example turn: I need where bo lin was born. search[bo lin born]"
)
"""The system prompt of a pretrained policy: the action grammar (``policy.format``)."""
MAX_ACTION_CHARS = 2_000
"""Longest turn (thought and action) the multihop env reads. The longest reference or
demonstration turn is 22 characters, so this leaves room for a thought of a few hundred words."""

KINDS = ("person", "city", "country", "company")


@dataclass(frozen=True)
class Relation:
    subject: str
    object: str
    noun: str
    """How a question names the object: "the <noun> of <subject>"."""
    keyword: str
    """The one word of the passage that a search adds to the subject's name."""
    template: str
    """The passage stating the fact, with {s} and {o}."""

    def __post_init__(self) -> None:
        if self.subject not in KINDS or self.object not in KINDS:
            raise ValueError(f"relation kinds must be among {KINDS}, got {self}")
        if self.keyword not in self.template.split():
            raise ValueError(f"keyword {self.keyword!r} must be a word of {self.template!r}")


RELATIONS: dict[str, Relation] = {
    "born_in": Relation("person", "city", "birthplace", "born", "{s} was born in {o} ."),
    "lives_in": Relation("person", "city", "residence", "lives", "{s} lives in {o} ."),
    "grew_up_in": Relation("person", "city", "hometown", "grew", "{s} grew up in {o} ."),
    "works_for": Relation("person", "company", "employer", "works", "{s} works for {o} ."),
    "founded_by": Relation("company", "person", "founder", "founded", "{s} was founded by {o} ."),
    "based_in": Relation("company", "city", "headquarters", "based", "{s} is based in {o} ."),
    "in_country": Relation("city", "country", "country", "city", "{s} is a city in {o} ."),
    "capital": Relation("country", "city", "capital", "capital", "the capital of {s} is {o} ."),
}
_BY_KEYWORD = {r.keyword: name for name, r in RELATIONS.items()}
HOPS = (2, 3, 4)

# Per-action slip probability of the demonstrations; a demo of h hops takes h + 1 actions, so it
# succeeds with probability about (1 - rate) ** (h + 1): 0.89, 0.52 and 0.12.
_SLIP_RATES = {2: 0.03, 3: 0.15, 4: 0.35}

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
# Words the templates use; no generated name may be one of them.
_RESERVED = frozenset(
    word
    for text in ("who what is the of ?", *(r.template for r in RELATIONS.values()))
    for word in text.split()
) | frozenset(r.noun for r in RELATIONS.values())
_HOPS = re.compile(r"hops=([0-9]+)")
_SEARCH_TURN = re.compile(r"search\[(.+) ([a-z]+)\]")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """HotpotQA's answer normalisation (hotpot_evaluate_v1.py), step for step.

    Lower case, drop punctuation (deleted, not replaced by a space: "Eiffel-Tower" becomes
    "eiffeltower"), drop the articles a/an/the, collapse whitespace.
    """
    text = text.lower()
    text = "".join(char for char in text if char not in _PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


class MultihopEnv:
    """``search[query]`` returns the top passages of the task's index; ``answer[x]`` ends it.

    A turn longer than ``max_action_chars`` is refused unread, as a malformed one is: the
    observation says so and the episode goes on. A search runs under the tools' time bound
    (``base.bounded_call``: past it, an ``error:`` observation), except on an index that bounds
    its own calls (a ``deadline_s``, as ``RemoteSearch``), which is called as it is; an index
    that raises (``RetrieverUnavailable``) makes ``step`` raise, and the rollout drops the prompt.
    """

    def __init__(
        self,
        index_for: Callable[[Task], Searcher],
        max_turns: int = 8,
        top_k: int = 2,
        max_action_chars: int = MAX_ACTION_CHARS,
    ) -> None:
        if max_turns < 1 or top_k < 1 or max_action_chars < 1:
            raise ValueError(
                "max_turns, top_k and max_action_chars must be >= 1, "
                f"got {max_turns}, {top_k}, {max_action_chars}"
            )
        self.max_turns, self.top_k, self.max_action_chars = max_turns, top_k, max_action_chars
        self._index_for = index_for
        self._index: Searcher | None = None
        self._episode = EpisodeState()

    def reset(self, task: Task) -> str:
        self._index = self._index_for(task)  # first: a task without an index does not start
        self._episode.start(task)
        return task.prompt

    def step(self, action: str) -> Step:
        task = self._episode.begin_step()
        assert self._index is not None  # reset sets it before it starts the episode
        refusal = refuse_long(action, self.max_action_chars)
        if refusal is not None:
            return self._episode.observe(refusal, self.max_turns)
        parsed = parse_action(action)
        if parsed is not None and parsed.name == "answer":
            correct = normalize_answer(parsed.argument) == normalize_answer(task.answer)
            return self._episode.finish(correct)
        if parsed is None:
            observation = NO_ACTION
        elif parsed.name == "search":
            observation = self._search(self._index, parsed.argument)
        else:
            observation = f"error: unknown tool {parsed.name} . use search or answer"
        return self._episode.observe(observation, self.max_turns)

    def _search(self, index: Searcher, query: str) -> str:
        if not query:
            return "error: empty query"
        if hasattr(index, "deadline_s"):  # bounded by itself; it raises past its deadline
            passages = index.search(query, self.top_k)
        else:
            try:
                passages = bounded_call(lambda: index.search(query, self.top_k))
            except ToolTimeout as err:
                return f"error: {err}"
        return "\n".join(passages) if passages else NO_RESULTS


# --- the synthetic world -----------------------------------------------------------------------


@dataclass(frozen=True)
class World:
    """Named entities of each kind and one object per (subject, relation)."""

    entities: Mapping[str, tuple[str, ...]]
    facts: Mapping[tuple[str, str], str]

    def __post_init__(self) -> None:
        if set(self.entities) != set(KINDS):
            raise ValueError(f"a world names entities of exactly the kinds {KINDS}")
        if len(self._kinds) != sum(len(names) for names in self.entities.values()):
            raise ValueError("entity names must be unique across kinds")
        for (subject, relation), obj in self.facts.items():
            r = RELATIONS[relation]
            if self._kinds.get(subject) != r.subject or self._kinds.get(obj) != r.object:
                raise ValueError(f"fact {subject!r} {relation} {obj!r} does not fit {r}")

    @cached_property
    def _kinds(self) -> dict[str, str]:
        return {name: kind for kind, names in self.entities.items() for name in names}

    def kind_of(self, name: str) -> str:
        if name not in self._kinds:
            raise ValueError(f"{name!r} is not an entity of this world")
        return self._kinds[name]

    def passage(self, subject: str, relation: str) -> str:
        obj = self.facts[(subject, relation)]
        return RELATIONS[relation].template.format(s=subject, o=obj)

    def passages(self) -> list[str]:
        return [self.passage(s, r) for s, r in self.facts]

    def follow(self, start: str, relations: Sequence[str]) -> list[str]:
        """The entities a chain of relations visits, ``start`` first."""
        path = [start]
        for relation in relations:
            path.append(self.facts[(path[-1], relation)])
        return path

    def mentions(self, text: str, kind: str) -> list[str]:
        """Entities of ``kind`` named in ``text``, in the order of ``entities``."""
        padded = f" {' '.join(text.split())} "
        return [n for n in self.entities[kind] if f" {n} " in padded]


def draw_world(rng: np.random.Generator, people: int) -> World:
    """A world of ``people`` people, people // 3 cities and companies, people // 15 countries.

    Names: people "bo lin" (a CV first name, a CVC last name), cities CVCV, companies CVCVC,
    countries CVCVCV, so kinds never share a name and no name is a template word.
    """
    if not 15 <= people <= 3000:
        # at most 3000: beyond that the syllable name pools run out
        raise ValueError(f"a world needs at least 15 and at most 3000 people, got {people}")
    syllables = [c + v for c in _CONSONANTS for v in _VOWELS]

    def words(count: int, make: Callable[[], str]) -> list[str]:
        chosen: dict[str, None] = {}
        while len(chosen) < count:
            word = make()
            if word not in _RESERVED:
                chosen[word] = None
        return list(chosen)

    def syllable() -> str:
        return syllables[int(rng.integers(len(syllables)))]

    def consonant() -> str:
        return _CONSONANTS[int(rng.integers(len(_CONSONANTS)))]

    side = math.ceil(math.sqrt(people)) + 2
    firsts = words(side, syllable)
    lasts = words(side, lambda: syllable() + consonant())
    pairs = [f"{f} {last}" for f in firsts for last in lasts]
    persons = [pairs[i] for i in rng.choice(len(pairs), size=people, replace=False).tolist()]
    n_cities, n_countries = people // 3, max(3, people // 15)
    entities: dict[str, tuple[str, ...]] = {
        "person": tuple(persons),
        "city": tuple(words(n_cities, lambda: syllable() + syllable())),
        "company": tuple(words(n_cities, lambda: syllable() + syllable() + consonant())),
        "country": tuple(words(n_countries, lambda: syllable() + syllable() + syllable())),
    }

    def pick(kind: str) -> str:
        return entities[kind][int(rng.integers(len(entities[kind])))]

    facts: dict[tuple[str, str], str] = {}
    for person in entities["person"]:
        for relation in ("born_in", "lives_in", "grew_up_in", "works_for"):
            facts[(person, relation)] = pick(RELATIONS[relation].object)
    for company in entities["company"]:
        facts[(company, "founded_by")] = pick("person")
        facts[(company, "based_in")] = pick("city")
    # Every country gets at least one city, and its capital is one of its cities.
    cities = [entities["city"][i] for i in rng.permutation(n_cities)]
    countries = entities["country"]
    for i, city in enumerate(cities):
        facts[(city, "in_country")] = countries[i % n_countries]
    for j, country in enumerate(countries):
        facts[(country, "capital")] = cities[j]
    return World(entities, facts)


def relation_chains(kind: str, hops: int) -> list[tuple[str, ...]]:
    """Every type-correct chain of ``hops`` relations starting from an entity of ``kind``."""
    if hops == 0:
        return [()]
    return [
        (name, *rest)
        for name, r in RELATIONS.items()
        if r.subject == kind
        for rest in relation_chains(r.object, hops - 1)
    ]


@dataclass(frozen=True)
class Chain:
    """A question's start entity and the relations it follows from there, first hop first."""

    start: str
    relations: tuple[str, ...]

    def __post_init__(self) -> None:
        unknown = [r for r in self.relations if r not in RELATIONS]
        if not self.relations or unknown:
            raise ValueError(f"a chain needs relations among {list(RELATIONS)}, got {self}")


def question(chain: Chain, answer_kind: str) -> str:
    """The question text: "what is the country of the birthplace of bo lin ?"."""
    phrase = chain.start
    for relation in chain.relations:
        phrase = f"the {RELATIONS[relation].noun} of {phrase}"
    return f"{'who' if answer_kind == 'person' else 'what'} is {phrase} ?"


def reference(world: World, chain: Chain) -> tuple[str, ...]:
    """One search per hop, "<entity> <keyword>", then the answer."""
    path = world.follow(chain.start, chain.relations)
    searches = [
        f"search[{e} {RELATIONS[r].keyword}]" for e, r in zip(path, chain.relations, strict=False)
    ]
    return (*searches, f"answer[{path[-1]}]")


class MultihopSuite:
    """Seeded multi-hop questions over a synthetic world, 2, 3 and 4 hops in equal shares.

    ``retriever_url``: a retrieval service holding ``corpus()`` that every task searches; None
    searches the in-process index (``index``).
    """

    name = "multihop"
    instructions = INSTRUCTIONS

    def __init__(
        self,
        seed: int = 0,
        entities: int = 150,
        train_size: int = 2000,
        eval_size: int = 200,
        max_turns: int = 8,
        top_k: int = 2,
        retriever_url: str | None = None,
    ) -> None:
        """``entities`` is the number of people; cities, companies and countries scale with it."""
        if train_size < 0 or eval_size < 0:
            raise ValueError(f"split sizes must be >= 0, got {train_size=} {eval_size=}")
        if max_turns < max(HOPS) + 1:
            raise ValueError(f"max_turns must be >= {max(HOPS) + 1} (4 searches and an answer)")
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        self.seed, self.max_turns, self.top_k = seed, max_turns, top_k
        self.world = draw_world(np.random.default_rng([seed, 0]), entities)
        self.index = SearchIndex(self.world.passages())
        self.searcher: Searcher = RemoteSearch(retriever_url) if retriever_url else self.index
        self._tasks = self._draw_tasks(np.random.default_rng([seed, 1]), train_size, eval_size)

    def _draw_tasks(
        self, rng: np.random.Generator, train_size: int, eval_size: int
    ) -> dict[Split, list[Task]]:
        # All questions of each hop count, shuffled; eval takes the first ones, train the next,
        # so the splits never share a question.
        pools: dict[int, list[Chain]] = {}
        for hops in HOPS:
            pool = [
                Chain(start, relations)
                for kind in KINDS
                for relations in relation_chains(kind, hops)
                for start in self.world.entities[kind]
                if len(set(self.world.follow(start, relations))) == hops + 1  # no entity twice
            ]
            pools[hops] = [pool[i] for i in rng.permutation(len(pool))]
        tasks: dict[Split, list[Task]] = {}
        taken = dict.fromkeys(HOPS, 0)
        plan: tuple[tuple[Split, int], ...] = (("eval", eval_size), ("train", train_size))
        for split, size in plan:
            tasks[split] = []
            for i in range(size):
                hops = HOPS[i % len(HOPS)]
                if taken[hops] == len(pools[hops]):
                    raise ValueError(
                        f"only {len(pools[hops])} {hops}-hop questions; raise entities"
                    )
                chain = pools[hops][taken[hops]]
                taken[hops] += 1
                answer = self.world.follow(chain.start, chain.relations)[-1]
                tasks[split].append(
                    Task(
                        id=f"multihop-{split}-{i:05d}",
                        prompt=question(chain, self.world.kind_of(answer)),
                        answer=answer,
                        difficulty=f"hops={hops}",
                        split=split,
                        reference=reference(self.world, chain),
                    )
                )
        return tasks

    def tasks(self, split: Split) -> list[Task]:
        return list(self._tasks[split])

    def make_env(self) -> MultihopEnv:
        return MultihopEnv(lambda task: self.searcher, self.max_turns, self.top_k)

    def _local_env(self) -> MultihopEnv:
        """An env on the in-process index, whatever ``retriever_url`` says."""
        return MultihopEnv(lambda task: self.index, self.max_turns, self.top_k)

    def corpus(self) -> list[Passage]:
        """The world's passages as a retrieval corpus, in index order, without titles."""
        return [
            Passage(f"multihop-{self.seed}-{i:06d}", "", text)
            for i, text in enumerate(self.index.passages)
        ]

    def mistake_rate_for(self, task: Task) -> float:
        """Per-action slip probability for demonstrations of ``task``, rising with hops."""
        match = _HOPS.fullmatch(task.difficulty)
        if match is None or int(match.group(1)) not in _SLIP_RATES:
            raise ValueError(f"task {task.id}: difficulty {task.difficulty!r} is not hops=2..4")
        return _SLIP_RATES[int(match.group(1))]

    def chain_of(self, task: Task) -> Chain:
        """A task's chain, read back from its scripted reference."""
        searches = [_SEARCH_TURN.fullmatch(turn) for turn in task.reference[:-1]]
        if not searches or any(m is None or m.group(2) not in _BY_KEYWORD for m in searches):
            raise ValueError(f"task {task.id} has no scripted search demonstration")
        matches = [m for m in searches if m is not None]
        chain = Chain(matches[0].group(1), tuple(_BY_KEYWORD[m.group(2)] for m in matches))
        try:
            consistent = reference(self.world, chain) == task.reference
        except KeyError:  # an entity this world does not have
            consistent = False
        if not consistent:
            raise ValueError(f"task {task.id}: its reference does not follow this suite's world")
        return chain

    def demonstration(
        self, task: Task, rng: np.random.Generator, mistake_rate: float
    ) -> tuple[str, ...]:
        """The scripted turns, each action slipping with probability ``mistake_rate``.

        A search slips by naming a wrong entity of the right kind (one the last observation
        mentioned, when there is one: the distractor a careless reader picks up); the demo then
        follows what that search returned. The answer slips to a wrong entity of the answer's
        kind, again preferring one in view. Slips whose chain would still reach the right answer
        are never picked, so ``mistake_rate=1`` never succeeds and ``mistake_rate=0`` always does.
        """
        if not 0.0 <= mistake_rate <= 1.0:
            raise ValueError(f"mistake_rate must be in [0, 1], got {mistake_rate}")
        chain = self.chain_of(task)
        env = self._local_env()
        seen = env.reset(task)
        turns: list[str] = []
        entity = chain.start
        for i, relation in enumerate(chain.relations):
            if rng.random() < mistake_rate:
                rest = chain.relations[i:]

                def misleads(e: str, rest: tuple[str, ...] = rest) -> bool:
                    return self.world.follow(e, rest)[-1] != task.answer

                kind = RELATIONS[relation].subject
                entity = self._distractor(rng, seen, kind, misleads, default=entity)
            turn = f"search[{entity} {RELATIONS[relation].keyword}]"
            turns.append(turn)
            seen = env.step(turn).observation
            entity = self.world.facts[(entity, relation)]
        if rng.random() < mistake_rate:
            entity = self._distractor(
                rng, seen, self.world.kind_of(entity), lambda e: e != task.answer
            )
        return (*turns, f"answer[{entity}]")

    def _distractor(
        self,
        rng: np.random.Generator,
        seen: str,
        kind: str,
        wrong: Callable[[str], bool],
        default: str | None = None,
    ) -> str:
        """A random entity of ``kind`` for which ``wrong`` holds, one named in ``seen`` if any."""
        for pool in (self.world.mentions(seen, kind), self.world.entities[kind]):
            candidates = [e for e in pool if wrong(e)]
            if candidates:
                return candidates[int(rng.integers(len(candidates)))]
        if default is None:
            raise ValueError(f"no {kind} makes a wrong answer")
        return default

    def vocabulary(self) -> list[str]:
        """Every distinct text the suite's episodes are made of: prompts of both splits, reference
        turns, every passage (a search observation is top_k of them joined by newlines, and a
        slipped search can return any), and the env's answers to common agent errors. Build a
        tokenizer from these."""
        texts: set[str] = {DONE, TURN_LIMIT, NO_RESULTS, *self.index.passages}
        for split in ("train", "eval"):
            for task in self._tasks[split]:
                texts.add(task.prompt)
                texts.update(task.reference)
        env = self._local_env()
        tasks = self._tasks["train"] or self._tasks["eval"]
        for action in ("search[]", "search[zzz]", "calc[1+1]", "hello") if tasks else ():
            env.reset(tasks[0])
            texts.add(env.step(action).observation)
        return sorted(texts)
