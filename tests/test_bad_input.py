"""Bad input, command by command: each case must end in one ``error:`` line naming the file,
flag or field, exit code 2, no traceback, and leave every file as it was (checksums before and
after) and no new one behind.

The commands run in this process through the real command group (``trace_core.cli.app``),
which is what turns a refusal into the error line; two cases also run the installed
``trace-rl`` script. Everything is built small in one module fixture: a random tiny calc
policy, damaged copies of it, prompt files, a run folder, a trees file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from trace_core.bench.store import sim_trees
from trace_core.cli import app
from trace_core.envs.calc import CalcSuite
from trace_core.envs.prompts import write_prompts
from trace_core.policy.model import create_policy, save_checkpoint
from trace_core.policy.tokenizer import build_word_tokenizer
from trace_core.store.schema import write_trees
from trace_core.train.config import TrainConfig
from trace_core.train.iteration import new_predictor


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the cases point at, all valid except what each name says."""
    from trace_core.policy.model import TinyPolicyConfig

    root = tmp_path_factory.mktemp("world")
    suite = CalcSuite(seed=0)
    tokenizer = build_word_tokenizer(suite.vocabulary())
    policy = root / "policy"
    save_checkpoint(
        create_policy(tokenizer, TinyPolicyConfig(hidden_size=32), 0), tokenizer, policy
    )
    shutil.copytree(policy, root / "truncated")
    weights = root / "truncated/model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    shutil.copytree(policy, root / "no-config")
    (root / "no-config/config.json").unlink()
    shutil.copytree(policy, root / "pickled")
    (root / "pickled/model.safetensors").rename(root / "pickled/pytorch_model.bin")
    (root / "not-a-folder").write_text("x")

    tasks = suite.tasks("train")[:8]
    write_prompts(root / "prompts.parquet", "calc", tasks)
    table = pq.read_table(root / "prompts.parquet")
    pq.write_table(table.slice(0, 0), root / "empty.parquet")
    ids = pa.array(range(table.num_rows), pa.int64())
    pq.write_table(table.set_column(0, "id", ids), root / "int-ids.parquet")
    pq.write_table(table.drop_columns(["answer"]), root / "no-answer.parquet")
    (root / "garbage.parquet").write_bytes(b"PAR1 not really")

    new_predictor(TrainConfig(), tokenizer).save(root / "predictor")
    (root / "predictor-damaged").mkdir()
    shutil.copy(root / "predictor/predictor.json", root / "predictor-damaged/predictor.json")
    (root / "predictor-damaged/predictor.safetensors").write_bytes(b"\x08" + b"\0" * 7 + b"{}")

    (root / "trees").mkdir()
    (root / "mixed").mkdir()
    write_trees(root / "trees/part.parquet", sim_trees(4))
    write_trees(root / "mixed/part.parquet", sim_trees(2))
    pq.write_table(pa.table({"x": [1]}), root / "mixed/foreign.parquet")

    run = root / "run"  # iterations, but the pointer is gone
    (run / "iterations/0001/policy").mkdir(parents=True)
    (run / "iterations/0001/metrics.json").write_text("{}")
    (run / "config.json").write_text(json.dumps(TrainConfig(output=run).to_json()))
    (root / "full").mkdir()
    (root / "full/keep.txt").write_text("mine")
    (root / "config.json").write_text("{}")
    return root


@dataclass(frozen=True)
class Case:
    args: str
    """The command line after ``trace-rl``; {w} is the world folder."""
    message: str
    """A regular expression the error line must match ({w} filled in, escaped)."""


ROLLOUT = "rollout --checkpoint {w}/policy --budget 4 --prompts 4 --output {w}/new/t.parquet"
STEP = "step {step} --config-json {w}/config.json"

