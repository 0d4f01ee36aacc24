"""slow-node slows a node's compute, not its waiting: the chaos tool asks the node's workers (two real-time signals,
the hook of training.injected_faults) to stretch each step's compute to four times its length until the fault's
seconds are up; the stretch shows in the rank's local time (what names a straggler), never in its wait. A hook's
signal goes only to a process that catches it: it would end one that does not."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from elastic_runner.chaos.faults import FaultContext, Skip, catches, slow_node
from elastic_runner.data.sampler import StepPlan
from elastic_runner.testing.localjob import Worker
from elastic_runner.training import injected_faults
from elastic_runner.training.injected_faults import SLOW_FACTOR, SLOW_OFF, SLOW_ON
from elastic_runner.training.step_clock import StepClock, WarmUp

from ..support import start_ranks
from .test_gradients import GLOBAL, _step

pytestmark = pytest.mark.skipif(SLOW_ON is None or not Path("/proc/self/status").exists(),
                                reason="needs real-time signals and /proc (Linux)")

#: A stand-in for a chaos job's worker: it catches the slow device's two signals (its hooks armed), then waits.
ARMED = ("import signal, sys\n"
         f"for s in ({SLOW_ON}, {SLOW_OFF}): signal.signal(s, lambda *a: None)\n"
         "print('ready', flush=True); sys.stdin.read()")
#: One still starting: it catches neither (a hook's signal would end it).
STARTING = "import sys; print('ready', flush=True); sys.stdin.read()"


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in started:
        p.kill()
        p.wait(timeout=10)


def start(started: list[subprocess.Popen[str]], code: str) -> int:
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    started.append(p)
    assert p.stdout is not None and p.stdout.readline() == "ready\n"
    return p.pid


class FakeJob:
    """Two nodes with the given processes as their workers; records every signal it is asked to send, sends none."""

    def __init__(self, slow: list[int], other: list[int]) -> None:
        self.pids = {"slow": slow, "other": other}
        self.sent: list[tuple[int, int]] = []  # (pid, signal)

    def running_agents(self) -> list[str]:
        return ["slow", "other"]

    def workers(self, agent: str) -> list[Worker]:
        return [Worker(pid, rank, rank, agent) for rank, pid in enumerate(self.pids[agent])]  # type: ignore[arg-type]

    def signal_worker(self, worker: Worker, sig: int) -> None:
        self.sent.append((worker.pid, sig))


@pytest.fixture
def job(processes: list[subprocess.Popen[str]]) -> FakeJob:
    return FakeJob([start(processes, ARMED) for _ in range(2)], [start(processes, ARMED) for _ in range(2)])


class FirstPick(random.Random):
    """The draw of the node to slow: always the first."""

    def choice(self, seq):  # type: ignore[no-untyped-def, override]
        return seq[0]


def context(job: FakeJob, seconds: float) -> FaultContext:
    return FaultContext(job=job, rng=FirstPick(), min_agents=1, max_agents=2,  # type: ignore[arg-type]
                        hang_seconds=0.0, snapshot_dir=None, slow_seconds=seconds)


def slowed(job: FakeJob, seconds: float) -> FaultContext:
    ctx = context(job, seconds)
    slow_node(ctx)
    return ctx


def test_the_chosen_nodes_workers_are_slowed_for_the_faults_seconds_then_let_go(job: FakeJob) -> None:
    a, b = job.pids["slow"]
    ctx = slowed(job, 1.5)
    assert job.sent == [(a, SLOW_ON), (b, SLOW_ON)] and ctx.targets == [a, b], "only the chosen node's"
    deadline = time.monotonic() + 10
    while len(job.sent) < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert job.sent[2:] == [(a, SLOW_OFF), (b, SLOW_OFF)], job.sent
    ctx.close()  # the chaos tool's, at the run's end: nothing more to end
    assert len(job.sent) == 4, job.sent


def test_a_fault_ended_early_lets_its_workers_go_at_once_and_only_once(job: FakeJob) -> None:
    a, b = job.pids["slow"]
    ctx = slowed(job, 60.0)
    ctx.close()
    assert job.sent[2:] == [(a, SLOW_OFF), (b, SLOW_OFF)], job.sent
    time.sleep(0.1)
    assert len(job.sent) == 4, "the timer was cancelled"


def test_an_earlier_faults_end_does_not_end_a_later_one_on_the_same_node(job: FakeJob) -> None:
    a, b = job.pids["slow"]
    ctx = context(job, 60.0)
    slow_node(ctx)
    first_end = ctx.cleanups[-1]
    slow_node(ctx)  # the next fault drew the same node while the first one's seconds still ran
    first_end()
    assert (a, SLOW_OFF) not in job.sent and (b, SLOW_OFF) not in job.sent, job.sent
    ctx.close()
    assert job.sent[-2:] == [(a, SLOW_OFF), (b, SLOW_OFF)], "the later one's end lets them go"


def test_a_worker_that_has_not_armed_its_hooks_is_never_sent_their_signals(
        processes: list[subprocess.Popen[str]]) -> None:
    """A hook's signal would end a process that does not catch it (one still starting, or exiting)."""
    starting = start(processes, STARTING)
    armed = start(processes, ARMED)
    assert not catches(starting, SLOW_ON) and catches(armed, SLOW_ON) and catches(armed, SLOW_OFF)  # type: ignore[arg-type]
    job = FakeJob([starting, armed], [start(processes, ARMED)])
    ctx = slowed(job, 60.0)
    assert job.sent == [(armed, SLOW_ON)] and ctx.targets == [armed], job.sent
    ctx.close()
    with pytest.raises(Skip, match="chaos hooks armed"):
        slowed(FakeJob([starting], [armed]), 60.0)


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
    assert hook.slowed_by == 1.0 and catches(os.getpid(), SLOW_ON)  # type: ignore[arg-type]
    os.kill(os.getpid(), SLOW_ON)  # type: ignore[arg-type]
    assert hook.slowed_by == SLOW_FACTOR == 4.0
    os.kill(os.getpid(), SLOW_ON)  # type: ignore[arg-type]  # twice on is on
    os.kill(os.getpid(), SLOW_OFF)  # type: ignore[arg-type]
    assert hook.slowed_by == 1.0 and not hook.requested and not hook.nan_requested, "no other fault asked for"


