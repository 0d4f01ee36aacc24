"""Room for snapshots: how big one is, and whether the volume can hold what ``keep_last`` asks for.

A full volume does not stop training (every failed write is reported and the previous snapshots stay
intact), but a run that never manages a durable snapshot loses everything with its last node. These
helpers put numbers in the lines that say so: at the start (:func:`room_warning`), on a failed write
and when a finished run's final snapshot cannot be written (:func:`space_note`).
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path
from typing import Any

import torch

from .format import read_meta
from .store import SnapshotError, SnapshotStore


def state_bytes(obj: Any) -> int:
    """Bytes of tensor data in a (nested) state: about what a snapshot of it takes on disk."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v) for v in obj)
    return 0


def is_disk_full(exc: BaseException) -> bool:
    while exc is not None:
        if getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(exc):
            return True
        exc = exc.__cause__  # type: ignore[assignment]
    return False


def space_note(root: Path | str, needed: int) -> str:
    """"X MB free on ROOT, a snapshot needs about Y MB" (empty where the volume cannot be read)."""
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        return ""
    return f"{free / 1e6:.1f} MB free on {root}, a snapshot needs about {needed / 1e6:.1f} MB"


def newest_size(store: SnapshotStore) -> int:
    """``size_bytes`` of the newest readable snapshot in ``store`` (0 if none)."""
    for ref in reversed(store.complete()):
        try:
            return int(read_meta(store.path(ref)).get("size_bytes", 0))
        except SnapshotError:
            continue
    return 0


def room_warning(store: SnapshotStore, keep_last: int, live_bytes: int) -> tuple[str, int, int] | None:
    """(message, free, needed) when the volume cannot hold ``keep_last + 1`` snapshots (the newest is
    written before the oldest is pruned); None when it can or cannot be measured. The size is the newest
    snapshot's, or the live state's tensor bytes before the first one (optimizer moments appear at the
    first step: an estimate)."""
    try:
        free = shutil.disk_usage(store.root).free
    except OSError:
        return None
    if not store.is_local:
        # An object store's capacity is not measured; the node's disk holds one staging copy at a time (reading the
        # newest snapshot's size would download it).
        needed = live_bytes
        if not needed or free >= needed:
            return None
        return (f"{store.root} (the node's staging directory for {store.location}) has {free / 1e6:.1f} MB free; "
                f"a snapshot needs about {needed / 1e6:.1f} MB there before it is uploaded. Durable snapshots may "
                "fail (training goes on); free space on run.dir's disk", free, needed)
    size = max(newest_size(store), live_bytes)
    needed = (keep_last + 1) * size
    if not size or free >= needed:
        return None
    return (f"the snapshot volume {store.root} has {free / 1e6:.1f} MB free; snapshot.keep_last: {keep_last} needs "
            f"about ({keep_last} + 1) x {size / 1e6:.1f} MB = {needed / 1e6:.1f} MB. Durable snapshots may fail "
            f"(training goes on); free space, or lower snapshot.keep_last", free, needed)
