"""The in-memory snapshot tier: the newest state, kept on every node that survives.

In DDP every rank holds the whole model and optimizer state, so any survivor
of a failure can seed the restart. When a worker's attempt ends — a peer died
and a collective failed, the watchdog saw a dead or hung peer, or torchrun
stopped it to re-form the group — it writes its last *completed* step into
node-local shared memory (``/dev/shm``; tmpfs, no disk I/O) before exiting.
On the next start every rank reports what its node holds, the newest
(generation, step) across the job wins, and its holder broadcasts the bytes to
all ranks. Only a loss of every node falls back to the durable disk snapshot.

Nothing is copied during normal training: the cost is paid once, on the way
out, by processes that are stopping anyway. The format and the atomic publish
are the disk format's (same store class, rooted in shared memory); one
snapshot per run and node is kept.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..files import private_dir, write_file_atomically
from .format import read_meta, read_verified_bytes
from .store import LocalStore, SnapshotError, SnapshotRef
from .writer import SnapshotWriter, require_ok

log = logging.getLogger(__name__)

SHM_ROOT = "/dev/shm"


#: In every run's node-memory directory: which run it belongs to (``snapshot gc`` reads it).
OWNER_NOTE = "owner.json"


def memory_base(base: str | None = None) -> Path:
    """This user's node-memory directory ``BASE/elastic-runner-<uid>`` (mode 0700, checked: not a
    symlink, not another user's, closed to others), so that no other local user can read the copies,
    plant one, or swap a run's directory for a link into real data. Raises
    ``files.UnsafeDirectoryError`` otherwise."""
    base = base or os.environ.get("ELASTIC_RUNNER_SHM_DIR") or (SHM_ROOT if os.path.isdir(SHM_ROOT) else tempfile.gettempdir())
    # A base named by ELASTIC_RUNNER_SHM_DIR may not exist yet; what is ours below it is checked.
    Path(base).mkdir(mode=0o700, parents=True, exist_ok=True)
    return private_dir(Path(base) / f"elastic-runner-{os.getuid()}")


def memory_key(snapshot_location: str) -> str:
    """The name of a run's directory in :func:`memory_base`: a digest of its snapshot location."""
    # A URL names the same place from every directory; a relative path does not.
    key = snapshot_location if "://" in snapshot_location else os.path.abspath(snapshot_location)
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def memory_root(snapshot_location: str, base: str | None = None) -> Path:
    """Node-local directory for one run (keyed by its snapshot location) in :func:`memory_base`."""
    root = private_dir(memory_base(base) / memory_key(snapshot_location))
    note = root / OWNER_NOTE
    if not note.is_file():
        write_file_atomically(note, json.dumps({"snapshot_location": str(snapshot_location),
                                                "created": time.time()}).encode())
    return root


@dataclass(frozen=True)
class GcDecision:
    path: Path
    remove: bool
    why: str
    size_bytes: int


def collect_garbage(base: str | None = None, older_than_s: float = 86_400.0, dry_run: bool = False,
                    empty_after_s: float = 3600.0, read_locations: bool = True) -> list[GcDecision]:
    """Remove node-memory copies nothing needs any more (``elastic-runner snapshot gc``), and say why for each.

    A run's directory goes when no writer of it is alive and
    - it holds no snapshot (a run that never kept one; older than ``empty_after_s``), or
    - its run has a durable snapshot at the same step or later (the copy is redundant), or
    - it was last written more than ``older_than_s`` ago (an abandoned run; its run directory may be gone).
    A copy newer than its run's durable snapshots and younger than that is kept: it may be the only copy
    of those steps (a node that lost its disk, a full volume), and the next start resumes from it.
    ``read_locations=False`` never looks at a run's snapshot location (a start-up sweep must not wait on
    another run's shared disk): only the first and last rule apply."""
    from .object_store import open_store

    decisions = []
    now = time.time()
    for root in sorted(p for p in memory_base(base).iterdir() if p.is_dir() and not p.is_symlink()):
        stats = [(f, f.lstat()) for f in [root, *root.rglob("*")]]  # one walk for size and age
        size = sum(st.st_size for f, st in stats if stat.S_ISREG(st.st_mode))
        age = now - max(st.st_mtime for _, st in stats)
        complete = LocalStore(root).complete()
        newest = complete[-1] if complete else None
        if any(not _stale(lock) for lock in root.glob(".writing-*")):
            decisions.append(GcDecision(root, False, "a writer is alive", size))
            continue
        location = _owner_location(root)
        if newest is None:
            remove = age > empty_after_s
            why = "holds no snapshot" if remove else "holds no snapshot yet (a run may be starting)"
        elif age > older_than_s:
            remove, why = True, f"abandoned: step {newest.step}, last written {age / 3600:.1f} h ago"
        elif not read_locations:
            remove, why = False, f"step {newest.step}; not compared with its run's durable snapshots"
        elif location is None:
            remove, why = False, (f"step {newest.step} of an unknown run (no {OWNER_NOTE}); removed once older "
                                  f"than {older_than_s / 3600:.1f} h")
        else:
            try:
                durable = [r.step for r in open_store(location).complete()]
            except (OSError, SnapshotError):
                durable = []
            if durable and max(durable) >= newest.step:
                remove, why = True, f"step {newest.step}; {location} has a durable snapshot at step {max(durable)}"
            else:
                remove, why = False, (f"step {newest.step} is newer than every durable snapshot in {location} "
                                      f"(newest: {max(durable) if durable else 'none'}); the next start resumes from "
                                      f"it. Removed once older than {older_than_s / 3600:.1f} h")
        if remove and not dry_run:
            shutil.rmtree(root, ignore_errors=True)
        decisions.append(GcDecision(root, remove, why, size))
    return decisions


