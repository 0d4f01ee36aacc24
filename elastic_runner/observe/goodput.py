"""Goodput: the share of a job's wall time spent on steps that count, and where the rest went.

Live: every worker carries a clock in the training state (``TrainState.productive_s`` and the session
times, see :mod:`elastic_runner.training.loop`): the time of each step is added when the step is done, minus what a
snapshot held it; a resume restores the clock with the steps, so time spent on steps that are later
recomputed never counts. Workers export ``elastic_runner_goodput`` and local rank 0 leaves the clock in a
file for its agent (:func:`publish_goodput`), whose ``elastic_runner_agent_goodput`` goes on falling while
no worker trains (:func:`agent_goodput`) — when the workers' own metrics are gone.

After the fact (``elastic-runner report``, the chaos report), from the run's event log:

    goodput = (wall time - recovery gaps - recomputed steps - snapshot blocking) / wall time

Wall time is the sessions' (a job stopped and resumed by hand is two sessions, not a failure: see
:mod:`elastic_runner.observe.report`). Each recovery gap — from the last step before a failure to the first step
after it — is broken down from the run's event log:

- *detection*: until an agent reported the failed worker or stopped its group (``agent_worker_failed``,
  ``agent_stopping_workers``, ``agent_restart``);
- *rendezvous*: the longest round any agent completed inside the gap (``agent_rendezvous``);
- *worker start and restore*: from the first start of a worker in the new attempt to the first step (imports,
  process group, loading the snapshot): a new process's start, or where a worker kept its process (in-process
  recovery), when it took its place in the new round or rebuilt its group;
- *other*: what remains (stopping the old workers, waiting for a slow node, ...).

*Recomputed steps* are the steps a resume redid (``steps_recomputed`` x the median step time) and
*snapshot blocking* the time snapshots held the step (rank 0's ``blocking_s``; the other ranks wait for
it at the next collective).
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

from ..env import GOODPUT_FILE_VAR

CAUSES = ("detection", "rendezvous", "worker start and restore", "other", "recomputed steps", "snapshot blocking")


@dataclass
class Goodput:
    wall_s: float
    lost_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0.0))

    @property
    def fraction(self) -> float | None:
        if self.wall_s <= 0:
            return None
        return max(0.0, self.wall_s - sum(self.lost_s.values())) / self.wall_s

    def text(self) -> str:
        if self.fraction is None:
            return "goodput: unknown (no training time)"
        parts = ", ".join(f"{cause} {seconds:.1f}" for cause, seconds in self.lost_s.items() if seconds >= 0.05)
        return (f"goodput {self.fraction:.3f}: {sum(self.lost_s.values()):.1f} s of {self.wall_s:.1f} s lost"
                + (f" ({parts})" if parts else ""))

    def to_dict(self) -> dict[str, Any]:
        return {"goodput": round(self.fraction, 4) if self.fraction is not None else None, "wall_s": round(self.wall_s, 3),
                "lost_s": {cause: round(seconds, 3) for cause, seconds in self.lost_s.items()}}


class _Window:
    """Events of some kinds, in time order, to take the ones inside a gap (a soak has thousands of gaps)."""

    def __init__(self, events: Iterable[dict[str, Any]], kinds: tuple[str, ...]) -> None:
        self.events = sorted((e for e in events if e.get("kind") in kinds and isinstance(e.get("time"), (int, float))),
                             key=lambda e: e["time"])
        self.times = [e["time"] for e in self.events]

    def between(self, start: float, end: float) -> list[dict[str, Any]]:
        return self.events[bisect.bisect_left(self.times, start):bisect.bisect_right(self.times, end)]


def measure(events: list[dict[str, Any]], gaps: Iterable[Any], wall_s: float,
            recovered_generations: set[int]) -> Goodput:
    """The goodput of a run from its events, its recovery gaps (objects with ``start``, ``end`` and
    ``generation``) and its wall time; ``recovered_generations``: the generations that began in a gap."""
    result = Goodput(wall_s=wall_s)
    lost = result.lost_s
    agents = [e for e in events if e.get("role") == "agent"]
    workers = [e for e in events if e.get("role") != "agent"]
    noticed = _Window(agents, ("agent_worker_failed", "agent_stopping_workers", "agent_restart"))
    rounds = _Window(agents, ("agent_rendezvous",))
    process_starts: dict[int, list[float]] = {}
    for e in workers:
        if e.get("kind") == "start" and isinstance(e.get("process_start"), (int, float)):
            process_starts.setdefault(e.get("generation"), []).append(float(e["process_start"]))
    for gap in gaps:
        total = max(0.0, gap.end - gap.start)
        first_notice = noticed.between(gap.start, gap.end)
        detection = first_notice[0]["time"] - gap.start if first_notice else 0.0
        rendezvous = max((float(e.get("seconds", 0.0)) for e in rounds.between(gap.start, gap.end)), default=0.0)
        starts = process_starts.get(gap.generation, [])
        start_restore = max(0.0, gap.end - max(min(starts), gap.start)) if starts else 0.0
        parts = [detection, rendezvous, start_restore]
        scale = min(1.0, total / sum(parts)) if sum(parts) > 0 else 1.0  # overlapping parts never exceed the gap
        for cause, seconds in zip(CAUSES, parts):
            lost[cause] += seconds * scale
        lost["other"] += max(0.0, total - sum(parts) * scale)
    rates = [e["samples_per_s"] for e in workers
             if e.get("kind") == "progress" and isinstance(e.get("samples_per_s"), (int, float)) and e["samples_per_s"] > 0]
    batches = [e["global_batch"] for e in workers if e.get("kind") == "world" and isinstance(e.get("global_batch"), int)]
    if rates and batches:
        step_s = statistics.median(batches) / statistics.median(rates)
        redone = sum(int(e.get("steps_recomputed") or 0) for e in workers if e.get("kind") == "resume"
                     and e.get("rank", 0) == 0 and e.get("generation") in recovered_generations)
        lost["recomputed steps"] = redone * step_s
    lost["snapshot blocking"] = sum(float(e.get("blocking_s") or 0.0) for e in workers
                                    if e.get("kind") == "snapshot_saved" and e.get("rank", 0) == 0)
    return result


#: The agent moves the productive time on by at most this many publishing intervals: workers that stopped
#: publishing (hung, killed, restarting) are not training.
PUBLISH_SLACK = 2.0


def publish_goodput(productive_s: float, wall_s: float, path: str | None = None, *, training: bool = True,
                    every_s: float | None = None) -> None:
    """Leave the live clock for this node's agent (a no-op when no agent of ours asked for it): ``training``
    False for an attempt that has not stepped yet, ``every_s`` the time since the previous publication.
    Atomic and private: a reader never sees half a file. A failure never disturbs training."""
    path = path or os.environ.get(GOODPUT_FILE_VAR)
    if not path:
        return
    staging = f"{path}.{os.getpid()}.tmp"
    try:
        fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump({"productive_s": productive_s, "wall_s": wall_s, "time": time.time(), "training": training,
                       "every_s": every_s}, fh)
        os.replace(staging, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(staging)  # never leave a half-published clock behind


def agent_goodput(path: str, now: float, training: bool) -> float | None:
    """The job's goodput now, as the agent sees it: the clock its workers left, moved on to ``now`` — the
    wall time always; the productive time only while the agent's workers are healthy, the clock says they
    were training, and for at most :data:`PUBLISH_SLACK` publishing intervals (a hung or restarting worker
    stops publishing)."""
    try:
        with open(path) as fh:
            clock = json.load(fh)
        productive, wall, at = float(clock["productive_s"]), float(clock["wall_s"]), float(clock["time"])
        every = clock.get("every_s")
        every = float(every) if isinstance(every, (int, float)) and every > 0 else None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    elapsed = max(0.0, now - at)
    wall += elapsed
    if training and clock.get("training", True) and every is not None:
        productive += min(elapsed, PUBLISH_SLACK * every)
    return min(1.0, productive / wall) if wall > 0 else None
