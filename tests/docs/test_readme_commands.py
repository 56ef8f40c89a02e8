"""Every command of the ```bash blocks of the README and the pages it leads to (``PAGES``),
accounted for: run here as printed, or named with the test that runs it (as printed, or the
same command with smaller settings) and why it is not run as printed in the suite (minutes of
compute, a cluster, a user's own file). docs/deploy.md, docs/results.md and docs/scaling.md
have tests of their own.

A command added to one of them that no rule accounts for fails
``test_every_command_has_a_rule``; a README longer than ``README_LINES`` fails too.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support import printed
from support.commands import commands

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
PAGES = (
    "README.md",
    "docs/engines.md",
    "docs/models.md",
    "docs/training.md",
    "docs/storage.md",
    "docs/pipeline.md",
)
README_LINES = 250
"""The README says what the project is, how to start and where to read next; the rest is in
the pages."""
RUN = "run as printed here"
SMALLER = "the same command with smaller settings"
CLUSTER = "needs a cluster: its part that runs here is tested"
BLOCK = "run as printed, in the cluster block's order (test_the_cluster_block_runs)"

# (pattern, how, the test that runs it, why not as printed in the suite)
RULES: list[tuple[str, str, str, str]] = [
    (r"make run", SMALLER, "pipelines/test_local_run.py", "≈ 9–17 min on 2 cores"),
    (r"make test", "what CI runs (.ci/run)", "", ""),
    (r"make test-fast", "make test's pytest with -m", "", "a subset of make test"),
    (r"trace-rl task check calc", RUN, "", ""),
    (r"trace-rl task check bfcl --json check.json", RUN, "", ""),
    (
        r"trace-rl task check deepscaler --data train.parquet",
        SMALLER,
        "test_cli_commands.py",
        "reads the user's DeepScaleR file; the test writes one",
    ),
    (
        r"trace-rl warmstart --task calc --output build/policy/calc",
        SMALLER,
        "test_cli_commands.py",
        "≈ 2.5 min; the test warm-starts with fewer steps",
    ),
    (r"trace-rl rollout-demo --task calc", SMALLER, "test_cli_commands.py", "≈ 6 min"),
    (
        r"trace-rl rollout --checkpoint build/policy/calc --strategy .*",
        SMALLER,
        "test_cli_commands.py",
        "needs the warm start above",
    ),
    (r"trace-rl model import smollm2 .*", "as printed", "policy/test_model_cli.py", ""),
    (r"trace-rl model check build/models/smollm2 .*", "as printed", "policy/test_model_cli.py", ""),
    (
        r"trace-rl bench update --checkpoint build/models/smollm2 .*",
        "as printed",
        "policy/test_model_cli.py",
        "",
    ),
    (
        r"trace-rl bench engine --checkpoint build/models/smollm2 .*",
        "as printed",
        "policy/test_model_cli.py",
        "",
    ),
    (
        r"trace-rl model upload build/models/smollm2 s3://\S+",
        SMALLER,
        "train/test_step_cli.py",
        "the tiny policy, to the test's SeaweedFS; its printed --param runs as printed",
    ),
    (
        r"trace-rl prep --task calc --split train --output build/prompts/calc-train.parquet",
        RUN,
        "",
        "",
    ),
    (
        r"trace-rl rollout --checkpoint build/policy/calc --prompt-file .*",
        SMALLER,
        "test_cli_commands.py",
        "needs the warm start above",
    ),
    (r"trace-rl train --task calc .*", SMALLER, "test_cli_commands.py", "12 iterations"),
    (
        r"trace-rl compare --task calc .*",
        SMALLER,
        "test_cli_commands.py",
        "every strategy × 3 seeds × 10 iterations",
    ),
    (
        r"trace-rl compare --task calc-mix --table ablation .*",
        SMALLER,
        "train/test_tables.py",
        "5 strategies × 5 seeds; the test runs the table's arithmetic on made-up runs",
    ),
    (
        r"trace-rl predictor score build/train/calc-trace .*",
        SMALLER,
        "train/test_loop.py",
        "needs the training run above",
    ),
    (
        r"trace-rl bench allocation .*",
        SMALLER,
        "bench/test_bench_commands.py",
        "2,048 prompts × 3 seeds × 4 iterations",
    ),
    (
        r"trace-rl bench allocator-speed --json speed.json",
        SMALLER,
        "bench/test_bench_commands.py",
        "the DP at B = 256 takes ≈ 20 s",
    ),
    (
        r"trace-rl bench engine --profile --json engine.json",
        SMALLER,
        "test_cli_commands.py",
        "a minute of decoding",
    ),
    (
        r"trace-rl bench contrast --checkpoint build/policy/calc",
        SMALLER,
        "bench/test_contrast.py",
        "needs the warm start above",
    ),
    (
        r"trace-rl bench workers --checkpoint build/policy/calc",
        SMALLER,
        "rollout/test_ray_pool.py",
        "starts Ray and 1 + 2 workers",
    ),
    (
        r"trace-rl bench reload --checkpoint build/policy/calc",
        SMALLER,
        "train/test_loop.py",
        "starts engine actors twice",
    ),
    (
        r"trace-rl bench async --checkpoint build/policy/calc .*",
        SMALLER,
        "train/test_staleness.py",
        "needs the warm start above; three runs of 6 iterations on Ray actors",
    ),
    (r"trace-rl bench parse --json parse.json", RUN, "", ""),
    (
        r"trace-rl inspect (summary|query|show|html) build/rollout.*",
        SMALLER,
        "store/test_inspect.py",
        "needs the rollout above",
    ),
    (
        r"trace-rl inspect query s3://.*",
        SMALLER,
        "store/test_inspect.py",
        "the test's bucket is on a SeaweedFS it starts",
    ),
    (
        r"trace-rl bench store --json build/store.json",
        SMALLER,
        "bench/test_store_bench.py",
        "1,000 trees and a 1M-node query",
    ),
    (r"make manifests REGISTRY=\S+", BLOCK, "", ""),
    (r"source \.venv/bin/activate", BLOCK, "", ""),
    (r'echo "auth_token=\$\(openssl rand -hex 32\)" > \S+', BLOCK, "", ""),
    (r"make images push", CLUSTER, "images/test_dockerfiles.py", "a container engine, a registry"),
    (
        r"kubectl -n kubeflow get secret mlpipeline-minio-artifact .*",
        CLUSTER,
        "",
        "reads KFP's Secret; the cluster block's test makes s3.env from its example",
    ),
    (r"kubectl -n kubeflow port-forward .*", CLUSTER, "", "a cluster's service"),
    (r"set -a; \. manifests/secrets/s3/s3\.env; set \+a", CLUSTER, "", "the cluster's keys"),
    (r"export AWS_ENDPOINT_URL_S3=\S+", CLUSTER, "", "the port-forward above"),
    (
        r"trace-rl inspect (summary|html) s3://mlpipeline/shared/trace-rl.*",
        SMALLER,
        "store/test_inspect.py",
        "the test's bucket is on a SeaweedFS it starts",
    ),
    (r"export KFP_HOST=\S+", CLUSTER, "", "the cluster block's test: a stand-in KFP"),
    (
        r"trace-rl pipeline (compile|upload|run|schedule|runs)( .*)?",
        "in the cluster block's order, or as in the deploy guide",
        "docs/test_deploy_guide.py",
        "against a stand-in KFP API",
    ),
    (
        r"trace-rl pipeline argo",
        "regenerates and diffs",
        "pipelines/test_argo.py",
        "writes the committed manifests",
    ),
    (
        r"kubectl apply -k manifests/overlays/\w+",
        CLUSTER,
        "manifests/test_build.py",
        "built offline with kubectl kustomize",
    ),
    (r"argo submit .*", CLUSTER, "", "a cluster's Argo controller"),
]


def rule_of(command: str) -> tuple[str, str, str, str]:
    matched = [rule for rule in RULES if re.fullmatch(rule[0], command)]
    assert len(matched) == 1, f"README.md: {command!r} matches {len(matched)} rules"
    return matched[0]


def page_commands() -> dict[str, list[str]]:
    """Each page's commands, as a reader would type them."""
    return {page: commands((REPO / page).read_text()) for page in PAGES}


