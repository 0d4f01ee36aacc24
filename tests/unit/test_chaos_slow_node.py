"""slow-node slows a node's compute, not its waiting: the chaos tool asks the node's workers (two real-time signals,
the hook of training.injected_faults) to stretch each step's compute to four times its length until the fault's
seconds are up; the stretch shows in the rank's local time (what names a straggler), never in its wait."""

from __future__ import annotations

import os
import random
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from elastic_runner.chaos.faults import FaultContext, slow_node
from elastic_runner.data.sampler import StepPlan
from elastic_runner.testing.localjob import Worker
from elastic_runner.training import injected_faults
from elastic_runner.training.injected_faults import SLOW_FACTOR, SLOW_OFF, SLOW_ON
from elastic_runner.training.step_clock import StepClock, WarmUp

from ..support import start_ranks
from .test_gradients import GLOBAL, _step


class FakeJob:
    """Two nodes, each with two workers (made-up PIDs: nothing is sent anywhere); records every signal sent."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, int]] = []  # (pid, signal)

    def running_agents(self) -> list[str]:
        return ["slow", "other"]

    def workers(self, agent: str) -> list[Worker]:
        first = 100 if agent == "slow" else 200
        return [Worker(first + rank, rank, rank, agent) for rank in range(2)]  # type: ignore[arg-type]

    def signal_worker(self, worker: Worker, sig: int) -> None:
        self.sent.append((worker.pid, sig))


class FirstPick(random.Random):
    """The draw of the node to slow: always the first."""

    def choice(self, seq):  # type: ignore[no-untyped-def, override]
        return seq[0]


def slowed(job: FakeJob, seconds: float) -> FaultContext:
    ctx = FaultContext(job=job, rng=FirstPick(), min_agents=1, max_agents=2,  # type: ignore[arg-type]
                       hang_seconds=0.0, snapshot_dir=None, slow_seconds=seconds)
    slow_node(ctx)
    return ctx


def test_the_chosen_nodes_workers_are_slowed_for_the_faults_seconds_then_let_go() -> None:
    job = FakeJob()
    ctx = slowed(job, 0.3)
    assert job.sent == [(100, SLOW_ON), (101, SLOW_ON)] and ctx.targets == [100, 101], "only the chosen node's"
    deadline = time.monotonic() + 10
    while len(job.sent) < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert job.sent[2:] == [(100, SLOW_OFF), (101, SLOW_OFF)], job.sent
    ctx.close()  # the chaos tool's, at the run's end: nothing more to end
    assert len(job.sent) == 4, job.sent


def test_a_fault_ended_early_lets_its_workers_go_at_once_and_only_once() -> None:
    job = FakeJob()
    ctx = slowed(job, 60.0)
    ctx.close()
    assert job.sent[2:] == [(100, SLOW_OFF), (101, SLOW_OFF)], job.sent
    time.sleep(0.1)
    assert len(job.sent) == 4, "the timer was cancelled"


@pytest.fixture
def hook(monkeypatch: pytest.MonkeyPatch) -> Iterator[injected_faults.CorruptionRequest]:
    """The chaos hook armed in this process as in a chaos job's worker; every signal's handler put back after."""
    wanted = (signal.SIGUSR1, signal.SIGUSR2, SLOW_ON, SLOW_OFF)
    previous = {s: signal.getsignal(s) for s in wanted}
    monkeypatch.setattr(injected_faults, "REQUEST", None)
    monkeypatch.setenv(injected_faults.ENV, "1")
    try:
        request = injected_faults.install()
        assert request is not None
        yield request
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def test_a_worker_is_slowed_from_the_first_signal_to_the_second(hook: injected_faults.CorruptionRequest) -> None:
    assert hook.slowed_by == 1.0
    os.kill(os.getpid(), SLOW_ON)
    assert hook.slowed_by == SLOW_FACTOR == 4.0
    os.kill(os.getpid(), SLOW_ON)  # twice on is on
    os.kill(os.getpid(), SLOW_OFF)
    assert hook.slowed_by == 1.0 and not hook.requested and not hook.nan_requested, "no other fault asked for"


#: Seconds each micro-batch's loss takes (a sleep: the least a step's compute takes, whatever the machine's load).
COMPUTE_S = 0.04


def _slow_loss(model: nn.Module, batch: Any) -> tuple[torch.Tensor, None]:
    time.sleep(COMPUTE_S)
    ids, labels = batch
    per_token = nn.functional.cross_entropy(model(ids).reshape(-1, 11), labels.reshape(-1), reduction="none")
    return per_token.view(labels.shape).mean(1), None


def _timed_steps(rank: int, store_path: str, out: str, slowed_by: float) -> None:
    import torch._dynamo  # noqa: F401 - before the process group, as worker.group.up does
    import torch.distributed as tdist

    tdist.init_process_group("gloo", store=tdist.FileStore(store_path, 1), rank=rank, world_size=1)
    model = nn.Sequential(nn.Embedding(11, 6), nn.Linear(6, 11))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = _step(model, optimizer, "ordered", 1, rank, 2, _slow_loss, False)
    step.clock = StepClock(torch.device("cpu"), warm_up=WarmUp(0))
    step.slowed_by = slowed_by
    g = torch.Generator().manual_seed(0)
    for number in range(1, 4):
        plan = StepPlan(epoch=0, start=0, global_count=GLOBAL, indices=list(range(GLOBAL)))
        ids = torch.randint(0, 11, (GLOBAL // 2, 3), generator=g)
        step.compute(number, plan, iter([(ids, ids), (ids, ids)]))
        step.clock.updating()
        optimizer.step()
        step.clock.end()
    timed = step.clock.take()
    torch.save({"local_s": timed.local_s, "stepped_s": timed.stepped_s, "steps": timed.steps}, out)
    tdist.destroy_process_group()


def test_a_slowed_step_takes_four_times_its_compute_in_its_own_time(tmp_path: Path) -> None:
    """Each step computes two micro-batches of at least COMPUTE_S each; slowed, its local time (up to the sync's
    wait) is at least four times that: the stretch lands before the wait, so the watch sees it as this rank's."""
    out = tmp_path / "timed.pt"
    start_ranks(_timed_steps, (tempfile.mktemp(dir=tmp_path), str(out), SLOW_FACTOR), 1)
    timed = torch.load(out)
    assert timed["steps"] == 3
    assert timed["local_s"] / 3 >= SLOW_FACTOR * 2 * COMPUTE_S, timed