def test_an_armed_worker_ignores_the_hooks_signals_once_its_interpreter_exits() -> None:
    """At its exit the interpreter puts each signal it handled back to the default action (after the exit functions
    ran), which for a real-time signal ends the process: a fault's end that reached a finishing worker then would turn
    its exit 0 into a death. The hooks' exit function makes them ignored first, which the interpreter leaves alone."""
    code = ("import atexit, os, signal\n"
            f"os.environ[{injected_faults.ENV!r}] = '1'\n"
            "from elastic_runner.training import injected_faults as hooks\n"
            "hooks.install()\n"
            "atexit._run_exitfuncs()  # what the interpreter runs first at its exit\n"
            "print([signal.getsignal(s) == signal.SIG_IGN for s in hooks._hook_signals()])\n"
            "os.kill(os.getpid(), hooks.SLOW_OFF)\n")
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0 and ran.stdout.strip() == "[True, True, True, True]", (ran.returncode, ran.stdout,
                                                                                    ran.stderr[-2000:])


#: Seconds each micro-batch's loss takes (a sleep: the least a step's compute takes, whatever the machine's load).
COMPUTE_S = 0.04


def _slow_loss(model: nn.Module, batch: Any) -> tuple[torch.Tensor, None]:
    time.sleep(COMPUTE_S)
    ids, labels = batch
    per_token = nn.functional.cross_entropy(model(ids).reshape(-1, 11), labels.reshape(-1), reduction="none")
    return per_token.view(labels.shape).mean(1), None


def _timed_steps(rank: int, store_path: str, out: str) -> None:
    import torch._dynamo  # noqa: F401 - before the process group, as worker.group.up does
    import torch.distributed as tdist

    os.environ[injected_faults.ENV] = "1"  # as in a chaos job's worker, slowed as the chaos tool slows it
    request = injected_faults.install()
    assert request is not None and SLOW_ON is not None
    os.kill(os.getpid(), SLOW_ON)

    tdist.init_process_group("gloo", store=tdist.FileStore(store_path, 1), rank=rank, world_size=1)
    model = nn.Sequential(nn.Embedding(11, 6), nn.Linear(6, 11))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = _step(model, optimizer, "ordered", 1, rank, 2, _slow_loss, False)
    step.clock = StepClock(torch.device("cpu"), warm_up=WarmUp(0))
    step.slowed_by = request.slowed_by  # (what the loop hands each step)
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
    start_ranks(_timed_steps, (tempfile.mktemp(dir=tmp_path), str(out)), 1)
    timed = torch.load(out)
    assert timed["steps"] == 3
    assert timed["local_s"] / 3 >= SLOW_FACTOR * 2 * COMPUTE_S, timed
