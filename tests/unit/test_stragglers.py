"""Stragglers: a rank whose own work per step stays well above the median rank's is named, and only such a rank."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from elastic_runner.config import ConfigError, config_from_dict
from elastic_runner.observe.events import EventLog, read_events
from elastic_runner.observe.metrics import Metrics
from elastic_runner.observe.stragglers import StragglerWatch
from elastic_runner.training.bookkeeping import StepBooks
from elastic_runner.training.state import TrainState
from elastic_runner.training.step_clock import StepClock, Timed, WarmUp

NODES = [0, 0, 1, 1]


def window(watch: StragglerWatch, per_step_ms: list[float], steps: int = 10, seconds: float = 10.0):  # noqa: ANN201
    """A logging window of ``steps`` steps lasting ``seconds``, each rank's local time per step given."""
    return watch.observe([ms / 1000 * steps for ms in per_step_ms], [steps] * len(per_step_ms), NODES, seconds)


def test_a_rank_slow_for_most_of_the_window_is_named_once_with_its_node_and_ratio() -> None:
    watch = StragglerWatch(ratio=1.3, window_s=30)
    assert window(watch, [10, 10, 10, 20]) == ([], [])  # slow for 10 s
    named, cleared = window(watch, [10, 11, 10, 20])  # 20 s: more than half of 30
    assert cleared == [] and [(s.rank, s.node, s.steps, s.seconds) for s in named] == [(3, 1, 20, 20.0)]
    assert named[0].ratio == pytest.approx(2.0) and named[0].median_s == pytest.approx(0.010)
    assert window(watch, [10, 10, 10, 20]) == ([], []), "named once, not at every window"
    assert watch.named == {3}


def test_a_rank_slow_for_half_the_window_or_less_is_not_named() -> None:
    watch = StragglerWatch(ratio=1.3, window_s=30)
    for _ in range(3):
        window(watch, [10, 10, 10, 10])
    window(watch, [10, 10, 10, 30], seconds=15.0)
    assert window(watch, [10, 10, 10, 10], seconds=15.0) == ([], []) and watch.named == set()


def test_one_slow_window_names_nobody() -> None:
    """What made it slow for a moment (a snapshot's window, say) is a minority of the window."""
    watch = StragglerWatch(ratio=1.3, window_s=30)
    for ms in [10, 10, 40, 10, 10, 10]:
        assert window(watch, [10, 10, 10, ms]) == ([], [])


def test_a_fast_window_now_and_then_does_not_hide_a_slow_rank() -> None:
    """A throttled node's slowness lands in its own work or in its wait by chance: one window in four below the
    ratio must not start the count again (a first rule that did never named a throttled node on a loaded machine)."""
    watch = StragglerWatch(ratio=1.5, window_s=3)
    found = []
    for ms in [40, 40, 12, 40, 40, 40, 12, 40]:
        found += window(watch, [10, ms], steps=25, seconds=0.5)[0]
    assert [s.rank for s in found] == [1] and found[0].seconds > 1.5


def test_a_rank_whose_windows_straddle_the_ratio_is_named_by_their_sum() -> None:
    """The soak's misses: a node throttled to a quarter of its time, ratio 2.5, a 3 s window, logging windows of
    ~2.5 s whose ratios straddle the line — never two above it in a row, so never slow for most of the window, but
    slower than 2.5x over it all. Once named, the same windows keep it named."""
    watch = StragglerWatch(ratio=2.5, window_s=3)
    assert window(watch, [10, 10, 23], steps=50, seconds=2.5) == ([], [])
    named, _ = window(watch, [10, 10, 35], steps=50, seconds=2.5)
    assert [s.rank for s in named] == [2], "2.3x then 3.5x: 2.9x over the window"
    for ms in [24, 31, 23, 30]:
        assert window(watch, [10, 10, ms], steps=50, seconds=2.5) == ([], []) and watch.named == {2}
    _, cleared = window(watch, [10, 10, 11], steps=50, seconds=2.5)
    assert cleared == [], "one normal window is no quarter of the window yet; the sum no longer names it"
    _, cleared = window(watch, [10, 10, 10], steps=50, seconds=2.5)
    assert [s.rank for s in cleared] == [2] and watch.named == set()


