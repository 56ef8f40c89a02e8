"""``trace-rl step`` run end to end as the Argo containers run it: one process per step, the
real command line (``BIN/trace-rl step STEP --config-json C --iteration I --input NAME=URI ...
--output NAME=URI ...``; prep takes ``--param NAME=VALUE``), chained as the workflow chains them
(pipelines/argo.py), with every step's files checked, not only its exit code::

    prep ─► warmstart ─► open-session ─► iterate 1 (its checkpoint registered) ─► close-session
         ─► report ─► prep again (now: load after iteration 1) ─► load (the registered checkpoint)

with every folder (and the checkpoint store) an s3:// prefix on the session's SeaweedFS server
(tests/conftest.py); the local pipeline's test runs the same steps on local folders. Without
a Ray cluster every session step starts Ray in its own process. A tiny run: M=4 roots, N=2
continuations, 1 iteration, 20 SFT steps.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trace_core.envs.prompts import read_prompts
from trace_core.envs.suites import make_suite
from trace_core.store.artifacts import file_sha256, open_store
from trace_core.store.reference import REFERENCE, Reference, read_reference
from trace_core.store.registry import CheckpointRegistry
from trace_core.store.schema import read_trees
from trace_core.store.sync import download_folder
from trace_core.train.contract import StepCall
from trace_core.train.dispatch import start_point
from trace_core.train.steps.session import StartPoint

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
RUN = "cli-chain"
BUDGET, CONTINUATIONS, EVAL_TASKS = 4, 2, 8
SETTINGS = {
    "warmstart_steps": 20,
    "prompts": 16,
    "eval_tasks": EVAL_TASKS,
    "eval_k": 1,
    "max_tokens": 16,
    # A 20-step warm start earns (almost) no reward, so every advantage is 0: keep the flat
    # paths and decay the weights, so that the update takes optimizer steps that change them.
    "update": {"lr": 1e-2, "minibatch": 4, "skip_flat_paths": False, "weight_decay": 0.1},
}
STEP_TIMEOUT = 600
# One torch thread per step (unless the caller sets it): on a small shared machine, and with
# two steps side by side, torch's default of a thread per core makes each step several times
# slower. What the steps compute does not depend on it.
STEP_ENV = {"OMP_NUM_THREADS": "1"}


# --- running steps as the containers do ------------------------------------------------------
@dataclass(frozen=True)
class Step:
    """One ``trace-rl step`` command line, built as pipelines/argo.py builds a container's."""

    step: str
    config: str = ""
    iteration: int = 0
    inputs: Mapping[str, str] = field(default_factory=dict)
    outputs: Mapping[str, str] = field(default_factory=dict)
    params: Mapping[str, str] = field(default_factory=dict)

    def argv(self) -> list[str]:
        args = [str(BIN / "trace-rl"), "step", self.step]
        if self.step != "prep":
            args += ["--config-json", self.config]
        args += ["--iteration", str(self.iteration)]
        for name, value in self.params.items():
            args += ["--param", f"{name}={value}"]
        for flag, folders in (("--input", self.inputs), ("--output", self.outputs)):
            for name, uri in folders.items():
                args += [flag, f"{name}={uri}"]
        return args


@dataclass(frozen=True)
class Done:
    returncode: int
    output: str
    """stdout and stderr together."""


def run_steps(cwd: Path, logs: Path, *steps: Step) -> list[Done]:
    """Run ``steps`` side by side (as the workflow's DAG does), each in its own process; wait
    for all. Output goes to ``logs/STEP-ITERATION-N.log`` (and into ``Done``)."""
    logs.mkdir(parents=True, exist_ok=True)
    env = {**STEP_ENV, **os.environ}
    running = []
    for s in steps:
        log = logs / f"{s.step}-{s.iteration}-{len(list(logs.iterdir()))}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                s.argv(), cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=env
            )
        running.append((process, log))
    done = []
    for process, log in running:
        try:
            process.wait(timeout=STEP_TIMEOUT)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        done.append(Done(process.returncode, log.read_text(errors="replace")))
    return done


def ok(cwd: Path, logs: Path, *steps: Step) -> None:
    """``run_steps``, and each must have exited 0 with its ``STEP I: wrote ...`` line."""
    for s, result in zip(steps, run_steps(cwd, logs, *steps), strict=True):
        assert result.returncode == 0, f"{' '.join(s.argv())}\n{result.output[-6000:]}"
        assert f"{s.step} {s.iteration}: wrote" in result.output, result.output[-3000:]