CASES = {
    # --- checkpoints -----------------------------------------------------------------------
    "checkpoint missing": Case(
        "rollout --checkpoint {w}/nope", r"checkpoint {w}/nope does not exist; pass a folder"
    ),
    "checkpoint is a file": Case(
        "rollout --checkpoint {w}/not-a-folder", r"{w}/not-a-folder is not a folder"
    ),
    "checkpoint truncated": Case(
        "rollout --checkpoint {w}/truncated",
        r"{w}/truncated/model.safetensors: truncated \(\d+ bytes of tensor data",
    ),
    "checkpoint without config": Case(
        "rollout --checkpoint {w}/no-config", r"{w}/no-config is not a model checkpoint"
    ),
    "checkpoint with pickled weights only": Case(
        "rollout --checkpoint {w}/pickled",
        r"{w}/pickled has no model.safetensors .*only pickled weights.*pytorch_model.bin",
    ),
    "predictor fit on a missing checkpoint": Case(
        "predictor fit --trees {w}/t --output {w}/new --checkpoint {w}/nope",
        r"checkpoint {w}/nope does not exist",
    ),
    "train from a missing --init": Case(
        "train --init {w}/nope --output {w}/new", r"--init {w}/nope does not exist"
    ),
    "rollout-demo on a truncated checkpoint": Case(
        "rollout-demo --checkpoint {w}/truncated", r"{w}/truncated/model.safetensors: truncated"
    ),
    "bench contrast on a truncated checkpoint": Case(
        "bench contrast --checkpoint {w}/truncated", r"{w}/truncated/model.safetensors: truncated"
    ),
    "bench predictor without a policy": Case(
        "bench predictor --trees {w}/trees --checkpoint {w}/nope",
        r"--checkpoint {w}/nope does not exist",
    ),
    # --- flags and config fields ---------------------------------------------------------
    "negative prompts": Case(ROLLOUT + " --prompts -3", r"--prompts must be >= 1.*got -3"),
    "absurd budget": Case(
        ROLLOUT + " --budget 1000000000", r"2,000,000,000 units; at most 65,536 fit one iteration"
    ),
    "budget of one root": Case(ROLLOUT + " --budget 1", r"roots must be at least 2"),
    "bad split": Case(ROLLOUT + " --split test", r"--split must be train or eval, got 'test'"),
    "missing predictor": Case(
        ROLLOUT + " --predictor {w}/nope", r"--predictor {w}/nope: no predictor.json"
    ),
    "eval_k of zero": Case("train --eval-k 0 --output {w}/new", r"eval_k must be >= 1, got 0"),
    "zero iterations": Case("train --iterations 0 --output {w}/new", r"iterations must be >= 1"),
    "negative seed": Case("train --seed -1 --output {w}/new", r"seed must be >= 0, got -1"),
    "negative threads": Case("train --threads -2 --output {w}/new", r"--threads must be >= 0"),
    "task without warm start": Case(
        "train --task bfcl --output {w}/new", r"task 'bfcl' has no built-in warm start"
    ),
    "task check of an unknown task": Case("task check nope", r"unknown task 'nope'"),
    "bench allocation of one root": Case(
        "bench allocation --budget 1", r"roots must be at least 2 \(one group\), got 1"
    ),
    "pipeline runs without a host": Case(
        "pipeline runs", r"--host \(or KFP_HOST\) is required: the KFP API endpoint"
    ),
    "unknown task": Case(
        "prep --task nope --output {w}/new/p.parquet", r"unknown task 'nope'; choose one of"
    ),
    "unknown engine": Case(ROLLOUT + " --engine tpu", r"engine must be one of torch, hf, vllm"),
    "bad memory fraction": Case(
        ROLLOUT + " --memory-fraction 1.5",
        r"memory_fraction must be 0 \(auto\) or in \(0, 1\], got 1.5",
    ),
    "zero seeds in a comparison": Case(
        "compare --seeds 0 --output {w}/new", r"seeds and parallel must be >= 1"
    ),
    "warm start of zero steps": Case(
        "warmstart --steps 0 --output {w}/new", r"steps and batch_size must be >= 1"
    ),
    # --- prompt files --------------------------------------------------------------------
    "prompt file with no rows": Case(
        ROLLOUT + " --prompt-file {w}/empty.parquet",
        r"{w}/empty.parquet: the prompt file has no rows",
    ),
    "prompt ids of the wrong type": Case(
        ROLLOUT + " --prompt-file {w}/int-ids.parquet",
        r"{w}/int-ids.parquet: column 'id' has type int64, expected string",
    ),
    "prompt file without a column": Case(
        ROLLOUT + " --prompt-file {w}/no-answer.parquet",
        r"{w}/no-answer.parquet: missing column\(s\) answer",
    ),
    "prompt file that is not Parquet": Case(
        ROLLOUT + " --prompt-file {w}/garbage.parquet",
        r"{w}/garbage.parquet: not a Parquet prompt file",
    ),
    "prompt file missing": Case(ROLLOUT + " --prompt-file {w}/nope.parquet", r"{w}/nope.parquet"),
    # --- predictors ----------------------------------------------------------------------
    "damaged predictor": Case(
        ROLLOUT + " --predictor {w}/predictor-damaged",
        r"{w}/predictor-damaged/predictor.safetensors: (damaged|truncated)",
    ),
    # --- run folders ---------------------------------------------------------------------
    "run folder without its pointer": Case(
        "train --output {w}/run",
        r"{w}/run holds iterations 1..1 but no valid latest pointer.*--restart",
    ),
    # --- pipeline steps ------------------------------------------------------------------
    "step without its config": Case(
        "step rollout --output trees={w}/new", r"step rollout needs --config-json"
    ),
    "step with a config that is not JSON": Case(
        "step warmstart --config-json {{ --output policy={w}/new --output predictor={w}/new2 "
        "--output optimizer={w}/new3",
        r"config_json is not JSON",
    ),
    "step with an unknown parameter": Case(
        "step prep --param nope=1 --output prompts={w}/new --output result={w}/new2",
        r"--param nope: the pipeline has no such parameter",
    ),
    "step with a mistyped parameter": Case(
        "step prep --param iterations=x --output prompts={w}/new --output result={w}/new2",
        r"--param iterations='x': expected an integer",
    ),
    "step with a missing input folder": Case(
        "step iterate --iteration 1 --config-json CONFIG --input prompts={w}/nope "
        "--input state={w}/state --output trees={w}/new --output state={w}/new-state",
        r"step iterate: input prompts={w}/nope: no such folder",
    ),
    "step writing into a folder that holds files": Case(
        "step prep --output prompts={w}/full --output result={w}/new",
        r"output prompts={w}/full already holds files",
    ),
    "run-local with settings that are not an object": Case(
        "run-local --output {w}/new --settings-json [1]", r"--settings-json must be a JSON object"
    ),
    "run-local keeping no checkpoint": Case(
        "run-local --output {w}/new --keep-checkpoints 0", r"keep_checkpoints must be >= 1, got 0"
    ),
    # --- stored trees --------------------------------------------------------------------
    "inspect a missing path": Case("inspect summary {w}/nope", r"{w}/nope"),
    "inspect a file that is not Parquet": Case(
        "inspect summary {w}/garbage.parquet", r"{w}/garbage.parquet"
    ),
    "inspect a folder with a foreign file": Case(
        "inspect summary {w}/mixed", r"{w}/mixed/foreign.parquet: .*every file under {w}/mixed"
    ),
    "query that writes a file": Case(
        "inspect query {w}/trees COPY_TO_TREES", r"only one SELECT query is allowed, got COPY"
    ),
    "query that reads another file": Case(
        "inspect query {w}/trees READ_PASSWD", r"refused: it reaches past the view nodes"
    ),
    "query result over a trees file": Case(
        "inspect query {w}/trees COUNT -o {w}/trees/part.parquet",
        r"--output {w}/trees/part.parquet is a trees file of",
    ),
    "query with negative max rows": Case(
        "inspect query {w}/trees COUNT --max-rows -1",
        r"--max-rows must be >= 0 \(0: none\), got -1",
    ),
    "html over a trees file": Case(
        "inspect html {w}/trees -o {w}/trees/part.parquet", r"name an .html file"
    ),
    "tree that is not there": Case("inspect show {w}/trees 999", r"999"),
}

