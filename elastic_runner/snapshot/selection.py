"""Which state a (re)started job resumes from: the newest of every node's memory tier and the disk.

A collective: every rank calls :func:`select_newest` with the job's collectives (``dist``: the
worker's :class:`~elastic_runner.dist.Dist` or anything with its ``rank``, ``backend``,
``device``, ``all_gather_object``, ``broadcast_object`` and ``broadcast_tensor``).

Ranks report what their node keeps in memory; rank 0 compares the newest of those with the newest
intact disk snapshot by (generation, step). A memory copy counts only if it belongs to this run
(its run id), to a generation this run has issued, and to the same configuration fingerprint. It
is read and verified by its holder and its bytes broadcast, so the other nodes need neither a copy
nor the shared filesystem. A disk snapshot is loaded by every rank itself. Everything is loaded to
CPU memory; ``load_state_dict`` then copies it onto each rank's own device, so no device needs room
for a second copy.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch

from .format import load_state_bytes, read_meta
from .loader import Loaded, find_newest, load_exact
from .memory import MemoryCandidate, MemoryTier
from .store import SnapshotError, SnapshotRef, SnapshotStore

log = logging.getLogger(__name__)

#: Memory-tier bytes travel in pieces of this size (a GPU needs only one piece at a time).
BROADCAST_CHUNK = 64 << 20


def select_newest(dist: Any, store: SnapshotStore, *, fingerprint: dict[str, str], run_uid: str, verify: bool,
                  memory: MemoryTier | None = None,
                  on_rejected: Callable[[SnapshotRef, str], None] | None = None) -> Loaded | None:
    """The newest state anywhere; every rank returns the same one (or None: start from scratch)."""
    local = memory.newest(dist.rank) if memory is not None else None
    reported = dist.all_gather_object(dataclasses.asdict(local) if local is not None else None)
    candidates = [MemoryCandidate(**c) for c in reported if c is not None]

    decision: tuple[str, Any, Any] | None = None
    loaded: Loaded | None = None
    if dist.rank == 0:
        issued = store.newest_generation()
        usable = [c for c in candidates
                  if c.fingerprint == fingerprint and c.run_uid == run_uid and c.generation <= issued]
        best_memory = max(usable, key=lambda c: (c.generation, c.step, -c.rank), default=None)
        complete = store.complete()
        newest_disk = complete[-1] if complete else None
        if best_memory is None or (newest_disk is not None and newest_disk > best_memory.ref):
            loaded = find_newest(store, map_location="cpu", verify=verify, on_rejected=on_rejected, run_uid=run_uid)
        if best_memory is not None and (loaded is None or best_memory.ref > loaded.ref):
            decision, loaded = ("memory", best_memory.rank, [best_memory.generation, best_memory.step]), None
        elif loaded is not None:
            decision = ("disk", 0, [loaded.ref.generation, loaded.ref.step])
    decision = dist.broadcast_object(decision)
    if decision is None:
        return None
    tier, holder, (generation, step) = decision
    ref = SnapshotRef(generation=generation, step=step)
    if tier == "disk":
        if loaded is None:
            loaded = load_exact(store, ref, map_location="cpu", verify=verify)
        loaded.tier = "disk"
        return loaded
    result = _broadcast_memory_snapshot(dist, memory, holder, ref)
    if result is None:
        # The holder could not read its copy: every rank falls back to the disk together.
        return select_newest(dist, store, fingerprint=fingerprint, run_uid=run_uid, verify=verify, memory=None,
                             on_rejected=on_rejected)
    return result


def _broadcast_memory_snapshot(dist: Any, memory: MemoryTier | None, holder: int, ref: SnapshotRef) -> Loaded | None:
    data = b""
    meta: dict[str, Any] = {}
    if dist.rank == holder:
        assert memory is not None
        try:
            data = memory.read_bytes(ref)
            meta = read_meta(memory.store.path(ref))
        except SnapshotError as exc:
            log.error("the in-memory snapshot %s is unusable (%s); falling back to disk", ref.name, exc)
            data = b""
    n, meta = dist.broadcast_object((len(data), meta), src=holder)
    if n == 0:
        return None
    buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8) if dist.rank == holder else torch.empty(n, dtype=torch.uint8)
    for start in range(0, n, BROADCAST_CHUNK):
        piece = buffer[start:start + BROADCAST_CHUNK]
        if dist.backend == "nccl":
            on_device = piece.to(dist.device)
            dist.broadcast_tensor(on_device, src=holder)
            piece.copy_(on_device.cpu())
        else:
            dist.broadcast_tensor(piece, src=holder)
    state = load_state_bytes(buffer.numpy().tobytes(), ref.name, "cpu")
    return Loaded(ref, meta, state, tier="memory")
