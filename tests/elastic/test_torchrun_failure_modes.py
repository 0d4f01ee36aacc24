"""torchrun 2.13's own failure modes: scale-up death, stale stores, split brain, hung group creation."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic_runner.observe.audit import check_audit
from elastic_runner.snapshot import LocalStore
from elastic_runner.testing.localjob import free_port

from ..support import events, run_bounded, wait_for_step, write_config

pytestmark = [pytest.mark.multiprocess]


def world_after(run_dir: Path, t: float, size: int, timeout: float, job) -> None:  # noqa: ANN001
    """Wait until a generation started after ``t`` is stepping at world size ``size``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        starts = {e["generation"] for e in events(run_dir, "world") if e["time"] > t and e["world_size"] == size}
        if any(e["generation"] in starts for e in events(run_dir, "first_step")):
            return
        time.sleep(0.1)
    raise AssertionError(f"no generation at world size {size} stepped within {timeout}s\n{job.logs_tail()}")


@pytest.mark.timeout(600)
def test_ten_consecutive_scale_ups_and_restarts_through_launch(tmp_path: Path, local_job) -> None:  # noqa: ANN001
    config = write_config(tmp_path / "long.yaml", train={"epochs": 1000, "max_steps": 100000, "eval_every_steps": 0},
                          snapshot={"every_steps": 50}, logging={"every_steps": 50})
    job = local_job(config=str(config), nnodes="1:3", launcher="elastic-runner")
    job.start_agent()
    run_dir = Path(job.run_dir)
    wait_for_step(run_dir, 20, timeout=120, job=job)
    for cycle in range(5):
        t = time.time()
        joiner = job.start_agent()  # scale-up: the failure mode that killed plain torchrun jobs
        world_after(run_dir, t, 2, 90, job)
        t = time.time()
        job.signal_worker(next(w for w in job.workers(joiner)), signal.SIGKILL)  # restart at the same size
        world_after(run_dir, t, 2, 90, job)
        t = time.time()
        job.kill_agent(joiner)  # back to one node for the next cycle
        world_after(run_dir, t, 1, 90, job)
        assert job.agents[0].running(), f"the job died in cycle {cycle}\n{job.logs_tail()}"
    # Let it end cleanly: a stop request through the remaining agent.
    job.agents[0].proc.send_signal(signal.SIGTERM)
    job.wait(timeout=120)
    report = check_audit(run_dir)
    assert report.ok, report.render()
    assert len(report.generations) >= 16


@pytest.mark.timeout(300)
def test_a_stale_writer_cannot_replace_the_newer_rounds_snapshots(small_config: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    common = [sys.executable, "-m", "elastic_runner.train", "--config", str(small_config), "--set", f"run.dir={run_dir}",
              "--set", "snapshot.every_steps=5", "--set", "train.epochs=1000", "--set", "snapshot.in_memory=false"]
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    def start(max_steps: int) -> subprocess.Popen[str]:
        return subprocess.Popen(common + ["--set", f"train.max_steps={max_steps}"], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)

    started: list[subprocess.Popen[str]] = []
    try:
        # The old round: a zombie that keeps training on its own after being cut off.
        old = start(100000)
        started.append(old)
        store = LocalStore(run_dir / "snapshots")
        deadline = time.monotonic() + 120
        while not store.complete():
            assert time.monotonic() < deadline and old.poll() is None
            time.sleep(0.05)
        # The old round is held (stopped) while the newer one starts on the same run directory and
        # claims generation 2: however slowly the new one starts, the old one is still far from
        # step 60, so the new round has steps left to train and snapshot.
        os.kill(old.pid, signal.SIGSTOP)
        try:
            new_proc = start(60)
            started.append(new_proc)
            while not (run_dir / "snapshots" / "generations" / "000002").exists():
                assert time.monotonic() < deadline, "the new round never claimed generation 2"
                assert new_proc.poll() is None, new_proc.communicate()[0][-2000:]
                time.sleep(0.05)
        finally:
            os.kill(old.pid, signal.SIGCONT)
        new_out, _ = new_proc.communicate(timeout=180)
        old_out, _ = old.communicate(timeout=120)
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert new_proc.returncode == 0, new_out[-2000:]
    assert old.returncode == 1, old_out[-2000:]
    assert "is stale: generation 2" in old_out and "split brain" in old_out
    complete = store.complete()
    assert complete[-1].generation == 2, "the newer round's snapshot is the latest"
    assert store.incomplete() == [], "the refused write left nothing half-written"


@pytest.mark.timeout(120)
def test_hung_process_group_creation_ends_within_the_configured_time(small_config: Path, tmp_path: Path) -> None:
    env = os.environ | {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(free_port()), "TORCHELASTIC_RUN_ID": "hung"}
    started = time.monotonic()
    result = run_bounded([sys.executable, "-m", "elastic_runner.train", "--config", str(small_config),
                          "--set", f"run.dir={tmp_path}", "--set", "dist.init_timeout_seconds=3"], timeout=90, env=env)
    elapsed = time.monotonic() - started
    assert result.returncode == 75, result.stdout[-2000:]
    assert "was not ready within dist.init_timeout_seconds=3s" in result.stdout
    assert elapsed < 3 + 30, f"took {elapsed:.0f}s (interpreter start included)"


@pytest.mark.timeout(240)
def test_a_worker_that_fails_after_finishing_ends_the_job_in_seconds_not_the_exit_barriers_300(
        small_config: Path, tmp_path: Path, local_job) -> None:  # noqa: ANN001
    """Seen in a soak: a worker dies in the job's last moments; its agent started a new round that nobody joined,
    while the other agents waited in torch's exit barrier for up to 300 s. Both agents need both nodes (2:2), so a
    new round could never form."""
    run_dir = tmp_path / "run"
    program = [str(Path(__file__).parents[1] / "dies_after_finishing.py"), "--config", str(small_config),
               "--set", f"run.dir={run_dir}", "--set", "train.max_steps=30"]
    job = local_job(config=str(small_config), run_dir=str(run_dir), nnodes="2:2", launcher="elastic-runner",
                    program=program, env={"PYTHONPATH": os.pathsep.join(sys.path)})
    job.start_agent()
    job.start_agent()
    assert job.wait(timeout=200) == [0, 0], job.logs_tail()
    (finished,) = [e for e in events(run_dir, "end") if e.get("rank") == 0]  # one attempt: no new round
    ended = max(a.log_path.stat().st_mtime for a in job.agents)
    assert ended - finished["time"] < 30, f"the agents ended {ended - finished['time']:.0f}s after the job finished"
    assert "after finishing the job, its final snapshot durable" in job.logs_tail(200)
    assert check_audit(run_dir).ok
