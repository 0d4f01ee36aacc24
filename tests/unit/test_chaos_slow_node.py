"""slow-node throttles a node's compute, not its waiting: a worker is stopped only after it has run CPU time, so a
stop lands in its own work and shows in its local time (what names a straggler), not in every rank's wait."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic_runner.chaos.faults import FaultContext, _cpu_s, slow_node
from elastic_runner.testing.localjob import Worker

pytestmark = pytest.mark.skipif(not Path("/proc/self/schedstat").exists(),
                                reason="needs the kernel's scheduler statistics (/proc/PID/schedstat)")

SPIN = "while True: pass"
WAIT = "import sys; sys.stdin.read()"  # blocked until its stdin closes: runs nothing


class FakeJob:
    """Two nodes; the first one's workers are the given processes. Records every signal it sends them."""

    def __init__(self, procs: list[subprocess.Popen[bytes]]) -> None:
        self.procs = procs
        self.sent: list[int] = []

    def running_agents(self) -> list[str]:
        return ["slow", "other"]

    def workers(self, agent: str) -> list[Worker]:
        return [Worker(p.pid, rank, rank, agent) for rank, p in enumerate(self.procs)] if agent == "slow" else []  # type: ignore[arg-type]

    def signal_worker(self, worker: Worker, sig: int) -> None:
        self.sent.append(sig)
        os.kill(worker.pid, sig)


class FirstPick(random.Random):
    """The draw of the node to slow: always the first."""

    def choice(self, seq):  # type: ignore[no-untyped-def, override]
        return seq[0]


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        p.kill()
        p.wait(timeout=10)


def throttle(job: FakeJob, seconds: float) -> None:
    """slow-node for ``seconds``, waited out, then its cleanups (as the chaos tool runs them at the fault's end)."""
    ctx = FaultContext(job=job, rng=FirstPick(), min_agents=1, max_agents=2,  # type: ignore[arg-type]
                       hang_seconds=0.0, snapshot_dir=None, slow_seconds=seconds)
    slow_node(ctx)
    time.sleep(seconds + 0.2)
    for cleanup in ctx.cleanups:
        cleanup()


def test_a_worker_that_computes_flat_out_is_left_a_quarter_of_its_time(started: list[subprocess.Popen[bytes]]) -> None:
    started.append(subprocess.Popen([sys.executable, "-c", SPIN]))
    time.sleep(0.3)  # its interpreter up
    job = FakeJob(started)
    before, began = _cpu_s(started[0].pid), time.monotonic()
    throttle(job, 1.5)
    ran = _cpu_s(started[0].pid) - before  # type: ignore[operator]
    share = ran / (time.monotonic() - began)
    assert share < 0.5, f"it ran {share:.0%} of the throttle's seconds: a quarter was its due"
    assert job.sent.count(signal.SIGSTOP) >= 10 and job.sent[-1] == signal.SIGCONT, job.sent[-5:]
    with open(f"/proc/{started[0].pid}/stat", encoding="ascii") as f:
        assert f.read().split(") ")[1][0] != "T", "never left stopped"


def test_a_worker_that_waits_is_never_stopped(started: list[subprocess.Popen[bytes]]) -> None:
    """Waiting in a collective runs nothing: a throttled GPU or a CPU quota slows no wait, and a stop there would show
    in every rank's wait instead of the slow node's own time."""
    started.append(subprocess.Popen([sys.executable, "-c", WAIT], stdin=subprocess.PIPE))
    time.sleep(0.3)
    job = FakeJob(started)
    throttle(job, 1.0)
    assert signal.SIGSTOP not in job.sent, f"stopped {job.sent.count(signal.SIGSTOP)} time(s) while it ran nothing"