def test_below_the_ratio_over_the_window_or_near_normal_in_one_window_names_nobody() -> None:
    watch = StragglerWatch(ratio=2.5, window_s=3)
    for ms in [23, 24, 23, 24]:  # steadily 2.35x: below the ratio
        assert window(watch, [10, 10, ms], steps=50, seconds=2.5) == ([], [])
    watch = StragglerWatch(ratio=2.5, window_s=3)
    for ms in [60, 11, 60, 11]:  # 6x, then normal: its mean is above the ratio, its windows are no steady slowness
        assert window(watch, [10, 10, ms], steps=50, seconds=2.5) == ([], [])


def test_many_fast_steps_are_not_a_long_time() -> None:
    """The window is in seconds: 1,000 steps of a millisecond slowed by a shared machine's scheduler are one second,
    not a straggler."""
    watch = StragglerWatch(ratio=1.3, window_s=60)
    for _ in range(5):
        assert window(watch, [1, 1, 1, 3], steps=200, seconds=0.4) == ([], [])


def test_a_named_rank_is_cleared_once_it_was_slow_for_a_quarter_of_the_window_or_less() -> None:
    watch = StragglerWatch(ratio=1.3, window_s=10)
    window(watch, [10, 25, 10, 10], seconds=4.0)
    named, _ = window(watch, [10, 25, 10, 10], seconds=3.0)
    assert [s.rank for s in named] == [1], "slow for 7 s of 10"
    assert window(watch, [10, 11, 10, 10], seconds=2.0) == ([], []), "slow for 7 s of the last 9: still named"
    assert window(watch, [10, 11, 10, 10], seconds=4.0) == ([], []), "slow for 4 s of the last 10: still named"
    named, cleared = window(watch, [10, 11, 10, 10], seconds=3.0)
    assert named == [] and [s.rank for s in cleared] == [1] and watch.named == set()
    assert cleared[0].seconds == pytest.approx(1.0) and cleared[0].local_s == pytest.approx(0.011)


def test_one_long_window_never_names_a_rank_by_itself() -> None:
    """A window counts for half of straggler_window_seconds at most: a first compile's or a stall's long window is
    one window, whatever its length."""
    watch = StragglerWatch(ratio=1.3, window_s=10)
    assert window(watch, [10, 40], seconds=60.0) == ([], [])
    named, _ = window(watch, [10, 40], seconds=1.0)
    assert [s.rank for s in named] == [1], "a second slow window makes most of the window"


def test_of_two_ranks_the_faster_is_the_measure() -> None:
    """The lower median: with two ranks the mean would put the slow one at most 2x whatever its slowness."""
    watch = StragglerWatch(ratio=1.5, window_s=10)
    watch.observe([0.4, 0.1], [10, 10], [0, 1], 5.0)
    named, _ = watch.observe([0.4, 0.1], [10, 10], [0, 1], 5.0)
    assert [(s.rank, s.node) for s in named] == [(0, 0)] and named[0].ratio == pytest.approx(4.0)


def test_a_rank_whose_steps_are_still_in_flight_keeps_its_standing() -> None:
    watch = StragglerWatch(ratio=1.3, window_s=20)
    window(watch, [10, 10, 10, 30])
    named, cleared = watch.observe([0.1, 0.1, 0.1, 0.0], [10, 10, 10, 0], NODES, 10.0)  # rank 3's events in flight
    assert (named, cleared) == ([], [])
    named, _ = window(watch, [10, 10, 10, 30], seconds=1.0)
    assert [s.rank for s in named] == [3] and named[0].seconds == pytest.approx(11.0), "the window in flight not counted"
    for _ in range(10):  # named, then in flight for five times the window: neither slow nor fast meanwhile
        assert watch.observe([0.1, 0.1, 0.1, 0.0], [10, 10, 10, 0], NODES, 10.0) == ([], [])
    assert watch.named == {3}


def test_a_new_world_starts_the_count_again() -> None:
    watch = StragglerWatch(ratio=1.3, window_s=20)
    window(watch, [10, 30, 10, 10], seconds=10.0)  # rank 1 of four slow for 10 s
    assert watch.observe([0.1, 0.3], [10, 10], [0, 1], 5.0) == ([], []), "rank 1 of two is not rank 1 of four"
    named, _ = watch.observe([0.1, 0.3], [10, 10], [0, 1], 6.0)
    assert [s.rank for s in named] == [1] and named[0].seconds == pytest.approx(11.0)


