"""The Checkpointer: the one owner of the state a training attempt leaves to the next.

Modelled on torchtitan's ``CheckpointManager``. It owns

- every stateful part of training: model, optimizer, schedule, gradient scaler, sampler,
  :class:`~elastic_runner.training.loop.TrainState` and the random generators
  (:class:`~elastic_runner.training.rng.RNGState`), each with ``state_dict()``/``load_state_dict()``;
- the **step lock** (:class:`StateGuard`): the loop changes the saved state only inside
  :meth:`Checkpointer.mutating`, so a thread that keeps the state of a failing attempt sees a whole
  step, and a step that an exception interrupted half-way is never kept;
- the **durable tier**: the asynchronous :class:`~elastic_runner.snapshot.SnapshotWriter` (rank 0
  writes periodic and final snapshots; on a stop every node's first worker writes too) and the set
  of steps known to be durable;
- the **memory tier** (:class:`~elastic_runner.snapshot.memory.MemoryTier`): what a survivor keeps
  in node memory when an attempt ends (:meth:`Checkpointer.keep`);
- **resume**: :meth:`Checkpointer.restore` picks the newest state of both tiers (by generation,
  then step; :mod:`elastic_runner.snapshot.selection`), checks that it fits this configuration and
  loads it into the parts.

The loop calls :meth:`Checkpointer.maybe_save` after every step and :meth:`Checkpointer.save` at the
end or on a stop; the watchdog's handler calls :meth:`Checkpointer.keep`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from .. import __version__
from ..config import Config, diff_configs, resume_free_keys
from ..observe.events import read_events
from ..snapshot import Loaded, SnapshotError, SnapshotWriter, require_ok
from ..snapshot.interval import AutoSchedule
from ..snapshot.memory import MemoryTier, memory_root, sweep_abandoned_memory
from ..snapshot.selection import select_newest
from ..snapshot.space import room_warning, space_note, state_bytes
from .rng import RNGState

if TYPE_CHECKING:
    from ..observe.events import EventLog
    from ..observe.metrics import Metrics
    from ..snapshot import LocalStore, SnapshotRef
    from ..worker.dist import Dist
    from ..worker.env import WorkerEnv
    from .loop import TrainState

log = logging.getLogger(__name__)

Capture = Callable[[], "tuple[dict[str, Any], dict[str, Any]]"]


class ResumeError(RuntimeError):
    """The snapshot cannot be resumed with this configuration."""


class StopSnapshotFailed(SnapshotError):
    """A stop was requested but its snapshot could not be written: not a clean stop."""


class FinalSnapshotFailed(SnapshotError):
    """Training finished but its final snapshot could not be written; the message says where the state is
    kept and how to write it out (the worker exits with :data:`~elastic_runner.worker.lifecycle.EXIT_NOT_DURABLE`)."""


# -- does a snapshot fit this configuration ----------------------------------------------------------


@dataclass
class Compatibility:
    differing: list[str]
    model_ok: bool
    data_ok: bool
    optim_ok: bool

    @property
    def exact(self) -> bool:
        return self.model_ok and self.data_ok and self.optim_ok


def compatibility(meta: dict[str, Any], cfg: Config, identity: dict[str, Any] | None = None) -> Compatibility:
    theirs = meta.get("fingerprint", {})
    ours = cfg.fingerprint(identity)
    saved_cfg = meta.get("config", {})
    current = cfg.to_dict()
    sections = ("model", "data", "optim", "schedule", "batch")
    free = resume_free_keys()
    differing = [k for k in diff_configs({s: saved_cfg.get(s, {}) for s in sections}, {s: current[s] for s in sections})
                 if k not in free]
    if saved_cfg.get("run", {}).get("seed") != cfg.run.seed:
        differing.append("run.seed")
    differing += [f"the script's {part} ({meta.get('script', {}).get(part)} -> {value})"
                  for part, value in (identity or {}).items() if meta.get("script", {}).get(part) != value]
    return Compatibility(differing=differing, model_ok=theirs.get("model") == ours["model"],
                         data_ok=theirs.get("data") == ours["data"], optim_ok=theirs.get("optim") == ours["optim"])


def check_compatible(loaded: Loaded, cfg: Config, identity: dict[str, Any] | None = None) -> Compatibility:
    compat = compatibility(loaded.meta, cfg, identity)
    if compat.exact:
        return compat
    keys = ", ".join(compat.differing) or "the config fingerprint"
    if not cfg.snapshot.allow_mismatch:
        raise ResumeError(
            f"snapshot {loaded.ref.name} in {cfg.snapshot_dir} was written with a different configuration "
            f"({keys} differ). To resume it anyway (e.g. fine-tuning) set snapshot.allow_mismatch: true; "
            "to start from scratch, use a new run.dir"
        )
    log.warning("resuming %s although %s differ (snapshot.allow_mismatch: true)", loaded.ref.name, keys)
    return compat


# -- the step lock and the memory keeper ---------------------------------------------------------------


class StateGuard:
    """The lock the loop holds while it changes the saved state, and a ``dirty`` mark that stays set
    when an exception escapes that window (a half-applied step is never kept)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.dirty = False

    @contextlib.contextmanager
    def mutating(self) -> Iterator[None]:
        with self.lock:
            self.dirty = True
            yield
            self.dirty = False  # not reached when the block raised: the state stays "dirty"


