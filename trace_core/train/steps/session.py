"""The pipeline's iterations on the run's session: trainer and engine actors on the Ray cluster
that live across steps, found again by name by every step of the run, so the policy and its
optimizer state stay resident and only references travel between steps.

    open_session_step(config, prompts, start, state_out)      # trainers, engines, iteration 0
    iterate_step(config, 1, prompts, state, state_out, trees)  # train.phases.run_iteration
    close_session(config, state)                               # the run's last step

What travels from step to step is the run's **state** folder (a KFP artifact of a few MB):

    state/state.json    RunState: iterations done, the newest checkpoint (its URIs), what the
                        engines serve (a sync label), the session's name
    state/log.jsonl     every iteration's record so far (``train.record``)
    state/predictor/    the predictor after the last fit
    state/tokenizer/    the policy's tokenizer and config, no weights
    state/ahead/NNNN/   with max_staleness k >= 1: the trees grown ahead, of the next k
                        iterations (``train.ahead``), which the next steps update on

A checkpoint (every ``checkpoint_every`` iterations and the last) is written by trainer rank 0
straight into a reserved folder of the run's registry (``store.registry``); the step adds the
predictor and the log, and moves ``latest`` once every file is there at the size its writer
hashed; then the run's checkpoints beyond the newest ``keep_checkpoints`` are deleted
(``CheckpointRegistry.prune``), never one the step's session could start again from. On a
cluster a checkpoint before the last is written in the background while the next iteration
rolls out (the trainers' next update waits for it); the next step commits it
(``RunState.pending``).
When the session is gone (the Ray cluster restarted, a trainer actor died), the next step
rebuilds it from the newest checkpoint if nothing was trained since; otherwise it stops with
one line naming that checkpoint and how the run resumes from it.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from trace_core.algo.metrics import BatchMetrics
from trace_core.algo.tree import RolloutTree
from trace_core.envs.base import TaskSuite
from trace_core.train.contract import (
    EVAL_FILE,
    OPTIMIZER,
    PROMPTS_EVAL,
    PROMPTS_TRAIN,
    TREES,
    PipelineConfig,
    write_draws,
    write_metrics,
)
from trace_core.train.lost import SessionLostError, lost_line, stop_if_updated
from trace_core.train.record import LOG, read_log
from trace_core.train.steps.commit import (
    MASTER,
    carry_ahead,
    commit_checkpoint,
    optimizer_files,
    registry_run,
    run_registry,
)
from trace_core.train.steps.finish import eval_metrics, record_metrics
from trace_core.train.steps.handoff import STATE, remove_scratch, session_uri, state_folder
from trace_core.train.steps.run_state import (  # noqa: F401  (their home before)
    KIND,
    RunState,
    StartPoint,
    read_state,
    write_state,
)
from trace_core.train.steps.tracked import log_tracking, open_tracking

UPSTREAM = ("ray.get(object_refs, /)", "ray.actor.ActorMethod.remote")
"""What the steps call in Ray directly (``policy.upstream``: entry syntax there); the session's
actors are ``rollout.ray_pool``'s and ``train.trainer_group``'s."""


# --- the steps --------------------------------------------------------------------------------
def open_session_step(
    config: PipelineConfig,
    prompts_dir: Path,
    start: StartPoint,
    state_out: Path,
    suite: TaskSuite | None = None,
) -> dict[str, float]:
    """Start the run's session from ``start`` (trainers load it, engines boot from it), and,
    for a new run, evaluate the starting policy: iteration 0's record, as ``trace-rl train``
    writes it."""
    from trace_core.policy.checkpoint import load_tokenizer
    from trace_core.policy.predictor import SharedPredictor
    from trace_core.store.sync import download_folder
    from trace_core.store.uri import is_remote
    from trace_core.train.base_model import not_weights

    _check_session(config)
    optimizer = master = None
    if start.optimizer:
        optimizer, master = optimizer_files(start.optimizer)
    state = RunState(
        iteration=start.iteration,
        checkpoint=start.iteration,
        policy=start.policy,
        optimizer=optimizer,
        master=master,
        reference=start.policy if config.train.update.kl_coef > 0 else None,
        serving="",
        session=config.engine_name,
        last=start.iteration + config.train.iterations,
    )
    with tempfile.TemporaryDirectory(prefix="trace-session-") as scratch:
        light = Path(scratch, "tokenizer")
        if is_remote(start.policy):
            download_folder(start.policy, light, keep=not_weights)
        else:
            light = Path(start.policy)
        tokenizer = load_tokenizer(light)
        predictor_dir = Path(start.predictor)
        if is_remote(start.predictor):
            predictor_dir = Path(scratch, "predictor")
            download_folder(start.predictor, predictor_dir)
        predictor = SharedPredictor.load(predictor_dir, tokenizer)
        records = [r for r in read_log(light) if r.iteration <= start.iteration]
        if [r.iteration for r in records] != list(range(len(records))) or (
            records and records[-1].iteration != start.iteration
        ):
            raise ValueError(
                f"{start.policy}: its log does not hold iterations 0..{start.iteration} in order"
            )
        mlflow_run = open_tracking(config, records)  # a bad server fails before the session
        with _Session(
            config, prompts_dir, state, tokenizer, predictor, suite, first=True
        ) as session:
            from trace_core.train.phases import eval_dict, evaluate, start_record

            if not records:
                records = [start_record(session.run, session.run.serving_now)]
            shown = records[-1].eval or eval_dict(evaluate(session.run, session.run.serving_now))
            state = replace(state, serving=session.run.serving_now, mlflow_run=mlflow_run)
            write_state(state_out, state, records, predictor, tokenizer)
            carry_ahead(config, start.policy, start.iteration, state_out)
            log_tracking(config, mlflow_run, records)
    result = {**shown, "iteration": start.iteration}
    (state_out / EVAL_FILE).write_text(json.dumps(result, indent=2) + "\n")
    metrics = {"iteration": float(start.iteration), **eval_metrics(result)}
    write_metrics(state_out, metrics)
    return metrics


def iterate_step(
    config: PipelineConfig,
    iteration: int,
    prompts_dir: Path,
    state_dir: Path,
    state_out: Path,
    trees_out: Path,
    suite: TaskSuite | None = None,
    state_uri: str | None = None,
) -> dict[str, float]:
    """Training iteration ``iteration`` on the run's session (``train.phases.run_iteration``):
    its trees and metrics to ``trees_out``, the state after it to ``state_out``. The trainers
    read the iteration's trees from the store: from the state it starts from (``state_uri``,
    where ``state_dir`` was read), when an earlier step grew them ahead, else from
    ``<store>/sessions/<session>/trees-NNNN``, where this step puts them first. The metrics
    include ``s3_bytes``, what this step and the session's actors read and wrote through
    object storage besides checkpoints, and ``checkpoint_bytes``, the files of the checkpoints
    this step committed (its own, and one written in the background since the step before).
    A retry whose first attempt reached the update never applies it twice: the trainers start
    again from the newest checkpoint if it holds the weights before it (the iteration then runs
    as it first did), else the step stops with one line (``train.lost``)."""
    from trace_core.policy.checkpoint import load_tokenizer
    from trace_core.policy.predictor import SharedPredictor
    from trace_core.store.schema import write_trees
    from trace_core.store.sync import put_trees
    from trace_core.train.ahead import held_ahead, keep_ahead
    from trace_core.train.draws import draw_iteration
    from trace_core.train.phases import fitted_after, iteration_line, run_iteration
    from trace_core.train.trainer_group import read_written

    _check_session(config)
    state, records = read_state(state_dir)
    if state.iteration != iteration - 1:
        raise ValueError(
            f"{state_dir / STATE}: the state after iteration {state.iteration}; iteration "
            f"{iteration} needs the one after {iteration - 1}"
        )
    tokenizer = load_tokenizer(state_dir / "tokenizer")
    predictor = SharedPredictor.load(state_dir / "predictor", tokenizer)
    registry = run_registry(config)
    # What this step's session may start again from (a retried step, lost trainers: the
    # input state's checkpoint when it holds its iteration's weights, and the KL anchor):
    # no prune deletes it.
    rebuilt_from = state.policy if state.checkpoint == state.iteration else None
    started_from = (rebuilt_from, state.reference)
    reserved: dict[int, str] = {}
    written: dict[str, tuple[int, str]] = {}
    background: list[int] = []
    adopted: list[int] = []  # bytes of a checkpoint committed as the session starts again

    def checkpoint_at(i: int) -> str:
        if i not in reserved:
            reserved[i] = registry.reserve(registry_run(config), i)
        return registry.store.uri(reserved[i])

    def persist(
        i: int, trees: Sequence[RolloutTree], metrics: BatchMetrics, save: Callable[..., Any] | None
    ) -> None:
        trees_out.mkdir(parents=True, exist_ok=True)
        write_trees(trees_out / TREES, trees)
        train = config.train
        draws = draw_iteration(train.seed, i, len(session.run.train_tasks), train.prompts)
        write_draws(trees_out, i, draws)
        if save is None:
            return
        trainers = session.run.weights.trainers
        if i < session.run.config.iterations and on_cluster(config):  # while the next rollout runs
            trainers.save_in_background(checkpoint_at(i))
            background.append(i)
        else:
            written.update(trainers.save(checkpoint_at(i)))

    def adopt(lost: RunState) -> RunState:
        assert lost.pending is not None and lost.pending_folder is not None
        uri = registry.store.uri(lost.pending_folder)
        files = read_written(uri)
        if files is None:  # they did not finish it
            return lost
        adopted.append(
            commit_checkpoint(
                config,
                registry,
                lost.pending_folder,
                files,
                records,
                state_dir / "predictor",
                ahead=state_dir,
                protect=started_from,
            )
        )
        print(f"the trainers are gone; iteration {lost.pending}'s checkpoint, which they wrote "
              "in full, is committed and the session starts again from it", flush=True)  # fmt: skip
        done = replace(lost, pending=None, pending_folder=None)
        return _checkpointed(done, lost.pending, uri, files)

    with _Session(
        config, prompts_dir, state, tokenizer, predictor, suite, adopt, iteration
    ) as session:
        state = session.state  # with a checkpoint written in the background committed, if adopted
        before = session.traffic()
        committed = sum(adopted)
        pending: dict[str, tuple[int, str]] | None = None
        if state.pending is not None and state.pending_folder is not None:
            statuses = session.trainers.save_status()
            if any(s == "none" or s.startswith("failed") for s in statuses):
                # Not being written (a failed write, or a retried step): the weights are still
                # that iteration's, so it is written again, now.
                why = next(s for s in statuses if s == "none" or s.startswith("failed"))
                print(f"iteration {state.pending}'s checkpoint was not written in the background "
                      f"({why}); writing it now", flush=True)  # fmt: skip
                pending = session.trainers.save(registry.store.uri(state.pending_folder))
        session.run.total_tokens = records[-1].total_tokens if records else 0
        session.run.serving_version = state.iteration  # the engines serve its weights
        session.run.fitted_through = fitted_after(state.iteration, config.train)
        session.run.ahead = held_ahead(state_dir)  # grown by the steps before, on older weights
        carried = set(session.run.ahead) if state_uri else set()

        def stored_trees(i: int, trees: Sequence[RolloutTree]) -> str:
            if i in carried:
                return f"{state_uri}/ahead/{i:04d}"
            uri = f"{session_uri(config)}/trees-{i:04d}"
            put_trees(uri, trees)
            return uri

        session.run.stored_trees = stored_trees
        session.run.checkpoint_at = checkpoint_at
        session.run.always_checkpoint = not on_cluster(config)
        earlier = list(records)  # the log a checkpoint written in the background goes with
        outcome = run_iteration(session.run, iteration, persist, print)
        print(iteration_line(config.train, outcome), flush=True)
        records.append(outcome.record)
        run = session.run
        new = replace(state, iteration=iteration, serving=run.serving_now, pending=None,
                      pending_folder=None)  # fmt: skip
        if state.pending is not None and state.pending_folder is not None:
            files = pending or session.trainers.saved()  # written while this one rolled out
            assert files is not None  # save_status said it was being written
            # The predictor and log as they were after that iteration: this step's input.
            committed += commit_checkpoint(
                config,
                registry,
                state.pending_folder,
                files,
                earlier,
                state_dir / "predictor",
                ahead=state_dir,
                protect=started_from,
            )
            new = _checkpointed(new, state.pending, registry.store.uri(state.pending_folder),
                                files)  # fmt: skip
        if iteration in background:
            new = replace(new, pending=iteration, pending_folder=reserved[iteration])
        for j, grown in sorted(run.ahead.items()):  # the next steps' trees: the state's
            keep_ahead(state_out, j, grown.trees)
        if iteration not in background and run.checkpointed == iteration:
            committed += commit_checkpoint(
                config,
                registry,
                reserved[iteration],
                written,
                records,
                predictor,
                state_out,
                protect=started_from,
            )
            new = _checkpointed(new, iteration, checkpoint_at(iteration), written)
        moved = session.traffic() - before
        storage = {"s3_bytes": float(moved), "checkpoint_bytes": float(committed)}
        records[-1] = replace(records[-1], storage=storage)  # TensorBoard's, MLflow's figures
        write_state(state_out, new, records, predictor, tokenizer)
        log_tracking(config, new.mlflow_run, records)
    metrics = {**record_metrics(outcome.record), **storage}
    write_metrics(trees_out, metrics)
    return metrics


def _checkpointed(
    state: RunState, iteration: int, uri: str, files: Mapping[str, tuple[int, str]]
) -> RunState:
    """``state`` with iteration ``iteration``'s committed checkpoint at ``uri`` as its newest."""
    return replace(
        state,
        checkpoint=iteration,
        policy=f"{uri}/policy",
        optimizer=f"{uri}/{OPTIMIZER}",
        master=uri if MASTER in files else None,
    )


