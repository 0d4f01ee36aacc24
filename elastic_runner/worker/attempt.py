"""One training attempt of one rank: from a process group that is up to the end of training.

An *attempt* is what runs between two rendezvous rounds. In order: rank 0 claims a new
generation in the run directory (fencing older attempts' writers) → the event log, metrics and
the :class:`~elastic_runner.training.checkpointer.Checkpointer` → the peer watchdog (liveness first, before
any slow set-up) → datasets, model, optimizer, schedule, sampler → resume from the newest state of
either snapshot tier → the loop → the final snapshot.

How an attempt ends:

- finished: final snapshot written, node memory dropped, ``end`` event;
- a stop signal: the loop writes a snapshot (and keeps it in node memory) and raises
  :class:`~elastic_runner.training.loop.GracefulStop`;
- a failure (usually a peer died and a collective raised): the last completed step is kept in
  node memory for the next attempt;
- a peer lost while this rank waits in a collective: :class:`AttemptEnd`, called from the
  watchdog's thread, keeps the state and leaves with :data:`~elastic_runner.worker.lifecycle.EXIT_PEER_LOST`.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
import time
from typing import Any, Callable

import torch

from .. import __version__
from ..config import Config, ConfigError, write_effective_config
from ..config.imports import resolve
from ..data.datasets import TensorPairDataset
from ..data.sampler import ElasticSampler
from ..data.sources import BatchSource, LoaderSource, TensorSource
from ..files import makedirs
from ..observe.audit import AuditWriter
from ..observe.events import EventLog, furthest_step_reached
from ..observe.goodput import publish_goodput
from ..observe.logs import say
from ..observe.metrics import Metrics
from ..snapshot import LocalStore, SnapshotError, open_store
from ..training.checkpointer import Checkpointer, FinalSnapshotFailed, StopSnapshotFailed
from ..training.layout import layout_for
from ..training.loop import (
    Components,
    GracefulStop,
    Trainer,
    TrainState,
    planned_total_steps,
    refresh_schedule,
    rescale_lr,
)
from ..workload.spec import Workload, check, check_batchnorm, from_config
from .dist import Dist
from .env import WorkerEnv
from .lifecycle import EXIT_PEER_LOST, StopRequest, exit_now
from .preflight import largest_world_size, parent_cmdline
from .watchdog import PeerWatchdog, start_watchdog

log = logging.getLogger("elastic_runner.train")


class SetupError(RuntimeError):
    """Rank 0 could not prepare the run; every rank stops with its message."""


class RetryableSetupError(RuntimeError):
    """Rank 0 could not prepare the run for a reason that may pass (I/O): the attempt is retried."""


# errno values that mean "this run directory cannot work" rather than "try again".
_PERMANENT_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST, errno.ENAMETOOLONG}


def prepare_run_dir(cfg: Config, env: WorkerEnv, dist: Dist) -> tuple[LocalStore, int, str]:
    """Rank 0 claims the generation and writes the effective config; all ranks learn the outcome."""
    store = open_store(cfg.snapshot_dir)
    outcome: tuple[str, Any, str] = ("ok", 0, "")
    if dist.rank == 0:
        try:
            if os.path.exists(cfg.run.dir) and not os.path.isdir(cfg.run.dir):
                raise NotADirectoryError(errno.ENOTDIR, "it exists and is not a directory")
            makedirs(cfg.run.dir)
            if not os.access(cfg.run.dir, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, f"not writable by uid {os.getuid()}")
            store.ensure()
            run_uid = store.run_uid()
            generation = store.claim_generation({"world_size": env.world_size, "run_id": env.run_id,
                                                 "restart_count": env.restart_count})
            store.sweep(generation)
            write_effective_config(cfg, cfg.run.dir)
            outcome = ("ok", generation, run_uid)
        except (OSError, SnapshotError) as exc:
            cause = exc if isinstance(exc, OSError) else exc.__cause__
            permanent = not isinstance(cause, OSError) or cause.errno in _PERMANENT_ERRNOS
            fix = ("; choose another run.dir (or remove that file)" if isinstance(cause, NotADirectoryError) else
                   "; fix its permissions or choose another run.dir" if permanent else "; retrying with the next attempt")
            message = f"cannot prepare run.dir {cfg.run.dir!r}: {exc}{fix}"
            outcome = ("usage" if permanent else "retry", message, "")
    status, value, run_uid = dist.broadcast_object(outcome)
    if status == "usage":
        raise SetupError(value)
    if status == "retry":
        raise RetryableSetupError(value)
    return store, int(value), run_uid


class AttemptEnd:
    """The watchdog's handler when a peer is lost (runs on the watchdog's thread).

    If the main thread is already ending the attempt (a failure or a stop it is handling), it
    leaves that to the main thread. Otherwise the main thread is stuck in a collective with the
    lost peer: with NCCL the process group is aborted first (only that returns the GPU stream to
    us), then the state is kept and the worker exits with ``EXIT_PEER_LOST`` — or 0 when this rank
    was asked to stop anyway.
    """

    def __init__(self, env: WorkerEnv, dist: Dist, stop: StopRequest, events: EventLog,
                 checkpointer: Checkpointer) -> None:
        self.env = env
        self.dist = dist
        self.stop = stop
        self.events = events
        self.checkpointer = checkpointer

    def on_peer_lost(self, reason: str) -> None:
        ckpt = self.checkpointer
        self.events.emit("failure", error=f"peer lost: {reason}", step=ckpt.state.step, detected_by="watchdog")
        if ckpt.ending.is_set():
            return  # the main thread is already keeping state and exiting
        if self.dist.device.type == "cuda":
            self.dist.abort()
            # The main thread now raises out of its collective and ends the attempt
            # through its own failure path; if it does not, we do it here.
            if ckpt.ending.wait(5.0):
                return
        ckpt.keep("peer lost")
        exit_now(0 if self.stop.requested else EXIT_PEER_LOST, f"rank {self.env.rank}: {reason}; ending this attempt")


class Attempt:
    """One training attempt of one rank; :meth:`run` returns when training finished."""

    def __init__(self, cfg: Config, env: WorkerEnv, dist: Dist, stop: StopRequest, started_at: float,
                 make_workload: Callable[[], Workload] | None = None) -> None:
        self.cfg, self.env, self.dist, self.stop, self.started_at = cfg, env, dist, stop, started_at
        self.make_workload = make_workload or (lambda: from_config(cfg))
        self.state = TrainState()
        self.resume_info: dict[str, Any] | None = None  #: rank 0, once resumed: the ``resume`` event's fields

    def run(self) -> None:
        cfg, env, dist = self.cfg, self.env, self.dist
        self.prepare()  # before anything is written: a bad input leaves run.dir as it was
        store, generation, run_uid = prepare_run_dir(cfg, env, dist)
        self.generation = generation
        events = self.events = EventLog(cfg.run.dir, f"gen-{generation:06d}-rank-{env.rank:05d}",
                                        generation=generation, rank=env.rank)
        events.emit("start", world_size=env.world_size, local_rank=env.local_rank, restart_count=env.restart_count,
                    run_id=env.run_id, device=str(dist.device), backend=dist.backend, process_start=self.started_at,
                    version=__version__, zygote="elastic_runner.agent.warm" in sys.modules, agent=env.agent_id)
        metrics = self.metrics = Metrics(env.rank, env.local_rank)
        self.checkpointer = Checkpointer(cfg, env, dist, store, generation=generation, run_uid=run_uid,
                                         state=self.state, events=events, metrics=metrics,
                                         identity=self.workload.identity, model_build=self.workload.model_build)
        # Liveness first: every rank is here within milliseconds of the others (the process
        # group is up), so no rank is declared dead for being slow to build its optimizer.
        end = AttemptEnd(env, dist, self.stop, events, self.checkpointer)
        self.watchdog: PeerWatchdog | None = start_watchdog(
            env, generation, cfg.dist.heartbeat_seconds, startup_grace=cfg.dist.init_timeout_seconds,
            on_lost=end.on_peer_lost)
        metrics.serve(cfg.metrics.port, cfg.metrics.bind)
        metrics.set_restarts(env.restart_count)
        metrics.set_generation(generation)
        try:
            self.build()
            resumed = self.resume()
            self._announce(resumed)
            result = self.train(resumed)
            self.checkpointer.finished()
            self._report_end(result)
        except GracefulStop:
            events.emit("end", status="stopped", step=self.state.step)
            raise
        except FinalSnapshotFailed as exc:
            events.emit("end", status="finished_not_durable", step=self.state.step, error=str(exc)[:500])
            raise
        except BaseException as exc:
            step = self.state.step
            if self.stop.requested and isinstance(exc, Exception) and not isinstance(exc, StopSnapshotFailed):
                # Peers that stopped first broke our collective: this is the stop we were asked for.
                events.emit("stop", step=step, signal=self.stop.signal_name, by_agent=self.stop.agent_reason,
                            note=f"peers stopped first ({type(exc).__name__})")
                events.emit("end", status="stopped", step=step)
            else:
                events.emit("failure", error=f"{type(exc).__name__}: {str(exc)[:300]}", step=step)
            raise
        finally:
            if self.watchdog is not None:
                self.watchdog.stop(done=False)
            metrics.close()
            events.close()

    # -- components ---------------------------------------------------------------------------------------

    def prepare(self) -> None:
        """What is trained, on this rank's device, checked on its first items; every rank agrees."""
        cfg, env, dist = self.cfg, self.env, self.dist
        problem: BaseException | None = None
        try:
            self.workload = self.make_workload()
            self.layout = layout_for(cfg.batch, env.world_size)
            self.model = self.workload.model.to(dist.device)
            check(self.workload, dist.device, self.layout.micro_size)
            largest = largest_world_size(os.environ, env.world_size, env.local_world_size, parent_cmdline())
            check_batchnorm(self.model, dist.device, cfg.batch, largest, env.world_size, self.workload.num_train,
                            cfg.data.partial_batch == "partial")
        except Exception as exc:  # noqa: BLE001 - raised below, after every rank has said how it went
            problem = exc
        verdicts = dist.all_gather_object(None if problem is None else (isinstance(problem, ConfigError), str(problem)))
        if problem is not None:
            raise problem
        for rank, verdict in enumerate(verdicts):
            if verdict is not None:
                usage, message = verdict
                raise (SetupError if usage else RetryableSetupError)(f"rank {rank}: {message}")

    def build(self) -> None:
        cfg, env, dist, w = self.cfg, self.env, self.dist, self.workload
        sampler_cls = ElasticSampler if cfg.data.sampler == "elastic" else resolve(cfg.data.sampler, "data.sampler")
        try:
            sampler = sampler_cls(w.num_train, self.layout.global_size, seed=cfg.run.seed,
                                  shuffle=cfg.data.shuffle, partial_batch=cfg.data.partial_batch,
                                  rank=env.rank, world_size=env.world_size)
        except ValueError as exc:
            raise ConfigError("batch.global_size", str(exc), "Adjust batch.global_size or data.partial_batch") from exc
        optimizer = w.make_optimizer(self.model.parameters(), self.layout.lr_scale)
        self.total_steps = planned_total_steps(cfg, sampler, 0)
        scheduler = w.make_schedule(optimizer, self.total_steps)
        scaler = None
        if cfg.train.precision == "fp16":
            if dist.device.type != "cuda":
                raise ConfigError("train.precision", "fp16 needs a CUDA device", "Use train.precision: bf16 or fp32 on CPU")
            scaler = torch.amp.GradScaler("cuda")
        self.state.lr_scale = self.layout.lr_scale
        self.checkpointer.track(model=self.model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                                sampler=sampler)

    # -- resume -----------------------------------------------------------------------------------------------

    def resume(self) -> bool:
        cfg, env, state, ckpt = self.cfg, self.env, self.state, self.checkpointer
        loaded = ckpt.restore()
        if loaded is not None:
            # The run's length and learning rate follow the current config and world size.
            self.total_steps = planned_total_steps(cfg, ckpt.sampler, state.step)
            refresh_schedule(ckpt.scheduler, cfg.schedule, self.total_steps)
            rescale_lr(ckpt.optimizer, ckpt.scheduler, old=state.lr_scale, new=self.layout.lr_scale)  # type: ignore[arg-type]
            state.lr_scale = self.layout.lr_scale
        ckpt.sampler.reshard(env.rank, env.world_size)
        state.enter_generation(self.generation, env.world_size, loaded is not None)
        agents = [a for a in self.dist.all_gather_object(env.agent_id) if a]
        state.start_clock(time.time(), agents, resumed=loaded is not None, by_hand=not env.under_torchrun)
        if env.local_rank == 0:  # the agent's clock, rolled back with the state, not training yet
            publish_goodput(state.productive_s, state.goodput_wall_s(time.time()), training=False)
        self.metrics.restore({"membership_changes": state.membership_changes, "recoveries": state.recoveries})
        if loaded is not None and self.dist.rank == 0:
            reached = furthest_step_reached(cfg.run.dir, self.generation)
            recomputed = max(0, reached - state.step)
            self.metrics.recomputed.set(recomputed)
            self.resume_info = {"step": state.step, "furthest_step": reached, "steps_recomputed": recomputed,
                                "snapshot": loaded.ref.name, "tier": loaded.tier}
            self.events.emit("resume", **self.resume_info)
        return loaded is not None

    # -- training ---------------------------------------------------------------------------------------------

    def _announce(self, resumed: bool) -> None:
        layout, m, sampler = self.layout, self.metrics, self.checkpointer.sampler
        m.world_size.set(self.env.world_size)
        m.global_batch.set(layout.global_size)
        m.micro_batch.set(layout.micro_size)
        m.accumulation.set(layout.accumulation)
        self.events.emit("world", world_size=self.env.world_size, global_batch=layout.global_size,
                         micro_batch=layout.micro_size, accumulation=layout.accumulation, step=self.state.step)
        if self.dist.rank == 0:
            log.info("%s %s; dataset %s; at step %d/%d (epoch %d, %d consumed); generation %d",
                     "resuming" if resumed else "starting", layout.describe(), self.workload.description,
                     self.state.step, self.total_steps, sampler.epoch, sampler.consumed, self.generation)

    def train(self, resumed: bool) -> dict[str, Any]:
        cfg, env, dist, ckpt = self.cfg, self.env, self.dist, self.checkpointer
        ckpt.open_writer()
        audit = None
        if cfg.audit.samples:
            audit = AuditWriter(cfg.run.dir, generation=self.generation, rank=env.rank, world_size=env.world_size, header={
                "num_samples": self.workload.num_train, "seed": cfg.run.seed, "shuffle": cfg.data.shuffle,
                "partial_batch": cfg.data.partial_batch, "global_batch": self.layout.global_size,
                "sampler": cfg.data.sampler,
            })
        w = self.workload
        ddp = dist.wrap(self.model)
        ckpt.at_boundary()  # DDP made every rank's parameters and buffers rank 0's
        trainer = Trainer(Components(
            cfg=cfg, dist=dist, model=self.model, ddp=ddp, task=w.task, layout=self.layout,
            source=self._source(w.train, cfg.run.seed + ckpt.sampler.epoch),
            test_source=self._source(w.test, cfg.run.seed) if w.test is not None else None,
            test_size=len(w.test) if w.test is not None else 0,  # type: ignore[arg-type]
            total_steps=self.total_steps, checkpointer=ckpt, events=self.events, metrics=self.metrics, audit=audit,
            stop=self.stop, started_at=self.started_at, resumed=resumed, watchdog=self.watchdog,
            resume_info=self.resume_info,
        ))
        try:
            return trainer.fit()
        except (GracefulStop, FinalSnapshotFailed):
            raise  # FinalSnapshotFailed: every step is done and the state kept; nothing failed for the peers
        except BaseException:
            self._on_failure()
            raise
        finally:
            ckpt.close()
            if audit is not None:
                audit.close()

    def _on_failure(self) -> None:
        """The attempt broke (usually a peer died): keep what we have for the next one."""
        ckpt = self.checkpointer
        ckpt.ending.set()  # our own watchdog must not race us to the exit
        if self.watchdog is not None:
            self.watchdog.stop(done=False)
            self.watchdog.abort(f"rank {self.env.rank} failed at step {self.state.step}")
        if self.stop.requested and ckpt.writer is not None:
            # A peer stopped first and broke the collective; our last completed step is
            # the newest state there is: make it durable (a failure here is reported).
            ckpt.save("stop", sync=True)
        else:
            ckpt.keep("failure")

    def _source(self, dataset: Any, seed: int) -> BatchSource:
        w, device = self.workload, self.dist.device
        if isinstance(dataset, TensorPairDataset) and w.collate is None:
            return TensorSource(dataset.x, dataset.y, device)
        return LoaderSource(dataset, device, self.cfg.data.num_workers, seed, collate=w.collate)

    def _report_end(self, result: dict[str, Any]) -> None:
        step = self.state.step
        self.events.emit("end", status="finished", step=step, **{k: v for k, v in result.items() if k != "step"})
        if self.dist.rank == 0:
            shown = {k.removeprefix("eval_"): v for k, v in result.items()
                     if k.startswith("eval_") and k != "eval_samples" and isinstance(v, float)}
            log.info("finished at step %d%s; snapshots in %s", step,
                     "".join(f", test {k} {v:.4g}" for k, v in shown.items()), self.checkpointer.store.location)
            say(f"elastic_runner: finished step={step}" + "".join(f" test_{k}={v:.4f}" for k, v in shown.items()),
                sys.stdout)
