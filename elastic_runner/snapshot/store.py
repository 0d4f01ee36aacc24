"""Where snapshots live: naming, atomic commit, generation fencing.

A snapshot is a directory ``step-<STEP>-gen-<GEN>`` holding ``state.pt`` and
``meta.json``. It is assembled under a hidden temporary name in the same
directory, every file and the directory are fsynced, ``meta.json`` (the
completion marker, with the checksum of ``state.pt``) is written last, and
one ``rename`` publishes it. A reader lists only published names that carry a
marker, so it never sees a half-written snapshot.

Order is (generation, step), never modification time. Every training attempt
claims a new *generation* by exclusive creation of ``generations/<GEN>``
before it trains; a writer checks just before publishing that no newer
generation exists. A writer left over from an older rendezvous round (split
brain, a zombie node) therefore cannot publish after a newer round started,
and even in the race where it does, its snapshot sorts below the newer
round's. This works on any POSIX or NFS filesystem (O_EXCL + rename).

The interface is small (:class:`SnapshotStore`, and :class:`ShardedStore` for what sharded snapshots add):
:class:`~.object_store.ObjectStore` implements the same contract on ``s3://`` and ``gs://`` (marker uploaded last, created
without overwrite; generations claimed by conditional create). :func:`~.object_store.open_store`
picks one by the location.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import stat
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, runtime_checkable


from ..files import dir_mode, makedirs, open_file, sharing
from ..printable import printable

NAME_RE = re.compile(r"step-([0-9]{9})-gen-([0-9]{6})", re.ASCII)
META = "meta.json"
STATE = "state.pt"
#: A meta.json larger than this is not one of ours (a real one is a few KB; its config at most).
MAX_META_BYTES = 4 << 20


class SnapshotError(RuntimeError):
    """A snapshot could not be written or read; the message says what to check."""


class CorruptSnapshotError(SnapshotError):
    """The snapshot's bytes are damaged or unsafe: it is moved aside and the previous one used."""


class SnapshotUnavailableError(SnapshotError):
    """Reading failed for a reason that may pass (I/O error, memory): retry, never quarantine."""


class StoreAccessError(SnapshotError):
    """The store cannot work as configured (credentials refused, no such bucket, a URL it cannot serve): a set-up
    error that retrying does not fix."""


class StaleWriterError(SnapshotError):
    """A newer training generation exists: this writer must stop."""


class AlreadyCommittedError(SnapshotError):
    """The same (step, generation) was already published by another rank."""


@dataclass(frozen=True, order=True)
class SnapshotRef:
    generation: int
    step: int

    @property
    def name(self) -> str:
        return f"step-{self.step:09d}-gen-{self.generation:06d}"

    @classmethod
    def parse(cls, name: str) -> "SnapshotRef | None":
        m = NAME_RE.fullmatch(name)
        return cls(generation=int(m.group(2)), step=int(m.group(1))) if m else None


@runtime_checkable
class SnapshotStore(Protocol):
    """What every place for snapshots provides, whatever the model: :class:`LocalStore` (a directory) and
    :class:`~.object_store.ObjectStore` (a bucket). What sharded snapshots need beyond it:
    :class:`ShardedStore`."""

    location: str
    root: Path  #: where this node writes a snapshot before it is published (its free space is checked)
    is_local: bool  #: the volume itself holds the snapshots (its free space is their room)

    def spec(self) -> dict[str, str]: ...
    def ensure(self) -> None: ...
    def complete(self) -> list[SnapshotRef]: ...
    def incomplete(self) -> list[str]: ...
    def path(self, ref: SnapshotRef) -> Path: ...
    def describe(self, ref: SnapshotRef) -> tuple[bytes, dict[str, int]]: ...
    def corrupt_reason(self, name: str) -> str | None: ...
    def staging(self, ref: SnapshotRef) -> Path: ...
    def publish(self, staging: Path, ref: SnapshotRef, entries_synced: bool = False,
                replace_incomplete: bool = False) -> None: ...
    def discard(self, staging: Path) -> None: ...
    def remove(self, ref: SnapshotRef) -> None: ...
    def quarantine(self, ref: SnapshotRef, reason: str) -> None: ...
    def sweep(self, older_than_generation: int) -> list[str]: ...
    def run_uid(self) -> str: ...
    def existing_run_uid(self) -> str: ...
    def claim_generation(self, info: dict[str, Any]) -> int: ...
    def newest_generation(self) -> int: ...
    def check_fence(self, generation: int) -> None: ...