SQL = {
    "COPY_TO_TREES": "COPY (SELECT 1) TO '{w}/trees/part.parquet'",
    "READ_PASSWD": "SELECT * FROM read_csv('/etc/passwd')",
    "COUNT": "SELECT count(*) FROM nodes",
}


def snapshot(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        if p.is_file()
        else "dir"
        for p in sorted(root.rglob("*"))
    }


def config_json() -> str:
    from trace_core.train.contract import PipelineParameters

    return PipelineParameters(task="calc", iterations=1).config().to_json()


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_gives_one_error_line_and_changes_nothing(world: Path, name: str) -> None:
    case = CASES[name]
    args = case.args.format(w=world).split()
    args = [config_json() if a == "CONFIG" else a for a in args]
    args = [SQL[a].format(w=world) if a in SQL else a for a in args]
    args = [(world / "config.json").read_text() if a == f"{world}/config.json" else a for a in args]
    before = snapshot(world)
    result = CliRunner().invoke(app, args, env={"KFP_HOST": None, "TRACE_DEBUG": None})
    said = " ".join(result.output.split())
    assert result.exit_code == 2, said
    assert result.exception is None or isinstance(result.exception, SystemExit), said
    assert "Traceback" not in result.output, said
    lines = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, said
    pattern = re.escape(str(world)).join(case.message.split("{w}"))
    assert re.search(pattern, lines[0]), (pattern, lines[0])
    assert snapshot(world) == before  # nothing changed, nothing new


