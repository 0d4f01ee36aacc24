"""snapshot.every_steps: auto — the Young/Daly interval from the measured snapshot cost and the job-loss rate."""

from __future__ import annotations

import math

import pytest

from elastic_runner.config import ConfigError, load_config
from elastic_runner.snapshot.interval import (
    FIRST_REFRESH_STEPS,
    AutoInterval,
    AutoSchedule,
    SharedInterval,
    daly_interval,
    failures_seen,
    losses_seen,
    refresh_steps,
)


def test_the_interval_follows_young_daly() -> None:
    # C << M: close to Young's sqrt(2 C M), a little less once the snapshot's own cost is taken off.
    assert daly_interval(1.0, 86_400) == pytest.approx(math.sqrt(2 * 86_400), rel=0.01)
    assert daly_interval(10.0, 3600) < daly_interval(10.0, 36_000), "rarer losses, rarer snapshots"
    assert daly_interval(1.0, 3600) < daly_interval(10.0, 3600), "dearer snapshots, rarer snapshots"
    assert daly_interval(100.0, 10.0) == 10.0, "a snapshot dearer than the time between losses: once per MTBF"
    assert daly_interval(0.0, 3600) == 0.0


def test_the_estimate_learns_the_loss_rate_and_turns_seconds_into_steps() -> None:
    est = AutoInterval(prior_mtbf_s=3600.0, run_started=0.0)
    assert est.steps() == 20, "nothing measured yet: the first snapshot comes early, to measure it"
    for t in range(101):
        est.step_done(now=t * 0.1)                      # 0.1 s a step
    est.snapshot_cost(blocking_s=0.05, write_s=0.45)   # 0.5 s a snapshot
    quiet = est.steps()
    est.losses = 3                                      # three whole-job losses seen: about 4x as often
    lossy = est.steps()
    assert lossy < quiet and quiet / lossy == pytest.approx(2.0, rel=0.15), (quiet, lossy)


def test_only_a_resume_from_disk_after_an_unclean_end_is_a_loss() -> None:
    events = [
        {"time": 10.0, "kind": "start", "generation": 1, "rank": 0},
        {"time": 50.0, "kind": "failure", "generation": 1, "rank": 0},
        {"time": 52.0, "kind": "snapshot_loaded", "generation": 2, "rank": 0, "tier": "disk"},   # a loss
        {"time": 60.0, "kind": "snapshot_loaded", "generation": 2, "rank": 1, "tier": "disk"},   # same, rank 1
        {"time": 90.0, "kind": "end", "generation": 3, "status": "stopped"},
        {"time": 95.0, "kind": "snapshot_loaded", "generation": 4, "rank": 0, "tier": "disk"},   # resumed by hand
        {"time": 99.0, "kind": "snapshot_loaded", "generation": 5, "rank": 0, "tier": "memory"},  # a survivor kept it
    ]
    assert losses_seen(events) == (1, 10.0)


def test_the_schedule_saves_when_the_interval_has_passed_and_reports_it() -> None:
    reported: list[int] = []
    schedule = AutoSchedule(24.0, [], start_step=100, report=reported.append)
    assert reported == [20]
    assert not schedule.due(119) and schedule.due(120)
    schedule.saving(120)
    assert not schedule.due(121)


def test_the_config_takes_auto_and_a_prior(tmp_path) -> None:  # noqa: ANN001
    base = ["train.epochs=1"]
    cfg = load_config(None, base + ["snapshot.every_steps=auto", "snapshot.mtbf_hours=6"])
    assert cfg.snapshot.every_steps == "auto" and cfg.snapshot.mtbf_hours == 6.0
    with pytest.raises(ConfigError, match="snapshot.every_steps"):
        load_config(None, base + ["snapshot.every_steps=often"])
    with pytest.raises(ConfigError, match="snapshot.mtbf_hours"):
        load_config(None, base + ["snapshot.mtbf_hours=0"])


# -- snapshot.memory_every_steps: auto (the node-memory copy of a sharded model) -----------------------------------


