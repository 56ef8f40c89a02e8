"""BFCL v4 multi-turn function calling: the paper's Base, Long, Miss-Func and Miss-Param tasks.

Data and executable backends come from ``bfcl-eval`` (installed ``--no-deps``). Nothing from the
data or the agent is ever evaluated: calls are read with ``ast`` and dispatched by name to the
functions shown so far (BFCL's own executor uses ``eval`` and is never called).

Actions: each agent turn is free text ending in ``call[cd(folder='document'), ls(a=True)]``
or ``answer[any text]``. A call action runs the calls in order (Python syntax, literal arguments:
str, int, float, bool, None, and lists, tuples, dicts of them); the observation has a line per
call, ``name: result`` rendered as BFCL does (str as is, dict as JSON, else ``str()``) or
``name: error: ...``; one disallowed call (syntax, non-literal, a function not shown) rejects the
whole action. An answer ends the current request; the observation is the next one (in Miss-Func,
the functions added back then, with BFCL's "I have updated some more functions ..."). A turn
longer than ``MAX_ACTION_CHARS`` is refused unread, like one without an action.

Reward: BFCL's ``multi_turn_checker`` without eval. When a request with ground-truth calls is
answered: (1) the agent ran a call in it; (2) state check: each public attribute of every
ground-truth backend (fresh instances running the ground-truth calls so far) equals the agent's;
(3) response check: its ground-truth results all appear, as a multiset, among the results of
every call the agent ran. A failed check ends the episode with reward 0 (nothing later could
change it); answering the last request gives 1. Reaching ``max_turns`` (any turns) gives 0.

Split (the paper trains on 80% of each category, tests on the rest): task ``k`` is the same
scenario in all four categories, so a task is in eval iff ``k`` is one of the 40 (20% of 200)
with the smallest ``sha256(f"bfcl-multi-turn-{k}")`` hex digests. Base, Long, Miss-Param: 160
train / 40 eval; Miss-Func: 159 / 40 (one task dropped); 639 / 160 in all.

Departures from BFCL: only functions shown so far are callable (BFCL runs any public method).
``multi_turn_miss_func_49`` is dropped: its ground truth calls ``tail`` in request 1, two
requests before showing it. MathAPI ``power`` of ints and ``logarithm``/``square_root``
precision are refused above ``MAX_POWER_BITS``/``MAX_PRECISION``: a timed-out call cannot be
killed, so work outlasting the bound must not start; a call that still times out ends the
episode with reward 0. Observations are clipped (``observation_chars``, shared by an action's
calls): in 162 of the 200 Long tasks a ground-truth result exceeds the default 2,000 chars (up
to 30k), so the agent sees less than BFCL's models do. Not validated: scores against BFCL's.
"""

from __future__ import annotations

import ast
import copy
import functools
import hashlib
import importlib
import inspect
import json
import re
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.resources import files
from typing import Any, NamedTuple

from trace_core.envs import base
from trace_core.envs.base import Split, Step, Task

CATEGORIES = ("base", "long_context", "miss_func", "miss_param")
SCENARIOS = 200  # tasks per category; index k is the same scenario in every category
MAX_ACTION_CHARS = 20_000
"""Longest turn (thought and action) the env reads, and longest call list ``parse_calls`` reads.
The longest ground-truth turn is 6,914 characters (``multi_turn_long_context_8``)."""
MAX_NESTING = 16
MAX_PRECISION = 1_000
MAX_POWER_BITS = 100_000
CANNOT = "answer[I cannot do that with these functions and details.]"
ADDED_FUNCTIONS = "I have updated some more functions you can choose from. What about now?"
INSTRUCTIONS = (
    "Help the user with a series of requests by calling functions; state persists across them. "
    "End every turn with one action:\ncall[f(a=1), g(b='x')] runs the calls in order (Python "
    "syntax, literal arguments only) and shows their results;\nanswer[reply] ends the current "
    "request. If no function fits or a needed detail is missing, say so in answer[...].\n"
)
SYSTEM_PROMPT = (
    "You are a function-calling agent. Every turn ends with exactly one action, call[...] or "
    "answer[...], as the user's message describes."
)
_ACTION = re.compile(r"(?<![A-Za-z0-9_])(call|answer)\[")
_TYPES = {"string": "str", "integer": "int", "boolean": "bool", "array": "list"}
_MISSING = object()