class Keeper:
    """Writes the last *completed* step into the node's memory tier, from whichever thread."""

    def __init__(self, memory: MemoryTier | None, capture: Capture, guard: StateGuard, state: Any,
                 events: EventLog) -> None:
        self.memory = memory
        self.capture = capture
        self.guard = guard
        self.state = state
        self.events = events
        #: The step this attempt resumed at: that state is already stored where it came from.
        self.resumed_step: int | None = None
        self._kept_step: int | None = None

    def keep(self, reason: str, lock_timeout: float = 10.0) -> bool:
        """Keep the newest completed step in node memory; True if the node holds it."""
        if self.memory is None or self.state.step == 0 or self.state.step == self.resumed_step:
            return False
        if self._kept_step == self.state.step:
            return True
        started = time.perf_counter()
        if not self.guard.lock.acquire(timeout=lock_timeout):
            log.warning("could not keep the state in memory: the training step did not finish within %.0fs", lock_timeout)
            return False
        try:
            if self.guard.dirty:
                log.error("not keeping step %d in memory: an error interrupted the optimizer step, so the "
                          "state is half-applied; the next attempt resumes from the previous snapshot", self.state.step)
                return False
            step = self.state.step
            ok = self.memory.save(step, self.capture)
        finally:
            self.guard.lock.release()
        if ok:
            self._kept_step = step
            self.events.emit("kept_in_memory", step=step, reason=reason, seconds=time.perf_counter() - started)
            log.info("kept step %d in node memory (%s) in %.3fs", step, reason, time.perf_counter() - started)
        return ok


