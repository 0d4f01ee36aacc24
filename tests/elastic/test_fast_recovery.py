"""Fast recovery through elastic-runner launch when every worker restarts (``recovery.in_process: false``): memory
snapshots, watchdog, zygote, our agent. In-process recovery, the default: ``test_in_process.py``."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from elastic_runner.observe.audit import check_audit

from ..support import (
    assert_bitwise_equal,
    assert_told_once,
    continue_workers,
    events,
    exported_model,
    kill_worker_at_step,
    stop_workers_at_step,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

RESTART_EVERY_WORKER = "recovery.in_process=false"


def first_resume(run_dir: Path, after: float = 0.0) -> dict:
    """The first resume of the job (after the time ``after``, when given)."""
    resumes = [e for e in events(run_dir, "resume") if e["generation"] > 1 and e["time"] > after]
    assert resumes, "the job never resumed"
    return min(resumes, key=lambda e: e["generation"])


def test_worker_kill_resumes_from_a_survivors_memory_losing_no_step_and_ends_bitwise_identical(
        resume_config: Path, reference_model, local_job, tmp_path: Path) -> None:  # noqa: ANN001
    job = local_job(config=str(resume_config), nnodes="2:2", launcher="elastic-runner",
                    overrides=[RESTART_EVERY_WORKER])
    job.start_agent()
    job.start_agent()
    run_dir = Path(job.run_dir)
    victim = kill_worker_at_step(job, 130)
    assert job.wait(timeout=180) == [0, 0], job.logs_tail()
    assert_told_once(job, victim.pid)

    resume = first_resume(run_dir)
    assert resume["tier"] == "memory", "a survivor kept the newest step"
    assert resume["steps_recomputed"] <= 1
    assert resume["step"] % 20 != 0 or resume["steps_recomputed"] == 0  # not just the last disk snapshot
    report = check_audit(run_dir)
    assert report.ok, report.render()
    assert_bitwise_equal(exported_model(run_dir, tmp_path), reference_model)


def test_losing_every_worker_at_once_falls_back_to_the_disk_snapshot(resume_config: Path, local_job) -> None:  # noqa: ANN001
    job = local_job(config=str(resume_config), nnodes="2:2", launcher="elastic-runner",
                    overrides=[RESTART_EVERY_WORKER])
    job.start_agent()
    job.start_agent()
    run_dir = Path(job.run_dir)
    workers, _ = stop_workers_at_step(job, 90, count=2, timeout=120)
    for worker in workers:  # no survivor: nobody can keep the newest step
        job.signal_worker(worker, signal.SIGKILL)
    assert job.wait(timeout=180) == [0, 0], job.logs_tail()
    resume = first_resume(run_dir)
    assert resume["tier"] == "disk" and resume["step"] % 20 == 0
    assert check_audit(run_dir).ok


def test_hung_worker_is_detected_within_the_heartbeat_time_and_killed_at_once(resume_config: Path, local_job) -> None:  # noqa: ANN001
    job = local_job(config=str(resume_config), nnodes="1:1", nproc_per_node=2, launcher="elastic-runner",
                    overrides=["dist.heartbeat_seconds=2", RESTART_EVERY_WORKER])
    job.start_agent()
    run_dir = Path(job.run_dir)
    workers, _ = stop_workers_at_step(job, 60, count=2, timeout=120)
    stopped_at = time.time()
    continue_workers(job, [w for w in workers if w.rank != 1])  # rank 1 stays stopped: hung
    assert job.wait(timeout=120) == [0], job.logs_tail()
    detections = [e for e in events(run_dir, "failure") if e.get("detected_by") == "watchdog" and e["time"] > stopped_at]
    assert detections, "the watchdog reported the hung peer"
    detected_after = min(e["time"] for e in detections) - stopped_at
    # heartbeat timeout + one polling interval (0.4 s) + scheduling slack on a loaded 2-core machine
    assert detected_after < 2 + 3, f"detected after {detected_after:.1f}s"
    restarted = [e for e in events(run_dir, "start") if e["generation"] == 2]
    assert restarted and min(e["time"] for e in restarted) - stopped_at < 20, "stopped worker killed, not waited for 30 s"
    assert check_audit(run_dir).ok


def test_node_loss_survivor_keeps_the_newest_step(resume_config: Path, local_job) -> None:  # noqa: ANN001
    job = local_job(config=str(resume_config), nnodes="1:2", launcher="elastic-runner",
                    overrides=[RESTART_EVERY_WORKER])
    job.start_agent()
    second = job.start_agent()
    run_dir = Path(job.run_dir)
    # Two workers run at once only in a round of both agents (the first, or, when the second agent
    # started after the first round closed, the scale-up that follows): the kill hits a world of 2.
    paused, _ = stop_workers_at_step(job, 90, count=2, timeout=120)
    killed_at = time.time()
    job.kill_agent(second)
    continue_workers(job, paused)
    assert job.wait(timeout=180)[0] == 0, job.logs_tail()
    resume = first_resume(run_dir, after=killed_at)
    assert resume["tier"] == "memory" and resume["steps_recomputed"] <= 1
    assert {e["world_size"] for e in events(run_dir, "world") if e["time"] > killed_at} == {1}
    assert check_audit(run_dir).ok


SLOW_TO_START = """
import os, sys, time
import torch
from torch import nn
from torch.utils.data import TensorDataset
import elastic_runner

if os.environ.get("SLOW_TO_START"):  # this node's script takes long before it reaches fit: it is killed meanwhile
    time.sleep(600)
torch.manual_seed(0)
x = torch.randn(512, 8)
sys.exit(elastic_runner.fit(nn.Linear(8, 2), TensorDataset(x, (x[:, 0] > 0).long()), config={
    "run": {"dir": sys.argv[1]}, "batch": {"global_size": 32}, "train": {"epochs": 400}, "audit": {"samples": True},
    "dist": {"init_timeout_seconds": 600}}))
"""


def test_a_node_lost_before_its_worker_joined_the_process_group_is_not_waited_for(local_job, tmp_path: Path) -> None:  # noqa: ANN001
    """The fifth slow recovery of the 1,000-fault soak: the new workers of a round wait in the process group's start
    for a worker of a node that died before it got there. They wait no longer than the rendezvous takes to count the
    node dead (here 3 s), not ``dist.init_timeout_seconds`` (600 s here: a wait that long outlasts this test)."""
    script = tmp_path / "slow_to_start.py"
    script.write_text(SLOW_TO_START)
    job = local_job(config="", nnodes="1:2", launcher="elastic-runner")
    job.program = [str(script), job.run_dir]
    survivor = job.start_agent()
    job.wait_for_workers(1, timeout=120, agent=survivor)
    job.env = {**job.env, "SLOW_TO_START": "1"}
    doomed = job.start_agent()
    job.wait_for_workers(1, timeout=120, agent=doomed)  # the round of two is sealed and its workers started
    time.sleep(2)  # the survivor's new worker waits for the doomed one in the process group's start
    job.kill_agent(doomed)
    assert survivor.proc.wait(timeout=150) == 0, job.logs_tail()
    assert "is gone: this node's workers stop for the next round" in survivor.log_text(), job.logs_tail()
    # The attempt of the round of two never got past the process group's start: the events are the survivor's.
    run_dir = Path(job.run_dir)
    assert [e["world_size"] for e in events(run_dir, "world")][-1] == 1
    assert [e["status"] for e in events(run_dir, "end")] == ["finished"]
    assert not [e for e in events(run_dir, "failure") if "init_timeout" in str(e.get("error"))]
    report = check_audit(run_dir)
    assert report.ok and report.finished, report.render()
