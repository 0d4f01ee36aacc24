"""The run's event log: what happened when, for people and for ``report``.

Every process appends JSON lines to its own file under ``RUN_DIR/events/``
(one writer per file, so lines never interleave): start, world (size after a
rendezvous), resume, snapshot_saved / snapshot_loaded / snapshot_failed /
snapshot_rejected, progress (loss, throughput), eval, failure, stop, end.
Agents of ``elastic-runner launch`` and the chaos tool write here too.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any, TextIO

from ..files import makedirs, open_file
from ..printable import printable

EVENTS_DIR = "events"

log = logging.getLogger(__name__)


class EventLog:
    def __init__(self, run_dir: str | os.PathLike[str], source: str, **context: Any) -> None:
        directory = makedirs(Path(run_dir) / EVENTS_DIR)
        self.path = directory / f"{source}.jsonl"
        self.source = source
        self.context = {"host": socket.gethostname(), "pid": os.getpid()} | context
        self._fh: TextIO | None = open_file(self.path, "a", buffering=1)  # whole lines reach readers at once

    def emit(self, kind: str, **fields: Any) -> None:
        if self._fh is None:
            return
        record = {"time": time.time(), "kind": kind, "source": self.source} | self.context | fields
        try:
            self._fh.write(json.dumps(record, separators=(",", ":"), default=str) + "\n")
        except OSError:
            pass  # the event log must never take training down (e.g. disk full)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


class NullEventLog(EventLog):
    def __init__(self) -> None:  # noqa: D107 - deliberately writes nothing
        self.source = "null"
        self.context = {}
        self._fh = None


_NUMBER = (int, float)
#: The fields every reader of events relies on, with their types; an event whose field has another type is no event
#: of ours (a planted or damaged line) and is skipped, so that no reader (a resuming worker, ``report``, ``audit``,
#: the chaos tool) meets a string where it computes with a time. Other fields are the emitters' own.
FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "time": _NUMBER, "kind": str, "source": str, "host": str, "role": str, "agent": str, "status": str,
    "snapshot": str, "tier": str, "error": str, "reason": str, "mode": str,
    "generation": int, "step": int, "rank": int, "world_size": int, "pid": int, "global_batch": int,
    "micro_batch": int, "accumulation": int, "steps_recomputed": int, "furthest_step": int,
    "samples_per_s": _NUMBER, "loss": _NUMBER, "eval_loss": _NUMBER, "write_s": _NUMBER, "blocking_s": _NUMBER,
    "seconds": _NUMBER, "process_start": _NUMBER, "failures": list, "node": int, "ratio": _NUMBER,
    "verified_step": int, "suspects": list, "nodes": list, "copies": int,
    "local_ratios": list, "slow_s": list, "stepped_s": _NUMBER,
}
#: The fields an event of each kind always carries (its readers index them).
REQUIRED: dict[str, tuple[str, ...]] = {
    "start": ("world_size",), "progress": ("step", "samples_per_s"), "eval": ("eval_loss",),
    "snapshot_saved": ("blocking_s", "write_s"), "resume": ("generation",), "agent_worker_failed": ("failures",),
    "straggler": ("step", "rank", "node", "ratio", "status"),
    "replica_mismatch": ("step", "verified_step", "suspects", "status"),
}
#: The numbers a run writes stay far below this; a larger one (10**400, an overflow waiting) is no event of ours.
_LARGEST = 1e15
#: What a worker failure an agent reports carries (``local_rank`` too).
_FAILURE_FIELDS = ("rank", "pid", "exitcode")


def _bad_number(field: str, value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, _NUMBER):
        return False
    if value != value:  # NaN: a diverged loss is one, nothing else is
        return field not in ("loss", "eval_loss")
    return not -_LARGEST < value < _LARGEST


def malformed(event: dict[str, Any]) -> str | None:
    """Why ``event`` is not an event a reader can rely on (None: it is one)."""
    for field, kind in FIELD_TYPES.items():
        if field not in event:
            continue
        value = event[field]
        if value is None and kind is str:
            continue  # an optional text left empty
        if not isinstance(value, kind) or isinstance(value, bool) or _bad_number(field, value):
            return f"'{field}' is {type(value).__name__} {printable(value, 20)}"  # (a planted value: printable())
    if "time" not in event or "kind" not in event:
        return "no 'time' or no 'kind'"
    missing = [f for f in REQUIRED.get(event["kind"], ()) if f not in event]
    if missing:
        return f"a {event['kind']} event without {', '.join(missing)}"
    for failure in event.get("failures") or ():
        if not isinstance(failure, dict) or not all(type(failure.get(k)) is int for k in _FAILURE_FIELDS):
            return "a malformed worker failure"
    return None


def read_events(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All events of a run, in time order; torn lines from killed writers are skipped."""
    return EventFollower(run_dir).read()