# --- folders: local paths or s3:// prefixes --------------------------------------------------
@dataclass(frozen=True)
class Folders:
    """The run's folders below ``root`` (a local path or s3://bucket/prefix), laid out as the
    workflow's staging area; ``local`` copies a folder here to look at its files."""

    root: str
    scratch: Path

    def __getitem__(self, name: str) -> str:
        return f"{self.root}/{name}"

    def named(self, *same: str, **renamed: str) -> dict[str, str]:
        """Step folder names → URIs: ``named("prompts", policy="start/policy")``."""
        return {**{n: self[n] for n in same}, **{n: self[p] for n, p in renamed.items()}}

    @property
    def remote(self) -> bool:
        return self.root.startswith("s3://")

    def keys(self, name: str) -> set[str]:
        """What the folder holds, as the store lists it (relative keys)."""
        return {o.key for o in open_store(self[name]).list_objects("")}

    def local(self, name: str) -> Path:
        if not self.remote:
            return Path(self[name])
        target = Path(tempfile.mkdtemp(prefix=name.replace("/", "-") + "-", dir=self.scratch))
        download_folder(self[name], target)
        return target


def sha(folder: Path, name: str) -> str:
    return file_sha256(folder / name)


def read_json(path: Path) -> dict[str, object]:
    body = json.loads(path.read_text())
    assert isinstance(body, dict), path
    return body


def log_lines(policy: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (policy / "log.jsonl").read_text().splitlines() if line]


def check_eval(result: Path, iteration: int) -> dict[str, object]:
    report = read_json(result / "eval.json")
    assert (report["tasks"], report["k"], report["iteration"]) == (EVAL_TASKS, 1, iteration)
    for name in ("pass1", "mean_k"):
        scores = report[name]
        assert isinstance(scores, dict) and "all" in scores, report
        assert all(0.0 <= float(v) <= 1.0 for v in scores.values()), report
    assert isinstance(report["tokens"], int) and report["tokens"] > 0
    return report


