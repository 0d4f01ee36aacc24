"""Spares: an agent started beyond ``--nnodes``' maximum waits, warm, for a seat, and takes a lost node's place in the
round that replaces it. The world size never changes, so the run is the uninterrupted run at that world size, bit
for bit, with every sample seen once."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from elastic_runner.observe.audit import check_audit
from elastic_runner.observe.events import read_events
from elastic_runner.testing.localjob import descendants

from ..support import (assert_bitwise_equal, continue_workers, events, exported_model, of_agent, stop_workers_at_step,
                       wait_until_blocked)

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _agent_events(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_events(run_dir) if e["kind"] == f"agent_{kind}"]


def _wait_until_spare(job: Any, spare: Any, run_dir: Path, timeout: float = 90) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        waiting = [e for e in _agent_events(run_dir, "spare_waiting") if e["source"].endswith(f"-{spare.pid}")]
        if waiting:
            return waiting[0]
        assert spare.running(), spare.log_text()[-3000:]
        time.sleep(0.05)
    pytest.fail("the third agent never said it waits as a spare\n" + job.logs_tail())


def _standby_pids(agent: Any) -> list[int]:
    """The standbys under ``agent``'s zygote: processes named as a standby names itself."""
    return [pid for pid in descendants(agent.pid) if _comm(pid) == "er-standby"]


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