def close_session(config: PipelineConfig, state_dir: Path) -> int:
    """Stop the run's session (its last step): trainers and kept engine actors, and free the
    run's placement group; how many actors ran. Without a Ray cluster they went with the step
    that started them."""
    from trace_core.rollout.ray_pool import ray_session, release_engines
    from trace_core.train.contract import worker_address
    from trace_core.train.trainer_group import release_run_group, release_trainers

    if not on_cluster(config):
        return 0
    state, _ = read_state(state_dir)
    address = worker_address(config)
    stopped = release_engines(state.session, address)
    with ray_session(address):
        stopped += release_trainers(f"{state.session}-trainer", config.train.train_workers)
        release_run_group(state.session)  # the devices the run reserved
    return stopped


def close_session_step(
    config: PipelineConfig, state_dir: Path, result_dir: Path
) -> dict[str, float]:
    """The run's last step: stop its session; ``result/eval.json`` is the last iteration's
    held-out evaluation, with the iteration and the checkpoint the registry holds of it. The
    session's scratch in the store goes too, but the last state, which the report reads
    (``handoff.remove_scratch``; the exit handler's release deletes that)."""
    state, records = read_state(state_dir)
    close_session(config, state_dir)
    last = records[-1]
    if last.eval is None:
        raise ValueError(
            f"{state_dir / LOG}: the last iteration ({last.iteration}) was not evaluated"
        )
    result = {**last.eval, "iteration": last.iteration}
    if config.run_name and state.checkpoint == last.iteration:
        result["checkpoint"] = state.policy.rsplit("/policy", 1)[0]
    result_dir.mkdir(parents=True, exist_ok=True)
    (result_dir / EVAL_FILE).write_text(json.dumps(result, indent=2) + "\n")
    metrics = eval_metrics(result)
    write_metrics(result_dir, metrics)
    if config.store and config.engine_name:
        remove_scratch(config.store, config.engine_name, state_folder(state.iteration))
    return metrics


