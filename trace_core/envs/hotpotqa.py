"""HotpotQA questions in the multihop env, each searching only its own context paragraphs.

    trace-rl task check hotpotqa --data hotpot_dev_distractor_v1.json

The distractor setting: a question's index holds just the paragraphs of its ``context`` (gold
and distractors), built on first use and cached. Answers are scored by HotpotQA's exact match
(``multihop.normalize_answer``). With ``retriever_url`` every question searches one retrieval
service instead, whose corpus is every paragraph of the dataset (``HotpotQASuite.corpus``); its
passages read as the in-process ones do ("title: sentences").
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from trace_core.envs.base import Split, Task, parse_action
from trace_core.envs.multihop import MultihopEnv
from trace_core.envs.remote import RemoteSearch
from trace_core.envs.retrieval import Passage, Searcher, SearchIndex
from trace_core.envs.source import read_records

MAX_ACTION_CHARS = 4_000
INSTRUCTIONS = (
    "Answer the question from the paragraphs you can search. In each turn, think briefly, then "
    "end the turn with exactly one action: search[query] shows the best-matching paragraphs; "
    "answer[text] gives the final answer (a short span, as in the paragraphs) and ends the "
    "episode."
)
"""The system prompt of a pretrained policy: the action grammar (``policy.format``)."""
"""Longest turn (thought and action) the env reads. References are ``search[<title>]`` and
``answer[<gold>]``, a title or an answer of at most a few hundred characters (a reference turn over
the limit is left out), so this leaves room for a ReAct thought of several sentences."""


@dataclass(frozen=True)
class HotpotQA:
    """HotpotQA questions as tasks, and each task's own passages (one per context paragraph)."""

    tasks: tuple[Task, ...]
    passages: Mapping[str, tuple[str, ...]]
    """Task id -> "title: sentence sentence ..." per paragraph of its ``context``."""
    titles: Mapping[str, tuple[str, ...]]
    """Task id -> the title of each of its paragraphs, in ``passages``' order."""


def load_hotpotqa(uri: str, split_seed: int = 0, eval_fraction: float = 0.1) -> HotpotQA:
    """The official HotpotQA JSON (or JSONL/Parquet with the same fields) as tasks and passages.

    Rows need ``_id`` (or ``id``), ``question``, ``answer`` and ``context`` ([[title,
    [sentences]], ...]); ``supporting_facts``, ``type`` and ``level`` are used when present. A
    seeded permutation puts ``round(eval_fraction * n)`` rows in eval (1.0 for a dev file). The
    reference searches each supporting title, then answers the gold text (no searches without
    supporting facts; a title that cannot be written as one ``search[...]`` turn is not searched;
    empty if the answer cannot be written as one ``answer[...]`` turn: brackets unbalanced, or
    longer than ``MAX_ACTION_CHARS``).
    """
    if not 0.0 <= eval_fraction <= 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1], got {eval_fraction}")
    rows = read_records(uri)
    if not rows:
        raise ValueError(f"{uri}: no rows")
    order = np.random.default_rng(split_seed).permutation(len(rows))
    eval_rows = set(order[: round(eval_fraction * len(rows))].tolist())
    tasks: list[Task] = []
    passages: dict[str, tuple[str, ...]] = {}
    titles: dict[str, tuple[str, ...]] = {}
    for i, row in enumerate(rows):
        split: Split = "eval" if i in eval_rows else "train"
        task, paragraphs, named = _hotpotqa_task(uri, i, row, split)
        if task.id in passages:
            raise ValueError(f"{uri}: row {i} repeats id {task.id!r}")
        tasks.append(task)
        passages[task.id], titles[task.id] = paragraphs, named
    return HotpotQA(tuple(tasks), passages, titles)