def test_every_command_has_a_rule() -> None:
    pages = page_commands()
    lines = [command for found in pages.values() for command in found]
    assert len(lines) >= 30 and all(pages.values()), {p: len(c) for p, c in pages.items()}
    for command in lines:
        _, _, where, _ = rule_of(command)
        if where:
            source = (TESTS / where).read_text()
            if command.startswith("trace-rl "):
                words = [w for w in command.split()[1:3] if not w.startswith(("-", "build"))]
                assert f'"{words[-1]}"' in source or words[-1] in source, (command, where)
    for pattern, *_ in RULES:
        assert any(re.fullmatch(pattern, c) for c in lines), f"no command for {pattern}"


def test_the_readme_is_short_and_leads_to_every_page() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= README_LINES
    for page in (*PAGES[1:], "docs/deploy.md", "docs/results.md", "docs/scaling.md"):
        assert f"]({page})" in readme, page
    for page in PAGES[1:]:  # each page's links resolve from docs/
        text = (REPO / page).read_text()
        for target in re.findall(r"\]\(([^)#:]+)[)#]", text):
            assert (REPO / "docs" / target).exists(), (page, target)


@pytest.mark.parametrize(
    "command",
    [rule[0].replace("\\", "") for rule in RULES if rule[1] == RUN],
)
def test_runs_as_printed(command: str, tmp_path: Path) -> None:
    assert any(command in found for found in page_commands().values())
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(
        command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-2000:])


