"""Real torchrun agents with ``--rdzv_backend=etcd-v3`` training the quickstart.

Membership changes (scale up, kill -9) under plain torchrun, an etcd restart mid-training under
``elastic-runner launch`` (both on the default lease protocol), and a wrong endpoint: the job either completes with a clean exactly-once
audit, or the agent fails fast with a sentence.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from elastic_runner.observe.audit import check_audit
from elastic_runner.testing.etcd_server import EtcdServer
from elastic_runner.testing.localjob import LocalJob, free_port

from ..support import (
    audited_step,
    continue_workers,
    events,
    run_bounded,
    start_agent_until_waiting,
    stop_workers_at_step,
    wait_for_step,
)
from .etcd_support import gateway_client

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


def wait_for_world(run_dir: Path, size: int, timeout: float, job: LocalJob,
                   after_generation: int = 0) -> tuple[int, int]:
    """Generation and resume step of the first world of size ``size`` (after ``after_generation``)
    in which every rank has loaded its state."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        worlds = [e for e in events(run_dir, "world")
                  if e["world_size"] == size and e.get("generation", 0) > after_generation]
        by_generation: dict[int, list[dict[str, Any]]] = {}
        for e in worlds:
            by_generation.setdefault(e["generation"], []).append(e)
        ready = [g for g, members in by_generation.items() if len(members) >= size]
        if ready:
            generation = min(ready)
            return generation, by_generation[generation][0]["step"]
        time.sleep(0.1)
    raise AssertionError(f"no world of size {size} within {timeout:.0f}s\n{job.logs_tail()}")


def generations_by_world(run_dir: Path) -> dict[int, int]:
    out: dict[int, int] = {}
    for e in events(run_dir, "start"):
        out[e["generation"]] = e["world_size"]
    return out


def rendezvous_keys(server: EtcdServer, prefix: str) -> dict[str, Any]:
    """The lease protocol's keys of a run (``PREFIX/RUN_ID/rdzv/``), by their name under it."""
    admin = gateway_client(server)
    try:
        kvs, _ = admin.get_prefix(prefix.encode())
        return {kv.key.decode()[len(prefix):]: kv for kv in kvs}
    finally:
        admin.close()


def someone_waits(server: EtcdServer, prefix: str) -> bool:
    """A node asks the running round to end (its ``ctl/next/R`` signal, what ``num_nodes_waiting`` reports)."""
    return any(name.startswith("ctl/next/") for name in rendezvous_keys(server, prefix))


@pytest.mark.slow
def test_two_then_three_agents_then_one_killed_the_job_completes_exactly_once(
        small_config: Path, local_job: Callable[..., LocalJob], etcd_server: EtcdServer) -> None:
    # At least 2: an agent that starts a moment late would otherwise miss the first round (1 s last call).
    job = local_job(config=str(small_config), nnodes="2:3", rdzv_backend="etcd-v3",
                    rdzv_endpoint=etcd_server.endpoint, rdzv_conf=LocalJob.rdzv_conf + ",key_prefix=/e2e-scale",
                    # Paced (>= 4 s for 100 steps): the runway after the join must outlast torchrun noticing the
                    # waiting node (up to a second of state cache) and restarting the group, however fast this
                    # machine trains; unpaced, a fast run finished before the third agent got in.
                    overrides=["train.epochs=20", "train.max_steps=100",
                               "data.sampler=tests.broken_components:PacedSampler"])
    run_dir = Path(job.run_dir)
    rdzv = f"/e2e-scale/{job.rdzv_id}/rdzv/"
    job.start_agent()
    second = job.start_agent()

    # Scale up. The workers are stopped while the new agent starts (seconds), so the job cannot
    # finish before it arrives however fast this machine trains; they go on once it waits.
    paused, _ = stop_workers_at_step(job, 5, count=2)
    assert set(generations_by_world(run_dir).values()) == {2}
    start_agent_until_waiting(job, paused, lambda: someone_waits(etcd_server, rdzv), timeout=60)
    three, resumed_at = wait_for_world(run_dir, 3, timeout=90, job=job)

    # Scale down: node loss, agent and its worker, no goodbye, a few steps into the new world.
    # The survivors' next collective fails.
    paused, killed_at = stop_workers_at_step(job, resumed_at + 3, count=3)
    assert killed_at < 100, "the job must still be running when the agent is killed"
    job.kill_agent(second, signal.SIGKILL)
    continue_workers(job, paused)
    wait_for_world(run_dir, 2, timeout=90, job=job, after_generation=three)
    codes = job.wait(timeout=150)
    assert codes == [0, -signal.SIGKILL, 0], job.logs_tail()

    report = check_audit(run_dir)
    assert report.ok, report.render()
    assert report.finished and report.final_step == 100
    sizes = list(generations_by_world(run_dir).values())
    assert sizes[0] == 2 and 3 in sizes and sizes[-1] == 2, sizes


