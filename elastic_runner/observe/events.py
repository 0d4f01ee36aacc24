"""The run's event log: what happened when, for people and for ``report``.

Every process appends JSON lines to its own file under ``RUN_DIR/events/``
(one writer per file, so lines never interleave): start, world (size after a
rendezvous), resume, snapshot_saved / snapshot_loaded / snapshot_failed /
snapshot_rejected, progress (loss, throughput), eval, failure, stop, end.
Agents of ``elastic-runner launch`` and the chaos tool write here too.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any, TextIO

from ..files import makedirs, open_file

EVENTS_DIR = "events"


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


def read_events(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All events of a run, in time order; torn lines from killed writers are skipped."""
    return EventFollower(run_dir).read()


class EventFollower:
    """The events of a run so far, in time order, for poll loops: each call reads only what was
    appended since the last one (a run writes thousands of events; re-reading them all every
    0.1 s takes CPU from the job being watched)."""

    def __init__(self, run_dir: str | os.PathLike[str], pattern: str = f"{EVENTS_DIR}/*.jsonl") -> None:
        self.dir = Path(run_dir)
        #: The event files below ``run_dir`` (``node-*/events/*.jsonl``: nodes with a directory each).
        self.pattern = pattern
        self._offsets: dict[Path, int] = {}
        self._events: list[dict[str, Any]] = []

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
                if path.stat().st_size <= self._offsets.get(path, 0):
                    continue  # nothing appended (most files: the attempts that ended)
                with open(path, "rb") as fh:
                    fh.seek(self._offsets.get(path, 0))
                    data = fh.read()
            except OSError:
                continue
            complete = data[:data.rfind(b"\n") + 1]  # a line still being written is read next time
            self._offsets[path] = self._offsets.get(path, 0) + len(complete)
            for line in complete.splitlines():
                try:
                    new.append(json.loads(line))
                except ValueError:
                    continue  # a torn line from a killed writer
        if new:
            new.sort(key=lambda e: e.get("time", 0))
            in_order = not self._events or new[0].get("time", 0) >= self._events[-1].get("time", 0)
            self._events.extend(new)
            if not in_order:
                self._events.sort(key=lambda e: e.get("time", 0))
        return new


def agent_stop_reason(run_dir: str | os.PathLike[str], pid: int, since: float, tail_bytes: int = 65536) -> str | None:
    """Why this worker's agent is stopping it, if the agent said so (an ``agent_stopping_workers`` event
    naming ``pid``, written just before torch sends the SIGTERM); None when nobody announced it (a person,
    Kubernetes, a plain torch agent). Reads only the end of each agent's log: it runs in a signal handler."""
    reason = None
    for path in (Path(run_dir) / EVENTS_DIR).glob("agent-*.jsonl"):
        try:
            with open(path, "rb") as fh:
                fh.seek(max(0, fh.seek(0, os.SEEK_END) - tail_bytes))
                lines = fh.read().splitlines()
        except OSError:
            continue
        for line in reversed(lines):
            if b"agent_stopping_workers" not in line:
                continue
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("time", 0) >= since and pid in event.get("pids", ()):
                reason = str(event.get("reason") or "a new rendezvous round")
                break
    return reason


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