# --- data ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Entry:
    """One BFCL multi-turn task, as read from bfcl-eval's data files."""

    id: str
    category: str
    index: int
    requests: tuple[str, ...]  # the user's text ("" where Miss-Func only adds functions back)
    truth: tuple[tuple[str, ...], ...]  # the ground-truth call strings of each request
    classes: tuple[str, ...]
    config: Mapping[str, Any]
    added: Mapping[int, tuple[str, ...]]  # Miss-Func: request -> functions withheld until then

    @property
    def first_functions(self) -> set[str]:
        """The functions shown from the start: all but those Miss-Func withholds."""
        withheld = {name for names in self.added.values() for name in names}
        return {doc["name"] for c in self.classes for doc in class_docs(c)} - withheld

    @property
    def defect(self) -> str | None:
        """Why no agent can replay the ground truth, if none can."""
        shown_at = {name: turn for turn, names in self.added.items() for name in names}
        for turn, calls in enumerate(self.truth):
            for name in (parse_calls(text)[0].name for text in calls):
                if shown_at.get(name, 0) > turn:
                    return f"ground truth calls {name} in request {turn}, shown at {shown_at[name]}"
        return None


def _data_lines(*parts: str) -> list[dict[str, Any]]:
    path = files("bfcl_eval").joinpath("data", *parts)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@functools.cache
def class_docs(class_name: str) -> tuple[dict[str, Any], ...]:
    from bfcl_eval.constants.executable_backend_config import MULTI_TURN_FUNC_DOC_FILE_MAPPING

    return tuple(_data_lines("multi_turn_func_doc", MULTI_TURN_FUNC_DOC_FILE_MAPPING[class_name]))


@functools.cache
def load_category(category: str) -> tuple[Entry, ...]:
    """Every task of one category, defective ones included (see ``Entry.defect``)."""
    if category not in CATEGORIES:
        raise ValueError(f"unknown bfcl category {category!r}; choose from {CATEGORIES}")
    name = f"BFCL_v4_multi_turn_{category}.json"
    truth = {row["id"]: row["ground_truth"] for row in _data_lines("possible_answer", name)}
    return tuple(
        Entry(
            id=row["id"],
            category=category,
            index=int(row["id"].rsplit("_", 1)[1]),
            requests=tuple(" ".join(m["content"] for m in turn) for turn in row["question"]),
            truth=tuple(tuple(calls) for calls in truth[row["id"]]),
            classes=tuple(row["involved_classes"]),
            config=row["initial_config"],
            added={int(t): tuple(n) for t, n in row.get("missed_function", {}).items()},
        )
        for row in _data_lines(name)
    )


