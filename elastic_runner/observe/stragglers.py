"""Stragglers: a rank whose own work per step stays well above the other ranks'.

In a synchronous job every rank steps at the pace of the slowest: a throttled GPU, a slow host or a noisy
neighbour makes every rank slow, and the step time alone cannot say which. What can is each rank's *local* time
per step — forward, backward, its batches and the optimizer, everything but waiting for the gradient sync
(:class:`~elastic_runner.training.step_clock.StepClock`): the slow rank's is long, the others' is short and they
wait instead. At each logging step every rank's local time over the window since the last one reaches every rank
(in the all-reduce that sums the logged loss: no collective of its own) and :class:`StragglerWatch` compares each
with the median rank's — the lower median, so that of two ranks the faster one is the measure.

A rank is *named* once its ratio stayed at or above ``recovery.straggler_ratio`` over consecutive logging windows
lasting at least ``recovery.straggler_window_seconds`` (a window in seconds, not steps: steps last from a millisecond
to seconds, and what makes a rank slow for a moment — a snapshot, a page-cache miss, the scheduler of a shared
machine — lasts about as long whatever the step), and *cleared* at the first window it is below again.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from typing import Sequence


@dataclass(frozen=True)
class Straggler:
    """A rank named (or cleared) at a logging step."""

    rank: int
    node: int  #: its node's index in the round (torchrun's group rank)
    ratio: float  #: its local time per step over the median rank's, in the window that named it
    local_s: float  #: its local seconds per step in that window
    median_s: float  #: the median rank's
    steps: int  #: consecutive steps it has been this slow
    seconds: float = 0.0  #: for how long


@dataclass
class StragglerWatch:
    """Which ranks are stragglers, from each logging window's local times; identical on every rank (every rank
    sees the same all-reduced numbers), so that each can say whether it is one."""

    ratio: float | None  #: recovery.straggler_ratio (None: nobody is ever named)
    window_s: float  #: recovery.straggler_window_seconds
    #: Per rank, the steps and seconds of the current run of slow windows.
    _slow: dict[int, tuple[int, float]] = field(default_factory=dict)
    named: set[int] = field(default_factory=set)
    #: Per rank, its local time over the median's in the newest window with numbers (for the metric).
    ratios: dict[int, float] = field(default_factory=dict)

    def observe(self, local_s: Sequence[float], steps: Sequence[float], nodes: Sequence[float],
                window_s: float) -> tuple[list[Straggler], list[Straggler]]:
        """One logging window of ``window_s`` seconds: each rank's local seconds, over how many steps, and its
        node. Returns the ranks named and the ranks cleared at this window. A rank with no timed step in the window (a GPU whose steps
        are still in flight) keeps its standing."""
        per_step = {rank: local_s[rank] / steps[rank] for rank in range(len(local_s)) if steps[rank] > 0}
        if len(per_step) < 2:
            return [], []
        median = statistics.median_low(per_step.values())
        if median <= 0:
            return [], []
        named, cleared = [], []
        for rank, seconds in sorted(per_step.items()):
            ratio = seconds / median
            self.ratios[rank] = ratio
            report = Straggler(rank=rank, node=int(nodes[rank]), ratio=ratio, local_s=seconds, median_s=median,
                               steps=0)
            if self.ratio is not None and ratio >= self.ratio:
                slow_steps, slow_s = self._slow.get(rank, (0, 0.0))
                self._slow[rank] = slow_steps, slow_s = slow_steps + int(steps[rank]), slow_s + window_s
                if rank not in self.named and slow_s >= self.window_s:
                    self.named.add(rank)
                    named.append(replace(report, steps=slow_steps, seconds=slow_s))
            else:
                self._slow.pop(rank, None)
                if rank in self.named:
                    self.named.discard(rank)
                    cleared.append(report)
        return named, cleared

