"""``snapshot.every_steps: auto``: the durable snapshot interval from what a snapshot costs and how often the
whole job is lost.

A durable snapshot is insurance against one event: losing every node at once (or every copy of the
newest step). A failure with a survivor resumes from the survivor's memory and loses at most one step,
whatever the disk interval (:mod:`elastic_runner.snapshot.memory`); without the memory tier every
failure is such an event. So the failure rate that matters is that of *resumes from disk*, and the
classic trade-off applies to it: snapshot often and pay the snapshot cost often, or rarely and redo
more work when the job is lost. Young (1974) and Daly (2006) give the interval that minimises the sum:

    tau = sqrt(2 C M) * (1 + sqrt(C / 2M) / 3 + C / 18M) - C      (C << 2M; tau = M when C >= 2M)

with ``C`` the cost of one snapshot in seconds of training time and ``M`` the mean time between losses.

- ``C`` is measured: the time the step was blocked plus the background write (which competes with
  training for the interpreter and the disk), median of the last snapshots.
- ``M`` starts from the prior ``snapshot.mtbf_hours`` and learns from the run: ``(prior + time run so
  far) / (1 + losses seen)``, a losses-per-hour estimate with the prior counted as one observation.
- The interval in steps is ``tau / step time`` (median of the recent steps), between 1 and 10^6 steps,
  recomputed after every snapshot; a change of more than a quarter is logged and the current value is
  exported (``elastic_runner_snapshot_interval_steps``).

``snapshot.memory_every_steps: auto`` (:class:`SharedInterval`) is the same trade-off for the node-memory copy of a
sharded model's state (:mod:`.sharded_memory`), which insures against every failure a survivor outlives (a worker or a
node lost): ``C`` is a refresh's cost (the step's wait plus the background copy), ``M`` the mean time between such
failures (prior ``snapshot.memory_mtbf_hours``, learned from the run's restarts after a failure). A refresh is a
collective (each rank swaps parts with a peer at the same step), so every rank must choose the same steps: each
refresh's measurements are reduced over the ranks in its background thread (the slowest rank's cost and step time,
rank 0's ``M``) and the next refresh applies them — every rank computes the same interval from the same numbers at
the same step.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

log = logging.getLogger(__name__)

#: Steps before the first measured snapshot (nothing is known about its cost yet).
FIRST_SNAPSHOT_STEPS = 20
MAX_STEPS = 1_000_000


#: Steps before the first node-memory refresh under ``memory_every_steps: auto``.
FIRST_REFRESH_STEPS = 10


def daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Seconds of training between snapshots that minimise snapshot cost + expected redone work."""
    if cost_s <= 0:
        return 0.0
    if cost_s >= 2 * mtbf_s:
        return mtbf_s
    ratio = cost_s / (2 * mtbf_s)
    return math.sqrt(2 * cost_s * mtbf_s) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - cost_s


