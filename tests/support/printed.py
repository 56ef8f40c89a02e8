"""A page's commands run as printed, in order, in one shell in a copy of the repository, where
this machine allows it: the docs tests of the deploy guide and of the README's cluster block.

    ran = run_printed(repo, lines, how, kfp_url)   # ran.status[n]: command n's exit status

``how(command)`` says what becomes of each command:
- ``RUN``: run as printed;
- ``HOST``: ``export KFP_HOST=...`` points at the stand-in KFP API (``kfp_standin``) instead;
- ``KUSTOMIZE``: ``kubectl apply -k DIR`` is built offline (``kubectl kustomize DIR``);
- ``S3_ENV``: reading KFP's store Secret from a cluster: ``s3.env`` is made from its example;
- ``CLUSTER``: needs a live cluster; replaced by ``:``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

RUN, KUSTOMIZE, HOST, CLUSTER, S3_ENV = "run", "kustomize", "host", "cluster", "s3-env"


@dataclass(frozen=True)
class Ran:
    status: dict[int, int]
    """Each command's exit status, by its index."""
    output: str


def fresh_terminal(repo: Path, home: Path) -> dict[str, str]:
    """The environment of a new terminal in ``repo``: the venv's scripts not on PATH until
    activated, and the copy's code, not the checkout's the venv was installed from (the
    commands write beside their modules: manifests/argo, pipelines/compiled)."""
    bin_dir = str(Path(sys.executable).parent)
    path = [p for p in os.environ["PATH"].split(os.pathsep) if p and p != bin_dir]
    return {
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "PYTHONPATH": str(repo),
        "PATH": os.pathsep.join(path),
    }


def run_printed(
    repo: Path, lines: Sequence[str], how: Callable[[str], str], kfp_url: str, home: Path
) -> Ran:
    script = ["set -u"]
    for n, command in enumerate(lines):
        what = how(command)
        if what == RUN:
            script.append(command)
        elif what == HOST:
            script.append(f"export KFP_HOST={kfp_url}")
        elif what == KUSTOMIZE:
            folder = re.fullmatch(r"kubectl apply -k (\S+)", command)[1]  # type: ignore[index]
            script.append(f"kubectl kustomize {folder} > build/kustomize-{n}.yaml")
        elif what == S3_ENV:
            script.append("cp manifests/secrets/s3/s3.env.example manifests/secrets/s3/s3.env")
        else:
            script.append(":")
        script.append(f'echo "@@ {n} $?"')
    (repo / "build").mkdir(exist_ok=True)
    env = fresh_terminal(repo, home)
    argv = ["bash", "-c", "\n".join(script)]
    done = subprocess.run(argv, cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    status = {int(n): int(s) for n, s in re.findall(r"^@@ (\d+) (\d+)$", done.stdout, re.M)}
    assert sorted(status) == list(range(len(lines))), output[-3000:]
    return Ran(status, output)