def cluster_block() -> list[str]:
    """The commands of the README's "Running on a cluster" block, in order."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Running on a cluster") :]
    return commands(section[: section.index("\n## ", 1)])


def printed_how(command: str) -> str:
    """What the cluster block's test does with ``command`` (``support.printed``)."""
    if re.fullmatch(r"export KFP_HOST=\S+", command):
        return printed.HOST
    if re.fullmatch(r"kubectl apply -k \S+", command):
        return printed.KUSTOMIZE
    if "get secret mlpipeline-minio-artifact" in command:
        return printed.S3_ENV
    if command.startswith("kubectl "):
        return printed.CLUSTER
    return printed.RUN  # make images push too: it fails here naming what it cannot run


@pytest.mark.slow
def test_the_cluster_block_runs(tmp_path: Path) -> None:
    """The block as printed, in a fresh terminal in a copy of the repository: up to the first
    command that needs a cluster everything runs (the registry moved, the venv, the Ray token),
    and past it what can run here does (the overlay built offline, upload, run and schedule
    against a stand-in KFP API with the compiled package's defaults: the kfp overlay's Ray
    cluster, no GPU in the step pods, KFP's store)."""
    from support.kfp_standin import API, StandIn, serving
    from support.repo_copy import repository_copy

    from pipelines.trace_training import PipelineOptions

    lines = cluster_block()
    hows = [printed_how(command) for command in lines]
    first = hows.index(printed.CLUSTER) if printed.CLUSTER in hows else len(lines)
    assert "make manifests REGISTRY=" in lines[0] and first >= 3, lines
    repo = repository_copy(tmp_path / "repo")
    (tmp_path / "home").mkdir()
    with serving(StandIn()) as kfp:
        ran = printed.run_printed(repo, lines, printed_how, kfp.url, tmp_path / "home")
    for n, command in enumerate(lines):
        if command == "make images push":
            assert ran.status[n] != 0 and "no container engine" in ran.output, ran.output[-3000:]
        else:
            assert ran.status[n] == 0, (command, ran.output[-1500:])
    registry = re.search(r"REGISTRY=(\S+)", lines[0])[1]  # type: ignore[index]
    images = (repo / "components/images.env").read_text()
    assert f"TRACE_IMAGE={registry}/trace:" in images
    assert f"TRACE_GPU_IMAGE={registry}/trace-gpu:" in images
    assert f"{registry}/trace-gpu" in (repo / "pipelines/compiled/trace_training.yaml").read_text()
    started = [r.body for r in kfp.requests if (r.method, r.path) == ("POST", f"{API}/runs")]
    (run,) = started
    sent = run["runtime_config"]["parameters"]  # type: ignore[index]
    defaults = PipelineOptions()
    uploaded = kfp.last("POST", f"{API}/pipelines/upload")
    assert uploaded is not None
    assert sent["run_name"] == "calc-1" and sent["budget"] == 64
    assert defaults.ray_jobs_url and "ray_jobs_url" not in sent  # the package's default
    assert kfp.last("POST", f"{API}/recurringruns") is not None