def test_what_the_watch_keeps_is_bounded_by_the_window_not_by_the_run() -> None:
    """Each logging window costs each rank a constant time: at most a window's worth of windows is kept."""
    watch = StragglerWatch(ratio=1.3, window_s=2)
    for i in range(10_000):
        window(watch, [10, 10, 10, 30 if i % 3 == 0 else 10], steps=3, seconds=0.01)
    kept = [len(w.windows) for w in watch._windows.values()]
    assert max(kept) <= 201 and watch.named == set(), (kept, "slow one window in three: a third, not most")


def test_with_the_ratio_off_nobody_is_named_and_the_ratios_are_still_measured() -> None:
    watch = StragglerWatch(ratio=None, window_s=1)
    assert window(watch, [10, 10, 10, 50]) == ([], [])
    assert watch.ratios[3] == pytest.approx(5.0) and watch.ratios[0] == pytest.approx(1.0)


def test_one_rank_alone_has_nobody_to_be_compared_with() -> None:
    watch = StragglerWatch(ratio=1.3, window_s=1)
    assert watch.observe([5.0], [10], [0], 10.0) == ([], []) and watch.ratios == {}


def test_the_clock_counts_the_steps_work_and_not_the_wait_for_the_sync() -> None:
    clock = StepClock(torch.device("cpu"), warm_up=WarmUp(0))
    for _ in range(3):
        clock.begin()
        time.sleep(0.01)  # batches, forward, backward
        clock.waiting()
        time.sleep(0.05)  # the other ranks' time
        clock.updating()
        time.sleep(0.005)  # the update
        clock.end()
    seconds, steps, stepped = clock.take()
    assert steps == 3 and 3 * 0.015 <= seconds < 3 * 0.015 + 0.1, seconds
    assert 3 * 0.065 <= stepped < 3 * 0.065 + 0.1, "the steps' whole time, the wait included"
    assert clock.take() == (0.0, 0, 0.0), "each take returns what came since the last"


def test_a_processs_first_seconds_of_steps_are_its_warm_up_and_not_timed() -> None:
    """A new process steps slower while it warms up (allocator, copy-on-write pages, cuDNN, NCCL): a straggler
    check that timed those steps named a node that had just joined."""
    warm = WarmUp(0.1)
    clock = StepClock(torch.device("cpu"), warm_up=warm)
    for _ in range(5):
        clock.begin()
        time.sleep(0.03)
        clock.waiting()
        clock.updating()
        clock.end()
    seconds, steps, stepped = clock.take()
    assert steps in (1, 2) and stepped < 0.1, "the steps of the first 0.1 s are not timed, the ones after are"
    again = StepClock(torch.device("cpu"), warm_up=warm)  # the next attempt of the same process
    again.begin(), again.waiting(), again.updating(), again.end()
    assert again.take().steps == 1, "a process kept through a recovery is warm"


def test_a_step_left_half_way_is_not_timed() -> None:
    clock = StepClock(torch.device("cpu"), warm_up=WarmUp(0))
    clock.begin()
    clock.waiting()  # the sync failed here: no update, no end
    clock.begin()
    clock.waiting()
    clock.updating()
    clock.end()
    assert clock.take()[1] == 1
    clock.updating()  # an update with no step before it (a test's, a tool's)
    clock.end()
    assert clock.take()[1] == 0


class RankZeroOfTwo:
    """Rank 0 of a two-rank job: its all-reduce adds what rank 1 (on node 1) sends, which the test sets."""

    rank, world_size, device = 0, 2, torch.device("cpu")
    env = SimpleNamespace(group_rank=0, local_rank=0)

    def __init__(self) -> None:
        self.peer = Timed(0.0, 0, 0.0)

    def all_reduce_sum(self, summed: torch.Tensor) -> torch.Tensor:
        theirs = torch.zeros_like(summed)
        theirs[2 + 4:2 + 8] = torch.tensor([self.peer.local_s, self.peer.steps, 1, self.peer.stepped_s])
        return summed + theirs


def _rank_zero_of_two_books(run_dir: Path) -> tuple[RankZeroOfTwo, StepBooks]:
    """Rank 0's books of a two-rank job with a 2 s straggler window at a ratio of 1.3, its events in ``run_dir``."""
    cfg = config_from_dict({"recovery": {"straggler_ratio": 1.3, "straggler_window_seconds": 2.0},
                            "train": {"max_steps": 1000}, "logging": {"progress_bar": "off"}})
    cfg.validate()
    dist = RankZeroOfTwo()
    books = StepBooks(cfg, dist, TrainState(), None, 1000, events=EventLog(run_dir, "worker-0"),  # type: ignore[arg-type]
                      metrics=Metrics(0, 0), audit=None)
    return dist, books


