"""The training loop end to end on a tiny policy: the run folder, resuming, crash safety, and
the comparison's arithmetic."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from support import parity
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from typer.testing import CliRunner

from trace_core.cli import app
from trace_core.policy.update import UpdateStats
from trace_core.store.artifacts import open_store
from trace_core.store.schema import read_trees
from trace_core.store.sync import upload_folder
from trace_core.train import phases
from trace_core.train import weights as weights_module
from trace_core.train.base_model import SOURCE
from trace_core.train.calibration import score_run
from trace_core.train.config import TrainConfig
from trace_core.train.loop import train
from trace_core.train.record import IterationRecord, read_log
from trace_core.train.run_folder import RunFolderError, read_latest


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


tiny = parity.tiny


def run(config: TrainConfig) -> list[IterationRecord]:
    return train(config, suite=parity.ParitySuite())  # type: ignore[arg-type]


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def test_run_folder_log_and_budget(init: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    records = run(tiny(init, out, iterations=2))
    assert [r.iteration for r in records] == [0, 1, 2]
    assert read_latest(out) == 2
    assert read_log(out) == records
    for i in (1, 2):
        folder = out / "iterations" / f"{i:04d}"
        for name in (
            "trees.parquet",
            "metrics.json",
            "optimizer.safetensors",
            "predictor/predictor.safetensors",
            "predictor/predictor.json",
        ):
            assert (folder / name).is_file(), name
        assert records[i].predictor["rows"] > 0  # the predictor was fitted on this iteration
        trees = read_trees(folder / "trees.parquet")
        assert sum(t.units for t in trees) == 6 * (1 + 2 / 2)  # M(1 + N/2), exactly
        assert {t.info.iteration for t in trees} == {i}
        assert {t.info.policy_version for t in trees} == {i - 1}
        assert records[i].tokens == sum(t.generated_tokens for t in trees)
    assert records[2].total_tokens == records[1].tokens + records[2].tokens
    # The update really changed the policy.
    first, second = weights(out / "iterations/0001/policy"), weights(out / "iterations/0002/policy")
    assert any(not torch.equal(first[k], second[k]) for k in first)
    # Every evaluation is timed, the starting one too; an update that trained measured its peak.
    assert records[0].seconds["eval"] > 0 and records[2].seconds["eval"] > 0
    assert all(
        r.update["peak_gib"] >= r.update["held_gib"] > 0 for r in records[1:] if r.update["paths"]
    )
    assert 0 <= records[2].eval["parse_rate"] <= 1  # type: ignore[index,operator]
    assert json.loads((out / "config.json").read_text())["strategy"] == "trace"
    # Beside the log, TensorBoard's event files: the same figures, iteration by iteration.
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    pass1 = [(e.step, e.value) for e in events.Scalars("eval/pass1")]
    assert pass1 == [(r.iteration, pytest.approx(r.eval["pass1"]["all"])) for r in records]  # type: ignore[index]
    ratio = [e.value for e in events.Scalars("rollout/prompt_effective_ratio")]
    assert ratio == [pytest.approx(r.rollout["prompt_effective_ratio"]) for r in records[1:]]

    # Iteration 2's trees, forecast by iteration 1's predictor: what the loop logged, recomputed
    # from the stored run (a skill the trees cannot define, one outcome only, is left out).
    assert "root_skill" not in records[1].predictor  # nothing before the first fit
    held_out = [r.predictor.get("eval_root_skill", 0.0) for r in records[1:]]
    assert all(math.isfinite(x) and x <= 1 for x in held_out)
    scored = {s.kind: s for s in score_run(out)}
    assert set(scored) == {"root", "prefix"} and scored["root"].iteration == 2
    assert scored["root"].nodes == len(read_trees(out / "iterations/0002/trees.parquet"))
    for kind in ("root", "prefix"):
        logged = records[2].predictor.get(f"{kind}_skill", math.nan)
        assert math.isclose(scored[kind].skill, logged, abs_tol=1e-6) or (
            math.isnan(scored[kind].skill) and math.isnan(logged)
        )
    plot = tmp_path / "calibration.png"
    shown = CliRunner().invoke(app, ["predictor", "score", str(out), "--plot", str(plot)])
    assert shown.exit_code == 0, shown.output
    assert "2 roots" in shown.output and "2 prefixes" in shown.output
    assert plot.stat().st_size > 0


def test_held_out_root_skill_scores_the_eval_prompts_against_their_samples() -> None:
    """4 held-out prompts, 4 samples each: 4, 3, 1 and 0 successes (rate 0.5, the constant's
    Brier 0.25). A predictor that says 0.9, 0.7, 0.3, 0.1 has Brier 1.6 / 16 = 0.1: skill 0.6."""
    from types import SimpleNamespace

    from trace_core.envs.base import Task
    from trace_core.train.evaluate import EvalReport
    from trace_core.train.iteration import held_out_root_skill

    tasks = [Task(f"t{i}", "x" * (i + 1), "", "any", "eval") for i in range(4)]
    ids = tuple(t.id for t in tasks)
    said = {1: 0.9, 2: 0.7, 3: 0.3, 4: 0.1}
    predictor = SimpleNamespace(predict_roots=lambda ps: np.array([said[p[0]] for p in ps]))
    fmt = SimpleNamespace(prompt_ids=lambda text: [len(text)])
    per_task = {"pass1": [1.0, 1.0, 0.0, 0.0], "mean_k": [1.0, 0.75, 0.25, 0.0]}
    report = EvalReport(4, 4, {}, {}, 0, per_task=per_task, task_ids=ids)
    skill = held_out_root_skill(predictor, fmt, tasks, report)  # type: ignore[arg-type]
    assert skill == pytest.approx(0.6)
    constant = SimpleNamespace(predict_roots=lambda ps: np.full(len(ps), 0.5))
    assert held_out_root_skill(constant, fmt, tasks, report) == pytest.approx(0.0)  # type: ignore[arg-type]
    one_kind = EvalReport(4, 4, {}, {}, 0, per_task={"mean_k": [1.0] * 4}, task_ids=ids)
    assert math.isnan(held_out_root_skill(predictor, fmt, tasks, one_kind))  # type: ignore[arg-type]
    other = EvalReport(4, 4, {}, {}, 0, per_task=per_task, task_ids=("a", "b", "c", "d"))
    assert math.isnan(held_out_root_skill(predictor, fmt, tasks, other))  # type: ignore[arg-type]


def test_the_iteration_line_gives_each_phase_and_the_update_measurements() -> None:
    seconds = {"rollout": 41.2, "predictor": 0.1, "update": 3.4, "eval": 19.6}
    stats = UpdateStats(12, 300, 1, 0.1, 0.0, 0.0, 1.0, 3e-5, 1e-4, 2, peak_gib=2.14, held_gib=1.5)
    assert phases.phases_line(seconds, stats) == (
        "rollout 41 s, predictor 0 s, update 3 s (12 paths, peak 2.1 GiB of which 1.5 held before "
        "it, logprob gap 3.0e-05), eval 20 s"
    )
    flat = UpdateStats(0, 0, 0, 0.0, 0.0, 0.0, 0.0, 0.0)
    assert "no path with an advantage" in phases.phases_line({"update": 0.0}, flat)


def test_warmstart_init_fine_tunes_init_once_then_trains_from_it(
    init: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    config = tiny(init, out, 1, task="calc", warmstart_init=True, warmstart_steps=3)
    records = run(config)
    warm = weights(out / "warmstart")
    start = weights(init)
    assert any(not torch.equal(warm[k], start[k]) for k in warm)  # SFT moved it
    assert records[0].eval  # the start eval is of the warm-started policy
    stamp = (out / "warmstart/model.safetensors").stat().st_mtime_ns
    run(replace(config, iterations=2))  # resumes: no second warm start
    assert (out / "warmstart/model.safetensors").stat().st_mtime_ns == stamp
    assert read_latest(out) == 2
    with pytest.raises(ValueError, match=r"warmstart_init .* needs --init"):
        TrainConfig(task="calc", warmstart_init=True)


def test_a_remote_init_is_downloaded_once_into_the_run(
    init: Path, tmp_path: Path, s3_env: dict[str, str]
) -> None:
    uri = f"s3://trace/{tmp_path.name}/policy"
    upload_folder(init, uri)
    out = tmp_path / "run"
    records = run(tiny(uri, out, 1))  # type: ignore[arg-type]
    assert (out / "init" / SOURCE).read_text() == uri + "\n"
    assert weights(out / "init").keys() == weights(init).keys()
    assert json.loads((out / "config.json").read_text())["init"] == uri
    store = open_store(uri)
    for obj in store.list_objects(""):
        store.delete(obj.key)
    resumed = run(tiny(uri, out, 2))  # type: ignore[arg-type]
    assert [r.iteration for r in resumed] == [0, 1, 2] and resumed[:2] == records


def test_resume_gives_the_same_run_as_no_interruption(init: Path, tmp_path: Path) -> None:
    straight = run(tiny(init, tmp_path / "straight", iterations=3))
    run(tiny(init, tmp_path / "resumed", iterations=2))
    resumed = run(tiny(init, tmp_path / "resumed", iterations=3))
    assert [r.tokens for r in resumed] == [r.tokens for r in straight]
    events = EventAccumulator(str(tmp_path / "resumed" / "tensorboard"))
    events.Reload()
    steps = [e.step for e in events.Scalars("update/loss")]
    assert steps == [r.iteration for r in resumed[1:]]  # one file, the whole run
    a = weights(tmp_path / "straight/iterations/0003/policy")
    b = weights(tmp_path / "resumed/iterations/0003/policy")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_bf16_policy_trains_fp32_master_weights_across_iterations_and_resumes(
    init: Path, tmp_path: Path
) -> None:
    """A checkpoint stored in bfloat16 (as Qwen3's is): the log says the update stepped fp32
    weights; every iteration's policy is bf16 for the engines, with the fp32 weights beside the
    optimizer state; a resumed run goes on from those and ends where the straight one does."""
    from trace_core.policy.model import MASTER, checkpoint_dtype, load_checkpoint, save_checkpoint

    model, tokenizer = load_checkpoint(init)
    bf16 = tmp_path / "bf16"
    save_checkpoint(model.to(torch.bfloat16), tokenizer, bf16)
    straight = run(tiny(bf16, tmp_path / "straight", iterations=3))
    assert {r.update["master_dtype"] for r in straight[1:]} == {"float32"}
    assert {r.update["compute_dtype"] for r in straight[1:]} == {"float32"}  # CPU: no autocast
    logged = [
        json.loads(line) for line in (tmp_path / "straight/log.jsonl").read_text().splitlines()
    ]
    assert [line["update"].get("master_dtype") for line in logged] == [None, *["float32"] * 3]
    for i in (1, 2, 3):
        folder = tmp_path / "straight/iterations" / f"{i:04d}"
        assert checkpoint_dtype(folder / "policy") == torch.bfloat16
        assert load_file(str(folder / MASTER))["model.norm.weight"].dtype == torch.float32

    run(tiny(bf16, tmp_path / "resumed", iterations=2))
    resumed = run(tiny(bf16, tmp_path / "resumed", iterations=3))
    assert [r.tokens for r in resumed] == [r.tokens for r in straight]
    events = EventAccumulator(str(tmp_path / "resumed" / "tensorboard"))
    events.Reload()
    steps = [e.step for e in events.Scalars("update/loss")]
    assert steps == [r.iteration for r in resumed[1:]]  # one file, the whole run
    for name in ("policy/model.safetensors", MASTER):
        a = load_file(str(tmp_path / "straight/iterations/0003" / name))
        b = load_file(str(tmp_path / "resumed/iterations/0003" / name))
        assert all(torch.equal(a[k], b[k]) for k in a), name


def test_crash_mid_iteration_keeps_the_last_complete_one(
    init: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "run"
    run(tiny(init, out, iterations=1))
    calls = []

    def failing_save(optimizer: torch.optim.Optimizer, path: Path) -> None:
        calls.append(path)
        raise OSError("disk full")

    monkeypatch.setattr(weights_module, "save_optimizer", failing_save)
    with pytest.raises(OSError, match="disk full"):
        run(tiny(init, out, iterations=2))
    assert calls and read_latest(out) == 1
    assert not (out / "iterations/0002").exists()  # only a .partial folder was left
    assert [r.iteration for r in read_log(out)] == [0, 1]
    monkeypatch.undo()
    records = run(tiny(init, out, iterations=2))
    assert [r.iteration for r in records] == [0, 1, 2] and read_latest(out) == 2


def checksums(folder: Path) -> dict[str, str]:
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_a_run_without_its_pointer_is_refused_not_rebuilt(init: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    run(tiny(init, out, iterations=2))
    (out / "latest").unlink()
    before = checksums(out)
    with pytest.raises(RunFolderError, match=f"{out} holds iterations 1..2 but no valid latest"):
        run(tiny(init, out, iterations=2))
    assert checksums(out) == before  # nothing rewritten, not even config.json
    (out / "latest").write_text("two\n")  # a pointer that is not a number is no pointer
    with pytest.raises(RunFolderError, match="--restart"):
        run(tiny(init, out, iterations=2))
    said: list[str] = []
    records = train(tiny(init, out, iterations=1), said.append, parity.ParitySuite(), restart=True)
    assert [r.iteration for r in records] == [0, 1] and read_latest(out) == 1
    assert not (out / "iterations/0002").exists()
    assert any(m.startswith("--restart: discarded config.json, log.jsonl, latest") for m in said)


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_a_damaged_latest_iteration_falls_back_to_the_last_complete_one(
    init: Path, tmp_path: Path, damage: str
) -> None:
    straight = run(tiny(init, tmp_path / "straight", iterations=2))
    out = tmp_path / "run"
    run(tiny(init, out, iterations=2))
    weights_file = out / "iterations/0002/policy/model.safetensors"
    if damage == "truncate":
        weights_file.write_bytes(weights_file.read_bytes()[:1000])
    else:
        (out / "iterations/0002/optimizer.safetensors").unlink()
    said: list[str] = []
    records = train(tiny(init, out, iterations=2), said.append, parity.ParitySuite())
    assert any(
        m.startswith("iteration 2 is incomplete (")
        and m.endswith("; resuming after iteration 1, the newest checkpoint")
        for m in said
    ), said
    # Iteration 2 is redone from iteration 1: the same draws give the same run.
    assert [r.tokens for r in records] == [r.tokens for r in straight]
    assert checksums(out / "iterations/0002/policy") == checksums(
        tmp_path / "straight/iterations/0002/policy"
    )


def test_no_complete_iteration_is_refused(init: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    run(tiny(init, out, iterations=1))
    (out / "iterations/0001/manifest.json").write_text("{")
    before = checksums(out)
    with pytest.raises(RunFolderError, match=r"no iteration up to it is complete.*damaged"):
        run(tiny(init, out, iterations=2))
    assert checksums(out) == before


def test_resume_refuses_a_different_config(init: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    run(tiny(init, out, iterations=1))
    with pytest.raises(ValueError, match="strategy"):
        run(tiny(init, out, iterations=2, strategy="grpo"))


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="simulator"):
        TrainConfig(strategy="oracle")
    with pytest.raises(ValueError, match="--init"):
        TrainConfig(task="bfcl")
    with pytest.raises(ValueError, match="train_fsdp needs train_workers"):
        TrainConfig(train_fsdp=True)


@pytest.mark.slow
def test_ray_train_workers_give_the_in_process_run(init: Path, tmp_path: Path) -> None:
    """``train_workers=1``: the update runs on a resident trainer actor (real Ray, in this
    process), which brings the in-process engine's model its weights by broadcast, and the run
    matches the in-process one."""
    local = run(tiny(init, tmp_path / "local", iterations=2))
    on_ray = run(tiny(init, tmp_path / "ray", iterations=2, train_workers=1))
    assert [r.tokens for r in on_ray] == [r.tokens for r in local]
    assert ["sync" in r.seconds for r in on_ray] == [False, True, True]
    a = weights(tmp_path / "local/iterations/0002/policy")
    b = weights(tmp_path / "ray/iterations/0002/policy")
    assert all(torch.allclose(a[k], b[k], atol=2e-5) for k in a)


def test_checkpoints_every_other_iteration_and_resumes_from_the_newest(
    init: Path, tmp_path: Path
) -> None:
    """``checkpoint_every=2``: iterations 2 and 4 and the last hold the policy and optimizer,
    the others trees, metrics and predictor only. A run stopped after iteration 3 resumes from
    iteration 2's checkpoint, says so, and ends where the straight run does."""
    straight = run(tiny(init, tmp_path / "straight", iterations=5, checkpoint_every=2))
    for i, held in ((1, False), (2, True), (3, False), (4, True), (5, True)):
        folder = tmp_path / "straight/iterations" / f"{i:04d}"
        assert (folder / "policy").is_dir() == held, i
        assert (folder / "optimizer.safetensors").is_file() == held, i
        assert (folder / "trees.parquet").is_file() and (folder / "predictor").is_dir()
        assert ("checkpoint" in straight[i].seconds) == held

    class Stop(Exception):
        pass

    def stop_after_3(line: str) -> None:
        if line.startswith("iteration 3/5:"):
            raise Stop

    out = tmp_path / "resumed"
    with pytest.raises(Stop):
        train(tiny(init, out, iterations=5, checkpoint_every=2), stop_after_3, parity.ParitySuite())
    assert read_latest(out) == 3
    said: list[str] = []
    resumed = train(
        tiny(init, out, iterations=5, checkpoint_every=2), said.append, parity.ParitySuite()
    )
    assert (
        "iteration 3 holds no checkpoint (checkpoint_every): grown and trained again from "
        "iteration 2's; resuming after iteration 2, the newest checkpoint"
    ) in said, said
    assert [r.tokens for r in resumed] == [r.tokens for r in straight]
    events = EventAccumulator(str(tmp_path / "resumed" / "tensorboard"))
    events.Reload()
    steps = [e.step for e in events.Scalars("update/loss")]
    assert steps == [r.iteration for r in resumed[1:]]  # one file, the whole run
    assert checksums(out / "iterations/0005/policy") == checksums(
        tmp_path / "straight/iterations/0005/policy"
    )


@pytest.mark.slow
@pytest.mark.cluster  # Ray in this process
def test_evaluation_runs_on_the_runs_engine_actor(init: Path, tmp_path: Path) -> None:
    """One engine actor (``engine.workers=1``) serves the rollouts and the evaluations: each new
    policy goes into it once, for its evaluation, and the next rollout finds it there. The
    starting policy's greedy pass@1 is the in-process engine's."""
    from trace_core.rollout.engine_config import EngineConfig

    local = run(tiny(init, tmp_path / "local", iterations=1))
    pooled = run(tiny(init, tmp_path / "pool", iterations=2, engine=EngineConfig(workers=1)))
    # Each new policy reaches the actor by broadcast from this process, not by a reload.
    assert ["sync" in r.seconds for r in pooled] == [False, True, True]
    assert not any("reload" in r.seconds for r in pooled)
    assert pooled[0].eval is not None and local[0].eval is not None
    assert pooled[0].eval["pass1"] == local[0].eval["pass1"]


def test_predictor_score_refuses_a_folder_that_is_no_run(tmp_path: Path) -> None:
    shown = CliRunner().invoke(app, ["predictor", "score", str(tmp_path)])
    assert shown.exit_code == 2
    assert "no iterations/ here: not a `trace-rl train` run folder" in " ".join(
        shown.output.split()
    )


@pytest.fixture(scope="module")
def resident_run(init: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[list, Path]:  # type: ignore[type-arg]
    """Three iterations on a resident trainer actor, unbroken: what the fault tests end as
    (checkpoints change what is written, not what is trained)."""
    out = tmp_path_factory.mktemp("resident") / "straight"
    return run(tiny(init, out, iterations=3, train_workers=1)), out


def _kill_trainer_after(line_start: str, out: Path) -> Callable[[str], None]:
    """A progress callback that kills trainer rank 0's process once ``line_start`` is said."""

    def say(line: str) -> None:
        said.append(line)
        if line.startswith(line_start):
            import os
            import signal

            import ray

            from trace_core.train.trainer_group import TRAINER_NAMESPACE

            actor = ray.get_actor(f"{out.name}-trainer-0", namespace=TRAINER_NAMESPACE)
            os.kill(int(ray.get(actor.pid.remote())), signal.SIGKILL)

    said: list[str] = []
    say.said = said  # type: ignore[attr-defined]
    return say


@pytest.mark.slow
@pytest.mark.cluster  # Ray in this process
def test_a_trainer_killed_after_a_checkpoint_is_rebuilt_from_it(
    init: Path,
    tmp_path: Path,
    resident_run: tuple[list, Path],  # type: ignore[type-arg]
) -> None:
    """The trainer actor dies after iteration 1, whose checkpoint holds its state: iteration 2
    starts a new one from that checkpoint, says so, and the run ends as an unbroken one."""
    straight, straight_dir = resident_run
    out = tmp_path / "killed"
    say = _kill_trainer_after("iteration 1/3:", out)
    records = train(tiny(init, out, iterations=3, train_workers=1), say, parity.ParitySuite())
    assert any(
        m.startswith("a trainer actor died: the trainers start again from iteration 1's checkpoint")
        for m in say.said  # type: ignore[attr-defined]
    ), say.said  # type: ignore[attr-defined]
    assert [r.tokens for r in records] == [r.tokens for r in straight]
    assert checksums(out / "iterations/0003/policy") == checksums(
        straight_dir / "iterations/0003/policy"
    )


@pytest.mark.slow
@pytest.mark.cluster  # Ray in this process
def test_a_trainer_killed_between_checkpoints_stops_the_run_and_a_rerun_resumes(
    init: Path,
    tmp_path: Path,
    resident_run: tuple[list, Path],  # type: ignore[type-arg]
) -> None:
    """With checkpoint_every 2 the trainer dies after iteration 1 (no checkpoint): iteration 2
    stops with one line naming where a rerun resumes; the rerun goes from the start and ends as
    an unbroken run."""
    from trace_core.train.weights import TrainersLostError

    config = {"iterations": 3, "train_workers": 1, "checkpoint_every": 2}
    straight, straight_dir = resident_run
    out = tmp_path / "killed"
    say = _kill_trainer_after("iteration 1/3:", out)
    with pytest.raises(TrainersLostError, match="since its start; run the same command again"):
        train(tiny(init, out, **config), say, parity.ParitySuite())
    said: list[str] = []
    records = train(tiny(init, out, **config), said.append, parity.ParitySuite())
    assert any(
        "iteration 1 holds no checkpoint (checkpoint_every): run again from the start" in m
        for m in said
    )
    assert [r.tokens for r in records] == [r.tokens for r in straight]
    assert checksums(out / "iterations/0003/policy") == checksums(
        straight_dir / "iterations/0003/policy"
    )