class StepBoundary:
    """The model's persistent buffers as they were at the last step boundary.

    A forward updates some buffers in place (BatchNorm's running statistics and its batch counter,
    a user's running averages), and not always through an operation that bumps the tensor's
    version (BatchNorm's kernel writes its statistics directly). When an attempt ends in the middle
    of a step, those buffers already hold part of a step that will never complete. So at every
    boundary (the end of each optimizer step, a restore) the buffers that a snapshot holds are
    copied aside, and a snapshot always takes them from that copy: one ``_foreach_copy_`` per step
    of the persistent buffers' bytes (a few KB for a ResNet; nothing for a model without buffers).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        persistent = set(model.state_dict(keep_vars=True))
        self.names = [name for name, _ in model.named_buffers() if name in persistent]
        self.copies: list[torch.Tensor] = []
        self.mark()

    def live(self) -> list[torch.Tensor]:
        if not self.names:
            return []
        named = dict(self.model.named_buffers())  # looked up each time: a module may replace a buffer
        return [named[name] for name in self.names]

    def mark(self) -> None:
        buffers = self.live()
        if [t.shape for t in buffers] != [t.shape for t in self.copies] or \
                [(t.dtype, t.device) for t in buffers] != [(t.dtype, t.device) for t in self.copies]:
            self.copies = [t.detach().clone() for t in buffers]
        elif buffers:
            torch._foreach_copy_(self.copies, [t.detach() for t in buffers])

    def overlay(self, model_state: dict[str, Any]) -> dict[str, Any]:
        """``model_state`` with every persistent buffer as of the last boundary."""
        for name, copy in zip(self.names, self.copies):
            model_state[name] = copy
        return model_state


# -- the Checkpointer ----------------------------------------------------------------------------------------


class Checkpointer:
    """See the module docstring. Built before the model (the watchdog's handler needs it from the
    first second of an attempt); :meth:`track` hands it the training parts once they exist."""

    def __init__(self, cfg: Config, env: WorkerEnv, dist: Dist, store: LocalStore, *, generation: int, run_uid: str,
                 state: TrainState, events: EventLog, metrics: Metrics, identity: dict[str, Any] | None = None,
                 model_build: dict[str, Any] | None = None) -> None:
        self.cfg, self.env, self.dist, self.store = cfg, env, dist, store
        self.generation, self.run_uid = generation, run_uid
        self.events, self.metrics = events, metrics
        self.state = state
        self.rng = RNGState()
        self.guard = StateGuard()
        self.identity = identity or {}
        self.fingerprint = cfg.fingerprint(self.identity)
        self._config = cfg.to_dict()
        self._model_build = model_build or {}
        self.memory: MemoryTier | None = None
        if cfg.snapshot.in_memory:
            try:
                self.memory = MemoryTier(memory_root(store.location), generation, run_uid)
            except OSError as exc:  # UnsafeDirectoryError: planted or shared by someone else
                log.warning("no node-memory snapshots (%s); a failure resumes from the disk snapshot. Remove that "
                            "directory or point ELASTIC_RUNNER_SHM_DIR at a directory of your own", exc)
        if self.memory is not None and env.is_local_leader:
            self.memory.sweep()
            sweep_abandoned_memory()
        self.model: torch.nn.Module | None = None
        self.boundary: StepBoundary | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        self.scaler: Any = None
        self.sampler: Any = None
        self.writer: SnapshotWriter | None = None
        #: ``snapshot.every_steps: auto`` on rank 0 (:mod:`elastic_runner.snapshot.interval`).
        self.auto: AutoSchedule | None = None
        #: Steps whose durable snapshot is known to be complete (filled on success only).
        self.saved_steps: set[int] = set()
        #: Set once the main thread takes the last state of this attempt (a stop or a failure it
        #: handles): the watchdog's handler must then leave the exit to the main thread.
        self.ending = threading.Event()
        self._keeper = Keeper(self.memory, self.capture, self.guard, self.state, events)
        self._last_save = time.monotonic()

    def track(self, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, scaler: Any,
              sampler: Any) -> None:
        """The parts a snapshot holds besides the TrainState and the generators."""
        self.model, self.optimizer, self.scheduler, self.scaler, self.sampler = model, optimizer, scheduler, scaler, sampler
        self.boundary = StepBoundary(model)

    # -- state ---------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The complete training state after the last completed step, with live tensors."""
        assert self.model is not None and self.boundary is not None, "track() the training parts first"
        return {
            "model": self.boundary.overlay(self.model.state_dict()), "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "train": self.state.state_dict(), "sampler": self.sampler.state_dict(), "rng": self.rng.state_dict(),
        }

    def metadata(self) -> dict[str, Any]:
        """What ``meta.json`` carries besides what the writer adds (step, size, checksum)."""
        return {
            "epoch": self.sampler.epoch, "consumed": self.sampler.consumed, "world_size": self.env.world_size,
            "world_history": self.state.world_history, "fingerprint": self.fingerprint, "config": self._config,
            "writer": {"rank": self.env.rank, "host": self.env.hostname}, "torch": torch.__version__,
            "elastic_runner": __version__, "samples_total": self.state.samples_total, "run_uid": self.run_uid,
            "model_build": self._model_build, "script": self.identity,
        }

    def capture(self) -> tuple[dict[str, Any], dict[str, Any]]:
        return self.state_dict(), self.metadata()

    @contextlib.contextmanager
    def mutating(self) -> Iterator[None]:
        """Hold the step lock while the loop changes the saved state (see :class:`StateGuard`); leaving
        the block normally is a step boundary."""
        if self.writer is not None:
            self.writer.wait_staged()  # a snapshot's copy of these tensors may still be under way
        with self.guard.mutating():
            yield
            self.at_boundary()

    def at_boundary(self) -> None:
        """The parts are at a step boundary now (a step completed, a restore, DDP's first broadcast)."""
        if self.boundary is not None:
            self.boundary.mark()

    def sync_buffers(self) -> None:
        """Every rank takes rank 0's persistent buffers, as DDP does before a forward (a collective).

        Run once per step, before the optimizer step (not under the step lock: a collective can
        fail on a lost peer), so that at every boundary each rank holds the job's buffers and any
        survivor's copy is the one the next step would have used.
        """
        if self.boundary is not None and self.dist.world_size > 1:
            self.dist.broadcast_tensors(self.boundary.live(), src=0)

    # -- resume ---------------------------------------------------------------------------------------------

    def restore(self) -> Loaded | None:
        """Load the newest state of either tier into the parts (a collective); None: nothing to resume."""
        cfg = self.cfg
        loaded = select_newest(
            self.dist, self.store, fingerprint=self.fingerprint, run_uid=self.run_uid, verify=cfg.snapshot.verify,
            memory=self.memory,
            on_rejected=lambda ref, why: self.events.emit("snapshot_rejected", snapshot=ref.name, reason=why))
        if loaded is None:
            return None
        skipped = self._load(loaded, check_compatible(loaded, cfg, self.identity))
        self.at_boundary()
        if loaded.tier == "disk":
            self.saved_steps.add(self.state.step)  # a memory copy is not durable: the final save must still happen
        self._keeper.resumed_step = self.state.step
        self.events.emit("snapshot_loaded", snapshot=loaded.ref.name, step=self.state.step, skipped=skipped,
                         tier=loaded.tier)
        return loaded

    def _load(self, loaded: Loaded, compat: Compatibility) -> list[str]:
        """Apply a loaded snapshot; returns the parts that were skipped (allow_mismatch)."""
        s = loaded.state
        skipped: list[str] = []
        try:
            self.model.load_state_dict(s["model"])  # type: ignore[union-attr]
        except RuntimeError as exc:
            raise ResumeError(
                f"snapshot {loaded.ref.name} does not fit this model: {str(exc).splitlines()[0]} "
                "(the architecture changed; use a new run.dir or export and fine-tune explicitly)"
            ) from exc
        if compat.optim_ok:
            self.optimizer.load_state_dict(s["optimizer"])  # type: ignore[union-attr]
            self.scheduler.load_state_dict(s["scheduler"])
            if self.scaler is not None and s.get("scaler"):
                self.scaler.load_state_dict(s["scaler"])
        else:
            skipped.append("optimizer/schedule state (optimisation config changed)")
        if compat.data_ok:
            try:
                self.sampler.load_state_dict(s["sampler"])
            except ValueError as exc:
                raise ResumeError(
                    f"snapshot {loaded.ref.name} does not fit this dataset: {exc}. The data changed under the same "
                    "config; restore it, or set snapshot.allow_mismatch: true to restart the epoch"
                ) from exc
        else:
            skipped.append("data position (data config changed: the epoch restarts)")
        self.state.load_state_dict(s["train"])
        self.rng.load_state_dict(s.get("rng", {}))
        return skipped

    # -- durable snapshots ------------------------------------------------------------------------------------

    def open_writer(self) -> None:
        """Rank 0 writes periodic and final snapshots; every node's first worker may write on a stop."""
        if self.writer is None and (self.dist.rank == 0 or self.env.is_local_leader):
            snap = self.cfg.snapshot
            self.writer = SnapshotWriter(self.store, generation=self.generation, keep_last=snap.keep_last,
                                         async_write=snap.async_write, observer=self,
                                         writer=snap.writer)
            if self.dist.rank == 0:
                self.check_space()
                if snap.every_steps == "auto":
                    self.auto = AutoSchedule(snap.mtbf_hours, read_events(self.cfg.run.dir), self.state.step,
                                             self.metrics.snapshot_interval.set)
        self._last_save = time.monotonic()

    def check_space(self) -> bool:
        """Warn once, at the start, when the snapshot volume cannot hold ``keep_last + 1`` snapshots."""
        low = room_warning(self.store, self.cfg.snapshot.keep_last,
                           state_bytes(self.state_dict()) if self.model is not None else 0)
        if low is not None:
            log.warning("%s", low[0])
            self.events.emit("snapshot_space_low", free_bytes=low[1], needed_bytes=low[2])
        return low is None

    def maybe_save(self, step: int, last: bool) -> None:
        """After every step: a periodic snapshot when ``snapshot.every_steps``/``every_seconds`` say so."""
        snap = self.cfg.snapshot
        if snap.every_steps == "auto":
            due_steps = self.auto is not None and self.auto.due(step)
        else:
            due_steps = bool(snap.every_steps) and step % snap.every_steps == 0
        due_time = snap.every_seconds and time.monotonic() - self._last_save >= snap.every_seconds
        if (due_steps or due_time) and not last:
            if self.auto is not None:
                self.auto.saving(step)
            self.save("periodic", sync=False)
            self._last_save = time.monotonic()

    def save(self, reason: str, sync: bool) -> None:
        """Durable snapshot of the current step (``reason``: periodic, final or stop). On a stop the
        state is also kept in node memory, so a preempted node leaves its state behind; so is a final
        state that cannot be written (:class:`FinalSnapshotFailed`)."""
        if reason == "stop":
            self.ending.set()
        try:
            self._save_durable(reason, sync)
        except SnapshotError as exc:
            if reason == "stop":
                raise StopSnapshotFailed(f"stop requested but its snapshot failed: {exc}") from exc
            if reason == "final":
                raise self._final_failed(exc) from exc
            raise
        finally:
            if reason == "stop":
                self.keep("stop")

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

    def _final_failed(self, exc: SnapshotError) -> FinalSnapshotFailed:
        step = self.state.step
        self.ending.set()
        kept = self.keep("final") or (self.memory is not None and any(r.step == step for r in self.memory.store.complete()))
        where = (f"the state is kept in node memory on {self.env.hostname} ({self.memory.root}); once there is "
                 f"space, `elastic-runner snapshot persist {self.cfg.run.dir}` on that node writes it out, and a "
                 f"restart resumes from it" if kept and self.memory is not None else
                 "no copy of it is kept (snapshot.in_memory is off); the newest durable snapshot is the one to resume from")
        size = self.writer.last.size_estimate if self.writer is not None and self.writer.last is not None else 0
        space = space_note(self.store.root, size)
        return FinalSnapshotFailed(
            f"training finished at step {step}, but its final snapshot could not be written to {self.store.location}: "
            f"{exc}{f' ({space})' if space else ''}; {where}")

    def check_writer(self) -> None:
        """Raise if the writer learned that a newer generation owns the run (split brain)."""
        if self.writer is not None:
            self.writer.raise_if_fatal()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    # -- the writer's reports (SnapshotObserver) ---------------------------------------------------------------

    def snapshot_saved(self, ref: SnapshotRef, meta: dict[str, Any], blocking_s: float, write_s: float) -> None:
        self.saved_steps.add(ref.step)
        self.metrics.snapshot_write.observe(write_s)
        self.metrics.snapshot_size.set(meta.get("size_bytes", 0))
        self.metrics.snapshot_last.set(time.time())
        if self.auto is not None:
            self.auto.saved(blocking_s, write_s)
        self.events.emit("snapshot_saved", snapshot=ref.name, step=ref.step, size_bytes=meta.get("size_bytes"),
                         blocking_s=blocking_s, write_s=write_s)

    def snapshot_failed(self, ref: SnapshotRef, error: BaseException) -> None:
        self.metrics.snapshot_failures.inc()
        self.events.emit("snapshot_failed", snapshot=ref.name, step=ref.step, error=str(error)[:300])

    # -- the memory tier -----------------------------------------------------------------------------------------

    def keep(self, reason: str) -> bool:
        """Keep the newest completed step in node memory (any thread); True if the node holds it."""
        return self._keeper.keep(reason)

    def finished(self) -> None:
        """The run is complete and its final snapshot durable: node memory is no longer needed."""
        if self.memory is not None:
            self.memory.drop()


__all__ = ["Checkpointer", "Compatibility", "FinalSnapshotFailed", "Keeper", "ResumeError", "StateGuard", "StepBoundary", "StopSnapshotFailed",
           "check_compatible", "compatibility"]
