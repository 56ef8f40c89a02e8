"""``TrainConfig``: one JSON through every step, nested configs included, errors naming fields;
and ``trace-rl train`` flags built from its fields (``trace_core.cli.options``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from typer.main import get_command

from trace_core.cli import app
from trace_core.cli.options import field_docs
from trace_core.policy.update_config import UpdateConfig
from trace_core.rollout.engine_config import EngineConfig
from trace_core.train.config import TrainConfig
from trace_core.train.contract import PipelineParameters


def test_json_round_trip_keeps_the_nested_configs() -> None:
    config = TrainConfig(
        budget=16, update=UpdateConfig(lr=3e-5), engine=EngineConfig("vllm", workers=4)
    )
    assert TrainConfig.from_json(config.to_json()) == config
    assert config.to_json()["engine"]["workers"] == 4  # type: ignore[index]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"engine": {"workers": "2"}}, "engine config field 'workers': expected int"),
        ({"engine": {"gpus": 1}}, "unknown engine config field"),
        ({"update": {"lr": True}}, "update config field 'lr': expected float"),
        ({"budgett": 1}, "unknown train config field"),
        ({"engine": {"engine": "tgi"}}, "engine must be one of"),
    ],
)
def test_from_json_names_the_field(body: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig.from_json(body)


def test_the_pipeline_carries_the_engine_settings() -> None:
    """engine, rollout_workers and gpus_per_worker are run parameters (the KFP UI's fields);
    the rest of ``EngineConfig`` comes through settings_json."""
    params = PipelineParameters(
        engine="vllm",
        rollout_workers=2,
        gpus_per_worker=1.0,
        settings_json='{"engine": {"tensor_parallel": 2, "memory_fraction": 0.8}}',
    )
    assert params.config().train.engine == EngineConfig(
        "vllm", workers=2, gpus_per_worker=1.0, tensor_parallel=2, memory_fraction=0.8
    )
    assert PipelineParameters().config().train.engine == EngineConfig()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ('{"engine": {"workers": 2}}', "engine sets workers: use the pipeline parameter"),
        ('{"engine": {"engine": "hf"}}', "engine sets engine: use the pipeline parameter"),
        ('{"engine": 4}', "engine must be a JSON object"),
    ],
)
def test_settings_json_may_not_override_the_engine_parameters(settings: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PipelineParameters(settings_json=settings).config()


def test_retriever_url_travels_from_the_run_parameter_and_is_checked() -> None:
    """Empty: the in-process index; a URL: checked, kept through the JSON every step reads; a
    task without passages refuses it. The flags: ``trace-rl train --retriever-url`` and ``trace-rl
    run-local --retriever-url`` (both built from the fields)."""
    url = "http://trace-retriever:8000"
    train = PipelineParameters(task="multihop", retriever_url=url).config().train
    assert train.retriever_url == url
    assert TrainConfig.from_json(train.to_json()) == train
    assert PipelineParameters(task="multihop").config().train.retriever_url is None
    assert TrainConfig.from_json({"task": "multihop", "retriever_url": ""}).retriever_url == ""
    cases: list[tuple[dict[str, object], str]] = [
        ({"task": "multihop", "retriever_url": "trace-retriever:8000"}, "^retriever_url '"),
        ({"task": "multihop", "retriever_url": 8000}, "^retriever_url must be text"),
        ({"task": "calc", "retriever_url": url}, "task 'calc' searches no passages"),
    ]
    for body, message in cases:
        with pytest.raises(ValueError, match=message):
            TrainConfig.from_json(body)
    with pytest.raises(ValueError, match="settings_json sets retriever_url"):
        PipelineParameters(task="multihop", settings_json=f'{{"retriever_url": "{url}"}}').config()
    for name in ("train", "run-local"):
        command = get_command(app).commands[name]  # type: ignore[attr-defined]
        flag = next(p for p in command.params if p.name == "retriever_url")
        assert flag.opts == ["--retriever-url"] and "retrieval service" in (flag.help or "")


def test_keep_checkpoints_travels_from_the_run_parameter_and_is_checked() -> None:
    """A run parameter of the registry, not a training setting: in the config JSON every step
    reads (2 by default, and for a config written before it), >= 1, refused in settings_json;
    ``trace-rl run-local --keep-checkpoints``, and no ``trace-rl train`` flag (its run folder
    registers nothing)."""
    from trace_core.train.contract import PipelineConfig

    config = PipelineParameters(keep_checkpoints=3).config()
    assert PipelineConfig.from_json(config.to_json()).keep_checkpoints == 3
    assert PipelineParameters().config().keep_checkpoints == 2
    assert PipelineConfig.from_json('{"train": {}}').keep_checkpoints == 2
    with pytest.raises(ValueError, match=r"^keep_checkpoints must be >= 1, got 0: "):
        PipelineParameters(keep_checkpoints=0).config()
    with pytest.raises(ValueError, match=r"^keep_checkpoints must be an integer, got '2'"):
        PipelineConfig.from_json('{"train": {}, "keep_checkpoints": "2"}')
    with pytest.raises(ValueError, match="settings_json sets keep_checkpoints"):
        PipelineParameters(settings_json='{"keep_checkpoints": 1}').config()
    commands = get_command(app).commands  # type: ignore[attr-defined]
    flag = next(p for p in commands["run-local"].params if p.name == "keep_checkpoints")
    assert flag.opts == ["--keep-checkpoints"] and flag.default == 2
    assert "newest checkpoints the registry keeps" in (flag.help or "")
    assert not any(p.name == "keep_checkpoints" for p in commands["train"].params)


def test_train_flags_are_the_config_fields_with_their_docstrings() -> None:
    command = get_command(app).commands["train"]  # type: ignore[attr-defined]
    flags = {p.name: p for p in command.params}
    fields = [f.name for f in dataclasses.fields(TrainConfig) if f.name not in ("update", "engine")]
    nested = [f.name for kind in (UpdateConfig, EngineConfig) for f in dataclasses.fields(kind)]
    assert set(flags) == {*fields, *nested, "threads", "restart"}
    assert flags["lr"].default == UpdateConfig().lr and flags["budget"].default == 128
    assert flags["output"].default == Path("build/train/calc-trace")
    assert flags["workers"].help == field_docs(EngineConfig)["workers"]
    assert flags["eval_k"].help == "Samples per task for mean@k."


def test_a_refused_flag_is_one_error_line(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", "--budget", "1", "--output", str(out)])
    assert result.exit_code == 2
    assert result.output.startswith("error:") and "budget" in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not out.exists()  # refused before anything was written


def test_an_s3_init_reaches_the_store_as_given(tmp_path: Path, s3_env: dict[str, str]) -> None:
    """``--init s3://…`` is a URI, not a path (a path would fold ``//``): the store is asked
    for exactly that prefix, and a missing one is refused before the run folder is made."""
    from typer.testing import CliRunner

    out, uri = tmp_path / "run", f"s3://trace/{tmp_path.name}/no-model"
    result = CliRunner().invoke(app, ["train", "--init", uri, "--output", str(out)])
    said = " ".join(result.output.split())
    assert result.exit_code == 2, said
    assert said.startswith("error:") and f"{uri}: nothing to download" in said
    assert not out.exists()


def test_a_real_models_update_is_not_left_on_the_ray_heads_cpu(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models

    from trace_core.envs.calc import CalcSuite
    from trace_core.policy.model import TinyPolicyConfig, create_policy, save_checkpoint
    from trace_core.policy.tokenizer import build_word_tokenizer
    from trace_core.train.config import check_update_place, is_builtin_tiny

    tiny = tmp_path / "tiny"
    tokenizer = build_word_tokenizer(CalcSuite(seed=0).vocabulary())
    save_checkpoint(create_policy(tokenizer, TinyPolicyConfig(), seed=0), tokenizer, tiny)
    real = tmp_path / "real"  # a byte-pair tokenizer, as every pretrained model has
    real.mkdir()
    Tokenizer(models.BPE()).save(str(real / "tokenizer.json"))
    assert is_builtin_tiny(tiny) and not is_builtin_tiny(real)
    check_update_place("127.0.0.1:6379", 0, tiny)  # seconds anywhere
    check_update_place("127.0.0.1:6379", 2, real)  # on trainer actors
    check_update_place(None, 0, real)  # no cluster: here is where it runs
    with pytest.raises(ValueError, match=r"train_workers is 0 .*--train-workers N"):
        check_update_place("127.0.0.1:6379", 0, real)


def test_gpu_trainers_beyond_one_node_are_refused_before_any_work() -> None:
    """The trainers' GPUs are one placement-group bundle, on one node (``rollout.placement``):
    more than a pod's GPUs would wait for a node that never comes."""
    with pytest.raises(ValueError, match=r"train_workers 16 with train_gpus: the trainers share"):
        TrainConfig(train_workers=16, train_gpus=True)
    wide = EngineConfig(gpus_per_node=16)
    assert TrainConfig(train_workers=16, train_gpus=True, engine=wide).train_workers == 16
    assert TrainConfig(train_workers=16).train_workers == 16  # CPU trainers: one bundle too
