"""The CPU image's package as its Dockerfile installs it, without a container engine
(``support.image_context``): the build context as docker sends it (.dockerignore), the
Dockerfile's COPY steps into the folder its ``pip install .`` runs in, that tree's wheel
installed into a venv that cannot see the checkout. There the Dockerfile's own import check
and the image's CMD must run, and every package pyproject.toml ships must be installed.

Then docker's .dockerignore rules on the patterns that trip people up, and the COPY replay on
small contexts of its own (both fast). The GPU image's check needs vLLM: tests/vllm.
"""

from __future__ import annotations

import json
import shlex
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest
from support.image_context import (
    REPO,
    DockerIgnore,
    ImageVenv,
    NotInContext,
    command,
    import_check,
    install_tree,
    instructions,
    user_env,
)

DOCKERFILE = REPO / "images" / "trace" / "Dockerfile"


@pytest.mark.slow
def test_the_image_passes_its_own_import_check(
    installed_image: Callable[[str], ImageVenv], tmp_path: Path
) -> None:
    venv = installed_image("trace")
    check = import_check(DOCKERFILE)  # RUN python -c "import trace_core.cli, ray, kfp, torch; ..."
    assert "trace_core.cli" in check[-1]
    done = venv.run(check, cwd=tmp_path, env=user_env(tmp_path))
    assert done.returncode == 0, f"{check} in {venv.prefix}:\n{done.stderr[-3000:]}"


@pytest.mark.slow
def test_the_image_runs_its_command(
    installed_image: Callable[[str], ImageVenv], tmp_path: Path
) -> None:
    venv = installed_image("trace")
    cmd = command(DOCKERFILE)
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert cmd[0] in scripts and (venv.prefix / "bin" / cmd[0]).is_file(), cmd
    done = venv.run(cmd, cwd=tmp_path, env=user_env(tmp_path))
    assert done.returncode == 0, f"{cmd} in {venv.prefix}:\n{done.stderr[-3000:]}"
    assert "Usage:" in done.stdout and "run-local" in done.stdout, done.stdout