@runtime_checkable
class ShardedStore(SnapshotStore, Protocol):
    """What a sharded snapshot (every rank writes its own part: :mod:`.sharded_writer`) needs of its place beyond
    :class:`SnapshotStore`: one staging place that every rank's part reaches, and rank 0 learning each part's
    records from it."""

    def shared_staging(self, ref: SnapshotRef) -> Path: ...
    def share_part(self, staging: Path, ref: SnapshotRef, rank: int) -> None: ...
    def part_records(self, staging: Path, ref: SnapshotRef) -> dict[str, Any]: ...


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def in_background(call: Callable[..., Any], *args: Any) -> Callable[[], Any]:
    """Start ``call(*args)`` in a thread (fsyncs, hashing and file writes give up the GIL: they overlap); the function
    returned waits for it and returns its value or raises its exception."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append((True, call(*args)))
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread by the waiter
            outcome.append((False, exc))

    thread = threading.Thread(target=run, name=f"snapshot-{getattr(call, '__name__', 'io')}", daemon=True)
    thread.start()

    def wait() -> Any:
        thread.join()
        ok, value = outcome[0]
        if not ok:
            raise value
        return value

    return wait


class LocalStore:
    """A local or shared (NFS, PVC) directory."""

    #: Its free space is the volume's (:mod:`.space` measures it).
    is_local = True

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.location = str(self.root)
        self.generations = self.root / "generations"

    def spec(self) -> dict[str, str]:
        """What another process needs to open the same store (:func:`store_from_spec`)."""
        return {"location": self.location}

    def ensure(self) -> None:
        try:
            makedirs(self.generations)
        except OSError as exc:
            raise SnapshotError(
                f"cannot create the snapshot directory {self.root} ({exc.strerror}); "
                "make run.dir (or snapshot.dir) point at a writable location"
            ) from exc
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise SnapshotError(
                f"the snapshot directory {self.root} is not writable by this user (uid {os.getuid()}); "
                "fix its permissions or choose another run.dir"
            )
        owner = os.lstat(self.root).st_uid
        if sharing() == "private" and owner != os.getuid():
            raise SnapshotError(
                f"the snapshot directory {self.root} belongs to uid {owner}, not to this user (uid {os.getuid()}); "
                "with snapshot.mode: private a run keeps its snapshots in a directory of its own. Choose another "
                "run.dir, or set snapshot.mode: group for a volume a team shares"
            )

    # -- listing -------------------------------------------------------------------------

    def _entries(self) -> Iterator[os.DirEntry[str]]:
        try:
            with os.scandir(self.root) as it:
                yield from it
        except FileNotFoundError:
            return

    def complete(self) -> list[SnapshotRef]:
        """Published snapshots with their completion marker, oldest first."""
        refs = []
        for entry in self._entries():
            ref = SnapshotRef.parse(entry.name)
            if ref is not None and (self.root / entry.name / META).is_file():
                refs.append(ref)
        return sorted(refs)

    def incomplete(self) -> list[str]:
        """Names of leftovers: staging directories and published names without a marker."""
        names = []
        for entry in self._entries():
            if entry.name.startswith(".tmp-"):
                names.append(entry.name)
            elif SnapshotRef.parse(entry.name) and not (self.root / entry.name / META).is_file():
                names.append(entry.name)
        return sorted(names)

    def corrupt(self) -> list[str]:
        return sorted(e.name for e in self._entries() if e.name.startswith("corrupt-"))

    def path(self, ref: SnapshotRef) -> Path:
        return self.root / ref.name

    def describe(self, ref: SnapshotRef) -> tuple[bytes, dict[str, int]]:
        """The bytes of ``ref``'s marker and the size of each of its files, without reading the rest (what
        ``snapshot inspect`` shows; on a bucket, what it can show without downloading the snapshot)."""
        sizes: dict[str, int] = {}
        try:
            with os.scandir(self.path(ref)) as it:
                for entry in it:
                    if entry.is_file(follow_symlinks=False):
                        sizes[entry.name] = entry.stat(follow_symlinks=False).st_size
            if sizes.get(META, 0) > MAX_META_BYTES:
                raise CorruptSnapshotError(f"{ref.name}: {META} has {sizes[META]} bytes, far more than any marker")
            return (self.path(ref) / META).read_bytes(), sizes
        except FileNotFoundError as exc:
            raise CorruptSnapshotError(f"{ref.name}: no {META} (removed or incomplete)") from exc
        except OSError as exc:
            raise SnapshotUnavailableError(f"{ref.name}: cannot read it ({exc.strerror}); is the filesystem "
                                           "healthy?") from exc

    def corrupt_reason(self, name: str) -> str | None:
        """Why a run moved ``name`` (``corrupt-...``) aside, as it wrote it."""
        try:
            return (self.root / name / "REASON").read_text(errors="replace")[:2000].strip() or None
        except OSError:
            return None

    # -- writing -------------------------------------------------------------------------

    def staging(self, ref: SnapshotRef) -> Path:
        path = self.root / f".tmp-{ref.name}-{socket.gethostname()}-{os.getpid()}-{time.monotonic_ns()}"
        try:
            path.mkdir(mode=dir_mode())
            os.chmod(path, dir_mode())
        except OSError as exc:
            raise SnapshotError(f"cannot create {path} ({exc.strerror}); check that {self.root} is writable and has space") from exc
        return path

    def shared_staging(self, ref: SnapshotRef) -> Path:
        """The staging directory every rank of a sharded snapshot writes its part into (named by the snapshot:
        the ranks meet there); created by the first to arrive, and it must be a directory of this user's."""
        path = self.root / f".tmp-{ref.name}-sharded"
        try:
            path.mkdir(mode=dir_mode())
            os.chmod(path, dir_mode())
        except FileExistsError:
            info = os.lstat(path)
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
                raise SnapshotError(f"{path} is not a directory of this user's (uid {os.getuid()}); remove it") from None
        except OSError as exc:
            raise SnapshotError(f"cannot create {path} ({exc.strerror}); check that {self.root} is writable and has space") from exc
        return path

    def share_part(self, staging: Path, ref: SnapshotRef, rank: int) -> None:
        """Nothing to do: the ranks share ``staging`` (:meth:`shared_staging`)."""

    def part_records(self, staging: Path, ref: SnapshotRef) -> dict[str, Any]:
        """How rank 0 finds the parts' records (:func:`~.shards.wait_for_parts`): in ``staging``, the default."""
        return {}

    def publish(self, staging: Path, ref: SnapshotRef, entries_synced: bool = False,
                replace_incomplete: bool = False) -> None:
        """Rename ``staging`` to ``ref``'s name and make that durable. ``entries_synced``: the caller fsynced
        ``staging`` itself after its last file was created (``write_snapshot_files`` does, beside ``meta.json``).
        ``replace_incomplete`` changes nothing here: a name in a directory only ever appears whole."""
        del replace_incomplete
        if not entries_synced:
            fsync_dir(staging)
        target = self.path(ref)
        try:
            # rename(2) of a directory onto an existing non-empty one fails:
            # publishing never replaces a snapshot.
            os.rename(staging, target)
        except OSError as exc:
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                raise AlreadyCommittedError(f"{ref.name} was already published") from exc
            raise SnapshotError(f"cannot publish {ref.name} in {self.root} ({exc.strerror})") from exc
        fsync_dir(self.root)

    def discard(self, staging: Path) -> None:
        shutil.rmtree(staging, ignore_errors=True)

    def remove(self, ref: SnapshotRef) -> None:
        # Hide it first (atomic) so no reader ever sees a half-deleted snapshot.
        hidden = self.root / f".tmp-deleting-{ref.name}-{os.getpid()}"
        try:
            os.rename(self.path(ref), hidden)
        except FileNotFoundError:
            return
        shutil.rmtree(hidden, ignore_errors=True)

    def quarantine(self, ref: SnapshotRef, reason: str) -> None:
        target = self.root / f"corrupt-{ref.name}"
        reason = reason.encode("utf-8", "backslashreplace").decode()  # whatever text a planted marker held
        for n in range(2, 100):  # a name taken already (moved aside before, or planted) must not keep it in place
            if not os.path.lexists(target):
                break
            target = self.root / f"corrupt-{ref.name}-{n}"
        try:
            os.rename(self.path(ref), target)
            with open_file(target / "REASON", "w") as fh:
                fh.write(reason + "\n")
        except OSError:
            pass  # another rank moved it first, or it is gone

    def sweep(self, older_than_generation: int) -> list[str]:
        """Remove staging leftovers of writers from older generations (dead by now)."""
        removed = []
        for name in self.incomplete():
            m = re.search(r"-gen-([0-9]{6})", name)
            if name.startswith(".tmp-") and m and int(m.group(1)) < older_than_generation:
                shutil.rmtree(self.root / name, ignore_errors=True)
                removed.append(name)
            elif name.startswith(".tmp-deleting-"):
                shutil.rmtree(self.root / name, ignore_errors=True)
                removed.append(name)
        return removed

    # -- identity ------------------------------------------------------------------------

    def run_uid(self) -> str:
        """A random id created with the run's first generation; tells this run's node-memory
        copies apart from those of an earlier run that used the same path."""
        path = self.root / "run-id"
        try:
            fh = open_file(path, "w", exclusive=True)
        except FileExistsError:
            return _run_id(path)
        with fh:
            fh.write(uuid.uuid4().hex)
            fh.flush()
            os.fsync(fh.fileno())
        fsync_dir(self.root)
        return _run_id(path)

    def existing_run_uid(self) -> str:
        """The run id if the run has one ("" if not); creates nothing."""
        path = self.root / "run-id"
        return _run_id(path) if path.is_file() else ""

    # -- fencing -------------------------------------------------------------------------

    def _claimed(self) -> list[int]:
        try:
            return sorted(int(n) for n in os.listdir(self.generations) if n.isascii() and n.isdigit())
        except FileNotFoundError:
            return []

    def newest_generation(self) -> int:
        claimed = self._claimed()
        return claimed[-1] if claimed else 0

    def claim_generation(self, info: dict[str, Any]) -> int:
        """Atomically take the next generation number; never returns one twice."""
        self.ensure()
        candidate = self.newest_generation() + 1
        body = json.dumps({"claimed_at": time.time(), "host": socket.gethostname(), "pid": os.getpid()} | info)
        while True:
            path = self.generations / f"{candidate:06d}"
            try:
                fh = open_file(path, "w", exclusive=True)
            except FileExistsError:
                candidate += 1
                continue
            except OSError as exc:
                raise SnapshotError(f"cannot claim a generation in {self.generations} ({exc.strerror}); check that the run directory is writable") from exc
            with fh:
                fh.write(body)
                fh.flush()
                os.fsync(fh.fileno())
            fsync_dir(self.generations)
            return candidate

    def generation_info(self, generation: int) -> dict[str, Any]:
        try:
            info = json.loads((self.generations / f"{generation:06d}").read_bytes()[:4096])
        except (OSError, ValueError, RecursionError):
            return {}
        return info if isinstance(info, dict) else {}

    def check_fence(self, generation: int) -> None:
        newest = self.newest_generation()
        if newest > generation:
            raise fence_error(generation, newest, self.generation_info(newest), str(self.root))