def recent_events(run_dir: str | os.PathLike[str], since: float, sources: str = "*") -> list[dict[str, Any]]:
    """The events at or after ``since`` (wall-clock seconds) of the sources matching ``sources`` (a glob of their
    names, e.g. ``gen-*-rank-00000``), in time order, reading only the files written to since then: a look back over
    a window costs what the window holds, not what the run does (a soak's run directory holds thousands of
    attempts' files, and reading them all took seconds)."""
    follower = EventFollower(run_dir, f"{EVENTS_DIR}/{sources}.jsonl", touched_since=since)
    return [e for e in follower.read() if e.get("time", 0) >= since]


class EventFollower:
    """The events of a run so far, in time order, for poll loops: each call reads only what was
    appended since the last one (a run writes thousands of events; re-reading them all every
    0.1 s takes CPU from the job being watched)."""

    def __init__(self, run_dir: str | os.PathLike[str], pattern: str = f"{EVENTS_DIR}/*.jsonl",
                 touched_since: float | None = None) -> None:
        self.dir = Path(run_dir)
        #: The event files below ``run_dir`` (``node-*/events/*.jsonl``: nodes with a directory each).
        self.pattern = pattern
        #: Files last written to before this wall-clock time are left unread (None: every file).
        self.touched_since = touched_since
        self._offsets: dict[Path, int] = {}
        self._events: list[dict[str, Any]] = []
        self._warned: set[Path] = set()

    def read(self) -> list[dict[str, Any]]:
        self.read_new()
        return self._events

    @property
    def events(self) -> list[dict[str, Any]]:
        """The events read so far, in time order (no new read)."""
        return self._events

    def read_new(self) -> list[dict[str, Any]]:
        """Only the events appended since the last call (in time order among themselves); :meth:`read`
        still returns them all."""
        new: list[dict[str, Any]] = []
        for path in sorted(self.dir.glob(self.pattern)):
            try:
                status = path.stat()
                if status.st_size <= self._offsets.get(path, 0):
                    continue  # nothing appended (most files: the attempts that ended)
                if self.touched_since is not None and status.st_mtime < self.touched_since:
                    continue
                with open(path, "rb") as fh:
                    fh.seek(self._offsets.get(path, 0))
                    data = fh.read()
            except OSError:
                continue
            complete = data[:data.rfind(b"\n") + 1]  # a line still being written is read next time
            self._offsets[path] = self._offsets.get(path, 0) + len(complete)
            for line in complete.splitlines():
                try:
                    event = json.loads(line)
                except (ValueError, RecursionError):
                    event = None  # a torn line from a killed writer, or bytes that are no event
                problem = "not a JSON object" if not isinstance(event, dict) else malformed(event)
                if problem is None:
                    new.append(event)
                elif path not in self._warned:
                    self._warned.add(path)
                    log.warning("%s: a line that is no event is skipped (%s); a writer of the run directory, or a "
                                "process killed mid-line, left it (warned once per file)", printable(path, 500), problem)
        if new:
            new.sort(key=lambda e: e.get("time", 0))
            in_order = not self._events or new[0].get("time", 0) >= self._events[-1].get("time", 0)
            self._events.extend(new)
            if not in_order:
                self._events.sort(key=lambda e: e.get("time", 0))
        return new


def furthest_step_reached(run_dir: str | os.PathLike[str], before_generation: int) -> int:
    """The highest step any attempt before ``before_generation`` reported: the bound for steps recomputed."""
    furthest = 0
    for event in read_events(run_dir):
        if event.get("generation", before_generation) < before_generation and isinstance(event.get("step"), int):
            furthest = max(furthest, event["step"])
    return furthest


def starts_a_session(starts: list[dict[str, Any]], earlier_agents: set[str], previous: list[dict[str, Any]]) -> bool:
    """Whether the generation whose workers' ``start`` events are ``starts`` was started anew (a ``torchrun`` or
    ``launch`` command run again, a Kubernetes Job restarted) rather than by a recovery inside a running job.

    A worker's ``start`` event names its agent (host, pid and start time of its ``launch`` or torchrun process; set by
    elastic_runner's agent on both paths): a generation whose agents are all new to the run began a new session —
    every node's agent was started again. Without agent names (torch's agent opted out, or ``elastic-runner train``
    run directly) a generation after one that finished (``previous``: its events), or one not under torchrun at all,
    begins a session."""
    if starts and all(e.get("agent") for e in starts) and earlier_agents:
        return {e["agent"] for e in starts}.isdisjoint(earlier_agents)
    return any(e.get("kind") == "end" and e.get("status") == "finished" for e in previous) or \
        bool(starts) and not any(e.get("run_id", "local") != "local" for e in starts)