def on_cluster(config: PipelineConfig) -> bool:
    """Whether the run's steps share a Ray cluster (its session outlives each step)."""
    from trace_core.train.contract import in_ray_job

    return bool(config.train.ray_address) or in_ray_job(config)


# --- the session --------------------------------------------------------------------------------
class _Session:
    """The run's trainers and engines for one step: found by name, or started (from the newest
    checkpoint) when nothing was trained since it; ``run`` is ``train.phases.Run`` on them."""

    def __init__(
        self,
        config: PipelineConfig,
        prompts_dir: Path,
        state: RunState,
        tokenizer: Any,
        predictor: Any,
        suite: TaskSuite | None,
        adopt: Callable[[RunState], RunState] | None = None,
        iteration: int | None = None,
        first: bool = False,
    ) -> None:
        """``adopt``: when the trainers are gone, the state with the checkpoint they were
        writing in the background committed, if they finished it. ``iteration``: the one this
        step runs; trainers that already applied its update (a retried step) are not updated
        again: they start again from the newest checkpoint if it holds the weights before it,
        else the step stops with one line. ``first``: open-session (no other session of the
        run's ``run_name`` may run: ``release.refuse_second_run``)."""
        self.config, self.prompts_dir, self.state = config, prompts_dir, state
        self.tokenizer, self.predictor, self.suite = tokenizer, predictor, suite
        self.adopt, self.iteration, self.first = adopt, iteration, first

    def __enter__(self) -> _Session:
        import contextlib

        import torch

        from trace_core.envs.prompts import read_prompts
        from trace_core.envs.suites import make_suite
        from trace_core.rollout.engines import EngineSession
        from trace_core.rollout.ray_pool import ray_session
        from trace_core.train import iteration
        from trace_core.train.contract import worker_address
        from trace_core.train.lease import renewing
        from trace_core.train.phases import Run
        from trace_core.train.release import refuse_second_run
        from trace_core.train.start_state import StartState
        from trace_core.train.trainer_group import TrainerGroup, TrainerSpec
        from trace_core.train.weights import Weights

        config, state, train = self.config, self.state, self.config.train
        task, train_tasks = read_prompts(str(self.prompts_dir / PROMPTS_TRAIN))
        _, eval_tasks = read_prompts(str(self.prompts_dir / PROMPTS_EVAL))
        suite = self.suite or make_suite(task, train.data, train.seed, train.retriever_url)
        address = worker_address(config)
        self._stack = contextlib.ExitStack()
        self._stack.__enter__()
        try:
            self._stack.enter_context(ray_session(address))
            if self.first:
                refuse_second_run(config)
            keep = train.engine.keep_alive_s  # the trainers' lease too (``train.lease``)
            spec = TrainerSpec(
                train.objective(),
                train.train_workers,
                train.train_gpus,
                train.train_fsdp,
                idle_exit_s=keep,
                place_timeout_s=train.engine.ready_timeout_s,
                wait_timeout_s=train.wait_timeout_s,
            )
            # From here on, this step renews the leases of the run's actors it has found or
            # started, the whole time: while it waits for devices (pods Pending while nodes come
            # up), while the engines start, and while the step runs.
            self.trainers, self._engines = None, None
            self._stack.enter_context(renewing(self._lease_holders, keep))
            placement = _run_placement(config, spec)
            name = f"{state.session}-trainer"
            trainers = self.trainers = TrainerGroup.find(spec, name, placement)
            retried = stop_if_updated(trainers, config, self.iteration, len(train_tasks))
            trainers = None if retried is not None else trainers
            if trainers is None and state.pending is not None and self.adopt is not None:
                state = self.state = self.adopt(state)
            if trainers is None:
                if state.checkpoint != state.iteration:
                    why = lost_line(
                        config, state.checkpoint, state.iteration, state.policy, retried
                    )
                    raise SessionLostError(why)
                if placement is None:  # the run's devices, trainers' and engines', all at once
                    placement = _run_placement(config, spec, reserve=True)
                start = StartState(state.policy, state.optimizer, state.master, state.reference)
                trainers = self.trainers = TrainerGroup(
                    spec, start, name=name, detached=True, placement=placement
                )
            session = self._engines = self._stack.enter_context(
                EngineSession(train.engine, address, name=state.session, placement=placement)
            )
            start = StartState(state.policy, state.optimizer, state.master, state.reference)
            weights = Weights(train, None, torch.float32, start, name, trainers=trainers)  # type: ignore[arg-type]
            label = state.serving or f"sync:{config.run_id}:{state.iteration}"
            if not session.attach(state.policy, label):
                weights.sync(session, label)  # new or restarted engines: the current weights
            # The run's last iteration, as ``train.phases`` counts it: a resumed run's goes on
            # from its checkpoint's (it is checkpointed and evaluated whatever the schedule).
            last = replace(train, iterations=state.last) if state.last else train
            self.run = Run(
                last, config.run_id, suite, train_tasks, eval_tasks,
                iteration.turn_format(train, suite, self.tokenizer), None, self.tokenizer,  # type: ignore[arg-type]
                torch.float32, None, None, self.predictor, weights, session,  # type: ignore[arg-type]
                serving_now=label, checkpointed=state.checkpoint, started=state.checkpoint,
                checkpoint_at=lambda i: state.policy.rsplit("/policy", 1)[0], total_tokens=0,
            )  # fmt: skip
            self.trainers = trainers
        except BaseException:
            self._stack.__exit__(None, None, None)
            raise
        return self

    def _lease_holders(self) -> list[Any]:
        """The run's actors this step holds now (trainer ranks, engine actors): their leases
        are renewed while it runs (``train.lease.renewing``)."""
        run = getattr(self, "run", None)
        trainers = run.weights.trainers if run is not None else self.trainers
        pool = self._engines.pool if self._engines is not None else None
        return [*(trainers.ranks if trainers is not None else []), *(pool.actors if pool else [])]

    def traffic(self) -> int:
        """Bytes read plus written through object storage so far by this process and the
        session's actors, checkpoints' aside (``Traffic.checkpoint``: one written in the
        background moves between steps; a step reports the checkpoints it commits)."""
        import ray

        from trace_core.store.artifacts import TRAFFIC

        counts = [TRAFFIC.counts()]
        counts += ray.get([r.traffic.remote() for r in self.trainers.ranks])
        pool = self.run.session.pool
        if pool is not None:
            engines, _ = pool.sync_members()
            counts += ray.get([e.traffic.remote() for e in engines])
        return sum(r + w - c for r, w, c in counts)

    def __exit__(self, *exc: object) -> None:
        self._stack.__exit__(*exc)  # type: ignore[arg-type]


