"""How a state is saved, kept and restored, by how the model is spread over the ranks: the Checkpointer has one save
path, and asks one of these what differs.

- :class:`Replicated` (``parallel.strategy: ddp``): every rank holds the whole state. Rank 0 writes the periodic and
  final snapshots (on a stop every node's first worker writes too); node memory keeps the whole state when an
  attempt ends (the :class:`~elastic_runner.training.boundary.Keeper`); a resume reads the newest state of either
  tier (:func:`~elastic_runner.snapshot.selection.select_newest`).
- :class:`Sharded` (``fsdp``, ``hsdp``): every rank holds only its shards, and every rank that writes parts (all of
  them under fsdp, the first replica's under hsdp) writes its own into each snapshot
  (:class:`~elastic_runner.snapshot.sharded_writer.ShardedSnapshotWriter`); node memory holds the shards, refreshed
  every ``snapshot.memory_every_steps`` steps (:class:`~elastic_runner.snapshot.sharded_memory.ShardedMemory`), not
  when an attempt ends: a survivor's own shards are no whole state, and a lost rank's are only in its node's memory or
  its neighbour's; a resume gathers the newest step every rank's parts can be read at
  (:func:`~elastic_runner.snapshot.sharded_memory.select_sharded`).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Protocol

from ..observe.events import read_events
from ..snapshot import Loaded, SnapshotWriter
from ..snapshot.interval import SharedInterval, failures_seen
from ..snapshot.memory import MemoryTier
from ..snapshot.selection import select_newest
from ..snapshot.shards import split
from ..snapshot.sharded_memory import Layout, ShardedMemory, exchange_group, select_sharded
from ..snapshot.sharded_writer import ShardedSnapshotWriter
from ..snapshot.writer import SnapshotObserver

if TYPE_CHECKING:
    from ..config import Config
    from ..dist import Dist
    from ..env import WorkerEnv
    from ..observe.metrics import Metrics
    from ..snapshot import ShardedStore
    from .state import TrainState

log = logging.getLogger(__name__)


class Checkpointer(SnapshotObserver, Protocol):
    """What the strategies read of the :class:`~elastic_runner.training.checkpointer.Checkpointer` they serve (which
    also hears what its writer did)."""

    cfg: Config
    env: WorkerEnv
    dist: Dist
    store: ShardedStore
    memory: MemoryTier | None
    fingerprint: dict[str, str]
    run_uid: str
    generation: int
    state: TrainState
    metrics: Metrics


class Replicated:
    """Every rank holds the whole state (see the module docstring)."""

    #: The model's state as ``Module.state_dict`` gives it by default (detached tensors).
    keep_vars = False
    #: What :meth:`~.checkpointer.Checkpointer._final_failed` says when node memory holds no copy of a final state.
    no_copy_reason = "snapshot.in_memory is off"

    def wants_memory(self, ckpt: Checkpointer) -> bool:
        return ckpt.cfg.snapshot.in_memory

    def start(self, ckpt: Checkpointer) -> None:
        """Once the Checkpointer's node memory exists (or does not): nothing more for a replicated state."""

    def kept_at_the_end(self, memory: MemoryTier | None) -> MemoryTier | None:
        """Where the Keeper puts the last completed step when an attempt ends: node memory, the whole state."""
        return memory

    def arrange(self, ckpt: Checkpointer, state: dict[str, Any], replicated_from: str) -> dict[str, Any]:
        return state

    def select(self, ckpt: Checkpointer, on_rejected: Callable[..., None]) -> Loaded | None:
        return select_newest(ckpt.dist, ckpt.store, fingerprint=ckpt.fingerprint, run_uid=ckpt.run_uid,
                             verify=ckpt.cfg.snapshot.verify, memory=ckpt.memory, on_rejected=on_rejected)

    def localizes(self, loaded: Loaded) -> bool:
        """Whether a loaded state is cut to this rank's layout first: only a sharded snapshot's parts."""
        return loaded.parts is not None

    def writer(self, ckpt: Checkpointer) -> SnapshotWriter | None:
        """Rank 0 writes periodic and final snapshots; every node's first worker may write on a stop."""
        if ckpt.dist.rank != 0 and not ckpt.env.is_local_leader:
            return None
        snap = ckpt.cfg.snapshot
        return SnapshotWriter(ckpt.store, generation=ckpt.generation, keep_last=snap.keep_last,
                              async_write=snap.async_write, observer=ckpt, writer=snap.writer)

    def writes_periodic(self, rank: int) -> bool:
        """Whether ``rank`` writes (its part of) periodic and final snapshots."""
        return rank == 0

    # -- node memory refreshed between steps (sharded only) -------------------------------------------------------

    def wait_staged(self) -> None:
        """Before the step changes the state: a refresh's copy of it is done (on a GPU: the stream waits)."""

    def resumed(self, step: int) -> None:
        """The attempt resumed ``step``: refreshes count from it."""

    def refresh_due(self, step: int) -> bool:
        return False

    def step_done(self) -> None:
        """A step completed (the refresh interval's clock)."""

    def refresh(self, step: int, capture: Callable[[], tuple[dict[str, Any], dict[str, Any]]]) -> float:
        """Refresh node memory with ``step``'s state; the seconds the step was held."""
        return 0.0

    def reserve(self, capture: Callable[[], tuple[dict[str, Any], dict[str, Any]]]) -> None:
        """A GPU state's pinned host buffers for the refreshes, reserved off the step."""

    def finished(self) -> None:
        """The run is complete: a refresh still writing is waited for."""


