"""The run's records in object storage: each node's ``run.dir`` uploaded in the background, read back as one run.

Without a shared filesystem every node keeps its own ``run.dir`` (events, the audit trail, the effective config).
:class:`RecordSync` copies what a node wrote to ``SNAPSHOT_URL/records/`` every ``every_s`` seconds and once more
when its worker ends, from a thread (a step never waits for it). The record files are append-only JSON lines with
names of their own on every node (``gen-G-rank-R``, ``agent-HOST-PID``), so a node uploads only what was appended
since its last upload, as an object named by the file's *incarnation* (a digest of its first line: a file of the
same name written anew, e.g. by an agent of a replaced pod with the same hostname and pid, is another incarnation)
and its byte range: ``records/events/gen-000002-rank-00001.jsonl/3f9a0c21b7e4/000000000004096-000000000008192``.
Whole lines only: a reader never sees a torn line that was not torn on the node.
Small whole files (``config.yaml``) are replaced.

:func:`~elastic_runner.observe.records_view.fetch_records` rebuilds the whole run from those objects into a local directory that ``elastic-runner
audit``, ``report`` and the chaos checker read as they read a shared ``run.dir``. Ranges may overlap (a restarted
worker uploads a file again from where the bucket ends, two processes of a node may upload the same lines): the
bytes of an append-only file at an offset never change, so any chain of ranges that starts at 0 rebuilds it; the
incarnations of one name are joined (whole lines each).

A node lost with its disk loses what it had not uploaded: at most ``every_s`` seconds of its records (and the
records of a worker killed on a node that is never seen again since its last upload). The upload errors of an
unreachable store are counted and logged once in full, then at most once a minute; training goes on.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Any, Callable

from ..files import makedirs, open_file

log = logging.getLogger("elastic_runner.records")

#: What of a run directory is a record (relative paths): the append-only logs and the effective config.
APPEND_ONLY = ("events", "audit")
WHOLE_FILES = ("config.yaml",)
RECORDS = "records"
_RANGE = re.compile(r"([0-9]{15})-([0-9]{15})")
_INCARNATION = re.compile(r"[0-9a-f]{16}")
#: A chunk is at most this many bytes (a long run's first upload after a restart is split).
MAX_CHUNK = 8 << 20
#: In a directory :func:`fetch_records` rebuilt: the records' URL and the files it found a gap in (JSON,
#: :func:`bucket_view`). The audit checker reads it as "the nodes' records came through a bucket" (a node lost with
#: its disk took its last lines along: :mod:`elastic_runner.observe.audit`).
FROM_BUCKET = ".records-from"


def records_url(snapshot_url: str) -> str:
    return f"{snapshot_url.rstrip('/')}/{RECORDS}"


def filesystem_of(url: str) -> tuple[Any, str]:
    from ..object_client import open_filesystem

    fs, path = open_filesystem(url)  # gives up within seconds: records are retried at the next sync anyway
    return fs, path.rstrip("/")


class RecordSync:
    """Uploads the record files of ``run_dir`` (those ``wanted`` accepts) below ``url``; see the module docstring."""

    def __init__(self, run_dir: str | os.PathLike[str], url: str, *, every_s: float = 15.0,
                 wanted: Callable[[str], bool] = lambda relative: True, fs: Any = None,
                 fresh: Callable[[str], bool] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.url = url.rstrip("/")
        if fs is None:
            fs, self.prefix = filesystem_of(self.url)
        else:
            self.prefix = self.url.split("://", 1)[-1]
        self.fs = fs
        self.every_s = every_s
        self.wanted = wanted
        #: Files this attempt creates (none of them in the bucket yet): what :meth:`soon` uploads, with no listing.
        self.fresh = fresh
        self.failures = 0
        self.uploaded_bytes = 0
        #: (relative path, incarnation) -> bytes the bucket has (learned on the first sync)
        self._sent: dict[tuple[str, str], int] | None = None
        self._fresh_sent: dict[tuple[str, str], int] = {}  # the same for fresh files, before the first listing
        self._whole: dict[str, tuple[int, int]] = {}  # relative path -> (size, mtime_ns) last uploaded
        self._last_report = 0.0
        self._all_due: float | None = None  #: when :meth:`soon` asked for everything (else: the interval's end)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    # -- one pass ----------------------------------------------------------------------------------------------

    def _remote_ends(self) -> dict[tuple[str, str], int]:
        """How far the bucket has each append-only file (the end of its chain of ranges from 0)."""
        ranges: dict[tuple[str, str], list[tuple[int, int]]] = {}
        for key in _list(self.fs, self.prefix):
            chunk = split_chunk(key[len(self.prefix) + 1:])
            if chunk is not None:
                relative, incarnation, lo, hi = chunk
                ranges.setdefault((relative, incarnation), []).append((lo, hi))
        return {name: _chain_end(spans) for name, spans in ranges.items()}

    def _local_files(self) -> list[tuple[str, Path]]:
        found = []
        for sub in APPEND_ONLY:
            directory = self.run_dir / sub
            if directory.is_dir():
                found += [(f"{sub}/{p.name}", p) for p in sorted(directory.glob("*.jsonl"))]
        found += [(name, self.run_dir / name) for name in WHOLE_FILES if (self.run_dir / name).is_file()]
        return [(relative, path) for relative, path in found if self.wanted(relative)]

    def sync(self, fresh_only: bool = False) -> int:
        """Upload what is new; returns the bytes sent. Raises what the store raised (the thread counts it).
        ``fresh_only``: only the files :attr:`fresh` names, which the bucket cannot have yet from anyone else, so no
        listing is needed (a new attempt's first uploads stay off the recovery's requests)."""
        with self._lock:
            if fresh_only and self.fresh is not None and self._sent is None:
                sent = sum(self._sync_appended(relative, path, self._fresh_sent) for relative, path in
                           self._local_files() if relative not in WHOLE_FILES and self.fresh(relative))
                self.uploaded_bytes += sent
                return sent
            if self._sent is None:
                self._sent = self._remote_ends()  # the fresh files' uploads so far are listed there too
            sent = 0
            for relative, path in self._local_files():
                if relative in WHOLE_FILES:
                    sent += self._sync_whole(relative, path)
                else:
                    sent += self._sync_appended(relative, path, self._sent)
            self.uploaded_bytes += sent
            return sent

    def _sync_appended(self, relative: str, path: Path, ends: dict[tuple[str, str], int]) -> int:
        try:
            with open(path, "rb") as fh:
                first = fh.readline(1 << 16)
                if not first.endswith(b"\n"):
                    return 0  # not one whole line yet
                incarnation = hashlib.sha256(first).hexdigest()[:16]
                start = ends.get((relative, incarnation), 0)
                fh.seek(start)
                data = fh.read(MAX_CHUNK * 16)
        except FileNotFoundError:
            return 0
        end_of_lines = data.rfind(b"\n") + 1  # whole lines only: the rest is still being written
        sent = 0
        while sent < end_of_lines:
            piece = data[sent:min(end_of_lines, sent + MAX_CHUNK)]
            if len(piece) == MAX_CHUNK and not piece.endswith(b"\n"):
                piece = piece[:piece.rfind(b"\n") + 1] or piece
            lo, hi = start + sent, start + sent + len(piece)
            self.fs.pipe_file(f"{self.prefix}/{relative}/{incarnation}/{lo:015d}-{hi:015d}", piece)
            sent += len(piece)
            ends[(relative, incarnation)] = hi
        return sent

    def _sync_whole(self, relative: str, path: Path) -> int:
        info = path.stat()
        stamp = (info.st_size, info.st_mtime_ns)
        if self._whole.get(relative) == stamp:
            return 0
        data = path.read_bytes()
        self.fs.pipe_file(f"{self.prefix}/{relative}", data)
        self._whole[relative] = stamp
        return len(data)

    # -- in the background -------------------------------------------------------------------------------------

    def start(self) -> "RecordSync":
        self._thread = threading.Thread(target=self._run, name="record-sync", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        due = time.monotonic() + self.every_s
        while True:
            next_all = min(due, self._all_due) if self._all_due is not None else due
            woken = self._wake.wait(max(0.0, next_all - time.monotonic()))
            if self._stop.is_set():
                return
            self._wake.clear()
            if woken and time.monotonic() < next_all:
                self._attempt(fresh_only=True)
            else:
                self._attempt()
                self._all_due, due = None, time.monotonic() + self.every_s

    def soon(self, then_all_after: float | None = None) -> None:
        """Upload this attempt's new files now rather than at the end of the interval (its audit header, its first
        step: a node lost in its first interval would otherwise leave the bucket no record of its ranks).
        ``then_all_after``: and, that many seconds later, everything of the node the bucket lacks — the records of
        the node's earlier attempts, whose workers (ended by a peer's failure, parked, recovered in place) left them
        to this one: an attempt shorter than the interval would otherwise hand them on until a node lost with its
        disk takes them along."""
        if then_all_after is not None:
            self._all_due = time.monotonic() + then_all_after
        self._wake.set()

    def _attempt(self, fresh_only: bool = False) -> None:
        try:
            self.sync(fresh_only)
        except Exception as exc:  # noqa: BLE001 - the store unreachable or refusing: training goes on
            self.failures += 1
            now = time.monotonic()
            if not self._last_report:
                log.warning("could not upload the run's records to %s (%s: %s); training goes on, the upload is "
                            "retried every %.0f s", self.url, type(exc).__name__, str(exc)[:300], self.every_s)
                self._last_report = now
            elif now - self._last_report >= 60:
                log.warning("the run's records still do not reach %s (%d failed uploads so far)", self.url,
                            self.failures)
                self._last_report = now

    def close(self, final: bool = True, timeout_s: float = 10.0) -> None:
        """Stop the thread; with ``final``, one last upload of everything written so far (the worker's end), given
        at most ``timeout_s``: a store that does not answer never holds up a worker's exit (or a recovery)."""
        self._stop.set()
        self._wake.set()
        deadline = time.monotonic() + timeout_s
        if self._thread is not None and final:
            self._thread.join(timeout=timeout_s)  # a periodic upload in flight ends first (then nothing is sent twice)
        if final:
            last = threading.Thread(target=self._attempt, name="record-sync-final", daemon=True)
            last.start()
            last.join(timeout=max(0.0, deadline - time.monotonic()))
            if last.is_alive():  # it counts its own failure when the client gives up
                log.warning("the last records of this worker did not reach %s within %.0f s; they stay in %s",
                            self.url, timeout_s, self.run_dir)


def own_records(generation: int, rank: int) -> Callable[[str], bool]:
    """What one worker wrote itself: its event log and its audit trail of this generation."""
    mine = f"gen-{generation:06d}-rank-{rank:05d}.jsonl"
    return lambda relative: relative.rsplit("/", 1)[-1] == mine


def _chain_end(spans: list[tuple[int, int]]) -> int:
    end = 0
    for lo, hi in sorted(spans):
        if lo > end:
            break
        end = max(end, hi)
    return end


def split_chunk(key: str) -> tuple[str, str, int, int] | None:
    """``(relative path, incarnation, start, end)`` of a chunk's key below ``records/``, or None if the key is not
    one (nothing planted may name a path outside the directory it is fetched into)."""
    parts = key.split("/")
    if len(parts) != 4:
        return None
    sub, name, incarnation, span = parts
    m = _RANGE.fullmatch(span)
    if (m is None or sub not in APPEND_ONLY or not name.endswith(".jsonl") or name.startswith(".")
            or "\\" in name or not _INCARNATION.fullmatch(incarnation) or int(m.group(2)) <= int(m.group(1))):
        return None
    return f"{sub}/{name}", incarnation, int(m.group(1)), int(m.group(2))


def _list(fs: Any, prefix: str) -> list[str]:
    try:
        return [k for k in fs.find(prefix, detail=False) if k.startswith(prefix + "/")]
    except FileNotFoundError:
        return []


def write_private(path: Path, data: bytes) -> None:
    makedirs(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open_file(tmp, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)
