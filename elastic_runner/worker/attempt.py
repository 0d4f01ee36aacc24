"""One training attempt of one rank: from a process group that is up to the end of training.

An *attempt* is what runs between two rendezvous rounds. In order:

1. :meth:`Attempt.prepare`: the workload (datasets, model, task) is built and checked on its first
   items, on every rank, before anything is written — a bad input leaves ``run.dir`` as it was;
2. rank 0 claims a new generation in the run directory, fencing older attempts' writers
   (:mod:`elastic_runner.worker.run_dir`);
3. the event log, metrics and the :class:`~elastic_runner.training.checkpointer.Checkpointer`, then
   the peer watchdog (liveness before any slow set-up);
4. :meth:`Attempt.build`: optimizer, schedule, scaler and sampler — the
   :class:`~elastic_runner.training.parts.TrainingParts`, handed to the Checkpointer once;
5. :meth:`Attempt.resume`: the newest state of either snapshot tier, adapted to this world size;
6. :meth:`Attempt.train`: the wrapped model, the step, the loop; the final snapshot.

How an attempt ends — the ``end`` event, what is kept for the next attempt, the exit status — is
decided in one place, :mod:`elastic_runner.worker.ending`; :meth:`Attempt.run` records it. A peer
lost while this rank waits in a collective is noticed on the watchdog's thread
(:class:`PeerLost`), which keeps the state and leaves at once (with in-process recovery too: no
replacement comes for a peer that is alive but hung).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any, Callable

import torch

from .. import __version__
from ..config import Config, ConfigError
from ..config.imports import resolve
from ..data.corpus import mixture_sampler
from ..data.datasets import TensorPairDataset
from ..data.mixture import MixtureDataset
from ..data.order import DEFAULT_ORDER
from ..data.layout import layout_for
from ..data.sampler import ElasticSampler
from ..data.sources import BatchSource, KeptLoaders, LoaderSource, TensorSource, collate_items, to_device
from ..observe.audit import AuditWriter
from ..observe.events import EventLog, furthest_step_reached
from ..observe.goodput import publish_goodput
from ..observe.logs import say
from ..observe.metrics import Metrics
from ..observe.records import RecordSync
from ..training import parallel
from ..training.adapt import planned_total_steps, refresh_schedule, rescale_lr
from ..training.bookkeeping import StepBooks
from ..training.checkpointer import Checkpointer
from ..training.compiling import compiled_forward, use_private_cache
from ..training.evaluation import Evaluator
from ..training.gradients import StepGradients
from ..training.loop import AttemptStart, ParkChannel, Trainer
from ..training.parts import TrainingParts
from ..training.sharding import FSDPSync, check_shardable, compile_units, shard_model
from ..training.state import TrainState
from ..training.step import TrainStep
from ..workload.spec import Workload, check, check_batchnorm, from_config
from ..dist import Dist
from .ending import Ending, RetryableSetupError, SetupError, ending_for, peer_lost_exit
from ..env import WorkerEnv
from ..lifecycle import EXIT_FINAL, StopRequest, exit_now
from .preflight import largest_world_size, parent_cmdline
from .run_dir import prepare_run_dir, record_sync
from ..snapshot.format import current_signing_key
from .watchdog import PeerWatchdog, start_watchdog

log = logging.getLogger("elastic_runner.train")


class PeerLost:
    """The watchdog's handler when a peer is lost (runs on the watchdog's thread).

    If the main thread is already ending the attempt (a failure or a stop it is handling), it
    leaves that to the main thread. Otherwise the main thread is stuck in a collective with the
    lost peer: with NCCL the process group is aborted first (only that returns the GPU stream to
    us), then the state is kept and the worker exits at once (:func:`~.ending.peer_lost_exit`).
    With in-process recovery too: a peer that stops answering without its connections failing is
    alive (hung) or on a lost node, and no agent replaces it, so every worker restarts.
    """

    def __init__(self, env: WorkerEnv, dist: Dist, stop: StopRequest, events: EventLog,
                 checkpointer: Checkpointer) -> None:
        self.env, self.dist, self.stop, self.events, self.checkpointer = env, dist, stop, events, checkpointer

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
        exit_now(peer_lost_exit(self.stop.requested), f"rank {self.env.rank}: {reason}; ending this attempt")


class Attempt:
    """One training attempt of one rank; :meth:`run` returns when training finished."""

    def __init__(self, cfg: Config, env: WorkerEnv, dist: Dist, stop: StopRequest, started_at: float,
                 make_workload: Callable[[], Workload] | None = None, kept: Workload | None = None,
                 park: ParkChannel | None = None, loaders: KeptLoaders | None = None,
                 skip_steps: frozenset[int] = frozenset()) -> None:
        self.cfg, self.env, self.dist, self.stop, self.started_at = cfg, env, dist, stop, started_at
        #: Steps this process's earlier attempts rolled back from (a non-finite gradient): skipped by rule from now on,
        #: whatever the snapshot resumed from knows (one from before the rollback knows nothing of it).
        self.skip_steps = skip_steps
        #: How this worker's agent asks it to leave for a new membership (:mod:`.handover`), at a step boundary.
        self.park = park
        self.make_workload = make_workload or (lambda: from_config(cfg))
        #: What an earlier attempt of this process built (in-process recovery): its model, on the device, with the
        #: compiled code torch keeps for it; or what this process built as a standby (:mod:`.standby`). Its state
        #: is replaced by the resumed one.
        self.kept = kept
        #: The DataLoaders (and their worker processes) this process keeps from one attempt to the next.
        self.loaders = loaders
        self.state = TrainState()
        self.watchdog: PeerWatchdog | None = None
        self.resume_info: dict[str, Any] | None = None  #: rank 0, once resumed: the ``resume`` event's fields
        self.records: RecordSync | None = None  #: the upload of the node's records (snapshots in a bucket)

    def run(self) -> None:
        cfg, env, dist = self.cfg, self.env, self.dist
        self.prepare()  # before anything is written: a bad input leaves run.dir as it was
        store, generation, run_uid = prepare_run_dir(cfg, env, dist)
        self.generation = self.stop.generation = generation
        records = self.records = record_sync(cfg, env, store, generation)
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
        lost = PeerLost(env, dist, self.stop, events, self.checkpointer)
        self.watchdog = start_watchdog(env, generation, cfg.dist.heartbeat_seconds,
                                       startup_grace=cfg.dist.init_timeout_seconds, on_lost=lost.on_peer_lost,
                                       key=current_signing_key())
        metrics.serve(cfg.metrics.port, cfg.metrics.bind)
        metrics.set_restarts(env.restart_count)
        metrics.set_generation(generation)
        # A worker that ends because a peer failed leaves its last records to the node's next worker (the node is
        # still there, the files too): uploading them now would hold up the recovery.
        last_upload = False
        try:
            parts = self.build()
            resumed = self.resume(parts)
            result = self.train(parts, resumed)
            self.checkpointer.finished()
            self._report_end(result)
            last_upload = True
        except BaseException as exc:
            ending = ending_for(exc, self.stop.requested)
            # A restart comes after a peer's failure (keeps_state); a job-ending status (2, 3, 4) or a stop does not.
            last_upload = self.stop.requested or not ending.keeps_state or ending.exit_code in EXIT_FINAL
            self.record_end(ending, exc)
            raise
        finally:
            if self.watchdog is not None:
                self.watchdog.stop(done=False)
            metrics.close()
            events.close()
            if records is not None:
                records.close(final=last_upload)  # after the last event: the whole attempt reaches the bucket

    def _audit_header(self, parts: TrainingParts, resumed: bool) -> dict[str, Any]:
        """The first record of this rank's audit trail: the dataset and its order, and where the attempt resumed (a
        snapshot's step and sampler position prove what came before it, should every record of it be lost)."""
        cfg, w, sampler = self.cfg, self.workload, parts.sampler
        mixture = sampler.state_dict() if isinstance(w.train, MixtureDataset) else None
        header = {"num_samples": w.num_train, "seed": cfg.run.seed, "shuffle": cfg.data.shuffle,
                  "partial_batch": cfg.data.partial_batch, "global_batch": self.layout.global_size,
                  "sampler": "mixture" if mixture else cfg.data.sampler,
                  # The order this attempt follows, as resumed: a run from before order kinds goes on in randperm.
                  "order": getattr(sampler, "order_kind", DEFAULT_ORDER)}
        epoch, consumed = getattr(sampler, "epoch", None), getattr(sampler, "consumed", None)
        if resumed and isinstance(epoch, int) and isinstance(consumed, int):
            header["resumed_at"] = {"step": self.state.step, "epoch": epoch, "consumed": consumed}
        if self.checkpointer.started_from:
            header["started_from"] = self.checkpointer.started_from
        if mixture:
            header["sources"] = [{"label": label, "samples": n, "weight": weight}
                                 for label, n, weight in zip(mixture["labels"], mixture["sizes"], mixture["weights"])]
        return header

    def _records_soon(self) -> None:
        """At the first step: this attempt's records at once, and a second later (off the recovery's critical path)
        whatever of the node's earlier attempts the bucket still lacks."""
        assert self.records is not None
        self.records.soon(then_all_after=1.0)

    def reusable(self) -> Workload | None:
        """What the next attempt of this process may train instead of building it again (in-process recovery):
        the workload of a replicated model with the ordered gradient sync. A sharded model's parameters were
        replaced by their shards, and a DDP wrapper holds hooks on them; those are built again."""
        cfg = self.cfg
        if cfg.parallel.sharded or cfg.dist.gradient_sync != "ordered":
            return None
        return getattr(self, "workload", None)

    def keep_for_next_attempt(self, ending: Ending) -> None:
        """The loop broke (usually a peer died): leave the last completed step for the next attempt."""
        if not ending.keeps_state:
            return
        ckpt = self.checkpointer
        ckpt.ending.set()  # our own watchdog must not race us to the exit
        if self.watchdog is not None:
            self.watchdog.stop(done=False)
            if not self._peers_see_it_themselves(ending):
                self.watchdog.abort(f"rank {self.env.rank} failed at step {self.state.step}")
        if self.stop.requested and ckpt.writer is not None:
            # A peer stopped first and broke the collective; our last completed step is
            # the newest state there is: make it durable (a failure here is reported).
            ckpt.save("stop", sync=True)
        else:
            ckpt.keep("failure")

    def _peers_see_it_themselves(self, ending: Ending) -> bool:
        """Whether this rank leaves its peers' watchdogs alone as it ends the attempt: with in-process recovery on
        gloo, when it survives a peer's failure or fails on its own (its agent replaces it alone). Its peers then see
        the broken collective (or the closed connections of a survivor that gave the group up) and rebuild; the
        job-wide abort would make their watchdogs end their process, the restart of every worker that in-process
        recovery avoids (a third survivor read it before its own collective failed). On NCCL a collective need not
        fail on a peer's death: there the abort is what releases the others (their watchdogs abort the group)."""
        return (self.dist.in_process is not None and ending.exit_code is None and not self.stop.requested
                and self.dist.device.type != "cuda")

    def record_end(self, ending: Ending, exc: BaseException) -> None:
        """The attempt's last events: how it ended (:mod:`~elastic_runner.worker.ending` decided)."""
        step = self.state.step
        if ending.peers_stopped_first:
            self.events.emit("stop", step=step, signal=self.stop.signal_name, by_agent=self.stop.agent_reason,
                             note=f"peers stopped first ({type(exc).__name__})")
        if ending.status == "failed":
            self.events.emit("failure", error=f"{type(exc).__name__}: {str(exc)[:300]}", step=step)
        else:
            self.events.emit("end", status=ending.status, step=step,
                             **({"error": str(exc)[:500]} if ending.status == "finished_not_durable" else {}))

    # -- what is trained ------------------------------------------------------------------------------------

    def prepare(self) -> None:
        """What is trained, on this rank's device, checked on its first items; every rank agrees."""
        cfg, env, dist = self.cfg, self.env, self.dist
        problem: BaseException | None = None
        try:
            self.workload = self.kept if self.kept is not None else self.make_workload()
            self.layout = layout_for(cfg.batch, env.world_size)
            self.model = self.workload.model.to(dist.device)
            if self.kept is not None:
                self.model.train()  # as built (the attempt may have ended inside an evaluation)
                for param in self.model.parameters():
                    param.grad = None  # views of the ended attempt's gradient buckets
            check(self.workload, dist.device, self.layout.micro_size)
            if cfg.parallel.sharded:
                check_shardable(cfg, self.workload, env.world_size, env.local_world_size)
            if cfg.model.compile or self.workload.compiled is not None:
                use_private_cache()
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

    def build(self) -> TrainingParts:
        """Optimizer, schedule, scaler and sampler around the model: the parts a step changes."""
        cfg, env, dist, w = self.cfg, self.env, self.dist, self.workload
        sampler_cls = ElasticSampler if cfg.data.sampler == "elastic" else resolve(cfg.data.sampler, "data.sampler")
        try:
            if isinstance(w.train, MixtureDataset):  # data.sources
                sampler = mixture_sampler(w.train, self.layout.global_size, seed=cfg.run.seed,
                                          shuffle=cfg.data.shuffle, rank=env.rank, world_size=env.world_size)
            else:
                sampler = sampler_cls(w.num_train, self.layout.global_size, seed=cfg.run.seed,
                                      shuffle=cfg.data.shuffle, partial_batch=cfg.data.partial_batch,
                                      rank=env.rank, world_size=env.world_size)
        except ValueError as exc:
            raise ConfigError("batch.global_size", str(exc), "Adjust batch.global_size or data.partial_batch") from exc
        if cfg.parallel.sharded:  # before the optimizer: it must hold this rank's shards only
            shard_model(self.model, cfg.parallel, dist.device, env.world_size, env.local_world_size)
        optimizer = w.make_optimizer(self.model.parameters(), self.layout.lr_scale)
        self.total_steps = planned_total_steps(cfg, sampler, 0)
        scheduler = w.make_schedule(optimizer, self.total_steps)
        scaler = None
        if cfg.train.precision == "fp16":
            if dist.device.type != "cuda":
                raise ConfigError("train.precision", "fp16 needs a CUDA device", "Use train.precision: bf16 or fp32 on CPU")
            scaler = torch.amp.GradScaler("cuda")
        self.state.lr_scale = self.layout.lr_scale
        parts = TrainingParts(model=self.model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                              sampler=sampler, state=self.state)
        self.checkpointer.track(parts)
        return parts

    # -- resume -----------------------------------------------------------------------------------------------

    def resume(self, parts: TrainingParts) -> bool:
        cfg, env, state = self.cfg, self.env, self.state
        loaded = self.checkpointer.restore()
        if loaded is None and self.kept is not None:
            # Nothing to resume from anywhere: the run starts over, from the weights a new process would build.
            self.model.load_state_dict(self.make_workload().model.state_dict())
        if loaded is not None:
            # The run's length and learning rate follow the current config and world size.
            self.total_steps = planned_total_steps(cfg, parts.sampler, state.step)
            refresh_schedule(parts.scheduler, cfg.schedule, self.total_steps)
            rescale_lr(parts.optimizer, parts.scheduler, old=state.lr_scale, new=self.layout.lr_scale)
            state.lr_scale = self.layout.lr_scale
        parts.sampler.reshard(env.rank, env.world_size)
        state.enter_generation(self.generation, env.world_size, loaded is not None)
        # Every rank skips the same steps: those its resumed state knows, and those any kept process rolled back from
        # since (a replacement process knows none of them; a rank skipping alone would leave the others in a collective).
        mine = {"agent": env.agent_id, "skips": sorted(set(state.skipped_steps) | set(self.skip_steps))}
        everyone = self.dist.all_gather_object(mine)
        state.add_skipped(step for other in everyone for step in other["skips"])
        agents = [other["agent"] for other in everyone if other["agent"]]
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
        self._announce(parts, resumed=loaded is not None)
        return loaded is not None

    def _announce(self, parts: TrainingParts, resumed: bool) -> None:
        layout, m, sampler = self.layout, self.metrics, parts.sampler
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

    # -- training ---------------------------------------------------------------------------------------------

    def train(self, parts: TrainingParts, resumed: bool) -> dict[str, Any]:
        cfg, env, dist, ckpt, w = self.cfg, self.env, self.dist, self.checkpointer, self.workload
        ckpt.open_writer()
        audit = None
        if cfg.audit.samples:
            audit = AuditWriter(cfg.run.dir, generation=self.generation, rank=env.rank, world_size=env.world_size,
                                header=self._audit_header(parts, resumed))
            if self.records is not None:
                self.records.soon()  # the header says this rank is in the attempt, should its node be lost early
        sync: parallel.GradientSync
        if cfg.parallel.sharded:
            if cfg.model.compile or w.compiled is not None:
                if w.compiled is not None and dist.rank == 0:
                    log.info("the script's compiled model is sharded: compiled again unit by unit (a compiled "
                             "wrapper around a sharded model compiles nothing), with static shapes")
                compile_units(parts.model)
            sync = FSDPSync(parts.model, self._stand_in())
        else:
            forward = compiled_forward(parts.model, cfg.model.compile, w.compiled)
            sync = parallel.replicate(parts.model, dist.device, cfg.dist.gradient_sync, forward=forward)
        ckpt.at_boundary()  # every rank's parameters and buffers are now rank 0's
        gradients = StepGradients(dist, parts.model, cfg.optim.grad_clip_norm, cfg.train.on_nonfinite, parts.scaler,
                                  averages_over=sync.averages_over)
        step = TrainStep(parts, sync, w.task, self.layout, gradients, seed=cfg.run.seed, rank=dist.rank,
                         device=dist.device, precision=cfg.train.precision,
                         timed=cfg.recovery.straggler_ratio is not None)
        books = StepBooks(cfg, dist, self.state, self.layout, self.total_steps, events=self.events,
                          metrics=self.metrics, audit=audit, tokens_per_sample=w.model_build.get("block_size"))
        test_size = len(w.test) if w.test is not None else 0  # type: ignore[arg-type]
        evaluator = Evaluator(dist, sync.module, parts.model, w.task,
                              self._source("test", w.test, cfg.run.seed) if w.test is not None else None, test_size,
                              cfg.data.eval_batch_size, self.metrics,
                              lockstep=self._stand_in(evaluating=True) if cfg.parallel.sharded else None)
        trainer = Trainer(cfg, dist, parts, step, books, evaluator,
                          self._source("train", w.train, cfg.run.seed + parts.sampler.epoch), ckpt,
                          total_steps=self.total_steps, start=AttemptStart(self.started_at, resumed, self.resume_info),
                          stop=self.stop, events=self.events, metrics=self.metrics, watchdog=self.watchdog,
                          on_first_step=self._records_soon if self.records is not None else None,
                          park=self.park)
        try:
            return trainer.fit()
        except BaseException as exc:
            self.keep_for_next_attempt(ending_for(exc, self.stop.requested))
            raise
        finally:
            sync.close()
            ckpt.close()
            if audit is not None:
                audit.close()

    def _stand_in(self, evaluating: bool = False) -> Callable[[torch.nn.Module], torch.Tensor]:
        """A sharded model's forward on the first training items, for a rank that has no sample where its peers
        run the model (every forward gathers parameters: :mod:`elastic_runner.training.sharding`)."""
        w = self.workload
        n = max(1, min(2, w.num_train))  # BatchNorm in training mode needs two
        batch = to_device(collate_items(w.train, list(range(n)), w.collate), self.dist.device)

        def run(module: torch.nn.Module) -> torch.Tensor:
            if evaluating:
                w.task.eval_sums(module, batch, n)
                return torch.zeros(())
            losses, _ = w.task.compute_loss(module, batch, n)
            return losses.sum()

        return run

    def _source(self, role: str, dataset: Any, seed: int) -> BatchSource:
        w, device, workers = self.workload, self.dist.device, self.cfg.data.num_workers
        if isinstance(dataset, TensorPairDataset) and w.collate is None:
            return TensorSource(dataset.x, dataset.y, device)
        if self.loaders is not None and workers > 0:
            return self.loaders.source(role, dataset, lambda: LoaderSource(dataset, device, workers, seed,
                                                                           collate=w.collate, keep_workers=True))
        return LoaderSource(dataset, device, workers, seed, collate=w.collate)

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