#: What a start-up sweep removes of other runs' node memory without asking: copies untouched for a week.
ABANDONED_AFTER_S = 7 * 86_400.0


def sweep_abandoned_memory() -> None:
    """At a run's start (one rank per node): remove other runs' empty directories and copies untouched
    for :data:`ABANDONED_AFTER_S`; ``elastic-runner snapshot gc`` does the rest on request."""
    try:
        removed = [d for d in collect_garbage(older_than_s=ABANDONED_AFTER_S, read_locations=False) if d.remove]
    except OSError as exc:
        log.debug("node-memory sweep skipped: %s", exc)
        return
    for d in removed:
        log.info("removed node memory %s (%s, %.1f MB)", d.path, d.why, d.size_bytes / 1e6)


def _owner_location(root: Path) -> str | None:
    try:
        note = json.loads((root / OWNER_NOTE).read_bytes()[:65536])
    except (OSError, ValueError):
        return None
    location = note.get("snapshot_location") if isinstance(note, dict) else None
    return location if isinstance(location, str) and location else None


@dataclass(frozen=True)
class MemoryCandidate:
    rank: int
    generation: int
    step: int
    size_bytes: int
    fingerprint: dict[str, str]
    run_uid: str

    @property
    def ref(self) -> SnapshotRef:
        return SnapshotRef(generation=self.generation, step=self.step)


class MemoryTier:
    """One run's node-memory snapshots. Only the first local rank to get there writes
    (the others wait for it): N ranks on a node must not fill tmpfs with N copies."""

    def __init__(self, root: Path, generation: int, run_uid: str) -> None:
        self.root = root
        self.store = LocalStore(root)
        self.generation = generation
        self.run_uid = run_uid

    def newest(self, rank: int) -> MemoryCandidate | None:
        for ref in reversed(self.store.complete()):
            try:
                meta = read_meta(self.store.path(ref))
            except SnapshotError:
                self.store.remove(ref)
                continue
            return MemoryCandidate(rank, ref.generation, ref.step, int(meta.get("size_bytes", 0)),
                                   meta.get("fingerprint", {}), str(meta.get("run_uid", "")))
        return None

    def read_bytes(self, ref: SnapshotRef) -> bytes:
        directory = self.store.path(ref)
        return read_verified_bytes(directory, read_meta(directory), verify=True)

    def has(self, step: int) -> bool:
        return any(r.step == step and r.generation == self.generation for r in self.store.complete())

    def sweep(self) -> None:
        """At start: drop staging leftovers of killed writers and copies from other runs on this path."""
        self.store.sweep(older_than_generation=10**9)
        for ref in self.store.complete():
            try:
                uid = str(read_meta(self.store.path(ref)).get("run_uid", ""))
            except SnapshotError:
                uid = ""
            if uid != self.run_uid:
                self.store.remove(ref)
        for lock in self.root.glob(".writing-*"):
            if _stale(lock):
                lock.unlink(missing_ok=True)

    def save(self, step: int, capture: Callable[[], tuple[dict[str, Any], dict[str, Any]]],
             wait_for_other: float = 120.0) -> bool:
        """Write the state of ``step`` (synchronously); True if this node now holds it."""
        if self.has(step):
            return True  # another local rank was faster: replicas are identical
        try:
            self.store.ensure()
        except SnapshotError as exc:
            log.warning("no memory tier at %s (%s); the disk snapshot remains", self.root, exc)
            return False
        lock = self.root / f".writing-g{self.generation}-s{step}"
        deadline = time.monotonic() + wait_for_other
        while True:
            try:
                fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                break
            except FileExistsError:
                # Another rank of this node writes it: wait, unless that rank died.
                if self.has(step):
                    return True
                if _stale(lock):
                    lock.unlink(missing_ok=True)
                    continue
                if time.monotonic() > deadline:
                    return self.has(step)
                time.sleep(0.02)
        try:
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
            if self.has(step):
                return True  # written by the rank that held the lock just before us
            writer = SnapshotWriter(self.store, generation=self.generation, keep_last=1, async_write=False,
                                    durable=False)
            require_ok(writer.save(step, capture, sync=True))
        except SnapshotError as exc:
            log.warning("could not keep the state of step %d in memory (%s); the disk snapshot remains", step, exc)
        finally:
            lock.unlink(missing_ok=True)
        return self.has(step)

    def drop(self) -> None:
        """Remove this run's memory snapshots (the run finished)."""
        shutil.rmtree(self.root, ignore_errors=True)


def _lock_pid(lock: Path) -> int:
    try:
        return int(lock.read_text() or 0)
    except (OSError, ValueError):
        return 0


def _stale(lock: Path) -> bool:
    """The writer that took ``lock`` is gone (or never got to write its pid within 2 s)."""
    pid = _lock_pid(lock)
    if pid <= 0:
        try:
            return time.time() - lock.stat().st_mtime > 2.0
        except FileNotFoundError:
            return True
    return not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
