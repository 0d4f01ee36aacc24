"""The run directory at an attempt's start: what a worker says when it cannot be prepared."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from elastic_runner.config import load_config
from elastic_runner.snapshot import LocalStore
from elastic_runner.snapshot.store import SnapshotUnavailableError
from elastic_runner.worker import run_dir
from elastic_runner.worker.ending import RetryableSetupError
from elastic_runner.env import WorkerEnv

from ..support import QUICKSTART


class OneRank:
    rank = 0

    def broadcast_object(self, obj: Any) -> Any:
        return obj


class Unanswering(LocalStore):
    def ensure(self) -> None:
        raise SnapshotUnavailableError("the store did not answer")


@pytest.mark.parametrize(("env", "said"), [
    (WorkerEnv(under_torchrun=True, restart_count=1, max_restarts=3), "the agent starts the next attempt"),
    (WorkerEnv(under_torchrun=True, restart_count=3, max_restarts=3), "no restart is left to try again"),
    (WorkerEnv(), "no restart is left to try again"),  # alone: nothing would retry it
])
def test_a_run_directory_that_may_come_back_says_whether_anything_will_try_again(
        env: WorkerEnv, said: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config(QUICKSTART, [f"run.dir={tmp_path / 'run'}"])
    monkeypatch.setattr(run_dir, "open_store", lambda location, local: Unanswering(location))
    with pytest.raises(RetryableSetupError) as raised:
        run_dir.prepare_run_dir(cfg, env, OneRank())  # type: ignore[arg-type]
    assert said in str(raised.value) and "retrying" not in str(raised.value), raised.value
