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
as long whatever the step), and *cleared* once it was for a quarter of that window or less. Most of the window, not
every logging window in it: a throttled node's slowness comes and goes from one logging window to the next (a
noisy neighbour, a throttle's duty cycle land in the step's own work or in its wait by chance), and a first rule that
started the count again at every window below the ratio never named a node throttled to a quarter of its time on a
loaded machine. The gap between the two thresholds keeps a rank near the line from being named and cleared at every
other window.
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


@dataclass(frozen=True)
class _Window:
    """One logging window as the watch keeps it: its length, and per rank its ratio to the median (None: no timed
    step) and its steps."""

    seconds: float
    ratios: tuple[float | None, ...]
    steps: tuple[int, ...]


@dataclass
class StragglerWatch:
    """Which ranks are stragglers, from each logging window's local times; identical on every rank (every rank
    sees the same all-reduced numbers), so that each can say whether it is one."""

    ratio: float | None  #: recovery.straggler_ratio (None: nobody is ever named)
    window_s: float  #: recovery.straggler_window_seconds
    #: The newest logging windows, together just covering window_s.
    _history: deque[_Window] = field(default_factory=deque)
    named: set[int] = field(default_factory=set)
    #: Per rank, its local time over the median's in the newest window with numbers (for the metric).
    ratios: dict[int, float] = field(default_factory=dict)

    def observe(self, local_s: Sequence[float], steps: Sequence[float], nodes: Sequence[float],
                window_s: float) -> tuple[list[Straggler], list[Straggler]]:
        """One logging window of ``window_s`` seconds: each rank's local seconds, over how many steps, and its
        node. Returns the ranks named and the ranks cleared at this window. A rank with no timed step in a window (a
        GPU whose steps are still in flight) is neither slow nor fast in it."""
        world = len(local_s)
        per_step = {rank: local_s[rank] / steps[rank] for rank in range(world) if steps[rank] > 0}
        median = statistics.median_low(per_step.values()) if len(per_step) >= 2 else 0.0
        if median <= 0:
            return [], []
        ratios = tuple(per_step[rank] / median if rank in per_step else None for rank in range(world))
        self.ratios.update({rank: r for rank, r in enumerate(ratios) if r is not None})
        if self.ratio is None:
            return [], []
        if self._history and len(self._history[-1].ratios) != world:
            self._history.clear()  # another world: its ranks are other ranks
        self._history.append(_Window(window_s, ratios, tuple(int(n) for n in steps)))
        # Twice window_s kept: a window in which a rank had no timed step does not count in its window_s.
        while len(self._history) > 1 and sum(w.seconds for w in self._history) - self._history[0].seconds >= \
                2 * self.window_s:
            self._history.popleft()
        named, cleared = [], []
        for rank in range(world):
            slow_s, slow_steps = self._slow_in_window(rank)
            if rank not in self.named and slow_s > self.window_s / 2:
                self.named.add(rank)
                named.append(self._report(rank, nodes, median, per_step, slow_steps, slow_s))
            elif rank in self.named and slow_s <= self.window_s / 4:
                self.named.discard(rank)
                cleared.append(self._report(rank, nodes, median, per_step, slow_steps, slow_s))
        return named, cleared

    def _slow_in_window(self, rank: int) -> tuple[float, int]:
        """Seconds (and steps) of the last window_s in which ``rank`` was at or above the ratio, counting only the
        windows in which it had timed steps; of the oldest window counted, only the part inside window_s."""
        assert self.ratio is not None
        left, slow_s, slow_steps = self.window_s, 0.0, 0
        for w in reversed(self._history):
            ratio = w.ratios[rank]
            if ratio is None:
                continue
            part = min(w.seconds, left)
            if ratio >= self.ratio:
                slow_s += part
                slow_steps += round(w.steps[rank] * part / w.seconds) if w.seconds > 0 else 0
            left -= part
            if left <= 0:
                break
        return slow_s, slow_steps

    def _report(self, rank: int, nodes: Sequence[float], median: float, per_step: dict[int, float],
                slow_steps: int, slow_s: float) -> Straggler:
        seconds = per_step.get(rank, median)
        return Straggler(rank=rank, node=int(nodes[rank]), ratio=self.ratios.get(rank, seconds / median),
                         local_s=seconds, median_s=median, steps=slow_steps, seconds=slow_s)
