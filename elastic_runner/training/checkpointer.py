"""The Checkpointer: the one owner of the state a training attempt leaves to the next.

Modelled on torchtitan's ``CheckpointManager``. It keeps

- a reference to the :class:`~elastic_runner.training.parts.TrainingParts` (model, optimizer, schedule,
  gradient scaler, sampler, :class:`~elastic_runner.training.state.TrainState`, random generators),
  which it reads to save and writes to restore — and never hands back: the loop and the worker hold
  the same parts object;
- the **step lock** (:class:`~elastic_runner.training.boundary.StateGuard`): the loop changes the saved state only inside
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

One save path for every parallelism: what differs between a replicated state and a sharded one (who writes, what
node memory holds and when, how a resume selects and cuts the state) is asked of one strategy object
(:mod:`elastic_runner.training.save_path`), never branched on here.

The loop calls :meth:`Checkpointer.maybe_save` after every step and :meth:`Checkpointer.save` at the
end or on a stop; the watchdog's handler calls :meth:`Checkpointer.keep`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from .. import __version__
from ..config import Config
from ..observe.events import read_events
from ..snapshot import Loaded, SnapshotError, SnapshotRef, SnapshotWriter, find_newest, load_exact, open_store, require_ok
from ..snapshot.interval import AutoSchedule
from ..snapshot.memory import MemoryTier, memory_root, sweep_abandoned_memory
from ..snapshot.space import room_warning, space_note, state_bytes
from .boundary import Keeper, StateGuard, StepBoundary
from .compatibility import Compatibility, ResumeError, check_compatible
from .parts import scaler_numbers
from .save_path import save_path
from .sharding import localize

if TYPE_CHECKING:
    from ..observe.events import EventLog
    from ..observe.metrics import Metrics
    from ..snapshot import ShardedStore
    from ..dist import Dist
    from ..env import WorkerEnv
    from .parts import TrainingParts
    from .state import TrainState

log = logging.getLogger(__name__)

class StopSnapshotFailed(SnapshotError):
    """A stop was requested but its snapshot could not be written: not a clean stop."""


class FinalSnapshotFailed(SnapshotError):
    """Training finished but its final snapshot could not be written; the message says where the state is
    kept and how to write it out (the worker exits with :data:`~elastic_runner.lifecycle.EXIT_NOT_DURABLE`)."""


class Checkpointer:
    """See the module docstring. Built before the model (the watchdog's handler needs it from the
    first second of an attempt); :meth:`track` hands it the training parts once they exist."""

    def __init__(self, cfg: Config, env: WorkerEnv, dist: Dist, store: ShardedStore, *, generation: int, run_uid: str,
                 state: TrainState, events: EventLog, metrics: Metrics, identity: dict[str, Any] | None = None,
                 model_build: dict[str, Any] | None = None) -> None:
        self.cfg, self.env, self.dist, self.store = cfg, env, dist, store
        self.generation, self.run_uid = generation, run_uid
        self.events, self.metrics = events, metrics
        self.state = state
        self.guard = StateGuard()
        self.identity = identity or {}
        self.fingerprint = cfg.fingerprint(self.identity)
        self._config = cfg.to_dict()
        self._model_build = model_build or {}
        self.memory: MemoryTier | None = None
        #: What differs by how the model is spread: replicated whole, or sharded (:mod:`.save_path`).
        self.path = save_path(self)
        if self.path.wants_memory(self):
            try:
                self.memory = MemoryTier(memory_root(store.location), generation, run_uid)
            except OSError as exc:  # UnsafeDirectoryError: planted or shared by someone else
                log.warning("no node-memory snapshots (%s); a failure resumes from the disk snapshot. Remove that "
                            "directory or point ELASTIC_RUNNER_SHM_DIR at a directory of your own", exc)
        if self.memory is not None and env.is_local_leader:
            self.memory.sweep()
            sweep_abandoned_memory()
        self.path.start(self)
        self.parts: TrainingParts | None = None
        self.boundary: StepBoundary | None = None
        self.writer: SnapshotWriter | None = None
        #: ``snapshot.every_steps: auto`` on rank 0 (:mod:`elastic_runner.snapshot.interval`).
        self.auto: AutoSchedule | None = None
        #: Steps whose durable snapshot is known to be complete (filled on success only).
        self.saved_steps: set[int] = set()
        #: Where this run began when it started from another run's snapshot (``snapshot.resume_from``): the audit's
        #: first step, and the position in the epoch before which the samples are the other run's.
        self.started_from: dict[str, Any] | None = None
        #: Set once the main thread takes the last state of this attempt (a stop or a failure it
        #: handles): the watchdog's handler must then leave the exit to the main thread.
        self.ending = threading.Event()
        #: The newest step whose replicas' fingerprints agreed (recovery.fingerprint_every_steps), in each
        #: snapshot's meta: pruning keeps the newest snapshot at or before it, the one a rollback returns to.
        self.verified_step: int | None = None
        # A replicated state is kept whole when an attempt ends; shards are kept by the periodic refresh instead.
        self._keeper = Keeper(self.path.kept_at_the_end(self.memory), self.capture, self.guard, self.state, events)
        self._last_save = time.monotonic()
        self._reserved = False  #: the periodic captures' host buffers (:meth:`_reserve_buffers`)

    def track(self, parts: TrainingParts) -> None:
        """The parts a snapshot holds (their TrainState is the one this Checkpointer was built with)."""
        if parts.state is not self.state:
            raise ValueError("the parts' TrainState must be the Checkpointer's own")
        self.parts = parts
        self.boundary = StepBoundary(parts.model)

    # -- state ---------------------------------------------------------------------------------------------

    def state_dict(self, keep_vars: bool = False) -> dict[str, Any]:
        """The complete training state after the last completed step, with live tensors (``keep_vars``: the model's
        parameters themselves, as ``Module.state_dict`` gives them)."""
        assert self.parts is not None and self.boundary is not None, "track() the training parts first"
        return self.parts.state_dict(model_state=self.boundary.overlay(self.parts.model.state_dict(keep_vars=keep_vars)))

    def metadata(self) -> dict[str, Any]:
        """What ``meta.json`` carries besides what the writer adds (step, size, checksum)."""
        assert self.parts is not None, "track() the training parts first"
        sampler = self.parts.sampler
        return {
            "epoch": sampler.epoch, "consumed": sampler.consumed, "world_size": self.env.world_size,
            "world_history": self.state.world_history, "fingerprint": self.fingerprint, "config": self._config,
            "writer": {"rank": self.env.rank, "host": self.env.hostname}, "torch": torch.__version__,
            "elastic_runner": __version__, "samples_total": self.state.samples_total, "run_uid": self.run_uid,
            "model_build": self._model_build, "script": self.identity,
        } | ({"verified_step": self.verified_step} if self.verified_step is not None else {})

    def capture(self, replicated_from: str = "rank0") -> tuple[dict[str, Any], dict[str, Any]]:
        """(state, meta) with live tensors. Sharded: this rank's slices apart, and the rest (with a marker per slice)
        from rank 0 only, or (``replicated_from="node"``, for node memory) from every node's first rank."""
        state, meta = self.state_dict(keep_vars=self.path.keep_vars), self.metadata()
        return self.path.arrange(self, state, replicated_from), meta

    @contextlib.contextmanager
    def mutating(self) -> Iterator[None]:
        """Hold the step lock while the loop changes the saved state (see ``StateGuard``); leaving
        the block normally is a step boundary."""
        if self.writer is not None:
            self.writer.wait_staged()  # a snapshot's copy of these tensors may still be under way
        self.path.wait_staged()  # likewise a node-memory refresh's (on a GPU: the stream waits)
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

        def rejected(ref: SnapshotRef, why: str) -> None:
            self.events.emit("snapshot_rejected", snapshot=ref.name, reason=why)

        loaded = self.path.select(self, rejected)
        another_run = loaded is None and bool(cfg.snapshot.resume_from)
        if another_run:
            loaded = self._from_another_run(cfg.snapshot.resume_from, rejected)  # type: ignore[arg-type]
        if loaded is None:
            return None
        skipped = self._load(loaded, check_compatible(loaded, cfg, self.identity))
        if another_run:  # where the audit of this run begins: what came before is the other run's
            sampler = self.parts.sampler.state_dict()  # type: ignore[union-attr]
            self.started_from = {"step": self.state.step, "epoch": sampler.get("epoch", 0),
                                 "consumed": sampler.get("consumed", 0), "snapshot": loaded.ref.name,
                                 "taken": sampler.get("taken")}
        self.at_boundary()
        if loaded.tier == "disk":
            self.saved_steps.add(self.state.step)  # a memory copy is not durable: the final save must still happen
        self._keeper.resumed_step = self.state.step
        self.path.resumed(self.state.step)
        self.events.emit("snapshot_loaded", snapshot=loaded.ref.name, step=self.state.step, skipped=skipped,
                         tier=loaded.tier)
        return loaded

    def _from_another_run(self, location: str, rejected: Callable[[SnapshotRef, str], None]) -> Loaded:
        """``snapshot.resume_from``: the newest intact snapshot of another run, read and never changed (a collective;
        this run has none of its own yet). Its run id is not this run's: that is the point."""
        other = open_store(location, local=os.path.join(self.cfg.run.dir, ".objects-resume-from"))
        found = find_newest(other, verify=self.cfg.snapshot.verify, on_rejected=rejected, readonly=True) \
            if self.dist.rank == 0 else None
        name = self.dist.broadcast_object(found.ref.name if found is not None else None)
        if name is None:
            raise ResumeError(f"snapshot.resume_from {location!r} holds no intact snapshot to start from; point it at "
                              "another run's snapshot directory (RUN_DIR/snapshots) or bucket, or remove it")
        ref = SnapshotRef.parse(name)
        assert ref is not None
        loaded = found if found is not None else load_exact(other, ref, map_location="cpu",
                                                            verify=self.cfg.snapshot.verify)
        if self.dist.rank == 0:
            log.warning("this run starts from another run's snapshot %s in %s (snapshot.resume_from); its own "
                        "snapshots follow from it", name, location)
            self.events.emit("resumed_from_another_run", location=location, snapshot=name,
                             their_run_uid=loaded.meta.get("run_uid", ""))
        return loaded

    def _load(self, loaded: Loaded, compat: Compatibility) -> list[str]:
        """Apply a loaded snapshot; returns the parts that were skipped (allow_mismatch)."""
        assert self.parts is not None, "track() the training parts first"
        parts, s = self.parts, loaded.state
        if self.path.localizes(loaded):  # each tensor in this rank's layout, whatever wrote it
            s = localize(s, parts.model, parts.optimizer, loaded.parts)
        skipped: list[str] = []
        try:
            parts.model.load_state_dict(s["model"])
        except RuntimeError as exc:
            raise ResumeError(
                f"snapshot {loaded.ref.name} does not fit this model: {str(exc).splitlines()[0]} "
                "(the architecture changed; use a new run.dir or export and fine-tune explicitly)"
            ) from exc
        if compat.optim_ok:
            parts.optimizer.load_state_dict(s["optimizer"])
            parts.scheduler.load_state_dict(s["scheduler"])
            if parts.scaler is not None and s.get("scaler"):
                parts.scaler.load_state_dict(scaler_numbers(s["scaler"]))
        else:
            skipped.append("optimizer/schedule state (optimisation config changed)")
        if compat.data_ok:
            try:
                parts.sampler.load_state_dict(s["sampler"])
            except ValueError as exc:
                raise ResumeError(
                    f"snapshot {loaded.ref.name} does not fit this dataset: {exc}. The data changed under the same "
                    "config; restore it, or set snapshot.allow_mismatch: true to restart the epoch"
                ) from exc
        else:
            skipped.append("data position (data config changed: the epoch restarts)")
        self.state.load_state_dict(s["train"])
        parts.rng.load_state_dict(s.get("rng", {}))
        return skipped

    # -- durable snapshots ------------------------------------------------------------------------------------

    def open_writer(self) -> None:
        """Rank 0 writes periodic and final snapshots; every node's first worker may write on a stop. Sharded:
        every rank writes its part of each snapshot (:mod:`.save_path`)."""
        snap = self.cfg.snapshot
        opened = self.writer is None
        if self.writer is None:
            self.writer = self.path.writer(self)
        if opened and self.writer is not None and self.dist.rank == 0:
            self.check_space()
            if snap.every_steps == "auto":
                self.auto = AutoSchedule(snap.mtbf_hours, read_events(self.cfg.run.dir), self.state.step,
                                         self.metrics.snapshot_interval.set)
        self._last_save = time.monotonic()

    def check_space(self) -> bool:
        """Warn once, at the start, when the snapshot volume cannot hold ``keep_last + 1`` snapshots."""
        low = room_warning(self.store, self.cfg.snapshot.keep_last,
                           state_bytes(self.state_dict()) if self.parts is not None else 0)
        if low is not None:
            log.warning("%s", low[0])
            self.events.emit("snapshot_space_low", free_bytes=low[1], needed_bytes=low[2])
        return low is None

    def capture_due(self, step: int, last: bool) -> tuple[bool, bool]:
        """Whether :meth:`maybe_save` will capture the state after ``step``: (a node-memory refresh of the shards,
        a periodic snapshot). The loop reads what it must of the device before either."""
        if last:
            return False, False
        snap = self.cfg.snapshot
        if snap.every_steps == "auto":
            due_steps = self.auto is not None and self.auto.due(step)
        else:
            due_steps = bool(snap.every_steps) and step % snap.every_steps == 0
        due_time = bool(snap.every_seconds) and time.monotonic() - self._last_save >= snap.every_seconds
        return self.path.refresh_due(step), bool(due_steps or due_time)

    def maybe_save(self, step: int, last: bool, due: tuple[bool, bool] | None = None) -> None:
        """After every step: a periodic snapshot when ``snapshot.every_steps``/``every_seconds`` say so (``due``:
        what :meth:`capture_due` said for this step, if the caller asked already)."""
        memory_due, snapshot_due = due if due is not None else self.capture_due(step, last)
        if not self._reserved:
            self._reserve_buffers()
        self.path.step_done()
        if memory_due:
            self.metrics.snapshot_blocking.observe(self.path.refresh(step, lambda: self.capture(replicated_from="node")))
        if snapshot_due:
            if self.auto is not None:
                self.auto.saving(step)
            self.save("periodic", sync=False)
            self._last_save = time.monotonic()

    def _reserve_buffers(self) -> None:
        """After an attempt's first step (the optimizer's state exists by then): a GPU state's pinned host buffers for
        the periodic captures, allocated in the background rather than inside the step of the first capture."""
        self._reserved = True
        if self.dist.device.type != "cuda":
            return  # host buffers cost nothing that a step would notice: made at the first capture, as ever
        if self.writer is not None and self.path.writes_periodic(self.dist.rank) and self.cfg.snapshot.async_write:
            self.writer.reserve(self.capture()[0])
        self.path.reserve(lambda: self.capture(replicated_from="node"))

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
        if self.writer is None or (reason in ("periodic", "final") and not self.path.writes_periodic(self.dist.rank)):
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
        once = "there is space" if self.store.is_local else f"{self.store.location} can be reached"
        where = (f"the state is kept in node memory on {self.env.hostname} ({self.memory.root}); once {once}, "
                 f"`elastic-runner snapshot persist {self.cfg.run.dir}` on that node writes it out, and a "
                 f"restart resumes from it" if kept and self.memory is not None else
                 f"no copy of it is kept ({self.path.no_copy_reason}); the newest durable snapshot is the one to "
                 "resume from")
        size = self.writer.last.size_estimate if self.writer is not None and self.writer.last is not None else 0
        space = space_note(self.store.root, size)
        return FinalSnapshotFailed(
            f"training finished at step {step}, but its final snapshot could not be written to {self.store.location}: "
            f"{exc}{f' ({space})' if space else ''}; {where}")

    def never_keep_diverged(self, first_bad: Callable[[], int | None]) -> None:
        """``first_bad``: the first step whose gradient was not finite (None: none yet); no thread keeps a state from
        it on in node memory (a failure, a lost peer, a park between that step and the logging step that reads it)."""
        self._keeper.diverged_at = first_bad

    def keep_nothing_after(self, step: int) -> None:
        """From now on no thread keeps a state after ``step`` in node memory (a rollback is under way)."""
        self._keeper.keep_at_most = step

    def discard_after(self, step: int, reason: str) -> tuple[list[str], list[str]]:
        """Take the states after ``step`` out of every resume (a rollback: no check vouched for them): this
        attempt's disk snapshots of later steps moved aside (rank 0, once its writer has finished: a write in
        flight would publish one after), its node-memory copies removed (each node's first rank). Every rank calls
        it; returns (the names moved aside, those that could not be: still in place)."""
        self.keep_nothing_after(step)
        if self.writer is not None:
            self.writer.wait()
        suspect = []
        if self.dist.rank == 0:
            suspect = [ref for ref in self.store.complete() if ref.generation == self.generation and ref.step > step]
            for ref in suspect:
                self.store.quarantine(ref, reason)
        if self.memory is not None and self.env.is_local_leader:
            for ref in self.memory.store.complete():
                if ref.generation == self.generation and ref.step > step:
                    self.memory.store.remove(ref)
        left = set(self.store.complete()) if suspect else set()
        return [r.name for r in suspect if r not in left], [r.name for r in suspect if r in left]

    def set_aside_after(self, step: int, reason: str) -> list[str]:
        """A rollback's first act, on each node's first rank, before anything that waits for a peer: this attempt's
        durable snapshots of steps after ``step`` moved aside now (no wait for a writer: rank 0's
        :meth:`discard_after` takes what its writer still publishes). The node that holds the suspect replica, and
        rank 0 who writes the snapshots, may be the next one lost; seen in a soak: rank 0's replica corrupted, a
        snapshot of it taken before the check, rank 0's node lost while it judged, and the next round resumed from
        that snapshot — the survivors had refused to keep their own (no check vouched for it) and set nothing aside.
        Returns the names it moved aside."""
        self.keep_nothing_after(step)
        if not self.env.is_local_leader:
            return []
        try:
            suspect = [ref for ref in self.store.complete() if ref.generation == self.generation and ref.step > step]
            for ref in suspect:
                self.store.quarantine(ref, reason)
            left = set(self.store.complete()) if suspect else set()
        except (OSError, SnapshotError) as exc:  # rank 0's discard_after tries again; the rollback must go on
            log.warning("could not set the snapshots after step %d aside: %s", step, exc)
            return []
        return [r.name for r in suspect if r not in left]

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
        self.path.finished()
        if self.memory is not None:
            self.memory.drop()


__all__ = ["Checkpointer", "FinalSnapshotFailed", "ResumeError", "StopSnapshotFailed"]