@pytest.mark.slow
def test_training_rides_out_an_etcd_restart(small_config: Path, local_job: Callable[..., LocalJob],
                                             etcd_factory: Callable[..., EtcdServer]) -> None:
    server = etcd_factory()
    job = local_job(config=str(small_config), nnodes="2:2", rdzv_backend="etcd-v3", rdzv_endpoint=server.endpoint,
                    launcher="elastic-runner",
                    overrides=["train.epochs=20", "train.max_steps=350",
                               "data.sampler=tests.broken_components:PacedSampler"])  # >= 14 s of steps
    run_dir = Path(job.run_dir)
    job.start_agent()
    job.start_agent()
    wait_for_step(run_dir, 5, timeout=90, job=job)
    rdzv = f"/elastic_runner/rdzv/{job.rdzv_id}/rdzv/"
    nodes = {name: kv.create_revision for name, kv in rendezvous_keys(server, rdzv).items() if name.startswith("node/")}
    assert len(nodes) == 2, nodes
    # SIGKILL, down for longer than keep_alive_interval * keep_alive_max_attempt (3 s): the agents' liveness
    # leases would have run out meanwhile; etcd renews every lease when it is back (a new leader).
    before = audited_step(run_dir)
    server.restart(down_seconds=4, crash=True)
    assert before < audited_step(run_dir) < 350, "training went on while etcd was down, and is not over yet"
    time.sleep(4)  # more than a window after etcd is back: a lease nobody refreshed would be gone
    keys = rendezvous_keys(server, rdzv)
    after = {name: kv.create_revision for name, kv in keys.items() if name.startswith("node/")}
    assert after == nodes, f"both agents' keys lived through the outage, never re-created: {nodes} -> {after}"
    assert not any(name.startswith("ctl/next/") for name in keys), "nobody asked for a new round"
    assert all(a.running() for a in job.agents), "checked while the job was still training"

    assert job.wait(timeout=150) == [0, 0], job.logs_tail()
    report = check_audit(run_dir)
    assert report.ok, report.render()
    assert report.finished and report.final_step == 350
    # Workers never talk to etcd: the agents retry their heartbeats through the outage and training
    # goes on in the same generation; the membership record is current again for the next change.
    assert set(generations_by_world(run_dir)) == {1}, generations_by_world(run_dir)


def test_no_etcd_at_the_endpoint_is_a_clear_error_within_connect_timeout(small_config: Path, tmp_path: Path) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc_per_node=1",
           "--rdzv_backend=etcd-v3", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=nobody",
           "--rdzv_conf=connect_timeout=3,request_timeout=1",
           "-m", "elastic_runner.train", "--config", str(small_config), "--set", f"run.dir={tmp_path / 'run'}"]
    started = time.monotonic()
    result = run_bounded(cmd, timeout=60)
    elapsed = time.monotonic() - started
    assert result.returncode != 0
    # One line that says what to check, after the warnings of the retries; no chained tracebacks.
    final = [line for line in result.stdout.splitlines() if "Check that etcd is running" in line]
    assert len(final) == 1 and final[0].startswith("elastic-runner: The etcd-v3 rendezvous cannot start run 'nobody'"), \
        result.stdout[-3000:]
    assert f"127.0.0.1:{port}" in final[0] and "Traceback" not in result.stdout, result.stdout[-3000:]
    assert elapsed < 40, f"took {elapsed:.0f}s"
    assert not list((tmp_path / "run").glob("events/gen-*")), "no worker started (the agent's own log may exist)"




@pytest.mark.parametrize("launcher", ["torchrun", "elastic-runner"])
def test_a_node_that_arrives_after_the_job_ended_says_so_in_one_line(
        launcher: str, small_config: Path, tmp_path: Path, etcd_server: EtcdServer) -> None:
    """Before: a replacement pod started as the job finished died on RendezvousClosedError's traceback."""
    run_id = f"closed-{launcher}"
    runner = ["-m", "torch.distributed.run"] if launcher == "torchrun" else ["-m", "elastic_runner", "launch"]
    cmd = [sys.executable, *runner, "--nnodes=1:2", "--nproc_per_node=1", "--rdzv_backend=etcd-v3",
           f"--rdzv_endpoint={etcd_server.endpoint}", f"--rdzv_id={run_id}", "--rdzv_conf=last_call_timeout=1",
           "-m", "elastic_runner.train", "--config", str(small_config), "--set", f"run.dir={tmp_path / 'run'}",
           "--set", "train.max_steps=5"]
    assert run_bounded(cmd, timeout=120).returncode == 0
    late = run_bounded(cmd, timeout=60)
    assert late.returncode == 1, late.stdout[-3000:]
    (line,) = [line for line in late.stdout.splitlines() if "rendezvous is closed" in line]
    assert "nothing to join" in line and "new --rdzv-id" in line and "Traceback" not in late.stdout, late.stdout[-3000:]
