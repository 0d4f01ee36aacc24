"""snapshot.every_steps: auto — the Young/Daly interval from the measured snapshot cost and the job-loss rate."""

from __future__ import annotations

import math

import pytest

from elastic_runner.config import ConfigError, load_config
from elastic_runner.snapshot.interval import AutoInterval, AutoSchedule, daly_interval, losses_seen


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
