"""The pipeline's steps without KFP: chained by hand they give exactly the run ``train`` gives,
their config JSON round-trips and names what is wrong, resume goes through the registry, and
the report writes the HTML tree view and the Markdown summary."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import trace_train_parity as parity  # registered by tests/conftest.py
from safetensors.torch import load_file

from trace_core.policy.update_config import UpdateConfig
from trace_core.store.artifacts import open_store
from trace_core.store.registry import CheckpointRegistry
from trace_core.store.schema import read_trees
from trace_core.train.config import PRETRAINED, TrainConfig
from trace_core.train.contract import PipelineConfig, PipelineParameters
from trace_core.train.loop import train
from trace_core.train.record import read_log
from trace_core.train.steps.cycle import fit_predictor_step, rollout_step, update_step
from trace_core.train.steps.finish import evaluate_step, report_step
from trace_core.train.steps.start import load_step, prep_step, warmstart_step

SETTINGS = {
    "group": 2,
    "prompts": 12,
    "max_tokens": 6,
    "eval_tasks": 4,
    "eval_k": 1,
    "eval_every": 1,
    "update": {"lr": 1e-2, "minibatch": 4, "skip_flat_paths": False},
}


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def params(init: Path, **kwargs: object) -> PipelineParameters:
    base = {
        "task": "calc",
        "base_model_uri": str(init),
        "strategy": "trace",
        "budget": 6,
        "continuations": 2,
        "iterations": 2,
        "settings_json": json.dumps(SETTINGS),
    }
    return PipelineParameters(**{**base, **kwargs})  # type: ignore[arg-type]


def chain(config: PipelineConfig, root: Path, start: int = 0) -> Path:
    """Run the steps of ``config.train.iterations`` iterations as the pipeline wires them;
    returns the last policy folder."""
    suite = parity.ParitySuite()
    policy, predictor = root / f"policy-{start}", root / f"predictor-{start}"
    optimizer = root / f"optimizer-{start}"
    load_step(config, policy, predictor, optimizer)
    reference = policy
    for i in range(start + 1, start + config.train.iterations + 1):
        trees = root / f"trees-{i}"
        rollout_step(config, i, root / "prompts", policy, predictor, trees, suite=suite)
        fit_predictor_step(config, i, trees, policy, predictor, root / f"predictor-{i}")
        update_step(
            config, i, trees, policy, reference, optimizer, root / f"policy-{i}",
            root / f"optimizer-{i}",
        )  # fmt: skip
        assert not (root / f"policy-{i}" / "optimizer.safetensors").exists()  # its own artifact
        assert (root / f"optimizer-{i}" / "optimizer.safetensors").is_file()
        policy, predictor = root / f"policy-{i}", root / f"predictor-{i}"
        optimizer = root / f"optimizer-{i}"
    return policy


def test_steps_chained_give_the_loops_run(init: Path, tmp_path: Path) -> None:
    loop_config = TrainConfig.from_json(
        {**SETTINGS, "init": str(init), "output": str(tmp_path / "loop"), "budget": 6,
         "iterations": 2}
    )  # fmt: skip
    records = train(loop_config, suite=parity.ParitySuite())  # type: ignore[arg-type]
    prep = prep_step(params(init), tmp_path / "prompts", suite=parity.ParitySuite())  # type: ignore[arg-type]
    assert (prep.start, prep.start_iteration) == ("load", 0)
    config = PipelineConfig.from_json(prep.config_json)
    last = chain(config, tmp_path)
    for i in (1, 2):
        mine = read_trees(tmp_path / f"trees-{i}" / "trees.parquet")
        theirs = read_trees(tmp_path / "loop" / "iterations" / f"{i:04d}" / "trees.parquet")
        assert [t.generated_tokens for t in mine] == [t.generated_tokens for t in theirs]
    a = load_file(str(last / "model.safetensors"))
    b = load_file(str(tmp_path / "loop" / "iterations" / "0002" / "policy" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    # The log travels with the policy and says what the loop's log says.
    log = read_log(last)
    assert [r.iteration for r in log] == [1, 2]
    assert [r.tokens for r in log] == [r.tokens for r in records[1:]]


def test_config_json_round_trips_and_names_bad_fields(init: Path) -> None:
    config = params(init, run_name="nightly", store_uri="s3://bucket/trace").config()
    assert PipelineConfig.from_json(config.to_json()) == config
    assert config.train.update == UpdateConfig(lr=1e-2, minibatch=4, skip_flat_paths=False)
    with pytest.raises(ValueError, match="settings_json sets strategy"):
        params(init, settings_json='{"strategy": "grpo"}').config()
    with pytest.raises(ValueError, match="'budget': expected int"):
        PipelineConfig.from_json(
            json.dumps({"train": {"budget": "12"}, "run_name": "", "store": ""})
        )
    with pytest.raises(ValueError, match="unknown train config field"):
        params(init, settings_json='{"budjet": 3}').config()
    with pytest.raises(ValueError, match="store_uri"):
        params(init, run_name="nightly").config()
    with pytest.raises(ValueError, match="ray_address"):
        params(init, ray_address="ray://head:10001", store_uri="s3://b/p").config()
    with pytest.raises(ValueError, match="s3:// prefix"):
        params(init, ray_address="http://head:8265", store_uri="runs/store").config()
    with pytest.raises(ValueError, match="base_model_uri"):  # no warm start for bfcl
        PipelineParameters(task="bfcl").config()


def test_prep_names_the_kept_engines_of_a_run_on_a_ray_cluster(init: Path, tmp_path: Path) -> None:
    """keep_alive_s on a Ray cluster: prep gives the run's engine actors a name of their own,
    new for every pipeline run; without a cluster (every step its own process) there is none."""
    keep = json.dumps({**SETTINGS, "engine": {"keep_alive_s": 900}})
    cluster = {"ray_address": "http://head:8265", "store_uri": "s3://b/p", "rollout_workers": 2}
    names = []
    for i in range(2):
        prep = prep_step(params(init, settings_json=keep, **cluster), tmp_path / f"p{i}")
        config = PipelineConfig.from_json(prep.config_json)
        assert config.train.engine.keep_alive_s == 900
        names.append(config.engine_name)
    assert names[0].startswith("pipeline-") and names[0] != names[1]
    alone = prep_step(params(init, rollout_workers=2, settings_json=keep), tmp_path / "alone")
    assert PipelineConfig.from_json(alone.config_json).engine_name == ""
    with pytest.raises(ValueError, match="engine_name 'a b'"):
        PipelineConfig.from_json(json.dumps({"train": {}, "engine_name": "a b"}))


def test_resume_from_the_registry_and_report(init: Path, tmp_path: Path) -> None:
    """A named run registers its final policy; the next run of that name starts after it."""
    store = tmp_path / "store"
    first = params(init, iterations=1, run_name="nightly", store_uri=str(store))
    prep = prep_step(first, tmp_path / "a" / "prompts", suite=parity.ParitySuite())  # type: ignore[arg-type]
    config = PipelineConfig.from_json(prep.config_json)
    last = chain(config, tmp_path / "a")
    final = evaluate_step(
        config, tmp_path / "a" / "prompts", last, tmp_path / "a" / "predictor-1",
        suite=parity.ParitySuite(),  # type: ignore[arg-type]
        optimizer_dir=tmp_path / "a" / "optimizer-1",
    )  # fmt: skip
    assert final["iteration"] == 1 and str(final["checkpoint"]).startswith(str(store))
    checkpoint = CheckpointRegistry(open_store(store)).latest("nightly")
    assert checkpoint is not None and checkpoint.iteration == 1

    other = shutil.copytree(init, tmp_path / "other-base")
    with pytest.raises(ValueError, match=f"start from base model {init}, but this run has"):
        prep_step(replace(first, base_model_uri=str(other)), tmp_path / "c" / "prompts")
    again = prep_step(first, tmp_path / "b" / "prompts", suite=parity.ParitySuite())  # type: ignore[arg-type]
    assert (again.start, again.start_iteration) == ("load", 1)
    resumed = chain(PipelineConfig.from_json(again.config_json), tmp_path / "b", start=1)
    assert [r.iteration for r in read_log(resumed)] == [1, 2]  # the log went on
    assert {t.info.iteration for t in read_trees(tmp_path / "b/trees-2/trees.parquet")} == {2}

    report_step(
        config,
        tmp_path / "b" / "trees-2",
        resumed,
        {"pass1": {"all": 0.25}, "mean_k": {"all": 0.5}, "tasks": 4, "k": 1},
        final,
        tmp_path / "report.html",
        tmp_path / "report.md",
    )
    html = (tmp_path / "report.html").read_text()
    assert html.count('<section class="tree"') >= 1 and "iteration 2" in html
    markdown = (tmp_path / "report.md").read_text()
    # The start report predates the parse rate ("-"); the final one has it.
    assert "| start | 0.250 | 0.500 | - | 4 |" in markdown
    assert f"| final | {final['pass1']['all']:.3f} |" in markdown
    assert f" | {final['parse_rate']:.3f} | {final['tasks']} |" in markdown
    assert "## Trees (first 12 rows of `trees.parquet`)" in markdown
    assert markdown.count("\n| 1 |") + markdown.count("\n| 2 |") >= 2  # two iteration lines


def test_a_base_model_warm_starts_in_the_warmstart_step(init: Path, tmp_path: Path) -> None:
    """``warmstart_init``: prep sends a base model to the warmstart step, which fine-tunes it
    (not a fresh tiny policy) and reports its parse rate and success before and after."""
    settings = json.dumps({**SETTINGS, "warmstart_init": True, "warmstart_steps": 2})
    prep = prep_step(params(init, settings_json=settings), tmp_path / "prompts")
    assert prep.start == "warmstart"
    config = PipelineConfig.from_json(prep.config_json)
    metrics = warmstart_step(config, tmp_path / "policy", tmp_path / "pred", tmp_path / "opt")
    assert metrics["warmstart_steps"] == 2
    for name in ("parse_rate_before", "parse_rate", "success_all_before", "success_all"):
        assert 0.0 <= metrics[f"warmstart_{name}"] <= 1.0
    tuned = load_file(str(tmp_path / "policy" / "model.safetensors"))
    start = load_file(str(init / "model.safetensors"))
    assert tuned.keys() == start.keys()  # the base model's weights, fine-tuned
    assert any(not torch.equal(tuned[k], start[k]) for k in tuned)


def test_a_pretrained_base_model_gets_the_pretrained_defaults(tmp_path: Path) -> None:
    """As ``trace-rl train --init`` does: lr, turn length and pass size of ``PRETRAINED``,
    except where ``settings_json`` sets them."""
    from trace_test_models import smollm2_dir

    base = str(smollm2_dir())
    settings = json.dumps({"eval_tasks": 4, "update": {"lr": 3e-6}})
    prep = prep_step(params(Path(base), settings_json=settings), tmp_path / "prompts")
    train_config = PipelineConfig.from_json(prep.config_json).train
    assert (train_config.update.lr, train_config.update.micro_tokens) == (3e-6, 4096)
    assert train_config.max_tokens == PRETRAINED["max_tokens"]
    assert prep.start == "load"


@pytest.mark.slow
def test_update_step_on_ray_train_matches_the_in_process_one(init: Path, tmp_path: Path) -> None:
    """``train_workers=1``: the update step runs ``update_on_ray`` (Ray in this process) and
    writes what the in-process update step writes: policy, optimizer state, log line."""
    prep = prep_step(params(init, iterations=1), tmp_path / "prompts", suite=parity.ParitySuite())  # type: ignore[arg-type]
    config = PipelineConfig.from_json(prep.config_json)
    load_step(config, tmp_path / "policy-0", tmp_path / "predictor-0", tmp_path / "optimizer-0")
    trees = tmp_path / "trees-1"
    rollout_step(
        config, 1, tmp_path / "prompts", tmp_path / "policy-0", tmp_path / "predictor-0", trees,
        suite=parity.ParitySuite(),  # type: ignore[arg-type]
    )  # fmt: skip
    policy = tmp_path / "policy-0"
    opt = tmp_path / "optimizer-0"
    here = update_step(config, 1, trees, policy, policy, opt, tmp_path / "here", tmp_path / "o1")
    on_ray = replace(config, train=replace(config.train, train_workers=1))
    there = update_step(on_ray, 1, trees, policy, policy, opt, tmp_path / "ray", tmp_path / "o2")
    assert here["paths"] == there["paths"] and here["tokens"] == there["tokens"]
    a = load_file(str(tmp_path / "here" / "model.safetensors"))
    b = load_file(str(tmp_path / "ray" / "model.safetensors"))
    assert all(torch.allclose(a[k], b[k], atol=2e-5) for k in a)
    assert (tmp_path / "o2" / "optimizer.safetensors").is_file()
    assert not (tmp_path / "ray" / "optimizer.safetensors").exists()
    assert [r.iteration for r in read_log(tmp_path / "ray")] == [1]


def test_cli_prep_writes_what_argo_reads(tmp_path: Path) -> None:
    """``trace-rl step prep --param ...``: the config, where to start, and the prompts."""
    from trace_core.train.dispatch import execute_cli_step

    outputs = {"prompts": str(tmp_path / "prompts"), "result": str(tmp_path / "result")}
    params = {"task": "calc", "iterations": "3", "budget": "16", "settings_json": "{}"}
    execute_cli_step("prep", 0, {}, outputs, params=params)
    result = tmp_path / "result"
    config = PipelineConfig.from_json((result / "config.json").read_text())
    assert (config.train.iterations, config.train.budget) == (3, 16)
    assert (result / "start").read_text() == "warmstart"
    assert (result / "start_iteration").read_text() == "0"
    assert any((tmp_path / "prompts").glob("*.parquet"))
    with pytest.raises(ValueError, match="--param gpus: the pipeline has no such parameter"):
        execute_cli_step("prep", 0, {}, outputs, params={"gpus": "1"})
    with pytest.raises(ValueError, match=r"--param budget='many': expected an integer"):
        execute_cli_step("prep", 0, {}, outputs, params={"budget": "many"})
    with pytest.raises(ValueError, match=r"missing folder\(s\) \['result'\]"):
        execute_cli_step("prep", 0, {}, {"prompts": outputs["prompts"]}, params=params)
