"""The pipeline's start steps without KFP: the config JSON round-trips and names what is
wrong, prep gives every run a session of its own, the warm start of a base model, load's
references to a base model, prep on the command line. (The iterations on the run's session:
tests/train/test_session.py; load resuming a registry checkpoint: test_step_cli.py.)"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trace_core.policy.update_config import UpdateConfig
from trace_core.train.config import PRETRAINED
from trace_core.train.contract import PipelineConfig, PipelineParameters
from trace_core.train.steps.start import SESSION_KEEP_ALIVE_S, prep_step, warmstart_step

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
        "store_uri": "runs/store",
        "settings_json": json.dumps(SETTINGS),
    }
    return PipelineParameters(**{**base, **kwargs})  # type: ignore[arg-type]


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
        params(init, run_name="nightly", store_uri="").config()
    with pytest.raises(ValueError, match="ray_address 'ray://head:10001': expected a Ray head"):
        params(init, ray_address="ray://head:10001", store_uri="s3://b/p").config()
    with pytest.raises(ValueError, match="is a Ray dashboard URL: ray_address is the head's GCS"):
        params(init, ray_address="http://head:8265").config()
    assert params(init, ray_address="head:6379").config().train.ray_address == "head:6379"
    with pytest.raises(ValueError, match="ray_jobs_url needs store_uri to be an s3:// prefix"):
        params(init, ray_jobs_url="http://head:8265", store_uri="runs/store").config()
    with pytest.raises(ValueError, match="settings_json sets checkpoint_every"):
        params(init, settings_json='{"checkpoint_every": 3}').config()
    with pytest.raises(ValueError, match="base_model_uri"):  # no warm start for bfcl
        PipelineParameters(task="bfcl").config()


def test_prep_gives_every_run_a_session_of_its_own(init: Path, tmp_path: Path) -> None:
    """A session's name is new for every pipeline run; it has at least one trainer and one kept
    engine actor (what settings_json asks for when it asks for more), and a store."""
    names = []
    for i in range(2):
        prep = prep_step(params(init), tmp_path / f"p{i}")
        config = PipelineConfig.from_json(prep.config_json)
        assert config.train.train_workers == 1 and config.train.engine.workers == 1
        assert config.train.engine.keep_alive_s == SESSION_KEEP_ALIVE_S
        names.append(config.engine_name)
    assert names[0].startswith("pipeline-") and names[0] != names[1]
    more = json.dumps({**SETTINGS, "train_workers": 2, "engine": {"keep_alive_s": 900}})
    prep = prep_step(params(init, rollout_workers=2, settings_json=more), tmp_path / "more")
    train = PipelineConfig.from_json(prep.config_json).train
    assert (train.train_workers, train.engine.workers, train.engine.keep_alive_s) == (2, 2, 900)
    with pytest.raises(ValueError, match="store_uri is empty"):
        prep_step(params(init, store_uri=""), tmp_path / "none")
    with pytest.raises(ValueError, match="engine_name 'a b'"):
        PipelineConfig.from_json(json.dumps({"train": {}, "engine_name": "a b"}))


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
    from support.models import smollm2_dir

    base = str(smollm2_dir())
    settings = json.dumps({"eval_tasks": 4, "update": {"lr": 3e-6}})
    prep = prep_step(params(Path(base), settings_json=settings), tmp_path / "prompts")
    train_config = PipelineConfig.from_json(prep.config_json).train
    assert (train_config.update.lr, train_config.update.micro_tokens) == (3e-6, 4096)
    assert train_config.max_tokens == PRETRAINED["max_tokens"]
    assert prep.start == "load"


def test_load_refers_to_the_base_model_and_reads_only_its_config_and_tokenizer(
    init: Path, tmp_path: Path, s3_env: dict[str, str], request: pytest.FixtureRequest
) -> None:
    """A base model on S3 (as ``trace-rl model upload`` puts it): load reads its config and
    tokenizer files and nothing else, writes no weights, and its references resolve to the
    model for open session (an empty optimizer); a local one is referred to by its path."""
    from trace_core.policy.checkpoint import CheckpointError
    from trace_core.store.artifacts import TRAFFIC, open_store
    from trace_core.store.reference import REFERENCE
    from trace_core.store.sync import upload_folder
    from trace_core.train.base_model import light_file, upload_model
    from trace_core.train.contract import StepCall
    from trace_core.train.dispatch import start_point
    from trace_core.train.steps.start import load_step

    uri = f"s3://trace/{request.node.name}/base"
    upload_model(init, uri)
    prep = prep_step(
        params(init, base_model_uri=uri, store_uri=str(tmp_path / "s")), tmp_path / "prompts"
    )
    assert prep.start == "load"
    config = PipelineConfig.from_json(prep.config_json)
    out = {name: tmp_path / name for name in ("policy", "predictor", "optimizer")}
    before = TRAFFIC.counts()[0]
    assert load_step(config, *out.values()) == {"resumed_iteration": 0.0}
    light = sum(p.stat().st_size for p in init.iterdir() if light_file(p.name))
    assert TRAFFIC.counts()[0] - before == light < (init / "model.safetensors").stat().st_size
    assert {p.name for p in out["policy"].iterdir()} == {REFERENCE, "metrics.json"}
    assert {p.name for p in out["optimizer"].iterdir()} == {"optimizer.json"}
    assert (out["predictor"] / "predictor.json").is_file()  # the fresh one, beside no weights
    assert {p.parent for p in tmp_path.rglob("*.safetensors")} == {out["predictor"]}
    inputs = {"prompts": str(tmp_path / "prompts"), **{k: str(v) for k, v in out.items()}}
    call = StepCall("open-session", 0, inputs, {"state": str(tmp_path / "state")})
    start = start_point(call)
    assert (start.policy, start.predictor, start.optimizer) == (
        uri,
        inputs["predictor"],
        inputs["optimizer"],
    )
    with pytest.raises(ValueError, match=r"policy/reference.json: a start after iteration 0, "):
        start_point(StepCall("open-session", 3, inputs, call.outputs))

    local = replace(config, train=replace(config.train, init=f"file://{init}"))
    load_step(local, *(tmp_path / "local" / name for name in out))
    inputs["policy"] = str(tmp_path / "local" / "policy")
    assert start_point(StepCall("open-session", 0, inputs, call.outputs)).policy == str(init)
    # A prefix without config.json is named before anything is written.
    broken = f"s3://trace/{request.node.name}/no-config"
    upload_folder(init, broken)
    open_store(broken).delete("config.json")
    bad = replace(config, train=replace(config.train, init=broken))
    with pytest.raises(CheckpointError, match=f"{broken} is not a model checkpoint: it has no"):
        load_step(bad, *(tmp_path / "bad" / name for name in out))
    assert not (tmp_path / "bad").exists()


def test_cli_prep_writes_what_argo_reads(tmp_path: Path) -> None:
    """``trace-rl step prep --param ...``: the config, where to start, and the prompts."""
    from trace_core.train.dispatch import execute_cli_step

    outputs = {"prompts": str(tmp_path / "prompts"), "result": str(tmp_path / "result")}
    params = {"task": "calc", "iterations": "3", "budget": "16", "settings_json": "{}",
              "store_uri": str(tmp_path / "store")}  # fmt: skip
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