def _run_placement(config: PipelineConfig, spec: Any, reserve: bool = False) -> Any:
    """The run's placement group (``rollout.placement``): its trainers' devices and its engine
    actors', reserved as one group, all or nothing. Found by name (an earlier step's; one that
    waits for a lost node's bundles is waited for, a line every minute saying what is pending),
    else, with ``reserve``, reserved here; else None (trainers started before the run had a
    group of its own: its engines are placed one by one)."""
    from trace_core.rollout.placement import (
        PlacementError,
        find_run,
        reserve_run,
        run_group_name,
        run_shape,
        shortfall,
        wait_placed,
    )

    train = config.train
    shape = run_shape(train.train_workers, train.train_gpus, train.engine)
    name, what = run_group_name(config.engine_name), f"the run {config.engine_name}"
    timeout = spec.place_timeout_s
    found = find_run(shape, name)
    if found is not None:
        if not wait_placed(
            found.group, timeout, what, "ready_timeout_s", _say, kinds=shape.kinds()
        ):
            raise PlacementError(  # kept: it holds what the run started
                shortfall(shape.bundles(), what, timeout, "ready_timeout_s", shape.describe())
            )
        return found
    if not reserve:
        return None
    return reserve_run(shape, name, True, timeout, what, say=_say)


def _say(line: str) -> None:
    print(line, flush=True)


def _check_session(config: PipelineConfig) -> None:
    train = config.train
    if not config.engine_name:
        raise ValueError("a run's session needs its name (engine_name, set by prep)")
    if train.train_workers < 1 or train.engine.workers < 1 or not train.engine.keep_alive_s:
        raise ValueError(
            "a run's session needs trainer actors (train_workers >= 1) and kept engine actors "
            "(rollout_workers >= 1, engine keep_alive_s > 0)"
        )
    if not config.store:
        raise ValueError("a run's session needs store_uri: its checkpoints are written there")