def eval_indexes() -> frozenset[int]:
    """The scenarios held out for eval: the 20% whose sha256 hex digests are smallest."""
    digest = {
        k: hashlib.sha256(f"bfcl-multi-turn-{k}".encode()).hexdigest() for k in range(SCENARIOS)
    }
    return frozenset(sorted(digest, key=digest.__getitem__)[: SCENARIOS // 5])


# --- prompt ----------------------------------------------------------------------------------
def _type_name(schema: Mapping[str, Any]) -> str:
    name = str(_TYPES.get(schema.get("type", "any"), schema.get("type", "any")))
    return f"list[{_type_name(schema['items'])}]" if "items" in schema else name


def render_signature(doc: Mapping[str, Any]) -> str:
    """``name(p: str, q: int = 50) - what it does. Args: p: ...; q: ...`` on one line."""
    params = doc["parameters"]
    required = set(params.get("required", []))
    signature, notes = [], []
    for name, schema in params.get("properties", {}).items():
        default = "" if name in required else f" = {schema.get('default')!r}"
        signature.append(f"{name}: {_type_name(schema)}{default}")
        if schema.get("description", "").strip(" ."):
            notes.append(f"{name}: {schema['description'].strip(' .')}")
    what = doc["description"].split("Tool description: ")[-1].strip()
    args = f" Args: {'; '.join(notes)}." if notes else ""
    return f"{doc['name']}({', '.join(signature)}) - {what}{args}"


def render_functions(classes: tuple[str, ...], names: set[str]) -> str:
    """The signatures of ``names``, under each class's one-line description."""
    lines = []
    for class_name in classes:
        docs = [doc for doc in class_docs(class_name) if doc["name"] in names]
        if docs:
            lines.append("## " + docs[0]["description"].split("Tool description: ")[0].strip())
            lines.extend(render_signature(doc) for doc in docs)
    return "\n".join(lines)


def render_prompt(entry: Entry) -> str:
    functions = render_functions(entry.classes, entry.first_functions)
    return f"{INSTRUCTIONS}\nFunctions:\n{functions}\n\nUser: {entry.requests[0]}"


def reference_turns(entry: Entry) -> tuple[str, ...]:
    """The ground truth as agent turns: each request's calls in one action, then an answer."""
    turns: list[str] = []
    for calls in entry.truth:
        turns += [f"call[{', '.join(calls)}]", "answer[Done.]"] if calls else [CANNOT]
    return tuple(turns)


# --- calls -----------------------------------------------------------------------------------
class Call(NamedTuple):
    name: str
    args: tuple[object, ...]
    kwargs: Mapping[str, object]


def _check_literal(value: object, depth: int = 0) -> object:
    """``value``, unless ``ast.literal_eval`` let in more than allowed (sets, bytes, nesting)."""
    if depth > MAX_NESTING:
        raise ValueError(f"arguments nested deeper than {MAX_NESTING}")
    if isinstance(value, list | tuple | dict):
        for item in [*value.keys(), *value.values()] if isinstance(value, dict) else value:
            _check_literal(item, depth + 1)
    elif not (value is None or isinstance(value, str | int | float)):  # bool is an int
        raise ValueError(f"{type(value).__name__} is not an allowed argument type")
    return value


def _literal(node: ast.expr, what: str) -> object:
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        raise ValueError(f"{what} is not a literal") from None
    return _check_literal(value)


def parse_calls(text: str) -> list[Call]:
    """The calls of ``f(a=1), g('x')``; ValueError saying what is not allowed.

    The env refuses turns over ``MAX_ACTION_CHARS`` before reading them; the same bound here
    keeps any other caller's text away from ``ast.parse`` unread.
    """
    if len(text) > MAX_ACTION_CHARS:
        raise ValueError(f"action longer than {MAX_ACTION_CHARS} characters")
    try:
        tree = ast.parse(f"[{text}]", mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as err:
        raise ValueError(f"not Python call syntax ({type(err).__name__})") from None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        raise ValueError("expected one or more calls, like call[f(a=1), g()]")
    calls = []
    for i, node in enumerate(tree.body.elts, 1):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            raise ValueError(f"item {i} is not a plain function call like f(a=1)")
        name, keywords = node.func.id, {k.arg: k.value for k in node.keywords}
        if None in keywords or any(isinstance(a, ast.Starred) for a in node.args):
            raise ValueError(f"{name}: *args and **kwargs are not allowed")
        args = tuple(_literal(a, f"{name}: argument {j}") for j, a in enumerate(node.args, 1))
        kwargs = {k: _literal(v, f"{name}: argument {k}") for k, v in keywords.items() if k}
        calls.append(Call(name, args, kwargs))
    return calls


def read_action(text: str) -> tuple[str, str] | None:
    """The action ending a turn, as (kind, body): the longest suffix ``call[...]`` whose body
    parses or ``answer[...]`` whose brackets balance (so a string argument cannot hijack it).
    None without an action; a ``call[`` that never parses returns its last body, to explain.

    Linear in the text: one regex pass finds the heads, one backward pass the ``[`` matching the
    final ``]`` (an answer's brackets balance iff its ``[`` is that one), and at most 16 heads
    are parsed, each body at most ``MAX_ACTION_CHARS`` long or refused by its length.
    """
    stripped = text.rstrip()
    heads = list(_ACTION.finditer(stripped)) if stripped.endswith("]") else []
    opening = base.find_matching_open(stripped, len(stripped) - 1) if heads else None
    for head in heads[-16:]:  # bounds the parsing a hostile turn can cost
        kind, body = head.group(1), stripped[head.end() : -1]
        if kind == "answer" and head.end() - 1 == opening:
            return kind, body
        try:
            if kind == "call" and parse_calls(body):
                return kind, body
        except ValueError:
            continue
    calls = [head for head in heads if head.group(1) == "call"]
    return ("call", stripped[calls[-1].end() : -1]) if calls else None


def render_result(value: object) -> str:
    """BFCL's rendering of a return value (``execute_multi_turn_func_call``)."""
    if type(value) is dict:
        try:
            return json.dumps(value)
        except (TypeError, ValueError, RecursionError):
            pass
    return value if type(value) is str else str(value)


def too_costly(call: Call, method: Callable[..., object]) -> bool:
    """Whether this MathAPI call could outlast the time bound (see the module docstring)."""
    try:
        values = inspect.signature(method).bind(*call.args, **call.kwargs).arguments
    except TypeError:
        return False  # the call itself reports it
    precision, number, exponent = (values.get(k) for k in ("precision", "base", "exponent"))
    bits = max(abs(number), 2).bit_length() if isinstance(number, int) else 0
    return (isinstance(precision, int) and precision > MAX_PRECISION) or (
        call.name == "power" and isinstance(exponent, int) and exponent * bits > MAX_POWER_BITS
    )


def run_call(method: Callable[..., object], call: Call) -> str:
    """The rendered result, or ``error: ...``; raises ``ToolTimeout`` past the time bound."""

    def run() -> str:
        try:
            return render_result(method(*call.args, **call.kwargs))
        except Exception as err:  # a backend failure is something the agent reads
            return f"error: {type(err).__name__}: {err}"

    if call.name in ("power", "logarithm", "square_root") and too_costly(call, method):
        return "error: arguments too large to compute here"
    return base.bounded_call(run)


def load_backends(entry: Entry) -> dict[str, object]:
    """Fresh instances of the task's classes, loaded as BFCL loads them."""
    from bfcl_eval.constants import executable_backend_config as backends

    instances: dict[str, object] = {}
    for class_name in entry.classes:
        module = importlib.import_module(backends.CLASS_FILE_PATH_MAPPING[class_name])
        instance = instances[class_name] = getattr(module, class_name)()
        if class_name not in backends.STATELESS_CLASSES:
            config = copy.deepcopy(entry.config.get(class_name, {}))
            instance._load_scenario(config, long_context=entry.category == "long_context")
    return instances


def public_methods(instances: Mapping[str, object]) -> dict[str, Callable[..., object]]:
    """Public method name -> bound method; a later class wins a shared name, as in BFCL."""
    return {
        name: method
        for instance in instances.values()
        for name, method in inspect.getmembers(instance, inspect.ismethod)
        if not name.startswith("_")
    }


def state_difference(agent: Mapping[str, object], truth: Mapping[str, object]) -> str | None:
    """BFCL's state check: a public attribute of a ground-truth instance unequal to the agent's."""
    for class_name, expected in truth.items():
        for attr, value in vars(expected).items():
            if not attr.startswith("_") and getattr(agent[class_name], attr, _MISSING) != value:
                return f"{class_name}.{attr} differs from the ground truth"
    return None


# --- episodes --------------------------------------------------------------------------------
class BfclEnv:
    """One BFCL episode at a time: the agent's backends and the ground truth's, side by side."""

    def __init__(self, entries: Mapping[str, Entry], max_turns: int, observation_chars: int):
        self.max_turns = max_turns
        self._entries = entries
        self._limit = observation_chars
        self._entry: Entry | None = None
        self._done = True

    def reset(self, task: Task) -> str:
        if task.id not in self._entries:
            raise ValueError(f"{task.id!r} is not a task of this bfcl suite")
        entry = self._entry = self._entries[task.id]
        self._agent, self._truth = load_backends(entry), load_backends(entry)
        self._agent_methods = public_methods(self._agent)
        self._truth_methods = public_methods(self._truth)
        self._shown = entry.first_functions
        self._request = self._turns = self._calls_in_request = 0
        self._results: list[str] = []  # every result of the agent's calls, for the response check
        self._done = False
        return task.prompt

    def step(self, action: str) -> Step:
        if self._entry is None or self._done:
            raise RuntimeError("the episode is over (or never started): call reset first")
        self._turns += 1
        refusal = base.refuse_long(action, MAX_ACTION_CHARS)  # refused unread, as malformed
        kind, body = ("", "") if refusal else read_action(action) or ("", "")
        try:
            if kind == "answer":
                step = self._end_request(self._entry)
            elif kind == "call":
                step = self._run_calls(body)
            else:
                no_action = "error: end your turn with call[f(a=1), g()] or answer[...]"
                step = Step(refusal or no_action, False, 0)
        except base.ToolTimeout as err:  # its thread may still change the state: stop here
            step = Step(f"episode over: {err}", True, 0.0)
        if not step.done and self._turns >= self.max_turns:
            step = Step(f"episode over: turn limit ({self.max_turns}) reached", True, 0.0)
        self._done = step.done
        return Step(base.clip_observation(step.observation, self._limit), step.done, step.reward)

    def _run_calls(self, body: str) -> Step:
        try:
            calls = parse_calls(body)
        except ValueError as err:
            return Step(f"error: {err}", False, 0.0)
        for call in calls:  # all allowed, or none runs
            if call.name not in self._shown or call.name not in self._agent_methods:
                return Step(f"error: no function named {call.name!r} is available", False, 0.0)
        self._calls_in_request += len(calls)
        lines, share = [], self._limit // len(calls)
        for call in calls:
            result = run_call(self._agent_methods[call.name], call)
            self._results.append(result)
            lines.append(base.clip_observation(f"{call.name}: {result}", share))
        return Step("\n".join(lines), False, 0.0)

    def _end_request(self, entry: Entry) -> Step:
        turn, calls = self._request, [parse_calls(text)[0] for text in entry.truth[self._request]]
        expected = [run_call(self._truth_methods[call.name], call) for call in calls]
        if calls:  # BFCL checks only requests with ground-truth calls
            missing = Counter(expected) - Counter(self._results)
            failure = (
                (f"no call in request {turn}" if self._calls_in_request == 0 else None)
                or state_difference(self._agent, self._truth)
                or (f"{missing.total()} ground-truth result(s) not produced" if missing else None)
            )
            if failure:
                return Step(f"episode over: request {turn}: {failure}", True, 0.0)
        self._request, self._calls_in_request = turn + 1, 0
        if self._request == len(entry.requests):
            return Step("episode over: every request handled", True, 1.0)
        added = entry.added.get(self._request, ())
        self._shown.update(added)
        if added:
            functions = render_functions(entry.classes, set(added))
            return Step(f"New functions:\n{functions}\nUser: {ADDED_FUNCTIONS}", False, 0.0)
        return Step(f"User: {entry.requests[self._request]}", False, 0.0)


@functools.cache
def _entries(categories: tuple[str, ...]) -> dict[str, Entry]:
    return {e.id: e for c in categories for e in load_category(c) if e.defect is None}


@dataclass(frozen=True)
class BfclSuite:
    """BFCL v4 multi-turn tasks of the chosen categories, split 80/20 by scenario."""

    categories: tuple[str, ...] = CATEGORIES
    """Any of base, long_context, miss_func, miss_param."""
    max_turns: int = 32
    """Agent turns per episode, calls and answers alike (the longest reference takes 16)."""
    observation_chars: int = base.MAX_OBSERVATION_CHARS
    """Bound on one observation; the calls of one action share it equally."""
    name: str = field(default="bfcl", init=False)
    instructions: str = field(default=SYSTEM_PROMPT, init=False)
    """The system prompt of a pretrained policy (each task's prompt states its functions)."""

    def __post_init__(self) -> None:
        unknown = set(self.categories) - set(CATEGORIES)
        if not self.categories or unknown:
            raise ValueError(f"categories must be a non-empty subset of {CATEGORIES}: {unknown}")
        if self.max_turns < 1 or self.observation_chars < 100:
            raise ValueError("max_turns must be >= 1 and observation_chars >= 100")

    def tasks(self, split: Split) -> list[Task]:
        held_out = eval_indexes()
        return [
            # the answer is "": the reward is a state check
            Task(entry.id, render_prompt(entry), "", entry.category, split, reference_turns(entry))
            for entry in _entries(tuple(self.categories)).values()
            if (entry.index in held_out) == (split == "eval")
        ]

    def make_env(self) -> BfclEnv:
        return BfclEnv(_entries(tuple(self.categories)), self.max_turns, self.observation_chars)
