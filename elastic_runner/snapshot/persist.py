"""Node memory made durable: this node's newest in-memory copy of a run's state written into the run's snapshot
store, when it is newer than every durable snapshot there.

Two callers. ``elastic-runner snapshot persist``: a person, after a job whose final snapshot could not be written
(a full volume, a bucket that refused). And a worker stopped at a moment when it cannot save from its live state —
before its attempt trains (its process group coming up, the restore) or between two attempts of in-process recovery
(parked for a new round): the node's memory then often holds a step newer than the last durable snapshot (up to a
snapshot interval newer), and a stop is how a node is preempted, its memory gone with it. Seen in a soak: a parked
worker preempted with the newest step in its node's memory only; the next round resumed a step older.

The copy is the disk format already (written by the same writer, signed with the job's key), so it is copied as it
is, verified before (checksums, signature, that it is this run's) and after. A worker's copy is fenced like any
write: once a generation newer than the copy's and the worker's own exists, the job has gone on without this node
(a split brain's stale side, say) and nothing is written.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..files import open_file
from .format import read_meta, read_verified_bytes
from .space import space_note
from .store import AlreadyCommittedError, LocalStore, SnapshotError, SnapshotStore, StaleWriterError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Persisted:
    """What :func:`persist_newest` did."""

    snapshot: str  #: the in-memory copy's name
    step: int
    written: bool
    why: str = ""  #: why nothing was written
    to: str = ""  #: the store it was written to
    #: Nothing written because the store holds as new a snapshot already (nothing was at risk).
    durable_already: bool = False


def persist_newest(store: SnapshotStore, memory_root: Path, *, job_ended: bool,
                   own_generation: int | None = None) -> Persisted:
    """Write the newest copy in ``memory_root`` (a run's node-memory directory) into ``store`` when it is newer (by
    generation, then step: the order a resume picks in) than every durable snapshot there.

    ``job_ended``: a person persists after the job; a name that a writer left without its marker is replaced, and
    no fence applies. Otherwise (a live worker, of ``own_generation`` once its attempt knows it) a generation newer
    than both the copy's and the worker's own means the job went on without this node: nothing is written.
    Raises :class:`SnapshotError` when there is no copy, when it is damaged, or when nothing proves it is this
    run's (a copy of another run that used the same location, or a planted one, must never become its newest
    durable snapshot); the copy itself is never changed."""
    tier = LocalStore(memory_root)
    complete = tier.complete()
    if not complete:
        raise SnapshotError(f"this node holds no in-memory copy of the run whose snapshots are in {store.location} "
                            f"(looked in {memory_root}); run it on the node the message named")
    ref = complete[-1]
    meta = read_meta(tier.path(ref))
    if "sharded" in meta:
        return Persisted(ref.name, ref.step, False, "a sharded model's node memory holds this node's shards only")
    read_verified_bytes(tier.path(ref), meta, True)
    ours = store.existing_run_uid()
    theirs = str(meta.get("run_uid") or "")
    if not ours or not theirs:
        missing = f"{store.location}/run-id is missing" if not ours else f"the in-memory copy {ref.name} carries no run id"
        raise SnapshotError(f"cannot prove that the in-memory copy {ref.name} belongs to the run in {store.location}: "
                            f"{missing}; nothing was written")
    if ours != theirs:
        raise SnapshotError(f"the in-memory copy {ref.name} belongs to another run that used {store.location}; "
                            "nothing was written")
    durable = store.complete()
    if durable and max(durable) >= ref:
        return Persisted(ref.name, ref.step, False, f"{store.location} already has {max(durable).name}, as new or newer",
                         durable_already=True)
    if not job_ended:
        try:
            store.check_fence(max(ref.generation, own_generation or 0))
        except StaleWriterError as exc:
            return Persisted(ref.name, ref.step, False, f"the job went on without this node ({exc})")
    store.ensure()
    staging: Path | None = store.staging(ref)
    try:
        for item in sorted(tier.path(ref).iterdir()):
            with open(item, "rb") as src, open_file(staging / item.name, "wb", exclusive=True) as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
                dst.flush()
                os.fsync(dst.fileno())
        store.publish(staging, ref, replace_incomplete=job_ended)
        staging = None
    except AlreadyCommittedError:
        # Another node's first worker wrote the same step (replicas are identical): it is durable.
        return Persisted(ref.name, ref.step, False, "another node wrote it first", durable_already=True)
    except OSError as exc:
        note = space_note(store.location, int(meta.get("size_bytes", 0)))
        raise SnapshotError(f"could not write {ref.name} to {store.location}: {exc}{f' ({note})' if note else ''}; "
                            "the in-memory copy is untouched") from exc
    finally:
        if staging is not None:
            store.discard(staging)
    read_verified_bytes(store.path(ref), read_meta(store.path(ref)), True)
    return Persisted(ref.name, ref.step, True, to=store.location)
