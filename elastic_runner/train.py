"""The worker: ``python -m elastic_runner.train --config FILE [--set key=value ...]``.

Runs alone (world size 1), under ``torchrun --standalone``, or as part of a
multi-node elastic job; it reads its place in the job from the environment.
Data flow: env → config → process group → generation claim → datasets,
model, optimizer → resume from the newest snapshot → DDP → loop → final
snapshot → process group down (on every exit path).

Exit status: 0 finished or stopped gracefully (SIGTERM/SIGINT), 2 a
configuration or resume problem (the message says what to fix), 75 peers did
not arrive in time, 1 anything else.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import sys
import time
from typing import Any, Sequence

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from . import __version__
from .audit import AuditWriter
from .batching import layout_for
from .config import Config, ConfigError, load_config, write_effective_config
from .data import build_datasets, make_source
from .dist import Dist, DistError
from .env import EnvError, WorkerEnv
from .events import EventLog
from .imports import resolve
from .lifecycle import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    StopRequest,
    die_with_parent,
    name_process,
    process_start_time,
)
from .logs import setup_logging
from .loop import (
    Components, GracefulStop, Trainer, TrainState, planned_total_steps, refresh_schedule, rescale_lr, rng_state,
    set_rng_state,
)
from .metrics import Metrics
from .models import build_model
from .optim import build_optimizer, build_schedule
from .preflight import warn_known_bad_setups
from .recovery import AttemptEnd, Keeper, StateGuard, start_watchdog
from .resume import ResumeError, check_compatible, furthest_step_reached, restore, select_snapshot
from .sampler import ElasticSampler
from .snapshot import SnapshotError, SnapshotWriter, StaleWriterError, open_store, require_ok
from .snapshot.memory import MemoryTier, memory_root
from .watchdog import PeerWatchdog

log = logging.getLogger("elastic_runner.train")

class SetupError(RuntimeError):
    """Rank 0 could not prepare the run; every rank stops with its message."""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="elastic-runner train", description="Train from a YAML config (one worker).")
    parser.add_argument("--config", "-c", required=True, help="YAML config file, e.g. configs/quickstart.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set optim.lr=0.05 (repeatable; beats the file)")
    # torch.distributed.launch passed the local rank as an argument.
    parser.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


@record
def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        env = WorkerEnv.from_environ(legacy_local_rank=args.local_rank)
    except (ConfigError, EnvError) as exc:
        print(f"elastic_runner: config error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return run(cfg, env)


def run(cfg: Config, env: WorkerEnv) -> int:
    started_at = process_start_time()
    setup_logging(cfg.logging.level, env.rank, env.world_size)
    if env.under_torchrun:
        die_with_parent()
        name_process(env.rank, env.local_rank)
        if env.rank == 0:
            warn_known_bad_setups()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        # A worker forked from the zygote imported torch before the launcher chose this.
        torch.set_num_threads(int(threads))
    stop = StopRequest().install()
    if cfg.run.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    try:
        dist = Dist.up(env, backend=cfg.dist.backend, device=cfg.dist.device,
                       timeout_seconds=cfg.dist.timeout_seconds, init_timeout_seconds=cfg.dist.init_timeout_seconds)
    except DistError as exc:
        print(f"elastic_runner: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        _train(cfg, env, dist, stop, started_at)
        return EXIT_OK
    except GracefulStop:
        log.info("stopped on %s after saving a snapshot", stop.signal_name)
        return EXIT_OK
    except (ConfigError, ResumeError, SetupError) as exc:
        print(f"elastic_runner: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (StaleWriterError, StopSnapshotFailed, RetryableSetupError) as exc:
        print(f"elastic_runner: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except Exception:
        if stop.requested:
            # Peers stopping at the same time broke our collective after we kept our
            # state: that is the stop we were asked for, not a failure.
            log.info("stopped on %s (peers stopped first)", stop.signal_name)
            return EXIT_OK
        raise
    finally:
        stop.uninstall()
        dist.down()


class RetryableSetupError(RuntimeError):
    """Rank 0 could not prepare the run for a reason that may pass (I/O): the attempt is retried."""


class StopSnapshotFailed(SnapshotError):
    """A stop was requested but its snapshot could not be written: not a clean stop."""


# errno values that mean "this run directory cannot work" rather than "try again".
_PERMANENT_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST, errno.ENAMETOOLONG}


def _prepare_run_dir(cfg: Config, env: WorkerEnv, dist: Dist) -> tuple[Any, int, str]:
    """Rank 0 claims the generation and writes the effective config; all ranks learn the outcome."""
    store = open_store(cfg.snapshot_dir)
    outcome: tuple[str, Any, str] = ("ok", 0, "")
    if dist.rank == 0:
        try:
            os.makedirs(cfg.run.dir, exist_ok=True)
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
            message = (f"cannot prepare run.dir {cfg.run.dir!r}: {exc}" + ("; fix its permissions or choose "
                       "another run.dir" if permanent else "; retrying with the next attempt"))
            outcome = ("usage" if permanent else "retry", message, "")
    status, value, run_uid = dist.broadcast_object(outcome)
    if status == "usage":
        raise SetupError(value)
    if status == "retry":
        raise RetryableSetupError(value)
    return store, int(value), run_uid


def _train(cfg: Config, env: WorkerEnv, dist: Dist, stop: StopRequest, started_at: float) -> None:
    store, generation, run_uid = _prepare_run_dir(cfg, env, dist)
    events = EventLog(cfg.run.dir, f"gen-{generation:06d}-rank-{env.rank:05d}", generation=generation, rank=env.rank)
    events.emit("start", world_size=env.world_size, local_rank=env.local_rank, restart_count=env.restart_count,
                run_id=env.run_id, device=str(dist.device), backend=dist.backend, process_start=started_at,
                version=__version__, zygote="elastic_runner.agent.warm" in sys.modules)
    # Liveness first: every rank is here within milliseconds of the others (the process
    # group is up), so no rank is declared dead for being slow to build its dataset.
    attempt_end = AttemptEnd(env, dist, stop, events)
    watchdog = start_watchdog(env, dist, generation, cfg.dist.heartbeat_seconds,
                              startup_grace=cfg.dist.init_timeout_seconds, handler=attempt_end)
    metrics = Metrics(env.rank, env.local_rank)
    metrics.serve(cfg.metrics.port, cfg.metrics.bind)
    metrics.set_restarts(env.restart_count)
    metrics.set_generation(generation)
    worker: Worker | None = None
    try:
        worker = Worker(cfg, env, dist, stop, started_at, store, generation, run_uid, events, metrics, attempt_end,
                        watchdog)
        worker.run()
    except GracefulStop:
        events.emit("end", status="stopped", step=worker.state.step if worker else None)
        raise
    except BaseException as exc:
        step = worker.state.step if worker else None
        if stop.requested and isinstance(exc, Exception) and not isinstance(exc, StopSnapshotFailed):
            # Peers that stopped first broke our collective: this is the stop we were asked for.
            events.emit("stop", step=step, signal=stop.signal_name, note=f"peers stopped first ({type(exc).__name__})")
            events.emit("end", status="stopped", step=step)
        else:
            events.emit("failure", error=f"{type(exc).__name__}: {str(exc)[:300]}", step=step)
        raise
    finally:
        if watchdog is not None:
            watchdog.stop(done=False)
        metrics.close()
        events.close()


class Worker:
    """One training attempt of one rank: components, resume, loop, and how it ends."""

    def __init__(self, cfg: Config, env: WorkerEnv, dist: Dist, stop: StopRequest, started_at: float, store: Any,
                 generation: int, run_uid: str, events: EventLog, metrics: Metrics, attempt_end: AttemptEnd,
                 watchdog: PeerWatchdog | None) -> None:
        self.cfg, self.env, self.dist, self.stop = cfg, env, dist, stop
        self.started_at, self.store, self.generation, self.run_uid = started_at, store, generation, run_uid
        self.events, self.metrics = events, metrics
        self.attempt_end, self.watchdog = attempt_end, watchdog
        self.state = TrainState()
        self.guard = StateGuard()
        self.fingerprint = cfg.fingerprint()
        self.config_dict = cfg.to_dict()
        self.memory = MemoryTier(memory_root(store.location), generation, run_uid) if cfg.snapshot.in_memory else None
        if self.memory is not None and env.is_local_leader:
            self.memory.sweep()
        self.writer: SnapshotWriter | None = None
        #: Steps whose durable snapshot is known to be complete (filled on success only).
        self.saved_steps: set[int] = set()
        self.build()
        self.keeper = Keeper(self.memory, self.capture, self.guard, self.state, events)
        attempt_end.keeper = self.keeper

    # -- components ---------------------------------------------------------------------

    def build(self) -> None:
        cfg, env, dist = self.cfg, self.env, self.dist
        self.bundle = build_datasets(cfg.data)
        self.layout = layout_for(cfg.batch, env.world_size)
        sampler_cls = ElasticSampler if cfg.data.sampler == "elastic" else resolve(cfg.data.sampler, "data.sampler")
        try:
            self.sampler = sampler_cls(self.bundle.num_train, self.layout.global_size, seed=cfg.run.seed,
                                       shuffle=cfg.data.shuffle, partial_batch=cfg.data.partial_batch,
                                       rank=env.rank, world_size=env.world_size)
        except ValueError as exc:
            raise ConfigError("batch.global_size", str(exc), "Adjust batch.global_size or data.partial_batch") from exc
        torch.manual_seed(cfg.run.seed)  # identical initial weights on every rank
        self.model = build_model(cfg.model, self.bundle.input_shape, self.bundle.num_classes).to(dist.device)
        self.optimizer = build_optimizer(cfg.optim, self.model.parameters(), self.layout.lr_scale)
        self.total_steps = planned_total_steps(cfg, self.sampler, 0)
        self.scheduler = build_schedule(cfg.schedule, self.optimizer, self.total_steps)
        self.scaler = None
        if cfg.train.precision == "fp16":
            if dist.device.type != "cuda":
                raise ConfigError("train.precision", "fp16 needs a CUDA device", "Use train.precision: bf16 or fp32 on CPU")
            self.scaler = torch.amp.GradScaler("cuda")
        self.state.lr_scale = self.layout.lr_scale

    def empty_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero-length inputs and targets with a real sample's dtype and shape."""
        x, y = self.bundle.train[0]
        x, y = torch.as_tensor(x), torch.as_tensor(y)
        return (x.new_zeros((0, *x.shape)).to(self.dist.device), y.new_zeros((0, *y.shape)).to(self.dist.device))

    def capture(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The complete training state (live tensors) and its metadata."""
        snapshot = {
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "train": self.state.state_dict(), "sampler": self.sampler.state_dict(), "rng": rng_state(),
        }
        meta = {
            "epoch": self.sampler.epoch, "consumed": self.sampler.consumed, "world_size": self.env.world_size,
            "world_history": self.state.world_history, "fingerprint": self.fingerprint, "config": self.config_dict,
            "writer": {"rank": self.env.rank, "host": self.env.hostname}, "torch": torch.__version__,
            "elastic_runner": __version__, "samples_total": self.state.samples_total, "run_uid": self.run_uid,
        }
        return snapshot, meta

    # -- resume -------------------------------------------------------------------------------

    def resume(self) -> bool:
        cfg, env, dist, state = self.cfg, self.env, self.dist, self.state
        loaded = select_snapshot(dist, self.store, cfg, self.events, memory=self.memory, run_uid=self.run_uid)
        if loaded is not None:
            compat = check_compatible(loaded, cfg)
            skipped = restore(loaded, compat, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                              scaler=self.scaler, sampler=self.sampler, state=state)
            set_rng_state(loaded.state.get("rng", {}))
            if loaded.tier == "disk":
                self.saved_steps.add(state.step)  # a memory copy is not durable: the final save must still happen
            self.keeper.resumed_step = state.step
            # The run's length and learning rate follow the current config and world size.
            self.total_steps = planned_total_steps(cfg, self.sampler, state.step)
            refresh_schedule(self.scheduler, cfg.schedule, self.total_steps)
            rescale_lr(self.optimizer, self.scheduler, old=state.lr_scale, new=self.layout.lr_scale)
            state.lr_scale = self.layout.lr_scale
            self.events.emit("snapshot_loaded", snapshot=loaded.ref.name, step=state.step, skipped=skipped, tier=loaded.tier)
        self.sampler.reshard(env.rank, env.world_size)
        state.enter_generation(self.generation, env.world_size, loaded is not None)
        self.metrics.restore({"membership_changes": state.membership_changes, "recoveries": state.recoveries})
        if loaded is not None and dist.rank == 0:
            reached = furthest_step_reached(cfg.run.dir, self.generation)
            recomputed = max(0, reached - state.step)
            self.metrics.recomputed.set(recomputed)
            self.events.emit("resume", step=state.step, furthest_step=reached, steps_recomputed=recomputed,
                             snapshot=loaded.ref.name, tier=loaded.tier)
        return loaded is not None

    # -- saving ---------------------------------------------------------------------------------

    def save_snapshot(self, reason: str, sync: bool) -> None:
        """Durable snapshot. Periodic and final ones come from rank 0; on a stop every
        node's first worker writes too (durably first, then into node memory), so a
        preempted node leaves its state behind."""
        if reason == "stop":
            self.attempt_end.ending.set()
        try:
            self._save_durable(reason, sync)
        except SnapshotError as exc:
            if reason == "stop":
                raise StopSnapshotFailed(f"stop requested but its snapshot failed: {exc}") from exc
            raise
        finally:
            if reason == "stop":
                self.keeper.keep("stop")

    def _save_durable(self, reason: str, sync: bool) -> None:
        if self.writer is None or (reason in ("periodic", "final") and self.dist.rank != 0):
            return
        step = self.state.step
        if sync:
            self.writer.wait()  # an in-flight write of this very step may complete it
        if step in self.saved_steps:
            return
        result = self.writer.save(step, self.capture, sync=sync)
        self.metrics.snapshot_blocking.observe(result.blocking_s)
        if sync:
            require_ok(result)

    # -- the attempt ------------------------------------------------------------------------------

    def run(self) -> None:
        dist, state = self.dist, self.state
        resumed = self.resume()
        self._announce(resumed)
        result = self._train(resumed)
        if self.memory is not None:
            self.memory.drop()  # the run is complete and its final snapshot durable
        self.events.emit("end", status="finished", step=state.step, **{k: v for k, v in result.items() if k != "step"})
        if dist.rank == 0:
            acc = result.get("eval_accuracy")
            log.info("finished at step %d%s; snapshots in %s", state.step,
                     f", test accuracy {acc:.2%}" if acc is not None else "", self.store.location)
            print(f"elastic_runner: finished step={state.step}"
                  + (f" test_accuracy={acc:.4f} test_loss={result['eval_loss']:.4f}" if acc is not None else ""), flush=True)

    def _announce(self, resumed: bool) -> None:
        layout, m = self.layout, self.metrics
        m.world_size.set(self.env.world_size)
        m.global_batch.set(layout.global_size)
        m.micro_batch.set(layout.micro_size)
        m.accumulation.set(layout.accumulation)
        self.events.emit("world", world_size=self.env.world_size, global_batch=layout.global_size,
                         micro_batch=layout.micro_size, accumulation=layout.accumulation, step=self.state.step)
        if self.dist.rank == 0:
            log.info("%s %s; dataset %s; at step %d/%d (epoch %d, %d consumed); generation %d",
                     "resuming" if resumed else "starting", layout.describe(), self.bundle.description,
                     self.state.step, self.total_steps, self.sampler.epoch, self.sampler.consumed, self.generation)

    def _train(self, resumed: bool) -> dict[str, Any]:
        cfg, env, dist = self.cfg, self.env, self.dist
        if dist.rank == 0 or env.is_local_leader:
            self.writer = SnapshotWriter(self.store, generation=self.generation, keep_last=cfg.snapshot.keep_last,
                                         async_write=cfg.snapshot.async_write,
                                         observer=_SnapshotReport(self.events, self.metrics, self.saved_steps))
        audit = None
        if cfg.audit.samples:
            audit = AuditWriter(cfg.run.dir, generation=self.generation, rank=env.rank, world_size=env.world_size, header={
                "num_samples": self.bundle.num_train, "seed": cfg.run.seed, "shuffle": cfg.data.shuffle,
                "partial_batch": cfg.data.partial_batch, "global_batch": self.layout.global_size,
                "sampler": cfg.data.sampler,
            })
        test = self.bundle.test
        watchdog = self.watchdog
        trainer = Trainer(Components(
            cfg=cfg, dist=dist, model=self.model, ddp=dist.wrap(self.model), optimizer=self.optimizer,
            scheduler=self.scheduler, scaler=self.scaler, sampler=self.sampler, layout=self.layout,
            source=make_source(self.bundle.train, dist.device, cfg.data, cfg.run.seed + self.sampler.epoch),
            test_source=make_source(test, dist.device, cfg.data, cfg.run.seed) if test is not None else None,
            test_size=len(test) if test is not None else 0,  # type: ignore[arg-type]
            state=self.state, total_steps=self.total_steps,
            events=self.events, metrics=self.metrics, audit=audit, stop=self.stop, save_snapshot=self.save_snapshot,
            check_writer=self.writer.raise_if_fatal if self.writer is not None else (lambda: None),
            started_at=self.started_at, resumed=resumed, empty_batch=self.empty_batch(), guard=self.guard,
            on_collectives_done=lambda: watchdog.stop(done=True) if watchdog is not None else None,
        ))
        try:
            return trainer.fit()
        except GracefulStop:
            raise
        except BaseException:
            self._on_failure()
            raise
        finally:
            if self.writer is not None:
                self.writer.close()
            if audit is not None:
                audit.close()

    def _on_failure(self) -> None:
        """The attempt broke (usually a peer died): keep what we have for the next one."""
        self.attempt_end.ending.set()  # our own watchdog must not race us to the exit
        if self.watchdog is not None:
            self.watchdog.stop(done=False)
            self.watchdog.abort(f"rank {self.env.rank} failed at step {self.state.step}")
        if self.stop.requested and self.writer is not None:
            # A peer stopped first and broke the collective; our last completed step is
            # the newest state there is: make it durable (a failure here is reported).
            self.save_snapshot("stop", sync=True)
        else:
            self.keeper.keep("failure")


class _SnapshotReport:
    """Routes snapshot outcomes to the event log and metrics."""

    def __init__(self, events: EventLog, metrics: Metrics, saved_steps: set[int]) -> None:
        self.events = events
        self.metrics = metrics
        self.saved_steps = saved_steps

    def snapshot_saved(self, ref: Any, meta: dict[str, Any], blocking_s: float, write_s: float) -> None:
        self.saved_steps.add(ref.step)
        self.metrics.snapshot_write.observe(write_s)
        self.metrics.snapshot_size.set(meta.get("size_bytes", 0))
        self.metrics.snapshot_last.set(time.time())
        self.events.emit("snapshot_saved", snapshot=ref.name, step=ref.step, size_bytes=meta.get("size_bytes"),
                         blocking_s=blocking_s, write_s=write_s)

    def snapshot_failed(self, ref: Any, error: BaseException) -> None:
        self.metrics.snapshot_failures.inc()
        self.events.emit("snapshot_failed", snapshot=ref.name, step=ref.step, error=str(error)[:300])


if __name__ == "__main__":
    sys.exit(main())