@pytest.mark.parametrize("backend", ["c10d", "etcd-v3"])
def test_a_spare_takes_a_lost_nodes_place_at_the_same_world_size_and_the_run_is_the_uninterrupted_one(
        backend: str, resume_config: Path, local_job: Any, reference_model: Any, tmp_path: Path,
        request: pytest.FixtureRequest) -> None:
    # The first round waits up to 10 s for the second agent (a loaded machine starts it more than launch's 1 s after
    # the first, and 19 steps at world size 1 are not the reference's run); a round completes at once at the maximum.
    rdzv = {"rdzv_backend": "etcd-v3", "rdzv_endpoint": request.getfixturevalue("etcd").endpoint} \
        if backend == "etcd-v3" else {}
    job = local_job(config=str(resume_config), nnodes="1:2", launcher="elastic-runner",
                    rdzv_conf="last_call_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=3", **rdzv)
    first, second = job.start_agent(), job.start_agent()
    run_dir = Path(job.run_dir)
    workers, _ = stop_workers_at_step(job, 90, count=2, timeout=120)

    # A spare started with another configuration is refused before it waits, and costs the job nothing.
    job.overrides = [*job.overrides, "optim.lr=0.2"]
    wrong = job.start_agent()
    job.overrides = job.overrides[:-1]
    assert wrong.proc.wait(timeout=90) == 2, wrong.log_text()[-3000:]
    assert "its configuration differs from the running job's (optim.lr;" in wrong.log_text(), wrong.log_text()[-3000:]
    assert not [e for e in _agent_events(run_dir, "spare_waiting") if e["source"].endswith(f"-{wrong.pid}")]

    spare = job.start_agent()  # the round is full: no seat for it
    waiting = _wait_until_spare(job, spare, run_dir)
    assert waiting["max_nodes"] == 2, waiting
    assert not job.workers(spare), "a spare starts no worker while it waits"
    deadline = time.monotonic() + 60  # ... but its standby builds the workload the worker will train meanwhile
    while not (standbys := _standby_pids(spare)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(standbys) == 1, f"one standby for the spare's one worker: {standbys}\n{spare.log_text()[-3000:]}"

    lost = second if backend == "c10d" else first  # (c10d: the first agent hosts the rendezvous' store)
    lost_at = time.time()
    job.kill_agent(lost)
    continue_workers(job, [w for w in workers if w.agent is not lost])
    codes = job.wait(timeout=240)
    assert [codes[job.agents.index(a)] for a in job.agents if a not in (lost, wrong)] == [0, 0], job.logs_tail()

    after = [e for e in events(run_dir, "start") if e["time"] > lost_at]
    assert after and {e["world_size"] for e in after} == {2}, \
        f"the world size stayed 2 after the loss: {[(e['rank'], e['world_size']) for e in after]}"
    assert any(of_agent(e, spare) for e in after), \
        f"the spare's worker took the lost node's place: {[e['agent'] for e in after]}"
    seated = [e for e in _agent_events(run_dir, "spare_seated") if e["source"].endswith(f"-{spare.pid}")]
    assert seated and seated[0]["workers"] == 1 and seated[0]["built"] == 1, \
        f"the spare's worker had its workload built by the seat: {seated}\n{spare.log_text()[-3000:]}"
    assert any(e["pid"] in standbys for e in after), "the standby itself became the spare's worker"
    taken = [e for e in _agent_events(run_dir, "rendezvous") if e["source"].endswith(f"-{spare.pid}")]
    assert taken and taken[0]["world_size"] == 2 and taken[0]["spare_s"] > 0, taken
    resumed = [e for e in events(run_dir, "resume") if e["time"] > lost_at]
    assert resumed and all(e["tier"] == "memory" and e["steps_recomputed"] == 0 for e in resumed), \
        f"the spare's worker took the state from the survivor's node memory, losing no step: {resumed}"
    report = check_audit(run_dir)
    assert report.ok and report.finished, report.render()
    assert_bitwise_equal(exported_model(run_dir, tmp_path), reference_model)


def test_a_spare_takes_the_place_of_a_node_lost_while_its_peer_waits_for_it_inside_a_collective(
        resume_config: Path, local_job: Any, reference_model: Any, tmp_path: Path) -> None:
    """The survivor's worker blocked inside the step's collective waiting for the other node's worker, stopped, when
    that node is lost with a spare waiting: the collective fails under the survivor (its peer's connections closed,
    not its watchdog), which keeps its process and parks, and the spare takes the lost node's seat at the same world
    size, from the survivor's node memory, so the run is the uninterrupted one."""
    job = local_job(config=str(resume_config), nnodes="1:2", launcher="elastic-runner",
                    overrides=["dist.heartbeat_seconds=20"],
                    rdzv_conf="last_call_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=3")
    first, second = job.start_agent(), job.start_agent()
    run_dir = Path(job.run_dir)
    workers, _ = stop_workers_at_step(job, 90, count=2, timeout=120)
    spare = job.start_agent()
    _wait_until_spare(job, spare, run_dir)
    lost = second  # (c10d: the first agent hosts the rendezvous' store)
    survivor = next(w for w in workers if w.agent is not lost)
    continue_workers(job, [survivor])
    wait_until_blocked(survivor.pid)
    lost_at = time.time()
    job.kill_agent(lost)
    codes = job.wait(timeout=240)
    assert [codes[job.agents.index(a)] for a in (first, spare)] == [0, 0], job.logs_tail()

    after = [e for e in events(run_dir, "start") if e["time"] > lost_at]
    assert after and {e["world_size"] for e in after} == {2}, [(e["rank"], e["world_size"]) for e in after]
    assert any(of_agent(e, spare) for e in after), "the spare's worker took the lost node's place"
    assert {e["pid"] for e in events(run_dir, "start") if of_agent(e, first)} == {survivor.pid}, \
        "the survivor kept its process\n" + job.logs_tail()
    broke = [e for e in events(run_dir, "failure") if e["pid"] == survivor.pid and e["time"] > lost_at]
    assert len(broke) == 1 and broke[0].get("detected_by") != "watchdog", \
        f"the collective failed under the survivor, not its watchdog: {broke}"
    resumed = [e for e in events(run_dir, "resume") if e["time"] > lost_at]
    assert resumed and all(e["tier"] == "memory" and e["steps_recomputed"] <= 1 for e in resumed), resumed
    report = check_audit(run_dir)
    assert report.ok and report.finished, report.render()
    assert_bitwise_equal(exported_model(run_dir, tmp_path), reference_model)
