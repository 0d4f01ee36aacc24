"""Stragglers: a rank whose own work per step stays well above the other ranks'.

In a synchronous job every rank steps at the pace of the slowest: a throttled GPU, a slow host or a noisy
neighbour makes every rank slow, and the step time alone cannot say which. What can is each rank's *local* time
per step — forward, backward, its batches and the optimizer, everything but waiting for the gradient sync
(:class:`~elastic_runner.training.step_clock.StepClock`): the slow rank's is long, the others' is short and they
wait instead. At each logging step every rank's local time over the window since the last one reaches every rank
(in the all-reduce that sums the logged loss: no collective of its own) and :class:`StragglerWatch` compares each
with the median rank's — the lower median, so that of two ranks the faster one is the measure.

A rank is *named* once it was at or above ``recovery.straggler_ratio`` for more than half of the last
``recovery.straggler_window_seconds``, or once its local time summed over the windows that cover the last
``straggler_window_seconds`` is at least the ratio times the median rank's with none of those windows below halfway
between 1 and the ratio (a window in seconds, not steps: steps last from a millisecond to seconds, and
what makes a rank slow for a moment — a snapshot, a page-cache miss, the scheduler of a shared machine — lasts about
as long whatever the step; seconds spent stepping, so that a restart's restore or an evaluation between two logging
steps is no time in which a rank was slow), and *cleared* once it was for a quarter of that window or less. Most of
the window, not every logging window in it: a throttled node's slowness comes and goes from one logging window to the
next (a noisy neighbour, a throttle's duty cycle land in the step's own work or in its wait by chance), and a first
rule that started the count again at every window below the ratio never named a node throttled to a quarter of its
time on a loaded machine. The sum over the window is the second rule for the same reason: in the thousand-fault soak 18
of 73 nodes throttled to a quarter of their time (ratio 2.5, a 3 s window, ~2.5 s logging windows) were never named
in 10 s, their windows' ratios straddling the line (named ones ranged 2.6 to 6.5), so that no two windows in a row
were above it; their sums were. Its floor (no window near 1) keeps a rank that was very slow for a moment and normal
otherwise from being named by its mean. The gap between the thresholds keeps a rank near the line from being named
and cleared at every other window: a rank is cleared once it was at or above the ratio for a quarter of the window or
less and its sum no longer names it.
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
    #: (seconds counted, whether it was at or above the ratio, its steps, its local seconds, the median rank's local
    #: seconds for as many steps), oldest first.
    windows: deque[tuple[float, bool, int, float, float]] = field(default_factory=deque)
    covered_s: float = 0.0
    slow_s: float = 0.0
    slow_steps: int = 0

    def add(self, seconds: float, slow: bool, steps: int, local_s: float = 0.0, median_s: float = 0.0) -> None:
        self.windows.append((seconds, slow, steps, local_s, median_s))
        self.covered_s += seconds
        if slow:
            self.slow_s, self.slow_steps = self.slow_s + seconds, self.slow_steps + steps
        while len(self.windows) > 1 and self.covered_s - self.windows[0][0] >= self.span_s:
            old_s, old_slow, old_steps, _, _ = self.windows.popleft()
            self.covered_s -= old_s
            if old_slow:
                self.slow_s, self.slow_steps = self.slow_s - old_s, self.slow_steps - old_steps

    def steadily_at(self, ratio: float) -> bool:
        """Over the windows that cover the whole span (two at least), its local time summed is at least ``ratio``
        times the median rank's, and no window of them was below halfway between 1 and ``ratio``; of the oldest
        window, only its part inside the span counts. Walks the windows kept: a window's worth, as :meth:`add`."""
        if len(self.windows) < 2 or self.covered_s < self.span_s:
            return False
        floor = (1.0 + ratio) / 2
        outside = self.covered_s - self.span_s
        local = median = 0.0
        for i, (seconds, _, _, local_s, median_s) in enumerate(self.windows):
            if median_s <= 0 or local_s < floor * median_s:
                return False
            inside = 1.0 - outside / seconds if i == 0 and seconds > 0 else 1.0
            local, median = local + local_s * inside, median + median_s * inside
        return median > 0 and local >= ratio * median

    def slow(self) -> tuple[float, int]:
        """Seconds (and steps) of the last ``span_s`` in which the rank was at or above the ratio; of the oldest
        window kept, only its part inside the span counts."""
        outside = max(0.0, self.covered_s - self.span_s)
        old_s, old_slow, old_steps, _, _ = self.windows[0]
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
    #: The newest window, rank by rank: its local time over the median's and its seconds at or above the ratio in
    #: the last window_s (None: no timed steps in it), for the progress event, so that a run's events say how near
    #: each rank came to being named, window by window.
    newest: list[tuple[float, float] | None] = field(default_factory=list)

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
        self.newest = [None] * world
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
            windows.add(counted, seconds / median >= self.ratio, int(steps[rank]), local_s[rank], median * steps[rank])
            slow_s, slow_steps = windows.slow()
            self.newest[rank] = (self.ratios[rank], slow_s)
            steady = windows.steadily_at(self.ratio)
            if rank not in self.named and (slow_s > self.window_s / 2 or steady):
                self.named.add(rank)
                named.append(self._report(rank, nodes, median, slow_steps, slow_s))
            elif rank in self.named and slow_s <= self.window_s / 4 and not steady:
                self.named.discard(rank)
                cleared.append(self._report(rank, nodes, median, slow_steps, slow_s))
        return named, cleared

    def _report(self, rank: int, nodes: Sequence[float], median: float, slow_steps: int, slow_s: float) -> Straggler:
        return Straggler(rank=rank, node=int(nodes[rank]), ratio=self.ratios[rank], local_s=self._per_step[rank],
                         median_s=median, steps=slow_steps, seconds=slow_s)
