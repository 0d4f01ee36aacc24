"""This rank's local time per step, with no host sync: what :mod:`elastic_runner.observe.stragglers` compares.

Local time is the step less the wait for the gradient sync: from the step's start to the sync's wait (its batches,
forward, backward), plus the optimizer's update. On a CPU the host's clock measures it. On a GPU the host only
queues kernels, so the host's clock would measure the queueing: CUDA events recorded on the compute stream at the
same four points measure the device, and they are read at logging steps only once they have completed
(``Event.query``, which never waits): a step still in flight then counts in the next logging window.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, NamedTuple

import torch

#: Steps whose events are kept unread at most (a logging interval longer than this times fewer steps).
MAX_PENDING = 4096
#: Seconds of a process's first steps that are not timed: a new process steps slower while it warms up (its
#: allocator's pools grow, the pages it shares with the zygote it was forked from are copied at their first write,
#: cuDNN picks its algorithms, NCCL opens its connections). Seen in a soak: workers of an agent that had just joined
#: took 1.6x the others' local time for ~150 steps (2 s), and were named stragglers under a 3 s window.
WARM_UP_S = 3.0


class WarmUp:
    """Seconds of steps a process still takes untimed: one per process, not per attempt (a survivor kept in its
    process through a recovery is warm)."""

    def __init__(self, seconds: float = WARM_UP_S) -> None:
        self.left_s = seconds


#: This process's warm-up.
PROCESS_WARM_UP = WarmUp()


class Timed(NamedTuple):
    """What a :meth:`StepClock.take` returns: the steps completed since the last take and their times."""

    local_s: float  #: their local seconds (all but the wait for the gradient sync)
    steps: int
    #: Their whole seconds, from each one's start to its end (the wait included): the time the window spent stepping,
    #: without what came between steps (a restore, an evaluation, a snapshot's capture, a rendezvous).
    stepped_s: float


class StepClock:
    """Marks at four points of each step (:meth:`begin`, :meth:`waiting`, :meth:`updating`, :meth:`end`);
    :meth:`take` returns the local seconds and the count of the steps completed since the last take, once the
    process's first seconds of steps (``warm_up``) are past."""

    def __init__(self, device: torch.device, enabled: bool = True, warm_up: WarmUp = PROCESS_WARM_UP) -> None:
        self.enabled = enabled  #: False: every mark is a no-op and :meth:`take` returns nothing timed
        self._cuda = device.type == "cuda"
        self._warm_up = warm_up
        self._seconds = 0.0
        self._steps = 0
        self._stepped = 0.0
        self._marks: list[Any] = []  # this step's (host times or events)
        self._pending: deque[list[Any]] = deque()  # completed steps' events, not yet read
        self._spare: list[Any] = []  # events to record again

    def _mark(self) -> None:
        if not self.enabled:
            return
        if self._cuda:
            event = self._spare.pop() if self._spare else torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())

    def begin(self) -> None:
        """The step starts (before its first batch)."""
        self._marks = []
        self._mark()

    def waiting(self) -> None:
        """The gradient sync's wait begins: what follows until :meth:`updating` is the other ranks' time."""
        self._mark()

    def updating(self) -> None:
        """The optimizer's update begins."""
        self._mark()

    def end(self) -> None:
        """The update is done: the step's marks are complete."""
        self._mark()
        marks, self._marks = self._marks, []
        if not self.enabled:
            return
        if len(marks) != 4:  # a step left by an exception half-way: not a step to time
            self._spare.extend(m for m in marks if self._cuda)
            return
        if not self._cuda:
            begin, waiting, updating, end = marks
            self._count((waiting - begin) + (end - updating), end - begin)
            return
        self._pending.append(marks)
        if len(self._pending) > MAX_PENDING:  # never read: drop the oldest rather than hold events without end
            self._spare.extend(self._pending.popleft())

    def _count(self, local_s: float, stepped_s: float) -> None:
        if self._warm_up.left_s > 0:
            self._warm_up.left_s -= stepped_s
            return
        self._seconds += local_s
        self._stepped += stepped_s
        self._steps += 1

    def take(self) -> Timed:
        """The steps since the last take and their seconds; on a GPU of the steps whose events completed (the rest
        count at the next take)."""
        while self._pending and self._pending[0][-1].query():
            begin, waiting, updating, end = marks = self._pending.popleft()
            self._count((begin.elapsed_time(waiting) + updating.elapsed_time(end)) / 1000.0,
                        begin.elapsed_time(end) / 1000.0)
            self._spare.extend(marks)
        taken = Timed(self._seconds, self._steps, self._stepped)
        self._seconds, self._steps, self._stepped = 0.0, 0, 0.0
        return taken
