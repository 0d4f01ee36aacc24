"""The live goodput clock: carried in the training state, rolled back with the steps, paused between sessions,
and moved on by the agent while its workers are down."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from elastic_runner.observe.goodput import agent_goodput, publish_goodput
from elastic_runner.training.state import TrainState
from elastic_runner.env import GOODPUT_FILE_VAR


def test_a_recovery_counts_its_gap_and_the_steps_it_redoes_as_lost() -> None:
    state = TrainState()
    assert state.start_clock(1000.0, ["a", "b"], resumed=False, by_hand=False), "a fresh run begins a session"
    state.productive_s, state.state_time = 50.0, 1050.0  # what the snapshot at t=1050 holds
    # The job trained on to t=1060 (lost with the failure), restarted, and resumes from that snapshot at 1070.
    restored = TrainState()
    restored.load_state_dict(state.state_dict())
    assert not restored.start_clock(1070.0, ["b", "c"], resumed=True, by_hand=False), "b was there: a recovery"
    assert restored.goodput(1100.0) == 50.0 / 100.0, "wall time runs from the first start; 50 s counted"


def test_a_job_started_again_by_hand_is_a_new_session_and_the_pause_is_nobodys_loss() -> None:
    state = TrainState()
    state.start_clock(1000.0, ["a"], resumed=False, by_hand=False)
    state.productive_s, state.state_time = 90.0, 1100.0  # stopped at t=1100 with its final snapshot
    assert state.start_clock(5000.0, ["x", "y"], resumed=True, by_hand=False), "every agent new: a new session"
    assert state.closed_sessions_s == 100.0
    state.productive_s += 45.0
    assert state.goodput(5050.0) == (90.0 + 45.0) / (100.0 + 50.0)
    # Without agent names: a worker started by hand begins a session, one under torch's own agent does not.
    plain = TrainState()
    plain.start_clock(0.0, [], resumed=False, by_hand=True)
    assert plain.start_clock(10.0, [], resumed=True, by_hand=True)
    assert not plain.start_clock(20.0, [], resumed=True, by_hand=False)


def test_the_agent_moves_the_clock_on_and_it_falls_while_nobody_trains(tmp_path: Path) -> None:
    path = tmp_path / "goodput.json"
    assert agent_goodput(str(path), 0.0, training=True) is None, "nothing published yet"
    publish_goodput(80.0, 100.0, str(path), every_s=10.0)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, "private, like every file we write"
    published = json.loads(path.read_text())["time"]
    assert agent_goodput(str(path), published + 20.0, training=True) == 100.0 / 120.0
    assert agent_goodput(str(path), published + 20.0, training=False) == 80.0 / 120.0, "a restart: only wall time"
    # Workers that stopped publishing (hung, or killed before the agent noticed) are not training.
    assert agent_goodput(str(path), published + 100.0, training=True) == (80.0 + 20.0) / 200.0
    assert list(tmp_path.iterdir()) == [path], "written atomically, no staging file left"
    # A new attempt publishes its restored clock before its first step: the gap counts as lost at once.
    publish_goodput(70.0, 130.0, str(path), training=False)
    published = json.loads(path.read_text())["time"]
    assert agent_goodput(str(path), published + 10.0, training=True) == 70.0 / 140.0


def test_publishing_never_disturbs_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A directory that is gone (the agent died and its private directory was swept): no error, nothing left.
    publish_goodput(1.0, 2.0, str(tmp_path / "missing-dir" / "goodput.json"))
    assert not (tmp_path / "missing-dir").exists()
    # A path that cannot be written (a directory stands where the file goes): no error, no staging file left.
    (tmp_path / "taken").mkdir()
    publish_goodput(1.0, 2.0, str(tmp_path / "taken"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"] and (tmp_path / "taken").is_dir()
    # No agent of ours asked for the clock: nothing is written anywhere.
    monkeypatch.delenv(GOODPUT_FILE_VAR, raising=False)
    monkeypatch.chdir(tmp_path)
    publish_goodput(1.0, 2.0, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_the_private_directories_of_killed_agents_are_swept_at_the_next_start(tmp_path: Path) -> None:
    from elastic_runner.agent.adopt import PRIVATE_PREFIX, sweep_private_dirs

    live = tmp_path / f"{PRIVATE_PREFIX}{os.getpid()}-abc"
    dead = tmp_path / f"{PRIVATE_PREFIX}{2**22 + 12345}-def"  # above any pid_max: no such process
    other = tmp_path / "elastic-runner-something-else"
    for d in (live, dead, other):
        d.mkdir()
    assert sweep_private_dirs(str(tmp_path)) == [str(dead)]
    assert live.is_dir() and other.is_dir() and not dead.exists()