def _hotpotqa_task(
    uri: str, i: int, row: object, split: Split
) -> tuple[Task, tuple[str, ...], tuple[str, ...]]:
    where = f"{uri}: row {i}"
    if not isinstance(row, dict):
        raise ValueError(f"{where} is a {type(row).__name__}, expected an object")
    raw_id = row.get("_id", row.get("id"))
    if not isinstance(raw_id, str | int) or isinstance(raw_id, bool) or str(raw_id) == "":
        raise ValueError(f"{where} field '_id' (or 'id') is missing or not text")
    for field in ("question", "answer"):
        if not isinstance(row.get(field), str) or not row[field].strip():
            raise ValueError(f"{where} field {field!r} must be non-empty text")
    context = row.get("context")
    if not isinstance(context, list) or not context:
        raise ValueError(f"{where} field 'context' must be a non-empty list of [title, sentences]")
    paragraphs = []
    for j, entry in enumerate(context):
        ok = isinstance(entry, list | tuple) and len(entry) == 2 and isinstance(entry[0], str)
        if not ok or not isinstance(entry[1], list | tuple):
            raise ValueError(f"{where} field 'context'[{j}] must be [title, [sentences...]]")
        if not all(isinstance(s, str) for s in entry[1]):
            raise ValueError(f"{where} field 'context'[{j}] has a sentence that is not text")
        paragraphs.append(f"{entry[0]}: {' '.join(s.strip() for s in entry[1])}")
    titles: list[str] = []
    facts = row.get("supporting_facts") or []
    if not isinstance(facts, list | tuple):
        raise ValueError(f"{where} field 'supporting_facts' must be a list of [title, sentence]")
    for j, fact in enumerate(facts):
        if not isinstance(fact, list | tuple) or not fact or not isinstance(fact[0], str):
            raise ValueError(f"{where} field 'supporting_facts'[{j}] must be [title, sentence]")
        if fact[0] not in titles:
            titles.append(fact[0])
    answer = row["answer"].strip()
    searches = tuple(f"search[{t}]" for t in titles if _writable("search", t))
    turns = (*searches, f"answer[{answer}]") if _writable("answer", answer) else ()
    labels = [f"{k}={row[k]}" for k in ("type", "level") if isinstance(row.get(k), str)]
    task = Task(
        id=f"hotpotqa-{raw_id}",
        prompt=row["question"].strip(),
        answer=answer,
        difficulty=",".join(labels) or "hotpotqa",
        split=split,
        reference=turns,
    )
    return task, tuple(paragraphs), tuple(str(entry[0]) for entry in context)


def _writable(tool: str, argument: str) -> bool:
    """Whether ``tool[argument]`` reads back as exactly that action (brackets balanced, ...) and
    fits in one turn."""
    action = f"{tool}[{argument}]"
    parsed = parse_action(action)
    writable = parsed is not None and parsed.name == tool and parsed.argument == argument
    return writable and len(action) <= MAX_ACTION_CHARS


class HotpotQASuite:
    """HotpotQA in ``MultihopEnv``, each question searching its own context paragraphs, or with
    ``retriever_url`` the retrieval service holding ``corpus()``.

    Turns up to ``MAX_ACTION_CHARS`` are read, longer ones refused as in any ``MultihopEnv``.
    """

    name = "hotpotqa"
    instructions = INSTRUCTIONS
    _CACHE = 256  # indexes kept; building one for ten paragraphs takes about a millisecond

    def __init__(
        self,
        uri: str,
        split_seed: int = 0,
        eval_fraction: float = 0.1,
        max_turns: int = 8,
        top_k: int = 2,
        retriever_url: str | None = None,
    ) -> None:
        if max_turns < 1 or top_k < 1:
            raise ValueError(f"max_turns and top_k must be >= 1, got {max_turns}, {top_k}")
        self.uri, self.max_turns, self.top_k = uri, max_turns, top_k
        self.data = load_hotpotqa(uri, split_seed, eval_fraction)
        self.remote = RemoteSearch(retriever_url) if retriever_url else None
        self._indexes: OrderedDict[str, SearchIndex] = OrderedDict()
        self._lock = threading.Lock()  # envs of one suite may reset from several threads

    def tasks(self, split: Split) -> list[Task]:
        return [t for t in self.data.tasks if t.split == split]

    def make_env(self) -> MultihopEnv:
        return MultihopEnv(self.index_for, self.max_turns, self.top_k, MAX_ACTION_CHARS)

    def index_for(self, task: Task) -> Searcher:
        """The BM25 index over ``task``'s own paragraphs (built on first use, then cached); with
        ``retriever_url``, the service."""
        if task.id not in self.data.passages:
            raise ValueError(f"task {task.id} is not in {self.uri}")
        if self.remote is not None:
            return self.remote
        with self._lock:
            if task.id not in self._indexes:
                self._indexes[task.id] = SearchIndex(self.data.passages[task.id])
                if len(self._indexes) > self._CACHE:
                    self._indexes.popitem(last=False)
            self._indexes.move_to_end(task.id)
            return self._indexes[task.id]

    def corpus(self) -> list[Passage]:
        """Every distinct paragraph of the dataset, in the order the rows first give them: the
        title as its id, and ``title (2)``, ``title (3)``, ... for other paragraphs under a title
        already taken; its text is the sentences as the in-process passage joins them."""
        ids: dict[tuple[str, str], str] = {}
        taken: set[str] = set()
        following: dict[str, int] = {}  # title -> the suffix its next paragraph tries first
        for task in self.data.tasks:
            named = self.data.titles[task.id]
            for title, passage in zip(named, self.data.passages[task.id], strict=True):
                text = passage[len(title) + 2 :]  # the passage is f"{title}: {text}"
                if (title, text) in ids:
                    continue
                base = title or "untitled"
                n = following.get(base, 1)
                pid = base if n == 1 else f"{base} ({n})"
                while pid in taken:
                    n += 1
                    pid = f"{base} ({n})"
                following[base] = n + 1
                ids[(title, text)] = pid
                taken.add(pid)
        return [Passage(pid, title, text) for (title, text), pid in ids.items()]