@pytest.mark.slow
def test_the_image_installs_every_package_pyproject_ships(
    installed_image: Callable[[str], ImageVenv], tmp_path: Path
) -> None:
    """trace_core, components, pipelines: imported from the venv, with the data files they read
    (components/images.env, the compiled pipeline: the next test)."""
    venv = installed_image("trace")
    packaging = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    names = [pattern.rstrip("*") for pattern in packaging["packages"]["find"]["include"]]
    assert set(names) == {"trace_core", "components", "pipelines"}
    found = f"[importlib.import_module(n).__file__ for n in {names!r}]"
    probe = f"import importlib, json; print(json.dumps({found}))"
    done = venv.run(["python", "-c", probe], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    for name, origin in zip(names, json.loads(done.stdout), strict=True):
        assert origin is not None, f"{name}: not installed in the image ({venv.prefix})"
        assert Path(origin).resolve().is_relative_to(venv.prefix.resolve()), (name, origin)


@pytest.mark.slow
def test_the_image_holds_torch_engines_compiled_decode_step(
    installed_image: Callable[[str], ImageVenv], tmp_path: Path
) -> None:
    """The Dockerfile's build of TorchEngine's compiled step (``policy.native``), run in the
    image's venv: the library lands in the venv (which the final stage takes), and the engine
    loads it from there as the image's user, whose home holds nothing."""
    venv = installed_image("trace")
    runs = [args for op, args in instructions(DOCKERFILE) if op == "RUN"]
    steps = [part.strip() for args in runs for part in args.split("&&")]
    build = [shlex.split(step) for step in steps if "trace_core.policy.native" in step]
    assert build == [["python", "-m", "trace_core.policy.native"]], steps
    done = venv.run(build[0], cwd=tmp_path, env=user_env(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    probe = "from trace_core.policy import native; print(native.decode_step() is not None)"
    loaded = venv.run(["python", "-c", probe], cwd=tmp_path, env=user_env(tmp_path))
    assert loaded.stdout.strip() == "True", loaded.stderr[-3000:]
    found = list((venv.prefix / "share" / "trace-rl" / "native").glob("trace_native-*.so"))
    assert found and not list((tmp_path / "home").rglob("*.so"))


# --- .dockerignore, as docker reads it ------------------------------------------------------
def sent_paths(patterns: str, *paths: str) -> dict[str, bool]:
    """Path → whether the context sends it, under ``patterns``."""
    ignore = DockerIgnore.parse(patterns)
    return {path: not ignore.excluded(path) for path in paths}


def sends(patterns: str, sent: list[str], dropped: list[str]) -> None:
    """Under ``patterns``, the context sends every path of ``sent`` and none of ``dropped``."""
    expected = {**dict.fromkeys(sent, True), **dict.fromkeys(dropped, False)}
    assert sent_paths(patterns, *expected) == expected


def test_an_allow_list_sends_only_what_it_names() -> None:
    sends(
        "*\n!pyproject.toml\n!trace_core/\n!requirements/constraints.txt\n**/__pycache__",
        sent=["pyproject.toml", "trace_core/cli/app.py", "requirements/constraints.txt"],
        dropped=[
            "trace_core/__pycache__/a.pyc",
            "trace_core/x/__pycache__/b.pyc",
            "requirements/scan.txt",
            "pipelines/local.py",
            "tests/conftest.py",
            ".venv/bin/python",
        ],
    )


def test_the_last_matching_line_decides() -> None:
    """Docker's own examples: an exception, then an exclusion it covers, and the reverse."""
    sends(
        "*.md\n!README*.md\nREADME-secret.md",
        sent=["README.md", "x/README.md"],
        dropped=["README-secret.md", "notes.md"],
    )
    assert sent_paths("*.md\nREADME-secret.md\n!README*.md", "README-secret.md") == {
        "README-secret.md": True
    }


def test_double_star_crosses_folders_and_star_does_not() -> None:
    sends("**/*.go", sent=["a.gox"], dropped=["a.go", "x/a.go", "x/y/a.go"])
    sends(
        "*/temp*",
        sent=["temp", "a/b/temp"],
        dropped=["somedir/temporary.txt", "somedir/temp/x"],
    )
    sends("temp?", sent=["tempab", "x/tempa"], dropped=["tempa"])
    sends("docs/**", sent=["docs"], dropped=["docs/a.md", "docs/x/y.md"])
    assert not any(sent_paths("**", "a", "x/y/z").values())
    sends("a/**/b", sent=["a/xb"], dropped=["a/b", "a/x/b", "a/x/y/b"])


def test_a_folder_excluded_excludes_its_contents_unless_put_back() -> None:
    sends("build", sent=["builder/a"], dropped=["build", "build/x/y.txt"])
    sends(
        "build/\n!build/keep/",
        sent=["build/keep/a"],
        dropped=["build/other/a", "build/top"],
    )


def test_lines_are_cleaned_as_docker_cleans_them() -> None:
    """Leading ``/`` and ``./`` dropped, ``..`` resolved, spaces trimmed; ``#`` in column 1
    only starts a comment."""
    for pattern in ("/docs", "./docs", "  docs/  ", "x/../docs", "//docs"):
        sends(pattern, sent=["src/docs"], dropped=["docs/a.md"])
    assert sent_paths("# docs\n", "# docs", "docs") == {"# docs": True, "docs": True}
    assert sent_paths(" # docs\n", "# docs") == {"# docs": False}
    assert sent_paths("\\*literal", "*literal", "xliteral") == {"*literal": False, "xliteral": True}
    with pytest.raises(ValueError, match="illegal exclusion"):
        DockerIgnore.parse("!\n")


def test_the_walk_goes_into_an_excluded_folder_only_for_an_exception(tmp_path: Path) -> None:
    for name in ("keep/a.py", "keep/sub/b.py", "drop/c.py", "deep/x/y/keep.txt", "deep/x/no"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    folders, files = DockerIgnore.parse("*\n!keep\n!deep/*/y/keep.txt").context_files(tmp_path)
    assert files == ["deep/x/y/keep.txt", "keep/a.py", "keep/sub/b.py"]
    assert folders == ["deep", "deep/x", "deep/x/y", "keep", "keep/sub"]


# --- COPY, replayed -------------------------------------------------------------------------
def context(root: Path, dockerfile: str, dockerignore: str, files: list[str]) -> Path:
    for name in files:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(name)
    (root / ".dockerignore").write_text(dockerignore)
    (root / "Dockerfile").write_text(dockerfile)
    return root / "Dockerfile"


def test_copy_takes_a_folders_contents_into_dest_relative_to_workdir(tmp_path: Path) -> None:
    dockerfile = context(
        tmp_path / "context",
        dockerfile="FROM x AS build\nCOPY junk /junk\nFROM y\nWORKDIR /opt\nWORKDIR src\n"
        "COPY --from=build /junk /junk\nCOPY pkg pkg\nCOPY a.toml b.md ./\nCOPY c.txt conf\n"
        'COPY ["lib", "vendor/"]\nRUN pip install --no-cache-dir \'.[extra]\'\nCOPY late late\n',
        dockerignore="*\n!pkg\n!*.toml\n!b.md\n!c.txt\n!lib\n**/*.pyc\n",
        files=[
            "pkg/__init__.py",
            "pkg/m.pyc",
            "a.toml",
            "b.md",
            "c.txt",
            "lib/l.py",
            "late",
            "junk",
        ],
    )
    tree = install_tree(dockerfile, tmp_path / "image", context=dockerfile.parent)
    assert tree == tmp_path / "image" / "opt" / "src"
    found = sorted(p.relative_to(tree).as_posix() for p in tree.rglob("*") if p.is_file())
    assert found == ["a.toml", "b.md", "conf", "pkg/__init__.py", "vendor/l.py"]


def test_copy_of_what_the_context_lacks_fails(tmp_path: Path) -> None:
    dockerfile = context(
        tmp_path,
        dockerfile="FROM x\nWORKDIR /src\nCOPY pkg pkg\nCOPY tools tools\nRUN pip install .\n",
        dockerignore="*\n!pkg/\n",
        files=["pkg/a.py", "tools/b.py"],
    )
    with pytest.raises(NotInContext, match="COPY tools: not in the build context"):
        install_tree(dockerfile, tmp_path / "image", context=tmp_path)


def test_the_cpu_images_install_tree_holds_its_packages(tmp_path: Path) -> None:
    """What this image's ``pip install .`` sees, from the real .dockerignore and Dockerfile."""
    tree = install_tree(DOCKERFILE, tmp_path / "image")
    assert tree == tmp_path / "image" / "src"
    top = sorted(p.name for p in tree.iterdir())
    assert {"pyproject.toml", "README.md", "trace_core", "components", "pipelines"} <= set(top)
    assert not {"tests", "docs", "manifests", ".git", ".venv"} & set(top)
    assert not list(tree.rglob("__pycache__"))


@pytest.mark.slow
def test_the_image_compiles_the_committed_pipeline(
    installed_image: Callable[[str], ImageVenv], tmp_path: Path
) -> None:
    """`trace-rl pipeline compile` in the image: the image references come from the installed
    components/images.env, and the result is the pipeline the repository commits."""
    venv = installed_image("trace")
    output = tmp_path / "trace_training.yaml"
    cmd = ["trace-rl", "pipeline", "compile", "--output", str(output)]
    done = venv.run(cmd, cwd=tmp_path, env=user_env(tmp_path))
    assert done.returncode == 0, f"{cmd} in {venv.prefix}:\n{done.stderr[-3000:]}"
    assert output.read_text() == (REPO / "pipelines/compiled/trace_training.yaml").read_text()