def test_debug_shows_the_traceback(world: Path) -> None:
    from trace_core.policy.checkpoint import CheckpointError

    result = CliRunner().invoke(app, ["--debug", "rollout", "--checkpoint", f"{world}/nope"])
    assert isinstance(result.exception, CheckpointError)
    result = CliRunner().invoke(
        app, ["rollout", "--checkpoint", f"{world}/nope"], env={"TRACE_DEBUG": "1"}
    )
    assert isinstance(result.exception, CheckpointError)


@pytest.mark.slow  # two fresh Pythons
def test_the_installed_script_gives_the_same_error_line(world: Path) -> None:
    script = Path(sys.executable).with_name("trace-rl")
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}
    before = snapshot(world)
    for args, message in (
        (["rollout", "--checkpoint", f"{world}/truncated"], "model.safetensors: truncated"),
        (["train", "--output", f"{world}/run"], "but no valid latest pointer"),
    ):
        run = subprocess.run([str(script), *args], capture_output=True, text=True, env=env)
        assert run.returncode == 2, run.stdout + run.stderr
        assert "Traceback" not in run.stdout + run.stderr
        assert run.stdout.startswith("error: ") and message in run.stdout, run.stdout
    assert snapshot(world) == before


S3_CASES = {
    "inspect a bucket that does not exist": Case(
        "inspect summary s3://no-such-bucket/run", r"bucket 'no-such-bucket' does not exist"
    ),
    "inspect with a wrong secret": Case(
        "inspect summary s3://trace/bad-input WRONG_SECRET", r"s3://trace/bad-input.*access denied"
    ),
    "step writing into a prefix that holds files": Case(
        "step prep --output prompts=s3://trace/bad-input --output result={w}/new",
        r"output prompts=s3://trace/bad-input already holds files",
    ),
    "step writing into a bucket that does not exist": Case(
        "step prep --output prompts=s3://no-such-bucket/p --output result={w}/new",
        r"s3://no-such-bucket/p.*bucket 'no-such-bucket' does not exist",
    ),
}


@pytest.mark.cluster  # a SeaweedFS server
@pytest.mark.parametrize("name", list(S3_CASES))
def test_bad_s3_input_gives_one_error_line_and_changes_nothing(
    world: Path, name: str, s3_env: dict[str, str]
) -> None:
    from trace_core.store.artifacts import S3Settings, S3Store

    store = S3Store("trace", "bad-input", S3Settings.from_env(s3_env))
    store.put_bytes("keep.json", b'{"mine": true}\n')
    case = S3_CASES[name]
    args = case.args.format(w=world).split()
    env = {"AWS_SECRET_ACCESS_KEY": "not-the-secret"} if "WRONG_SECRET" in args else None
    args = [a for a in args if a != "WRONG_SECRET"]
    before = snapshot(world)
    result = CliRunner().invoke(app, args, env=env)
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and "Traceback" not in result.output, said
    (line,) = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert re.search(case.message, line), (case.message, line)
    assert "not-the-secret" not in result.output
    assert snapshot(world) == before
    assert [o.key for o in store.list_objects()] == ["keep.json"]
    assert store.get_bytes("keep.json") == b'{"mine": true}\n'
    assert "no-such-bucket" not in [b.name for b in store.client.list_buckets()]