def test_a_refresh_interval_is_young_daly_never_shorter_than_a_refresh_never_longer_than_the_disk_interval() -> None:
    step, mtbf = 0.02, 6 * 3600.0
    assert refresh_steps(0.05, step, mtbf) == round(daly_interval(0.05, mtbf) / step)
    assert refresh_steps(0.05, step, mtbf, cap=50) == 50, "a memory copy older than the disk's would never be used"
    assert refresh_steps(3.0, step, 10.0) >= 3.0 / step + 1, "the next refresh would only wait for this one"
    assert refresh_steps(0.05, 0.0, mtbf) == FIRST_REFRESH_STEPS, "no step time measured yet"


def _reduce_by_max(*ranks: list[float]) -> list[float]:  # what the exchange group's all-reduce does
    return [max(values) for values in zip(*ranks)]


def test_every_rank_applies_the_same_reduced_measurements_at_the_same_step() -> None:
    fast, slow = (SharedInterval("auto", prior_mtbf_s=60.0, failures=0, run_started=0.0, start_step=0, speaks=False)
                  for _ in range(2))
    for s in (fast, slow):
        s.estimate.clock = lambda: 0.0
    for t in range(30):
        fast.estimate.step_done(now=t * 0.01)
        slow.estimate.step_done(now=t * 0.03)
    assert [s.due(9) for s in (fast, slow)] == [False, False] and [s.due(10) for s in (fast, slow)] == [True, True]
    for s in (fast, slow):
        s.refreshing(10)
    reduced = _reduce_by_max(fast.measurements(0.01, 0.2, rank=0), slow.measurements(0.02, 0.5, rank=1))
    assert reduced[1] == pytest.approx(0.03) and reduced[2] == 60.0, "the slowest step; rank 0's failure rate"
    fast.pending = slow.pending = reduced
    assert fast.due(20) and slow.due(20), "nothing changes before the next refresh applies it"
    for s in (fast, slow):
        s.refreshing(20)
    assert fast.current == slow.current == refresh_steps(0.52, 0.03, 60.0)
    assert not fast.due(20 + fast.current - 1) and fast.due(20 + fast.current)


def test_a_fixed_refresh_interval_keeps_to_multiples_of_it() -> None:
    fixed = SharedInterval(10, prior_mtbf_s=60.0, failures=0, run_started=0.0, start_step=37)
    assert [step for step in range(37, 71) if fixed.due(step)] == [40, 50, 60, 70]
    off = SharedInterval(0, prior_mtbf_s=60.0, failures=0, run_started=0.0, start_step=0)
    assert not any(off.due(step) for step in range(1, 100))


def test_failures_are_attempts_that_started_after_one_that_did_not_end() -> None:
    events = [
        {"time": 10.0, "kind": "start", "generation": 1, "rank": 0},
        {"time": 11.0, "kind": "start", "generation": 1, "rank": 1},
        {"time": 50.0, "kind": "start", "generation": 2, "rank": 0},   # generation 1 never ended: a failure
        {"time": 80.0, "kind": "end", "generation": 2, "status": "stopped"},
        {"time": 95.0, "kind": "start", "generation": 3, "rank": 0},   # started again by hand: none
        {"time": 99.0, "kind": "start", "generation": 4, "rank": 0},   # generation 3 never ended: a failure
    ]
    assert failures_seen(events) == (2, 10.0)
    assert failures_seen([]) == (0, None)


def test_the_config_takes_auto_for_node_memory_and_a_prior() -> None:
    base = ["train.epochs=1"]
    cfg = load_config(None, base)
    assert cfg.snapshot.memory_every_steps == "auto" and cfg.snapshot.memory_mtbf_hours == 6.0
    assert load_config(None, base + ["snapshot.memory_every_steps=10"]).snapshot.memory_every_steps == 10
    with pytest.raises(ConfigError, match="snapshot.memory_every_steps"):
        load_config(None, base + ["snapshot.memory_every_steps=often"])
    with pytest.raises(ConfigError, match="snapshot.memory_mtbf_hours"):
        load_config(None, base + ["snapshot.memory_mtbf_hours=-1"])
