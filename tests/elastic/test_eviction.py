"""A straggler's node taken out of the job (``recovery.evict_stragglers``): named, it leaves as a preempted node does
(exit status 6), the other node trains on with its worker kept, and an agent started again on the evicted node
before ``recovery.exclusion_seconds`` is up is refused before it costs the job a round (exit status 6 again)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from elastic_runner.observe.audit import check_audit
from elastic_runner.observe.events import read_events
from elastic_runner.recovery.exclusions import EXIT_EXCLUDED
from elastic_runner.testing.etcd_server import EtcdServer

from ..support import events, write_config

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_straggler_node_is_evicted_kept_out_and_the_job_finishes_without_it(
        tmp_path: Path, local_job: Any, etcd: EtcdServer) -> None:
    slow_file = tmp_path / "slow"
    slow_file.touch()
    config = write_config(tmp_path / "evict.yaml", train={"epochs": None, "max_steps": 1500, "eval_every_steps": 0},
                          model={"name": "tests.broken_components:slow_on_one_rank",
                                 "params": {"rank": 1, "while_file": str(slow_file), "delay_s": 0.03}},
                          snapshot={"every_steps": 500}, logging={"every_steps": 10},
                          recovery={"in_process": True, "straggler_ratio": 3.0, "straggler_window_seconds": 2.0,
                                    "evict_stragglers": True, "exclusion_seconds": 600})
    job = local_job(config=str(config), nnodes="1:2", rdzv_backend="etcd-v3", rdzv_endpoint=etcd.endpoint,
                    rdzv_conf="last_call_timeout=1")
    job.start_agent()
    job.start_agent()
    workers = job.wait_for_workers(2, timeout=120)
    slow = next(w for w in workers if w.rank == 1)
    kept = next(w for w in workers if w is not slow)
    evicted = slow.agent
    deadline = time.monotonic() + 150
    while evicted.proc.poll() is None:
        assert time.monotonic() < deadline, f"the straggler's node never left\n{job.logs_tail()}"
        time.sleep(0.2)
    assert evicted.proc.returncode == EXIT_EXCLUDED, evicted.log_text()[-3000:]
    node = f"node-{evicted.index}"
    assert f"elastic_runner: node {node} leaves the job: rank 1 (node " in evicted.log_text(), \
        evicted.log_text()[-3000:]

    again = job.start_agent(node_name=node)  # the same machine, back before its exclusion is over
    assert again.proc.wait(timeout=90) == EXIT_EXCLUDED, again.log_text()[-3000:]
    assert f"elastic_runner: node {node} is excluded from job" in again.log_text(), again.log_text()[-3000:]

    codes = job.wait(timeout=240)
    assert codes[job.agents.index(kept.agent)] == 0, job.logs_tail()
    run_dir = Path(job.run_dir)
    starts = [e for e in events(run_dir, "start") if e["pid"] == kept.pid]
    assert [e["world_size"] for e in starts][-1] == 1 and len({e["pid"] for e in starts}) == 1, \
        "the other node trained on alone, its worker kept"
    agent_kinds = [e["kind"] for e in read_events(run_dir) if e.get("role") == "agent"]
    assert "agent_excluded" in agent_kinds, agent_kinds
    report = check_audit(run_dir)
    assert report.ok and report.finished, report.render()
