"""Stragglers: a rank whose own work per step stays well above the other ranks'.

In a synchronous job every rank steps at the pace of the slowest: a throttled GPU, a slow host or a noisy
neighbour makes every rank slow, and the step time alone cannot say which. What can is each rank's *local* time
per step — forward, backward, its batches and the optimizer, everything but waiting for the gradient sync
(:class:`~elastic_runner.training.step_clock.StepClock`): the slow rank's is long, the others' is short and they
wait instead. At each logging step every rank's local time over the window since the last one reaches every rank
(in the all-reduce that sums the logged loss: no collective of its own) and :class:`StragglerWatch` compares each
with the median rank's — the lower median, so that of two ranks the faster one is the measure.

A rank is *named* once it was at or above ``recovery.straggler_ratio`` for more than half of the last
``recovery.straggler_window_seconds`` (a window in seconds, not steps: steps last from a millisecond to seconds, and
what makes a rank slow for a moment — a snapshot, a page-cache miss, the scheduler of a shared machine — lasts about
as long whatever the step; seconds spent stepping, so that a restart's restore or an evaluation between two logging
steps is no time in which a rank was slow), and *cleared* once it was for a quarter of that window or less. Most of
the window, not every logging window in it: a throttled node's slowness comes and goes from one logging window to the
next (a noisy neighbour, a throttle's duty cycle land in the step's own work or in its wait by chance), and a first
rule that started the count again at every window below the ratio never named a node throttled to a quarter of its
time on a loaded machine. The gap between the two thresholds keeps a rank near the line from being named and cleared
at every other window.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence


@dataclass(frozen=True)
class Straggler:
    """A rank named (or cleared) at a logging step."""

    rank: int
    node: int  #: its node's index in the round (torchrun's group rank)
    ratio: float  #: its local time per step over the median rank's, in the window that named it
    local_s: float  #: its local seconds per step in that window
    median_s: float  #: the median rank's
    steps: int  #: its steps at or above the ratio in the last straggler_window_seconds
    seconds: float = 0.0  #: how many of those seconds it was at or above the ratio


@dataclass
class _RankWindows:
    """One rank's logging windows that together just cover straggler_window_seconds, with running totals: each
    window costs a constant time to add and to drop, whatever the world size and the window's length."""

    span_s: float  #: straggler_window_seconds
    #: (seconds counted, whether it was at or above the ratio, its steps), oldest first.
    windows: deque[tuple[float, bool, int]] = field(default_factory=deque)
    covered_s: float = 0.0
    slow_s: float = 0.0
    slow_steps: int = 0

    def add(self, seconds: float, slow: bool, steps: int) -> None:
        self.windows.append((seconds, slow, steps))
        self.covered_s += seconds
        if slow:
            self.slow_s, self.slow_steps = self.slow_s + seconds, self.slow_steps + steps
        while len(self.windows) > 1 and self.covered_s - self.windows[0][0] >= self.span_s:
            old_s, old_slow, old_steps = self.windows.popleft()
            self.covered_s -= old_s
            if old_slow:
                self.slow_s, self.slow_steps = self.slow_s - old_s, self.slow_steps - old_steps

    def slow(self) -> tuple[float, int]:
        """Seconds (and steps) of the last ``span_s`` in which the rank was at or above the ratio; of the oldest
        window kept, only its part inside the span counts."""
        outside = max(0.0, self.covered_s - self.span_s)
        old_s, old_slow, old_steps = self.windows[0]
        if not old_slow or outside <= 0:
            return max(0.0, self.slow_s), self.slow_steps
        return max(0.0, self.slow_s - outside), self.slow_steps - round(old_steps * outside / old_s)


@dataclass
class StragglerWatch:
    """Which ranks are stragglers, from each logging window's local times; identical on every rank (every rank
    sees the same all-reduced numbers), so that each can say whether it is one."""

    ratio: float | None  #: recovery.straggler_ratio (None: nobody is ever named)
    window_s: float  #: recovery.straggler_window_seconds
    #: Per rank, its windows with timed steps in the last window_s (a window in which its steps are still in flight
    #: on a GPU is none of them: the rank keeps its standing).
    _windows: dict[int, _RankWindows] = field(default_factory=dict)
    #: The world size the windows are of: another world's ranks are other ranks.
    _world: int = 0
    named: set[int] = field(default_factory=set)
    #: Per rank, its local time over the median's in the newest window with numbers (for the metric).
    ratios: dict[int, float] = field(default_factory=dict)
    #: Per rank, its local seconds per step in the newest window with numbers (for its lines).
    _per_step: dict[int, float] = field(default_factory=dict)

    def observe(self, local_s: Sequence[float], steps: Sequence[float], nodes: Sequence[float],
                window_s: float) -> tuple[list[Straggler], list[Straggler]]:
        """One logging window whose steps took ``window_s`` seconds (the slowest rank's, the wait included; not
        what came between steps, such as a restart's restore): each rank's local seconds, over how many steps, and
        its node. Returns the ranks named and the ranks cleared at this window.

        One window counts for half of straggler_window_seconds at most, so that a single slow window (a long
        one: a first compile, an evaluation, a stall) never names a rank by itself."""
        world = len(local_s)
        if world != self._world:
            self._windows, self.named, self.ratios, self._per_step, self._world = {}, set(), {}, {}, world
        per_step = {rank: local_s[rank] / steps[rank] for rank in range(world) if steps[rank] > 0}
        median = statistics.median_low(per_step.values()) if len(per_step) >= 2 else 0.0
        if median <= 0:
            return [], []
        self._per_step.update(per_step)
        self.ratios.update({rank: seconds / median for rank, seconds in per_step.items()})
        if self.ratio is None:
            return [], []
        counted = min(window_s, self.window_s / 2)
        named, cleared = [], []
        for rank, seconds in sorted(per_step.items()):
            windows = self._windows.setdefault(rank, _RankWindows(self.window_s))
            windows.add(counted, seconds / median >= self.ratio, int(steps[rank]))
            slow_s, slow_steps = windows.slow()
            if rank not in self.named and slow_s > self.window_s / 2:
                self.named.add(rank)
                named.append(self._report(rank, nodes, median, slow_steps, slow_s))
            elif rank in self.named and slow_s <= self.window_s / 4:
                self.named.discard(rank)
                cleared.append(self._report(rank, nodes, median, slow_steps, slow_s))
        return named, cleared

    def _report(self, rank: int, nodes: Sequence[float], median: float, slow_steps: int, slow_s: float) -> Straggler:
        return Straggler(rank=rank, node=int(nodes[rank]), ratio=self.ratios[rank], local_s=self._per_step[rank],
                         median_s=median, steps=slow_steps, seconds=slow_s)