@dataclass
class AutoInterval:
    """The running estimate; :meth:`steps` is the current interval."""

    prior_mtbf_s: float
    losses: int = 0  #: resumes from disk this run has seen (whole-job losses)
    run_started: float = field(default_factory=time.time)
    costs: deque[float] = field(default_factory=lambda: deque(maxlen=9))
    step_times: deque[float] = field(default_factory=lambda: deque(maxlen=200))
    current: int = FIRST_SNAPSHOT_STEPS
    clock: Callable[[], float] = time.time  #: wall clock (a simulation passes its own)
    _last_step_at: float | None = None

    def step_done(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self._last_step_at is not None:
            self.step_times.append(now - self._last_step_at)
        self._last_step_at = now

    def pause(self) -> None:
        """A step boundary that was not a step (a restore, an evaluation): do not count the gap as a step."""
        self._last_step_at = None

    def snapshot_cost(self, blocking_s: float, write_s: float) -> None:
        self.costs.append(max(0.0, blocking_s) + max(0.0, write_s))

    @property
    def mtbf_s(self) -> float:
        return (self.prior_mtbf_s + max(0.0, self.clock() - self.run_started)) / (1 + self.losses)

    def steps(self) -> int:
        """The interval in steps now (recomputed from the measurements; :attr:`current` keeps it)."""
        if not self.costs or not self.step_times:
            return self.current
        step_s = statistics.median(self.step_times)
        tau = daly_interval(statistics.median(self.costs), self.mtbf_s)
        self.current = max(1, min(MAX_STEPS, round(tau / step_s))) if step_s > 0 else self.current
        return self.current

    def explain(self) -> str:
        cost = statistics.median(self.costs) if self.costs else float("nan")
        step = statistics.median(self.step_times) if self.step_times else float("nan")
        mtbf = self.mtbf_s
        span = f"{mtbf / 3600:.1f} h" if mtbf >= 7200 else f"{mtbf / 60:.1f} min"
        return (f"every {self.current} steps (snapshot cost {cost:.3f} s, step {step * 1000:.1f} ms, mean time "
                f"between job losses {span} from the prior and {self.losses} loss(es) seen)")


def losses_seen(events: list[dict]) -> tuple[int, float | None]:
    """(whole-job losses, the run's first start) from a run's events: a resume from disk (rank 0's
    ``snapshot_loaded``) after an attempt that did not end cleanly. A run stopped or finished and started
    again by hand also resumes from disk; that is not a loss."""
    ended = {e.get("generation") for e in events if e.get("kind") == "end"}
    losses = sum(1 for e in events if e.get("kind") == "snapshot_loaded" and e.get("rank") == 0
                 and e.get("tier") == "disk" and isinstance(e.get("generation"), int) and e["generation"] - 1 not in ended)
    starts = [e["time"] for e in events if e.get("kind") == "start" and isinstance(e.get("time"), (int, float))]
    return losses, (min(starts) if starts else None)


def failures_seen(events: list[dict]) -> tuple[int, float | None]:
    """(failures, the run's first start) from a run's events: an attempt that started after an attempt that did not
    end (a worker or node lost, from memory or disk alike). A run stopped or finished and started again is none."""
    ended = {e.get("generation") for e in events if e.get("kind") == "end"}
    starts: dict[int, float] = {}
    for e in events:
        if e.get("kind") == "start" and isinstance(e.get("generation"), int) and isinstance(e.get("time"), (int, float)):
            starts.setdefault(e["generation"], e["time"])
    generations = sorted(starts)
    failures = sum(1 for before, after in zip(generations, generations[1:]) if before not in ended)
    return failures, (min(starts.values()) if starts else None)


def refresh_steps(cost_s: float, step_s: float, mtbf_s: float, cap: int | None = None) -> int:
    """Steps between node-memory refreshes: Young/Daly's interval, never shorter than a refresh takes (the next one
    would wait for it) and, with ``cap`` (a fixed durable interval), never longer than the durable snapshots' —
    a node-memory copy older than the disk's would never be used."""
    if step_s <= 0:
        return FIRST_REFRESH_STEPS
    steps = round(daly_interval(cost_s, mtbf_s) / step_s)
    steps = max(steps, math.ceil(cost_s / step_s) + 1, 1)
    return min(steps, cap or MAX_STEPS, MAX_STEPS)


class SharedInterval:
    """When to refresh the node-memory copy of a sharded model (module docstring): ``every`` steps, or ``"auto"``.
    The same answer on every rank: :meth:`due` depends only on the step and on numbers every rank holds alike."""

    def __init__(self, every: int | str, *, prior_mtbf_s: float, failures: int, run_started: float, start_step: int,
                 cap: int | None = None, report: Callable[[int], None] = lambda steps: None,
                 speaks: bool = True) -> None:
        self.fixed = every if isinstance(every, int) else None
        self.estimate = AutoInterval(prior_mtbf_s=prior_mtbf_s, losses=failures, run_started=run_started,
                                     current=self.fixed if self.fixed is not None else FIRST_REFRESH_STEPS)
        self.cap = cap
        self.last = start_step
        self.report = report
        #: The last refresh's (cost, step time, mean time between failures), reduced over the ranks; applied by the
        #: next refresh (written by the refresh's thread, read after joining it).
        self.pending: list[float] | None = None
        self.applied: list[float] | None = None  #: the measurements the current interval came from
        self.speaks, self._told = speaks, False  # rank 0 tells the interval; every rank computes it
        report(self.current)

    @property
    def current(self) -> int:
        return self.estimate.current

    def step_done(self) -> None:
        self.estimate.step_done()

    def due(self, step: int) -> bool:
        if self.fixed is not None:
            return self.fixed > 0 and step % self.fixed == 0
        return step - self.last >= self.current

    def measurements(self, blocking_s: float, background_s: float, rank: int) -> list[float]:
        """What this rank adds to the reduction (by maximum): its refresh cost and step time, and on rank 0 the
        mean time between failures (the others send 0, so rank 0's is the maximum)."""
        times = self.estimate.step_times
        return [max(0.0, blocking_s) + max(0.0, background_s), statistics.median(times) if times else 0.0,
                self.estimate.mtbf_s if rank == 0 else 0.0]

    def refreshing(self, step: int) -> None:
        """A refresh starts at ``step`` (the previous one's thread has been joined): apply its reduced measurements."""
        self.last = step
        if self.fixed is not None or self.pending is None:
            return
        cost_s, step_s, mtbf_s = self.applied = self.pending
        self.pending = None
        before = self.current
        self.estimate.current = refresh_steps(cost_s, step_s, mtbf_s, self.cap)
        self.report(self.current)
        if self.speaks and (not self._told or abs(self.current - before) > 0.25 * before):
            self._told = True
            span = f"{mtbf_s / 3600:.1f} h" if mtbf_s >= 7200 else f"{mtbf_s / 60:.1f} min"
            log.info("node-memory interval (snapshot.memory_every_steps: auto): every %d steps (refresh cost %.3f s, "
                     "step %.1f ms, mean time between failures %s%s)", self.current, cost_s, step_s * 1000, span,
                     f", at most the durable interval {self.cap}" if self.cap else "")


class AutoSchedule:
    """What the Checkpointer asks after every step under ``snapshot.every_steps: auto`` (rank 0 only)."""

    def __init__(self, prior_hours: float, events: list[dict], start_step: int,
                 report: Callable[[int], None] = lambda steps: None) -> None:
        losses, started = losses_seen(events)
        self.estimate = AutoInterval(prior_mtbf_s=prior_hours * 3600, losses=losses,
                                     run_started=started if started is not None else time.time())
        self.last_save_step = start_step
        self.report = report
        self._told = False
        report(self.estimate.current)

    def due(self, step: int) -> bool:
        self.estimate.step_done()
        return step - self.last_save_step >= self.estimate.current

    def saving(self, step: int) -> None:
        self.last_save_step = step

    def saved(self, blocking_s: float, write_s: float) -> None:
        """A snapshot completed: take its cost and recompute the interval (logged when it moved by a quarter)."""
        self.estimate.snapshot_cost(blocking_s, write_s)
        before = self.estimate.current
        now = self.estimate.steps()
        self.report(now)
        if not self._told or abs(now - before) > 0.25 * before:
            self._told = True
            log.info("snapshot interval (snapshot.every_steps: auto): %s", self.estimate.explain())
