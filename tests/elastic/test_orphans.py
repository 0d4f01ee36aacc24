"""No orphans: whatever kills an agent (the OOM killer, a crash, SIGKILL of that one process), the
processes it started — the zygote, the workers, their DataLoader processes — end with it. An orphaned
worker keeps its GPU memory and its old process group, and steps on as if nothing happened."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Callable

import pytest

from elastic_runner.observe.audit import check_audit
from elastic_runner.testing.localjob import LocalJob, alive, descendants

from ..support import continue_workers, events, stop_workers_at_step, wait_for_step

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


def wait_until_gone(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


@pytest.mark.parametrize("launcher", ["elastic-runner", "torchrun"])
def test_an_agent_killed_alone_takes_every_process_it_started_with_it(
        small_config: Path, local_job: Callable[..., LocalJob], launcher: str) -> None:
    """The zygote (launch and, through the entry-point hook, plain torchrun), its workers and their 2 DataLoader
    processes each."""
    num_workers = 2
    # A collate function takes the DataLoader path (in-memory tensors skip it): loader processes exist.
    loader = [f"data.num_workers={num_workers}", "data.collate=torch.utils.data:default_collate"]
    job = local_job(config=str(small_config), nnodes="1:2", launcher=launcher,
                    overrides=["train.epochs=50", "train.max_steps=2000", *loader,
                               "data.sampler=tests.broken_components:PacedSampler"])
    agent = job.start_agent()
    wait_for_step(Path(job.run_dir), 3, timeout=90, job=job)
    started = descendants(agent.pid)
    assert len(started) >= 1 + num_workers, started
    job.kill_agent(agent, signal.SIGKILL, with_workers=False)  # the agent process alone, not its tree
    left = wait_until_gone(started, seconds=2.0)
    assert not left, (f"{len(left)} of the {len(started)} processes the {launcher} agent started outlived it by 2 s: "
                      f"{[(p, Path(f'/proc/{p}/cmdline').read_bytes()[:120]) for p in left]}")


def test_a_killed_worker_takes_its_loader_processes_with_it_and_recovers_from_memory(
        small_config: Path, local_job: Callable[..., LocalJob]) -> None:
    """Loader processes forked after the process group hold copies of its sockets: left behind, they
    keep the peers from seeing the failure, and the fast path is gone."""
    job = local_job(config=str(small_config), nnodes="2:2", launcher="elastic-runner",
                    overrides=["train.epochs=20", "train.max_steps=120", "data.num_workers=2",
                               "data.collate=torch.utils.data:default_collate"])
    job.start_agent()
    job.start_agent()
    run_dir = Path(job.run_dir)
    workers, _ = stop_workers_at_step(job, 25, count=2, timeout=120)
    victim = next(w for w in workers if w.rank == 1)
    loaders = descendants(victim.pid)
    assert len(loaders) == 2, f"expected the victim's 2 loader processes, found {loaders}"
    job.signal_worker(victim, signal.SIGKILL)
    continue_workers(job, [w for w in workers if w is not victim])
    assert not wait_until_gone(loaders, seconds=1.0), "loader processes outlived their worker"
    assert job.wait(timeout=150) == [0, 0], job.logs_tail()
    resumes = [e for e in events(run_dir, "resume") if e["generation"] > 1]
    assert resumes and min(resumes, key=lambda e: e["generation"])["tier"] == "memory", resumes
    report = check_audit(run_dir)
    assert report.ok, report.render()