def test_what_comes_between_steps_is_no_time_a_rank_was_slow(tmp_path: Path) -> None:
    """A restart's first logging window holds the restore: a fresh process slower in its first hundred steps (a
    fraction of a second) is not named for the seconds before them; a rank slow for most of the window's seconds
    of steps is."""
    dist, books = _rank_zero_of_two_books(tmp_path)
    time.sleep(1.2)  # the restore and the rendezvous, before the first step
    mine, slow = Timed(50 * 0.0037, 50, 50 * 0.0062), Timed(50 * 0.006, 50, 50 * 0.0062)  # 1.6x rank 0's
    for step in (50, 100):
        dist.peer = slow
        books.report_progress(step, 0, 0.1, local=mine)
    assert books.stragglers.named == set(), "0.6 s of slow steps is not most of 2 s"
    for step in (150, 200):
        books.report_progress(step, 0, 0.1, local=mine)
    assert books.stragglers.named == {1}, "1.2 s of its 2 s of steps slow: named"


def test_each_progress_event_says_how_near_every_rank_came_to_being_named(tmp_path: Path) -> None:
    """A slow node that was not named must be explainable from the run's events: each logging window's ratio of
    every rank to the median rank, and its seconds at or above the straggler ratio in the straggler window."""
    dist, books = _rank_zero_of_two_books(tmp_path)
    mine, slow = Timed(50 * 0.004, 50, 0.5), Timed(50 * 0.008, 50, 0.5)  # rank 1 at twice rank 0's local time
    dist.peer = Timed(0.0, 0, 0.0)
    books.report_progress(50, 0, 0.1, local=mine)  # rank 1 timed no step in this window
    for step in (100, 150):
        dist.peer = slow
        books.report_progress(step, 0, 0.1, local=mine)
    progress = [e for e in read_events(tmp_path) if e["kind"] == "progress"]
    assert "local_ratios" not in progress[0], "one rank timed alone is compared with nobody"
    assert [e["local_ratios"] for e in progress[1:]] == [[1.0, 2.0], [1.0, 2.0]]
    assert [e["slow_s"] for e in progress[1:]] == [[0.0, 0.5], [0.0, 1.0]]
    assert [e["stepped_s"] for e in progress[1:]] == [0.5, 0.5] and books.stragglers.named == set()


@pytest.mark.parametrize("recovery, key", [
    ({"straggler_ratio": 1.0}, "recovery.straggler_ratio"),
    ({"straggler_ratio": 0.5}, "recovery.straggler_ratio"),
    ({"straggler_ratio": "fast"}, "recovery.straggler_ratio"),
    ({"straggler_ratio": float("inf")}, "recovery.straggler_ratio"),
    ({"straggler_window_seconds": 0}, "recovery.straggler_window_seconds"),
    ({"straggler_window_seconds": float("nan")}, "recovery.straggler_window_seconds"),
])
def test_a_ratio_that_would_name_the_median_rank_is_refused_naming_the_key(recovery: dict, key: str) -> None:
    with pytest.raises(ConfigError) as caught:
        config_from_dict({"recovery": recovery, "train": {"max_steps": 3}}).validate()
    assert caught.value.key == key, caught.value


def test_null_turns_the_names_off() -> None:
    config = config_from_dict({"recovery": {"straggler_ratio": None}, "train": {"max_steps": 3}})
    config.validate()
    assert config.recovery.straggler_ratio is None


@pytest.mark.gpu
def test_on_a_gpu_the_clock_times_the_device_and_never_waits_for_it() -> None:
    """CUDA events on the stream: the host queues a step's kernels and moves on; a take while they run returns only
    the steps whose events completed, and after them the device's time, not the host's queueing."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (the production path); none here")
    clock = StepClock(torch.device("cuda"), warm_up=WarmUp(0))
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(5):
        clock.begin()
        for _ in range(20):
            x = torch.tanh(x @ x)  # tens of milliseconds of device work, queued in microseconds
        clock.waiting()
        clock.updating()
        clock.end()
    early_seconds, early_steps, _ = clock.take()  # never blocks: the first steps' kernels may still be running
    assert early_steps < 5 or early_seconds > 0
    torch.cuda.synchronize()
    seconds, steps, stepped = clock.take()
    assert early_steps + steps == 5 and seconds > 0
    assert (early_seconds + seconds) / 5 > 1e-3, "the device's time per step, not the host's queueing"
    assert stepped >= seconds, "a step's whole time holds its local time"
