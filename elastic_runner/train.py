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
from .lifecycle import StopRequest, die_with_parent, process_start_time
from .logs import setup_logging
from .loop import Components, GracefulStop, Trainer, TrainState, rng_state, set_rng_state, total_steps
from .metrics import Metrics
from .models import build_model
from .optim import build_optimizer, build_schedule
from .resume import ResumeError, check_compatible, furthest_step_reached, restore, select_snapshot
from .sampler import ElasticSampler
from .snapshot import SnapshotError, SnapshotWriter, StaleWriterError, open_store, require_ok

log = logging.getLogger("elastic_runner.train")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


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
    except StaleWriterError as exc:
        print(f"elastic_runner: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except Exception:
        if stop.requested:
            # Peers stopping at the same time break our collectives: that is the
            # stop we were asked for, not a failure.
            log.info("stopped on %s (peers stopped first)", stop.signal_name)
            return EXIT_OK
        raise
    finally:
        stop.uninstall()
        dist.down()


def _prepare_run_dir(cfg: Config, env: WorkerEnv, dist: Dist) -> tuple[Any, int]:
    """Rank 0 claims the generation and writes the effective config; all ranks learn the outcome."""
    store = open_store(cfg.snapshot_dir)
    outcome: tuple[str, Any] = ("ok", 0)
    if dist.rank == 0:
        try:
            os.makedirs(cfg.run.dir, exist_ok=True)
            if not os.access(cfg.run.dir, os.W_OK | os.X_OK):
                raise SnapshotError(f"run.dir {cfg.run.dir!r} is not writable by uid {os.getuid()}; fix its permissions or choose another run.dir")
            store.ensure()
            generation = store.claim_generation({"world_size": env.world_size, "run_id": env.run_id,
                                                 "restart_count": env.restart_count})
            store.sweep(generation)
            write_effective_config(cfg, cfg.run.dir)
            outcome = ("ok", generation)
        except (OSError, SnapshotError) as exc:
            outcome = ("error", f"cannot prepare run.dir {cfg.run.dir!r}: {exc}")
    status, value = dist.broadcast_object(outcome)
    if status != "ok":
        raise SetupError(value)
    return store, int(value)


def _train(cfg: Config, env: WorkerEnv, dist: Dist, stop: StopRequest, started_at: float) -> None:
    store, generation = _prepare_run_dir(cfg, env, dist)
    events = EventLog(cfg.run.dir, f"gen-{generation:06d}-rank-{env.rank:05d}", generation=generation, rank=env.rank)
    events.emit("start", world_size=env.world_size, local_rank=env.local_rank, restart_count=env.restart_count,
                run_id=env.run_id, device=str(dist.device), backend=dist.backend, process_start=started_at,
                version=__version__)
    metrics = Metrics(env.rank, env.local_rank)
    metrics.serve(cfg.metrics.port, cfg.metrics.bind)
    metrics.set_restarts(env.restart_count)
    metrics.set_generation(generation)
    try:
        _train_with(cfg, env, dist, stop, started_at, store, generation, events, metrics)
    except GracefulStop:
        events.emit("end", status="stopped")
        raise
    except BaseException as exc:
        events.emit("failure", error=f"{type(exc).__name__}: {str(exc)[:300]}", step=getattr(exc, "step", None))
        raise
    finally:
        metrics.close()
        events.close()


def _train_with(cfg: Config, env: WorkerEnv, dist: Dist, stop: StopRequest, started_at: float, store: Any,
                generation: int, events: EventLog, metrics: Metrics) -> None:
    bundle = build_datasets(cfg.data)
    layout = layout_for(cfg.batch, env.world_size)
    sampler_cls = ElasticSampler if cfg.data.sampler == "elastic" else resolve(cfg.data.sampler, "data.sampler")
    try:
        sampler = sampler_cls(bundle.num_train, layout.global_size, seed=cfg.run.seed, shuffle=cfg.data.shuffle,
                              partial_batch=cfg.data.partial_batch, rank=env.rank, world_size=env.world_size)
    except ValueError as exc:
        raise ConfigError("batch.global_size", str(exc), "Adjust batch.global_size or data.partial_batch") from exc
    torch.manual_seed(cfg.run.seed)  # identical initial weights on every rank
    model = build_model(cfg.model, bundle.input_shape, bundle.num_classes).to(dist.device)
    optimizer = build_optimizer(cfg.optim, model.parameters(), layout.lr_scale)
    steps = total_steps(cfg, sampler.steps_per_epoch())
    scheduler = build_schedule(cfg.schedule, optimizer, steps)
    scaler = None
    if cfg.train.precision == "fp16":
        if dist.device.type != "cuda":
            raise ConfigError("train.precision", "fp16 needs a CUDA device", "Use train.precision: bf16 or fp32 on CPU")
        scaler = torch.amp.GradScaler("cuda")
    state = TrainState()

    loaded = select_snapshot(dist, store, cfg, events)
    resumed = loaded is not None
    if loaded is not None:
        compat = check_compatible(loaded, cfg)
        skipped = restore(loaded, compat, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                          sampler=sampler, state=state)
        set_rng_state(loaded.state.get("rng", {}))
        events.emit("snapshot_loaded", snapshot=loaded.ref.name, step=state.step, skipped=skipped)
    sampler.reshard(env.rank, env.world_size)
    state.enter_generation(generation, env.world_size, resumed)
    metrics.restore({"membership_changes": state.membership_changes, "recoveries": state.recoveries})
    if resumed and dist.rank == 0:
        reached = furthest_step_reached(cfg.run.dir, generation)
        recomputed = max(0, reached - state.step)
        metrics.recomputed.set(recomputed)
        events.emit("resume", step=state.step, furthest_step=reached, steps_recomputed=recomputed,
                    snapshot=loaded.ref.name if loaded else None)
    metrics.world_size.set(env.world_size)
    metrics.global_batch.set(layout.global_size)
    metrics.micro_batch.set(layout.micro_size)
    metrics.accumulation.set(layout.accumulation)
    events.emit("world", world_size=env.world_size, global_batch=layout.global_size, micro_batch=layout.micro_size,
                accumulation=layout.accumulation, step=state.step)
    if dist.rank == 0:
        log.info("%s %s; dataset %s; %s at step %d/%d (epoch %d, %d consumed); generation %d",
                 "resuming" if resumed else "starting", layout.describe(), bundle.description,
                 "resumed" if resumed else "fresh", state.step, steps, sampler.epoch, sampler.consumed, generation)

    writes_snapshots = dist.rank == 0 or env.is_local_leader
    writer = None
    if writes_snapshots:
        writer = SnapshotWriter(store, generation=generation, keep_last=cfg.snapshot.keep_last,
                                async_write=cfg.snapshot.async_write, observer=_SnapshotReport(events, metrics))
    fingerprint = cfg.fingerprint()
    config_dict = cfg.to_dict()

    def capture() -> tuple[dict[str, Any], dict[str, Any]]:
        snapshot = {
            "model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict() if scaler is not None else None, "train": state.state_dict(),
            "sampler": sampler.state_dict(), "rng": rng_state(),
        }
        meta = {
            "epoch": sampler.epoch, "consumed": sampler.consumed, "world_size": env.world_size,
            "world_history": state.world_history, "fingerprint": fingerprint, "config": config_dict,
            "writer": {"rank": env.rank, "host": env.hostname}, "torch": torch.__version__,
            "elastic_runner": __version__, "samples_total": state.samples_total,
        }
        return snapshot, meta

    saved_steps: set[int] = {state.step} if resumed else set()

    def save_snapshot(reason: str, sync: bool) -> None:
        if writer is None or state.step in saved_steps:
            return
        if reason in ("periodic", "final") and dist.rank != 0:
            return
        saved_steps.add(state.step)
        result = writer.save(state.step, capture, sync=sync)
        metrics.snapshot_blocking.observe(result.blocking_s)
        if sync:
            require_ok(result)

    audit = None
    if cfg.audit.samples:
        audit = AuditWriter(cfg.run.dir, generation=generation, rank=env.rank, world_size=env.world_size, header={
            "num_samples": bundle.num_train, "seed": cfg.run.seed, "shuffle": cfg.data.shuffle,
            "partial_batch": cfg.data.partial_batch, "global_batch": layout.global_size, "sampler": cfg.data.sampler,
        })
    test_source = make_source(bundle.test, dist.device, cfg.data, cfg.run.seed) if bundle.test is not None else None
    trainer = Trainer(Components(
        cfg=cfg, dist=dist, model=model, ddp=dist.wrap(model), optimizer=optimizer, scheduler=scheduler,
        scaler=scaler, sampler=sampler, layout=layout,
        source=make_source(bundle.train, dist.device, cfg.data, cfg.run.seed + sampler.epoch),
        test_source=test_source, test_size=len(bundle.test) if bundle.test is not None else 0,  # type: ignore[arg-type]
        input_shape=bundle.input_shape, state=state, total_steps=steps, events=events, metrics=metrics,
        audit=audit, stop=stop, save_snapshot=save_snapshot,
        check_writer=writer.raise_if_fatal if writer is not None else (lambda: None),
        started_at=started_at, resumed=resumed,
    ))
    try:
        result = trainer.fit()
    except GracefulStop:
        raise
    except BaseException as exc:
        if stop.requested and writer is not None:
            # A peer stopped first and broke the collective; our state is the
            # last completed step, which is still worth keeping.
            try:
                save_snapshot("stop", sync=True)
            except Exception:  # noqa: BLE001
                log.exception("snapshot on stop failed")
        exc.step = state.step  # type: ignore[attr-defined]
        raise
    finally:
        if writer is not None:
            writer.close()
        if audit is not None:
            audit.close()
    events.emit("end", status="finished", step=state.step, **{k: v for k, v in result.items() if k != "step"})
    if dist.rank == 0:
        acc = result.get("eval_accuracy")
        log.info("finished at step %d%s; snapshots in %s", state.step,
                 f", test accuracy {acc:.2%}" if acc is not None else "", store.location)
        print(f"elastic_runner: finished step={state.step}"
              + (f" test_accuracy={acc:.4f} test_loss={result['eval_loss']:.4f}" if acc is not None else ""), flush=True)


class _SnapshotReport:
    """Routes snapshot outcomes to the event log and metrics."""

    def __init__(self, events: EventLog, metrics: Metrics) -> None:
        self.events = events
        self.metrics = metrics

    def snapshot_saved(self, ref: Any, meta: dict[str, Any], blocking_s: float, write_s: float) -> None:
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
