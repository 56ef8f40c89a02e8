"""Where a run's training state lives and how new weights reach its engines (``train.loop``).

    with Weights(config, model, serving, start, run) as weights:
        stats = weights.trainers.update(trees, seed) if weights.trainers else update(model, ...)
        label = weights.sync(session, "sync:run:3")    # None: the engines load files only
        save = weights.saver(model, tokenizer, optimizer)   # on a checkpoint iteration

With ``train_workers`` the state is resident in a ``TrainerGroup`` for the whole run; else it is
this process's model and optimizer. Either way a kept pool of engine actors gets the weights by
broadcast (``policy.weight_sync``): from trainer rank 0, or from this process. An engine built
in this process around the model needs only the model's weights (from the trainers, when they
hold them). An in-process vLLM engine loads files: it reloads each iteration's checkpoint.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from trace_core.policy.model import save_checkpoint, save_master
from trace_core.policy.update import save_optimizer
from trace_core.rollout.engines import EngineSession
from trace_core.train.config import TrainConfig
from trace_core.train.start_state import StartState


class TrainersLostError(RuntimeError):
    """The trainer actors died with training state no checkpoint holds."""


class EnginesLostError(RuntimeError):
    """An engine actor restarted and lost synced weights no checkpoint holds (``phases``)."""


class Weights:
    def __init__(
        self,
        config: TrainConfig,
        model: PreTrainedModel,
        serving: torch.dtype,
        start: StartState,
        run: str,
        trainers: Any = None,
    ) -> None:
        """``start``: what resident trainers load. ``trainers``: the run's detached group a
        pipeline step found or started (``train.steps.session``); it outlives this object."""
        self.config, self.model, self.serving, self.start, self.run = (
            config,
            model,
            serving,
            start,
            run,
        )
        self.trainers: Any = trainers
        self.keep = trainers is not None
        self.placement: Any = getattr(trainers, "placement", None)
        """The run's group (``rollout.placement``), reserved here for trainers with Ray engine
        actors (their ``EngineSession`` takes its engine bundles), or the pipeline step's."""
        self.name = trainers.name if trainers is not None else f"{run}-trainer"
        """The trainer actors' name: ``<run>-trainer-<rank>`` (``trainer_group``)."""
        self._source: Any = None
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Weights:
        config = self.config
        if config.train_workers and self.trainers is None:
            from trace_core.rollout.placement import reserve_run, run_shape
            from trace_core.rollout.ray_pool import ray_session
            from trace_core.train.trainer_group import TrainerGroup, TrainerSpec

            shape = run_shape(config.train_workers, config.train_gpus, config.engine)
            cpus = sum(int(b.get("CPU", 0)) for b in shape.bundles())
            self._stack.enter_context(
                ray_session(config.ray_address, num_cpus=max(os.cpu_count() or 1, cpus))
            )
            spec = TrainerSpec(
                config.objective(),
                config.train_workers,
                config.train_gpus,
                config.train_fsdp,
                place_timeout_s=config.engine.ready_timeout_s,
                wait_timeout_s=config.wait_timeout_s,
            )
            if shape.engines:  # the trainers' and the engine actors' devices, all or nothing
                what = f"the run {self.run} (train_workers={config.train_workers}, " + (
                    f"engine workers={shape.engines})"
                )
                self.placement = reserve_run(
                    shape, f"{self.run}-run", False, spec.place_timeout_s, what, say=print
                )
                self._stack.callback(self.placement.remove)  # after the trainers (LIFO)
            self.trainers = TrainerGroup(spec, self.start, name=self.name, placement=self.placement)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.trainers is not None and not self.keep:
            self.trainers.close()
        self._stack.close()  # the run's group, then Ray, if this started them

    def recover(
        self, checkpoint: int, folder: str | None, current: bool, say: Callable[[str], None]
    ) -> bool:
        """Before an update, or after an update or sync that failed: trainer actors that died
        (their state with them) are rebuilt from the run's newest checkpoint (iteration
        ``checkpoint``'s ``folder``; None: ``start``'s) (a path or ``s3://`` prefix) when that
        holds their state (``current``: nothing was trained since); otherwise the run stops
        with one line naming the checkpoint a rerun resumes from. Whether they were rebuilt
        (False: none died)."""
        trainers = self.trainers
        if trainers is None or trainers.alive():
            return False
        where = f"iteration {checkpoint}'s checkpoint" if checkpoint else "its start"
        where += f" ({folder})" if folder else ""
        if not current:
            raise TrainersLostError(
                f"a trainer actor died, and with it the training state since {where}; run the "
                "same command again: it resumes from there"
            )
        say(f"a trainer actor died: the trainers start again from {where}")
        from trace_core.train.trainer_group import TrainerGroup

        trainers.close()
        start = self.start
        if folder is not None:
            start = StartState(
                f"{folder}/policy",
                optimizer=f"{folder}/optimizer.safetensors",
                master=folder,
                reference=start.reference,
            )
        self.trainers = TrainerGroup(
            trainers.spec,
            start,
            name=self.name,
            detached=self.keep,
            placement=trainers.placement,  # the run's group: its trainers' bundle again
        )
        return True

    def sync(self, session: EngineSession, label: str) -> str | None:
        """New weights into ``session``'s engines, which then serve them as ``label``; None
        when they load files only (the caller writes a checkpoint for them to reload)."""
        pool = session.pool
        if pool is not None:
            if self.trainers is None and self._source is None:
                from trace_core.train.trainer_group import LocalSource

                self._source = LocalSource(self.model, self.serving)
            engines, pids = pool.sync_members()
            seconds = (self.trainers or self._source).sync(engines, pids, label)
            pool.synced(label, seconds)
            session.synced(label, seconds)
            return label
        if session.keeps:  # vLLM in this process
            return None
        if self.trainers is not None:  # an engine around this process's model: bring it up
            from trace_core.policy.weight_sync import ModuleSink

            self.trainers.sync([], [], label, local=ModuleSink(self.model))
        return label

    def saver(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        optimizer: torch.optim.Optimizer,
    ) -> Callable[[str | Path], None]:
        """Writes the checkpoint into a folder: ``policy/`` in the serving dtype, the optimizer
        state, and the master weights when the serving dtype rounds them."""
        trainers = self.trainers
        if trainers is not None:

            def save_resident(folder: str | Path) -> None:
                trainers.save(folder)

            return save_resident

        def save(target: str | Path) -> None:
            folder = Path(target)
            save_checkpoint(model, tokenizer, folder / "policy", dtype=self.serving)
            save_optimizer(optimizer, folder / "optimizer.safetensors")
            save_master(model, folder, self.serving)

        return save
