"""The chaos clock starts once every agent trains: a late agent's scale-up is not the first fault."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_runner.chaos.runner import ChaosRun
from elastic_runner.chaos.scenario import Scenario, ScenarioError
from elastic_runner.observe.events import EventLog


class FakeJob:
    """What the wait looks at: which agents still run, and their logs for the error."""

    def __init__(self, running: int) -> None:
        self.running = running

    def running_agents(self) -> list[int]:
        return list(range(self.running))

    def logs_tail(self) -> str:
        return "(agent logs)"


def world(run_dir: Path, generation: int, size: int, stepped: bool = True) -> None:
    for rank in range(size):
        log = EventLog(run_dir, f"gen-{generation:06d}-rank-{rank:05d}", generation=generation, rank=rank)
        log.emit("world", world_size=size, step=0)
        if stepped:
            log.emit("first_step", step=1)
        log.close()


def chaos_run(tmp_path: Path, agents: int = 2) -> ChaosRun:
    return ChaosRun(Scenario(config=str(tmp_path / "x.yaml"), run_dir=str(tmp_path / "run"), agents=agents),
                    out=lambda _line: None)


def test_the_faults_wait_for_the_world_of_every_started_agent(tmp_path: Path) -> None:
    run = chaos_run(tmp_path)
    world(run.run_dir, 1, size=1)  # the first agent closed the first round alone...
    with pytest.raises(ScenarioError, match="before it started stepping with all 2 agents"):
        run._wait_stepping(FakeJob(running=0))  # ...and that world alone does not count

    world(run.run_dir, 2, size=2, stepped=False)  # the scale-up: loaded, not stepping yet
    with pytest.raises(ScenarioError):
        run._wait_stepping(FakeJob(running=0))

    world(run.run_dir, 3, size=2)
    run._wait_stepping(FakeJob(running=2))  # returns at once: both agents step together
