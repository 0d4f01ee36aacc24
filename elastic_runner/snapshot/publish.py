"""Write one snapshot and publish it: fenced by generation, atomic, with old snapshots pruned.

Runs wherever the bytes are written: in the writer process (:mod:`.writer_process`) or in the
worker's writer thread (:mod:`.writer`); both import it, and it imports neither.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NoReturn

from .format import write_snapshot_files
from .shards import PART_WAIT_MIN_S, SHARD_FORMAT, wait_for_parts, write_part
from .store import AlreadyCommittedError, ShardedStore, SnapshotRef, SnapshotStore, StaleWriterError, in_background


@dataclass
class Written:
    """What :func:`write_and_publish` did, for the worker to report."""

    meta: dict[str, Any]
    already_committed: bool = False
    prune_errors: list[str] = field(default_factory=list)
    #: ``time.perf_counter()`` when the snapshot was durable (published): deleting older ones comes after and is
    #: not part of its time to durable.
    published_at: float | None = None

    def seconds_since(self, started: float) -> float:
        """Time to durable of a write that began at ``started``."""
        return (self.published_at if self.published_at is not None else time.perf_counter()) - started


def write_and_publish(store: SnapshotStore, generation: int, keep_last: int, ref: SnapshotRef, state: dict[str, Any],
                      meta: dict[str, Any]) -> Written:
    """Write ``state`` as snapshot ``ref``, publish it unless a newer generation owns the run, and delete
    snapshots beyond ``keep_last``. Runs in the writer process or the writer thread. On failure the
    staging directory is gone and the published snapshots are as they were."""
    staging = None
    try:
        store.check_fence(generation)
        staging = store.staging(ref)
        written = _publish(store, generation, keep_last, staging, ref,
                           Written(write_snapshot_files(staging, state, meta, sync=store.is_local)))
        staging = None
        return written
    except Exception as exc:
        if staging is not None:  # first: the space it took is part of what the report measures
            store.discard(staging)
            staging = None
        _raise_stale_or(store, generation, exc)
    finally:
        if staging is not None:  # Ctrl-C during a synchronous save
            store.discard(staging)


def write_sharded(store: ShardedStore, generation: int, keep_last: int, ref: SnapshotRef, state: dict[str, Any],
                  meta: dict[str, Any], *, rank: int, writers: list[int]) -> Written:
    """One rank's share of a sharded snapshot (:mod:`.shards`): its part, if it is one of ``writers``; rank 0
    then waits for every writer's part, writes ``state.pt`` and ``meta.json`` (listing each part's SHA-256) and
    publishes, fenced like :func:`write_and_publish`. Every rank writes into the same staging directory
    (named by the snapshot, so that they meet there); only rank 0 publishes or gives it up."""
    staging = None
    own_part: Callable[[], Any] | None = None
    try:
        store.check_fence(generation)
        if rank != 0 and rank not in writers:
            # Nothing to write, and no staging directory to make: a slow rank arriving after rank 0 published
            # would make it again, and it would stay behind as a leftover beside the snapshot.
            return Written(meta={"part": None, "step": ref.step})
        staging = store.shared_staging(ref)
        began = time.monotonic()
        if rank != 0:
            record = write_part(staging, rank, state["part"])
            store.share_part(staging, ref, rank)  # a bucket: the part goes where rank 0 looks for it
            return Written(meta={"part": record, "step": ref.step})
        # Rank 0's own part in a thread while it writes state.pt (the rest of the state): the two fsyncs overlap.
        if rank in writers:
            own_part = in_background(write_part, staging, rank, state["part"])

        def parts_written() -> dict[str, Any]:
            if own_part is not None:
                own_part()
            # The others started writing when rank 0 did, parts of about its size: a part that has not come in many
            # times rank 0's own time (and at least a minute) will not come (its rank died, or a newer round began).
            parts = wait_for_parts(staging, writers, timeout_s=max(PART_WAIT_MIN_S, 8 * (time.monotonic() - began)),
                                   still_wanted=lambda: store.check_fence(generation),
                                   **store.part_records(staging, ref))
            return {"sharded": {"format": SHARD_FORMAT, "world_size": meta.get("world_size"), "writers": writers,
                                "parts": parts}}

        # meta.json once every part is there.
        written = Written(write_snapshot_files(staging, state["replicated"], meta, more_meta=parts_written,
                                               sync=store.is_local))
        # What the snapshot takes on disk (meta.json's size_bytes stays that of state.pt, which it checks).
        parts = written.meta["sharded"]["parts"]
        written.meta = written.meta | {"size_bytes": written.meta["size_bytes"] + sum(p["size_bytes"] for p in parts)}
        return _publish(store, generation, keep_last, staging, ref, written)
    except Exception as exc:
        if own_part is not None:  # done writing before its directory goes
            with contextlib.suppress(Exception):
                own_part()
        if staging is not None and (rank == 0 or not store.is_local):  # a bucket's staging is each rank's own
            store.discard(staging)
        _raise_stale_or(store, generation, exc)


def _publish(store: SnapshotStore, generation: int, keep_last: int, staging: Path, ref: SnapshotRef,
             written: Written) -> Written:
    """Publish ``staging`` as ``ref`` unless a newer round started meanwhile (fenced again right before the rename);
    then delete snapshots beyond ``keep_last``. Raises with ``staging`` still there (the caller discards it)."""
    store.check_fence(generation)
    try:
        store.publish(staging, ref, entries_synced=True)  # by write_snapshot_files
    except AlreadyCommittedError:
        written.already_committed = True
    written.published_at = time.perf_counter()
    written.prune_errors = _prune(store, keep_last, ref, written.meta.get("verified_step"))
    return written


def _raise_stale_or(store: SnapshotStore, generation: int, exc: Exception) -> NoReturn:
    """Raise the stale-writer error if a newer round explains ``exc`` (:func:`_stale_instead`), else ``exc``."""
    stale = _stale_instead(store, generation, exc)
    if stale is exc:
        raise exc
    raise stale from exc


def _stale_instead(store: SnapshotStore, generation: int, exc: Exception) -> Exception:
    """A write that failed because a newer round started meanwhile (its start sweeps older
    rounds' staging directories) is the stale-writer error, not a disk problem to retry."""
    if isinstance(exc, StaleWriterError):
        return exc
    try:
        store.check_fence(generation)
    except StaleWriterError as stale:
        return stale
    except Exception:  # noqa: BLE001 - the store itself failing: report the original error
        return exc
    return exc


def _prune(store: SnapshotStore, keep_last: int, newest: SnapshotRef, verified_step: int | None = None) -> list[str]:
    """Delete this run's snapshots older than the ``keep_last`` newest, but the newest of ``newest``'s generation
    at or before ``verified_step`` (the last step whose replicas' fingerprints agreed: where a rollback returns,
    however many snapshots were taken since). A name later than the one publishing (the fence just checked that its
    generation is the newest, and a generation's steps only grow) was put there by something else: it counts for
    nothing here (a reader moves it aside), so it never makes the job's own snapshots look old."""
    complete = [ref for ref in store.complete() if ref <= newest]
    keep = set(complete[-keep_last:])
    if verified_step is not None:
        vouched = [ref for ref in complete if ref.generation == newest.generation and ref.step <= verified_step]
        keep |= set(vouched[-1:])
    errors = []
    for ref in complete:
        if ref not in keep and ref < newest:
            try:
                store.remove(ref)
            except OSError as exc:
                errors.append(f"could not delete old snapshot {ref.name}: {exc}")
    return errors
