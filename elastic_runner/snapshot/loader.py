"""Find the newest snapshot that is complete and intact.

Rank 0 walks the published snapshots newest first (by generation, then step),
verifies each (marker, size, SHA-256, safe unpickling) and moves a damaged one
aside as ``corrupt-<name>`` with the reason, so the next start does not trip
over it again and a person can still look at it. The first good one wins; the
choice is broadcast so that every rank loads the same snapshot.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..printable import printable
from .format import load_state_bytes, read_meta, read_verified_bytes
from .shards import PartReader, verify_parts
from .store import CorruptSnapshotError, SnapshotError, SnapshotRef, SnapshotStore

log = logging.getLogger(__name__)


@dataclass
class Loaded:
    ref: SnapshotRef
    meta: dict[str, Any]
    state: dict[str, Any]
    tier: str = "disk"  #: "disk" or "memory" (a node's shared-memory copy)
    #: A sharded snapshot's parts (:mod:`.shards`): ``state`` holds markers that this reader resolves.
    parts: PartReader | None = None


def find_newest(store: SnapshotStore, *, map_location: torch.device | str = "cpu", verify: bool = True,
                on_rejected: Callable[[SnapshotRef, str], None] | None = None, run_uid: str = "",
                readonly: bool = False) -> Loaded | None:
    """The newest intact snapshot; None only if there never was one.

    Only damage to the snapshot itself (marker, size, checksum, unsafe or
    unreadable pickle) moves it aside. A failure that may pass — an I/O error
    on a shared filesystem, too little memory — raises
    :class:`SnapshotUnavailableError` and leaves everything in place, so the
    attempt fails and the next one retries. If snapshots existed but every one
    was damaged, :class:`SnapshotError` says so instead of silently training
    from scratch.

    ``run_uid``: this run's id (:meth:`~.store.LocalStore.run_uid`). A snapshot another run wrote (its signed
    ``run_uid`` differs: copied in from another job's directory or bucket) is moved aside like a damaged one —
    resuming from another run's state on purpose is ``snapshot.resume_from``. Snapshots written before run ids
    were recorded carry none and are taken. ``readonly``: another run's store, read and never changed (a damaged
    snapshot there is passed over, not moved aside).
    """
    candidates = list(reversed(store.complete()))
    rejected = []
    for ref in candidates:
        try:
            directory = store.path(ref)  # a bucket's: its marker checked before anything else is fetched
            meta = read_meta(directory)
            theirs = meta.get("run_uid")
            if run_uid and theirs and theirs != run_uid:
                raise CorruptSnapshotError(f"{ref.name}: written by another run (run id {printable(theirs, 80)}; this run's is "
                                           f"{run_uid}): copied in, not this run's state")
            data = read_verified_bytes(directory, meta, verify)
            state = load_state_bytes(data, ref.name, map_location)
            if "sharded" in meta:
                verify_parts(directory, meta, verify)
        except CorruptSnapshotError as exc:
            reason = str(exc)
            log.error("snapshot %s is damaged and is %s: %s; trying the previous one", ref.name,
                      "passed over" if readonly else "moved aside", reason)
            if not readonly:
                store.quarantine(ref, reason)
            rejected.append(ref.name)
            if on_rejected is not None:
                on_rejected(ref, reason)
            continue
        return Loaded(ref, meta, state, parts=PartReader(directory, meta) if "sharded" in meta else None)
    if rejected:
        raise SnapshotError(
            f"all {len(rejected)} snapshot(s) in {store.location} are damaged and were moved aside as corrupt-*; "
            "nothing to resume from. To start from scratch use a new run.dir (or remove the corrupt-* directories)"
        )
    return None


def load_exact(store: SnapshotStore, ref: SnapshotRef, *, map_location: torch.device | str, verify: bool = True) -> Loaded:
    """Load the snapshot rank 0 chose (every other rank)."""
    directory = store.path(ref)
    meta = read_meta(directory)
    data = read_verified_bytes(directory, meta, verify)
    # A sharded snapshot's parts were verified by rank 0, which chose it.
    return Loaded(ref, meta, load_state_bytes(data, ref.name, map_location),
                  parts=PartReader(directory, meta) if "sharded" in meta else None)