class Sharded(Replicated):
    """Every rank holds only its shards (see the module docstring)."""

    #: The parameters themselves, not a detached DTensor of each (~15 µs apiece through DTensor's dispatch); the
    #: split takes their local slices, which the staging copy detaches.
    keep_vars = True
    no_copy_reason = "a sharded state is copied into node memory every snapshot.memory_every_steps steps, not at the end"

    def __init__(self, ckpt: Checkpointer) -> None:
        env, cfg = ckpt.env, ckpt.cfg
        #: Who writes which part of a sharded snapshot (and holds which in node memory).
        self.layout = Layout(rank=ckpt.dist.rank, world=env.world_size, local_rank=env.local_rank,
                             local_world=env.local_world_size, strategy=cfg.parallel.strategy,
                             replicas=cfg.snapshot.memory_replicas)
        #: The shards copied into node memory every snapshot.memory_every_steps (:mod:`...sharded_memory`).
        self.memory: ShardedMemory | None = None

    def wants_memory(self, ckpt: Checkpointer) -> bool:
        snap = ckpt.cfg.snapshot
        wanted = bool(snap.in_memory and snap.memory_every_steps)
        if not wanted and ckpt.dist.rank == 0:
            log.info("parallel.strategy %s with snapshot.%s: a failure resumes from the newest disk snapshot",
                     ckpt.cfg.parallel.strategy, "in_memory off" if not snap.in_memory else "memory_every_steps 0")
        return wanted

    def start(self, ckpt: Checkpointer) -> None:
        if not self._everyone_has_memory(ckpt):
            ckpt.memory = None  # (shards in node memory on some ranks only would be no state anyone could resume)
            return
        if ckpt.memory is not None:
            group = exchange_group(ckpt.cfg.dist.timeout_seconds) if ckpt.env.world_size > 1 else None  # a collective
            self.memory = ShardedMemory(ckpt.memory, self.layout, group, self._schedule(ckpt))

    @staticmethod
    def _everyone_has_memory(ckpt: Checkpointer) -> bool:
        """Whether every rank opened its node memory (each rank asks its own directory, which may be refused on some
        nodes only: planted, another user's). The exchange group and every refresh are collectives: all ranks take
        part or none, so the ranks agree first (one all-reduce when the attempt starts)."""
        snap = ckpt.cfg.snapshot
        if ckpt.env.world_size == 1 or not (snap.in_memory and snap.memory_every_steps):
            return True
        import torch

        have = torch.tensor([1 if ckpt.memory is not None else 0], dtype=torch.long, device=ckpt.dist.device)
        ckpt.dist.all_reduce_sum(have)
        count = int(have.item())  # (once per attempt, before training: no step waits for it)
        if count == ckpt.env.world_size:
            return True
        if ckpt.dist.rank == 0:
            log.warning("node memory is off for the shards in this attempt: %d of %d ranks could not open their "
                        "node-memory directory (each said why); a failure resumes from the newest disk snapshot",
                        ckpt.env.world_size - count, ckpt.env.world_size)
        return False

    def kept_at_the_end(self, memory: MemoryTier | None) -> MemoryTier | None:
        return None  # the periodic refresh keeps the shards instead

    def arrange(self, ckpt: Checkpointer, state: dict[str, Any], replicated_from: str) -> dict[str, Any]:
        """This rank's slices apart, and the rest (with a marker per slice) from rank 0 only, or
        (``replicated_from="node"``, for node memory) from every node's first rank."""
        replicated, tensors, offsets = split(state)
        mine = ckpt.dist.rank == 0 if replicated_from == "rank0" else ckpt.env.local_rank == 0
        return {"replicated": replicated if mine else None, "part": {"tensors": tensors, "offsets": offsets}}

    def select(self, ckpt: Checkpointer, on_rejected: Callable[..., None]) -> Loaded | None:
        return select_sharded(ckpt.dist, ckpt.store, self.memory, fingerprint=ckpt.fingerprint, run_uid=ckpt.run_uid,
                              verify=ckpt.cfg.snapshot.verify, on_rejected=on_rejected)

    def localizes(self, loaded: Loaded) -> bool:
        return True  # each tensor in this rank's layout, whatever wrote it

    def writer(self, ckpt: Checkpointer) -> SnapshotWriter | None:
        snap = ckpt.cfg.snapshot
        return ShardedSnapshotWriter(ckpt.store, generation=ckpt.generation, keep_last=snap.keep_last,
                                     rank=ckpt.dist.rank, writers=self.layout.writers, async_write=snap.async_write,
                                     observer=ckpt)

    def writes_periodic(self, rank: int) -> bool:
        return True  # every rank its part (a rank with none writes nothing: the writer knows)

    def _schedule(self, ckpt: Checkpointer) -> SharedInterval:
        """When the node-memory copy of the shards is refreshed (``snapshot.memory_every_steps``; under ``auto`` rank
        0 learns the failures so far from the run's events)."""
        snap, rank0 = ckpt.cfg.snapshot, ckpt.dist.rank == 0
        failures, started = failures_seen(read_events(ckpt.cfg.run.dir)) if rank0 and snap.memory_every_steps == "auto" \
            else (0, None)
        return SharedInterval(snap.memory_every_steps, prior_mtbf_s=snap.memory_mtbf_hours * 3600, failures=failures,
                              run_started=started if started is not None else time.time(),
                              start_step=ckpt.state.step,
                              cap=snap.every_steps if isinstance(snap.every_steps, int) and snap.every_steps > 0 else None,
                              report=ckpt.metrics.memory_interval.set if rank0 else (lambda steps: None), speaks=rank0)

    def wait_staged(self) -> None:
        if self.memory is not None:
            self.memory.wait_staged()

    def resumed(self, step: int) -> None:
        if self.memory is not None:  # the first refresh counts from the step resumed (the same on every rank)
            self.memory.schedule.last = step

    def refresh_due(self, step: int) -> bool:
        return self.memory is not None and self.memory.due(step)

    def step_done(self) -> None:
        if self.memory is not None:
            self.memory.schedule.step_done()

    def refresh(self, step: int, capture: Callable[[], tuple[dict[str, Any], dict[str, Any]]]) -> float:
        assert self.memory is not None, "refresh_due said no refresh is due"
        return self.memory.refresh(step, capture)

    def reserve(self, capture: Callable[[], tuple[dict[str, Any], dict[str, Any]]]) -> None:
        if self.memory is not None:
            self.memory.reserve(capture()[0])

    def finished(self) -> None:
        if self.memory is not None:
            self.memory.wait(timeout=30.0)  # a refresh still writing would only find its directory gone


def save_path(ckpt: Checkpointer) -> Replicated:
    """The save path's strategy for this Checkpointer's model."""
    return Sharded(ckpt) if ckpt.cfg.parallel.sharded else Replicated()
