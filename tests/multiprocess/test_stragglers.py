"""A rank slowed down for real (its forward on a "slow device": the model sleeps on that rank while a file exists)
is named a straggler — by rank 0's line, its own event and its metric — and cleared once it is fast again; the
other rank is never named, and the job trains on untouched."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from elastic_runner.observe.audit import check_audit
from elastic_runner.observe.events import read_events
from elastic_runner.observe.report import summarize

from ..integration.test_metrics import free_port_pair, scrape, value
from ..support import write_config

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(300)]


def stragglers(run_dir: Path) -> list[dict]:
    return [e for e in read_events(run_dir) if e["kind"] == "straggler"]


def test_a_slow_rank_is_named_with_its_node_and_cleared_when_it_is_fast_again(tmp_path: Path,
                                                                              local_job) -> None:  # noqa: ANN001
    port, slow_file = free_port_pair(), tmp_path / "slow"
    slow_file.touch()
    # A 3x ratio for most of 2 s: a step here takes a few milliseconds, and on a loaded 2-core machine the scheduler
    # alone can make one rank's steps of a second slower by half or more; the slow rank's forward takes 30 ms more.
    config = write_config(tmp_path / "s.yaml", train={"epochs": None, "max_steps": 1200, "eval_every_steps": 0},
                          model={"name": "tests.broken_components:slow_on_one_rank",
                                 "params": {"rank": 1, "while_file": str(slow_file), "delay_s": 0.03}},
                          snapshot={"every_steps": 500}, logging={"every_steps": 10}, metrics={"port": port},
                          recovery={"straggler_ratio": 3.0, "straggler_window_seconds": 2.0})
    job = local_job(config=str(config), nnodes="1:1", nproc_per_node=2)
    job.start_agent()
    slow = next(w for w in job.wait_for_workers(2, timeout=90) if w.rank == 1)
    run_dir = Path(job.run_dir)
    deadline = time.monotonic() + 150
    while not stragglers(run_dir):
        assert time.monotonic() < deadline and job.running_agents(), f"nobody named\n{job.logs_tail()}"
        time.sleep(0.2)
    metrics = scrape(port + 1)  # rank 1 serves metrics.port + its local rank
    assert value(metrics, "elastic_runner_straggler") == 1.0
    assert value(metrics, "elastic_runner_step_local_ratio") >= 3.0
    assert value(scrape(port), "elastic_runner_straggler") == 0.0
    slow_file.unlink()  # its device is fast again
    assert job.wait(timeout=240) == [0], job.logs_tail()

    events = stragglers(run_dir)
    named = [e for e in events if e["status"] == "named"]
    assert [(e["rank"], e["node"], e["pid"]) for e in named] == [(1, 0, slow.pid)], events
    assert named[0]["ratio"] >= 3.0 and named[0]["seconds"] >= 1.0 and named[0]["steps"] > 0 and named[0]["host"]
    cleared = [e for e in events if e["status"] == "cleared"]
    assert [e["rank"] for e in cleared] == [1] and cleared[0]["step"] > named[0]["step"], events
    log = job.agents[0].log_text()
    assert "rank 1 (node 0) is a straggler" in log and "rank 1 (node 0) is no straggler any more" in log, log[-3000:]
    assert f"stragglers: rank 1 (node 0, host {named[0]['host']}) named at step {named[0]['step']}" in \
        summarize(str(run_dir)).text(), "elastic-runner report lists it"
    report = check_audit(run_dir)
    assert report.ok and report.final_step == 1200, report.render()