# --- the chain -------------------------------------------------------------------------------
def chain(f: Folders, store: str, cwd: Path, base: Path, model_uri: str) -> None:
    """The whole workflow on ``f``'s folders, from the HF folder ``base`` uploaded to
    ``model_uri``, checking what each step promised."""
    logs = f.scratch / "logs"
    params = {
        "task": "calc",
        "strategy": "trace",
        "budget": str(BUDGET),
        "continuations": str(CONTINUATIONS),
        "iterations": "1",
        "seed": "0",
        "run_name": RUN,
        "store_uri": store,
        "settings_json": json.dumps(SETTINGS),
    }

    # model upload: the base model where base_model_uri reads it; prep takes the parameter
    # line it prints as printed (``--param NAME=VALUE`` is ``Step.argv``'s form).
    upload = [str(BIN / "trace-rl"), "model", "upload", str(base), model_uri]
    env = {**STEP_ENV, **os.environ, "COLUMNS": "200"}
    done = subprocess.run(upload, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    (printed,) = [line for line in done.stdout.splitlines() if line.startswith("  --param ")]
    flag, param = shlex.split(printed)
    name, value = param.split("=", 1)
    assert (flag, name, value) == ("--param", "base_model_uri", model_uri)
    params[name] = value

    # prep: the config every later step gets, where the policy starts, and the prompts.
    ok(cwd, logs, Step("prep", params=params, outputs=f.named("prompts", result="prep")))
    assert f.keys("prep") == {"config.json", "start", "start_iteration"}
    assert f.keys("prompts") == {"train.parquet", "eval.parquet"}
    prep = f.local("prep")
    config_json = (prep / "config.json").read_text()
    config = json.loads(config_json)
    assert (config["run_name"], config["store"], config["ray_jobs_url"]) == (RUN, store, "")
    train = config["train"]
    assert (train["task"], train["budget"], train["continuations"]) == ("calc", BUDGET, 2)
    assert (train["iterations"], train["eval_tasks"], train["warmstart_steps"]) == (1, 8, 20)
    assert (train["update"]["weight_decay"], train["init"]) == (0.1, model_uri)
    assert (prep / "start").read_text() == "load"
    assert (prep / "start_iteration").read_text() == "0"
    prompts = f.local("prompts")
    suite = make_suite("calc", None, 0)
    task, train_tasks = read_prompts(str(prompts / "train.parquet"))
    eval_task, eval_tasks = read_prompts(str(prompts / "eval.parquet"))
    assert (task, eval_task) == ("calc", "calc")
    assert [t.id for t in train_tasks] == [t.id for t in suite.tasks("train")]
    assert [t.id for t in eval_tasks] == [t.id for t in suite.tasks("eval")[:EVAL_TASKS]]

    def step(
        name: str,
        iteration: int = 0,
        inputs: Mapping[str, str] | None = None,
        outputs: Mapping[str, str] | None = None,
    ) -> Step:
        return Step(name, config_json, iteration, inputs or {}, outputs or {})

    # load: a reference to the base model instead of its weights, the fresh predictor, an
    # empty optimizer state.
    start = {"policy": f["start/policy"], "predictor": f["start/predictor"]}
    ok(cwd, logs, step("load", outputs={**start, "optimizer": f["start/optimizer"]}))
    assert f.keys("start/policy") == {REFERENCE, "metrics.json"}
    assert read_reference(start["policy"]) == Reference(model_uri, 0)
    assert f.keys("start/optimizer") == {"optimizer.json"}
    assert {"predictor.json", "predictor.safetensors"} <= f.keys("start/predictor")
    predictor0 = f.local("start/predictor")
    weights0 = load_file(str(base / "model.safetensors"))
    predictor0_sha = sha(predictor0, "predictor.safetensors")

    # open-session: without a Ray cluster, Ray in the step's own process; its trainer and
    # engine read the base model at model_uri. The state it passes on holds the log with
    # iteration 0 (the start's evaluation), the predictor, no weights.
    opened = f.named(state="state-0")
    begin = {**f.named("prompts"), **start, "optimizer": f["start/optimizer"]}
    ok(cwd, logs, step("open-session", inputs=begin, outputs=opened))
    assert {"state.json", "log.jsonl", "eval.json", "metrics.json"} <= f.keys("state-0")
    assert not any(k.endswith("model.safetensors") for k in f.keys("state-0"))
    state0 = f.local("state-0")
    start_eval = check_eval(state0, iteration=0)
    assert "checkpoint" not in start_eval  # the start's evaluation registers nothing
    assert [r["iteration"] for r in log_lines(state0)] == [0]

    # iterate 1: rollout, fit, update, checkpoint (the last iteration, and every iteration
    # without a cluster: the trainers go with the step's process).
    trees = f["iter-1/trees"]
    ok(cwd, logs, step("iterate", 1, inputs=f.named("prompts", state="state-0"),
                       outputs={"trees": trees, "state": f["state-1"]}))  # fmt: skip
    assert {"trees.parquet", "draws.json", "metrics.json"} <= f.keys("iter-1/trees")
    trees1 = f.local("iter-1/trees")
    grown = read_trees(trees1 / "trees.parquet")
    assert grown and {t.info.iteration for t in grown} == {1}
    assert {t.info.run_id for t in grown} == {RUN}
    assert {t.info.prompt_id for t in grown} <= {t.id for t in train_tasks}
    assert sum(t.units for t in grown) == BUDGET * (1 + CONTINUATIONS / 2)
    rolled = read_json(trees1 / "metrics.json")
    assert rolled["units"] == BUDGET * (1 + CONTINUATIONS / 2)
    assert rolled["tokens"] == sum(t.generated_tokens for t in grown)
    assert rolled["update_paths"] > 0 and rolled["update_steps"] >= 1
    assert read_json(trees1 / "draws.json")["iteration"] == 1
    state1 = f.local("state-1")
    assert (
        sha(state1 / "predictor", "predictor.safetensors") != predictor0_sha
    )  # the fit changed it
    record = log_lines(state1)[-1]
    assert (record["iteration"], record["strategy"]) == (1, "trace")
    assert record["tokens"] == rolled["tokens"]
    registry = CheckpointRegistry(open_store(store))
    checkpoint = registry.latest(RUN)
    assert checkpoint is not None and checkpoint.iteration == 1
    resumed = tempfile.mkdtemp(prefix="registered-", dir=f.scratch)
    registered = registry.download(checkpoint, Path(resumed) / "c")
    weights1 = load_file(str(registered / "policy" / "model.safetensors"))
    assert weights1.keys() == weights0.keys()
    assert any(not torch.equal(weights0[k], weights1[k]) for k in weights0), (
        "update changed nothing"
    )
    assert {"optimizer.safetensors", "predictor/predictor.safetensors"} <= {
        c.path for c in checkpoint.files
    }

    # close-session: the last iteration's evaluation, with the checkpoint that holds it.
    ok(cwd, logs, step("close-session", inputs=f.named(state="state-1"),
                       outputs=f.named(result="eval-final")))  # fmt: skip
    final_eval = check_eval(f.local("eval-final"), iteration=1)
    assert final_eval["checkpoint"] == registry.store.uri(checkpoint.key)

    # report: the HTML tree view and the Markdown summary of the run.
    inputs = f.named(
        trees="iter-1/trees",
        state="state-1",
        start_eval="state-0",
        final_eval="eval-final",
    )
    ok(cwd, logs, step("report", inputs=inputs, outputs=f.named("report")))
    assert f.keys("report") == {"report.html", "summary.md"}
    report = f.local("report")
    html = (report / "report.html").read_text()
    assert html.count('<section class="tree"') >= 1 and f"{RUN}: iteration 1" in html
    summary = (report / "summary.md").read_text()
    assert summary.startswith(f"# TRACE run {RUN}\n")
    assert f"| start | {start_eval['pass1']['all']:.3f} |" in summary  # type: ignore[index]
    assert f"| final | {final_eval['pass1']['all']:.3f} |" in summary  # type: ignore[index]
    assert "\n| 1 |" in summary  # the iteration's line

    # The next workflow of this run name: prep says load after iteration 1, load resumes.
    again = f.named(prompts="run-2/prompts", result="run-2/prep")
    ok(cwd, logs, Step("prep", params=params, outputs=again))
    prep2 = f.local("run-2/prep")
    assert (prep2 / "start").read_text() == "load"
    assert (prep2 / "start_iteration").read_text() == "1"
    resume = {
        "policy": f["run-2/start/policy"],
        "predictor": f["run-2/start/predictor"],
        "optimizer": f["run-2/start/optimizer"],
    }
    ok(cwd, logs, step("load", outputs=resume))
    # References to the registered checkpoint's policy and optimizer state (its predictor, a
    # few MB, copied), which open session resolves to where they lie, at iteration 1.
    folder = registry.store.uri(checkpoint.key)
    assert f.keys("run-2/start/policy") == {REFERENCE, "metrics.json"}
    assert f.keys("run-2/start/optimizer") == {REFERENCE, "optimizer.json"}
    assert read_reference(resume["policy"]) == Reference(f"{folder}/policy", 1)
    assert read_reference(resume["optimizer"]) == Reference(folder, 1)
    loaded_predictor = f.local("run-2/start/predictor")
    assert sha(loaded_predictor, "predictor.safetensors") == sha(
        state1 / "predictor", "predictor.safetensors"
    )
    assert read_json(f.local("run-2/start/policy") / "metrics.json")["resumed_iteration"] == 1.0
    inputs = {"prompts": f["run-2/prompts"], **resume}
    call = StepCall("open-session", 1, inputs, {"state": f["run-2/state-0"]})
    assert start_point(call) == StartPoint(f"{folder}/policy", resume["predictor"], folder, 1)
    assert [r["iteration"] for r in log_lines(registered / "policy")] == [0, 1]  # travels along


@pytest.mark.cluster
@pytest.mark.long  # every session step starts Ray in its own process
def test_steps_chained_on_s3_folders(
    init: Path, s3_env: dict[str, str], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Every folder, the checkpoint store and the base model an s3:// prefix: nothing goes
    through local disk but each step's own scratch space."""
    root = f"s3://trace/step-cli-{os.getpid()}-{request.node.name}"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    folders = Folders(f"{root}/staging", tmp_path / "fetched")
    folders.scratch.mkdir()
    chain(folders, f"{root}/store", cwd, init, f"{root}/models/base")
    assert not any(cwd.iterdir()), "a step wrote into its working directory"
    keys = {o.key for o in open_store(root).list_objects("")}
    assert {
        "staging/prompts/train.parquet",
        "staging/iter-1/trees/trees.parquet",
        "staging/state-1/state.json",
        "staging/report/summary.md",
        "models/base/model.safetensors",
        f"store/checkpoints/{RUN}/latest.json",
    } <= keys


# --- what the workflow passes, and bad input -------------------------------------------------
def test_prep_takes_every_workflow_parameter_at_its_default(tmp_path: Path) -> None:
    """The Argo prep container passes ``--param NAME={{workflow.parameters.NAME}}`` for every
    workflow parameter (pipelines/argo.py ``PARAMETERS``): several default to the empty string
    (dataset_uri, base_model_uri, ray_address, run_name), which prep must take as unset."""
    from pipelines.argo import PARAMETERS

    params = {**PARAMETERS, "budget": str(BUDGET), "settings_json": json.dumps(SETTINGS)}
    params["iterations"] = "1"
    assert [k for k, v in params.items() if v == ""], "no empty default left to check"
    outputs = {"prompts": str(tmp_path / "prompts"), "result": str(tmp_path / "prep")}
    prep = Step("prep", params=params, outputs=outputs)
    (result,) = run_steps(tmp_path, tmp_path / "logs", prep)
    assert result.returncode == 0, result.output
    assert (tmp_path / "prep" / "start").read_text() == "warmstart"
    config = json.loads((tmp_path / "prep" / "config.json").read_text())
    assert (config["run_name"], config["ray_jobs_url"], config["train"]["init"]) == ("", "", None)

    # The warm start that start names: the tiny policy (weights: a few MB), its fresh
    # predictor and an empty optimizer state, as the Argo workflow's warmstart container runs it.
    config["train"]["warmstart_steps"] = 5
    start = {name: str(tmp_path / "start" / name) for name in ("policy", "predictor", "optimizer")}
    ok(tmp_path, tmp_path / "logs", Step("warmstart", json.dumps(config), outputs=start))
    assert {"config.json", "model.safetensors"} <= {p.name for p in Path(start["policy"]).iterdir()}
    assert json.loads(Path(start["optimizer"], "optimizer.json").read_text())["iteration"] == 0


def one_error_line(result: Done) -> str:
    """The failure as the CLI reports a bad input: exit 2 and nothing but one ``error:`` line
    (which the console wraps at 160 columns: returned joined)."""
    assert result.returncode == 2, result.output[-4000:]
    assert "Traceback" not in result.output, result.output[-4000:]
    lines = [line.strip() for line in result.output.splitlines() if line.strip()]
    assert lines and lines[0].startswith("error: "), result.output[-4000:]
    assert sum("error:" in line for line in lines) == 1, result.output[-4000:]
    return " ".join(lines)


CONFIG = '{"train": {}}'  # every TrainConfig default: the bad input is what fails


@pytest.mark.parametrize(
    "case",
    [
        "unknown-step",
        "missing-input-folder",
        pytest.param("missing-s3-input", marks=pytest.mark.cluster),
    ],
)
def test_bad_input_is_one_error_line(
    case: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if case == "unknown-step":
        bad = Step("grow", CONFIG, 1, {"prompts": str(tmp_path)}, {"trees": str(tmp_path / "t")})
        line = one_error_line(run_steps(tmp_path, tmp_path / "logs", bad)[0])
        assert "'grow'" in line and "iterate" in line  # names it and the steps there are
        return
    if case == "missing-input-folder":
        missing = str(tmp_path / "no-such")
    else:
        request.getfixturevalue("s3_env")
        missing = f"s3://trace/step-cli-{os.getpid()}-nothing-here"
    inputs = {name: f"{missing}/{name}" for name in ("prompts", "state")}
    predictor = tmp_path / "state-out"
    outputs = {"trees": str(tmp_path / "trees-out"), "state": str(predictor)}
    bad = Step("iterate", CONFIG, 1, inputs, outputs)
    line = one_error_line(run_steps(tmp_path, tmp_path / "logs", bad)[0])
    assert any(uri in line for uri in inputs.values()), line  # names the folder
    missing_words = ("no such", "not found", "missing", "does not exist", "nothing")
    assert any(word in line.lower() for word in missing_words), line  # and says it is missing
    assert not predictor.exists() or not any(predictor.iterdir())  # nothing half-written