def _run_id(path: Path) -> str:
    """The run id in ``path`` (:meth:`LocalStore.run_uid` writes 32 hex digits)."""
    try:
        text = path.read_bytes()[:256].decode("ascii").strip()
    except OSError as exc:
        raise SnapshotError(f"cannot read {path} ({exc.strerror})") from exc
    except UnicodeDecodeError:
        text = ""
    if not re.fullmatch(r"[0-9A-Za-z_.-]{1,128}", text):
        raise SnapshotError(f"{path} does not hold a run id: it was changed or damaged. Restore it "
                            "from a snapshot's meta.json (its run_uid), or start a new run.dir")
    return text


def fence_error(generation: int, newest: int, info: dict[str, Any], location: str) -> StaleWriterError:
    """Why a writer of ``generation`` must stop: ``newest`` was claimed (``info``: by whom, when)."""
    claimed = info.get("claimed_at")
    try:
        when = time.strftime("%H:%M:%S", time.localtime(claimed)) if isinstance(claimed, (int, float)) else "?"
    except (OverflowError, ValueError, OSError):
        when = "?"  # a claim's file is the run directory's: what it says is only a hint
    return StaleWriterError(
        f"generation {generation} is stale: generation {newest} was started at {when} by "
        f"{printable(info.get('host', '?'), 80)} (pid {printable(info.get('pid', '?'), 20)}). Another rendezvous round owns {location}; this worker "
        "stops instead of overwriting its snapshots (split brain)"
    )
