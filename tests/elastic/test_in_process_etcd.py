"""In-process recovery on etcd-v3's lease protocol: a node that is lost or leaves does not hold the survivors' next
round for the dead-node window. Here that window is 90 s (``keep_alive_interval=30``), so a round that waited for
the lost node's lease would not form within the 45 s each test gives it:

- a node lost (SIGKILL to its agent and workers): the survivor's worker sees the node's agent stop beating, and its
  agent counts the node out of the round (its key deleted: ``agent_members_counted_out``); this job has the job's
  key (``auth_key_file``), so the beats it judged by are signed ones (:mod:`elastic_runner.recovery.channel`);
- group rank 0's node lost: the job's store goes with its worker, so there is no beat to read; the survivor's worker
  challenges that node's agent on its liveness port (:mod:`elastic_runner.recovery.liveness`), finds it gone, and its
  agent counts the node out the same way;
- a node preempted (SIGTERM to its agent): its agent stops its workers and leaves the rendezvous (its key revoked).

Either way the survivor's worker keeps its process, trains on alone, and the run's audit is clean. And a second
fault while the first loss's survivors wait parked for the next round (a node lost, a node preempted, a parked
worker killed): the last node's worker keeps its process, and the job resumes from node memory.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from elastic_runner.observe.audit import check_audit
from elastic_runner.observe.events import read_events
from elastic_runner.testing.etcd_server import EtcdServer

from ..support import continue_workers, events, job_key_file, of_agent, stop_workers_at_step, tcp_sockets

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

#: The lease's dead-node window here: 30 s between keep-alives, three missed.
WINDOW_CONF = "keep_alive_interval=30,keep_alive_max_attempt=3,last_call_timeout=1"
#: Well inside that window: a round that waited for the lease would not be formed by then.
WITHIN_S = 45.0


def _world_after(run_dir: Path, size: int, after: float, job: Any) -> None:
    deadline = time.monotonic() + WITHIN_S
    while time.monotonic() < deadline:
        if any(e["world_size"] == size and e["time"] > after for e in events(run_dir, "start")):
            return
        time.sleep(0.05)
    pytest.fail(f"no attempt at world size {size} within {WITHIN_S:g}s (the dead-node window is 90 s)\n"
                + job.logs_tail())


@pytest.mark.parametrize("how", ["lost", "rank 0 lost", "preempted"])
def test_a_node_that_is_lost_or_leaves_does_not_hold_the_next_round_for_its_lease(
        how: str, resume_config: Path, local_job: Any, etcd: EtcdServer, tmp_path: Path) -> None:
    conf = WINDOW_CONF
    if how != "preempted":
        conf += f",auth_key_file={job_key_file(tmp_path)}"
    job = local_job(config=str(resume_config), nnodes="1:2", rdzv_backend="etcd-v3", rdzv_endpoint=etcd.endpoint,
                    rdzv_conf=conf, overrides=["recovery.in_process=true"])
    job.start_agent()
    job.start_agent()
    run_dir = Path(job.run_dir)
    workers, _ = stop_workers_at_step(job, 60, count=2, timeout=120)
    # Rank 1's node: the survivor reads its agent's beat in the job's store. Rank 0's: the store and its beats go with
    # that node's worker; only its agent's liveness port (or the lease, 90 s here) tells.
    gone = next(w for w in workers if w.rank == (0 if how == "rank 0 lost" else 1))
    survivor = next(w for w in workers if w is not gone)
    gone_node = gone.agent
    left_at = time.time()
    job.kill_agent(gone_node, signal.SIGTERM if how == "preempted" else signal.SIGKILL)
    continue_workers(job, [w for w in workers if how == "preempted" or w is survivor])
    _world_after(run_dir, 1, left_at, job)
    codes = job.wait(timeout=240)
    assert codes[job.agents.index(survivor.agent)] == 0, job.logs_tail()

    survivor_starts = [e for e in events(run_dir, "start") if of_agent(e, survivor.agent)]
    assert {e["pid"] for e in survivor_starts} == {survivor.pid}, \
        "the survivor's worker kept its process\n" + job.logs_tail()
    agent_events = [e for e in read_events(run_dir) if e.get("role") == "agent"]
    counted_out = [e for e in agent_events if e["kind"] == "agent_members_counted_out"]
    if how != "preempted":
        assert counted_out and counted_out[0]["source"].endswith(f"-{survivor.agent.pid}"), agent_events[-10:]
    else:  # (its survivor may count it out first, if its beat stopped before its workers did)
        assert "has left the rendezvous" in gone_node.log_text(), gone_node.log_text()[-3000:]
    report = check_audit(run_dir)
    assert report.ok and report.finished, report.render()


def test_group_rank_0s_machine_gone_without_closing_its_connections_is_left_behind_within_seconds(
        resume_config: Path, local_job: Any, etcd: EtcdServer) -> None:
    """Rank 0's machine frozen (every process of its node SIGSTOPped: nothing closes its connections, as with a
    machine powered off or cut off; the job's store, in rank 0's worker, stops answering). torch's store client waits
    without end on a server that does not answer, so the survivor's watchdog bounds its calls (:mod:`elastic_runner.bounded_store`): it fires, the survivor keeps its
    step in node memory and its agent forms the next round without the frozen node once its lease lapses (3 s under
    launch). It took 49 s before (the watchdog blocked, the worker never parked, and its agent waited 15 s for it to
    park and 30 s for it to end on SIGTERM)."""
    from elastic_runner.testing.localjob import descendants

    job = local_job(config=str(resume_config), nnodes="1:2", rdzv_backend="etcd-v3", rdzv_endpoint=etcd.endpoint,
                    launcher="elastic-runner", overrides=["recovery.in_process=true"])
    job.start_agent()
    job.start_agent()
    run_dir = Path(job.run_dir)
    workers, _ = stop_workers_at_step(job, 60, count=2, timeout=120)
    frozen = next(w for w in workers if w.rank == 0).agent
    survivor = next(w for w in workers if w.rank != 0)
    continue_workers(job, [survivor])  # (rank 0's stays stopped, with the rest of its node)
    frozen_at = time.time()
    for pid in [frozen.pid, *descendants(frozen.pid)]:
        os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 20
    while not any(e["world_size"] == 1 and e["time"] > frozen_at for e in events(run_dir, "start")):
        assert time.monotonic() < deadline, "the survivor did not train alone within 20 s\n" + job.logs_tail()
        time.sleep(0.05)
    story = [e for e in events(run_dir, "failure") if e["time"] > frozen_at]
    assert story and "the job's store at rank 0 stopped answering" in story[0]["error"], story
    job.kill_agent(frozen)
    codes = job.wait(timeout=240)
    assert codes[job.agents.index(survivor.agent)] == 0, job.logs_tail()
    resumed = [e for e in events(run_dir, "resume") if e["time"] > frozen_at]
    assert resumed and resumed[0]["tier"] == "memory", resumed
    report = check_audit(run_dir)
    assert report.ok and report.finished, report.render()


def _handover_dir(agent: Any) -> Path:
    """``agent``'s private directory, where its workers are handed their places
    (:mod:`elastic_runner.recovery.handover`: ``parked-<local rank>`` while one waits parked for its next place)."""
    from elastic_runner.agent.adopt import PRIVATE_PREFIX

    (found,) = Path(tempfile.gettempdir()).glob(f"{PRIVATE_PREFIX}{agent.pid}-*")
    return found


@pytest.mark.parametrize("second_fault", ["node lost", "node preempted", "worker killed", "node joined",
                                          "etcd down"])
def test_a_second_fault_while_the_survivors_wait_parked_leaves_the_job_training(
        second_fault: str, resume_config: Path, local_job: Any, etcd: EtcdServer, tmp_path: Path) -> None:
    """The park cells of a second fault: of three nodes, one is lost; the two survivors' workers park for the next
    round (held there by etcd paused until the second fault), and while they wait there a second fault comes:

    - its node lost (SIGKILL to its agent and worker): neither lease (90 s) is waited for; the last node's agent counts
      both out (the second by its silent liveness port), and its worker trains on alone in its process;
    - its node preempted (SIGTERM to its agent): its agent stops its parked worker and leaves the rendezvous; the last
      node's worker trains on alone in its process, from its node memory;
    - its parked worker killed (SIGKILL to the worker alone): its agent, still there, takes a new process into the
      round of two, and the job resumes from node memory; the last node's worker keeps its process;
    - a new node joining (its agent started while they wait, and etcd let go once it asks to join): the job grows
      back to three nodes, both survivors' workers keeping their processes, and resumes from node memory;
    - etcd down (crashed while paused, started again 3 s later on its data): the two survivors meet again in a round
      of two, their workers keeping their processes, and resume from node memory.

    Either way the run's audit is clean: no sample lost or repeated."""
    conf = f"{WINDOW_CONF},auth_key_file={job_key_file(tmp_path)}"
    if second_fault == "node joined":
        # The survivors' round waits 5 s in its last call, not 1 s: the joining node, let go with etcd, has the rest
        # of its start-up to do before it asks to join.
        conf = conf.replace("last_call_timeout=1", "last_call_timeout=5")
    job = local_job(config=str(resume_config), nnodes="1:3", rdzv_backend="etcd-v3", rdzv_endpoint=etcd.endpoint,
                    rdzv_conf=conf, overrides=["recovery.in_process=true"])
    for _ in range(3):
        job.start_agent()
    run_dir = Path(job.run_dir)
    workers, _ = stop_workers_at_step(job, 60, count=3, timeout=150)
    # By node, not by rank: a worker kept through the first rounds (of 1, 2, then 3 nodes) keeps its first name.
    survivor, second, first = job.agents
    (kept,) = [w for w in workers if w.agent is survivor]
    (second_worker,) = [w for w in workers if w.agent is second]
    parked = _handover_dir(second) / "parked-0"
    first_at = time.time()
    # etcd paused from the first loss to the second fault: the survivors' workers find the loss and park on their
    # own (the job's store tells them), and the round that would place them cannot form until etcd is back, so the
    # second fault lands in the park however late a loaded machine runs this test.
    os.kill(etcd.proc.pid, signal.SIGSTOP)
    try:
        job.kill_agent(first, signal.SIGKILL)
        continue_workers(job, [w for w in workers if w.agent is not first])
        deadline = time.monotonic() + WITHIN_S
        while not parked.exists():
            assert time.monotonic() < deadline, "the second node's worker never parked\n" + job.logs_tail()
            time.sleep(0.002)
        second_at = time.time()  # the second fault, while the survivors wait parked:
        if second_fault == "worker killed":
            os.kill(second_worker.pid, signal.SIGKILL)
        elif second_fault == "node joined":
            joiner = job.start_agent()
            # Its first question to etcd waits with the survivors' (the round cannot form before), so the three
            # meet in one round however long its start-up takes on a loaded machine.
            deadline = time.monotonic() + WITHIN_S
            while not any(state == "01" and remote == etcd.client_port for state, _, remote in tcp_sockets(joiner.pid)):
                assert joiner.running() and time.monotonic() < deadline, \
                    "the joining node never asked etcd\n" + job.logs_tail()
                time.sleep(0.02)
        elif second_fault == "etcd down":
            etcd.restart(down_seconds=3, crash=True)
        else:
            job.kill_agent(second, signal.SIGKILL if second_fault == "node lost" else signal.SIGTERM)
        time.sleep(0.3)
    finally:
        os.kill(etcd.proc.pid, signal.SIGCONT)
    _world_after(run_dir, {"worker killed": 2, "node joined": 3, "etcd down": 2}.get(second_fault, 1), second_at, job)
    codes = job.wait(timeout=240)
    assert codes[job.agents.index(survivor)] == 0, job.logs_tail()

    starts = [e for e in events(run_dir, "start") if e["time"] > first_at]
    assert {e["pid"] for e in starts if of_agent(e, survivor)} == {kept.pid}, \
        "the last node's worker kept its process\n" + job.logs_tail()
    if second_fault in ("node joined", "etcd down"):
        assert {e["pid"] for e in starts if of_agent(e, second)} == {second_worker.pid}, \
            "the second node's worker kept its process\n" + job.logs_tail()
        assert codes[job.agents.index(second)] == 0, job.logs_tail()
    else:
        assert second_worker.pid not in {e["pid"] for e in starts}, \
            "the second fault struck the second node's worker while it waited parked, before any new attempt"
    if second_fault == "node joined":
        assert {e["pid"] for e in starts if of_agent(e, joiner)}, "the joining node trained\n" + job.logs_tail()
        assert {e["world_size"] for e in starts if e["time"] > second_at} == {3}, \
            "the joining node was in the survivors' round: no round of two between\n" + job.logs_tail()
        assert codes[job.agents.index(joiner)] == 0, job.logs_tail()
    if second_fault == "worker killed":
        replaced = {e["pid"] for e in starts if of_agent(e, second)}
        assert replaced, "the killed worker's agent took a new process into the round\n" + job.logs_tail()
        assert codes[job.agents.index(second)] == 0, job.logs_tail()
    elif second_fault in ("node lost", "node preempted"):
        assert {e["pid"] for e in starts} == {kept.pid}, "the last node trains alone\n" + job.logs_tail()
    if second_fault == "node lost":
        assert "does not answer on its liveness port" in survivor.log_text() or \
            "do not answer on their liveness ports" in survivor.log_text(), \
            "the second node was counted out by its silent port (as sealer, or as the node waited for)\n" + \
            job.logs_tail()
    if second_fault == "node preempted":
        assert "has left the rendezvous" in second.log_text(), second.log_text()[-3000:]
    resumed = [e for e in events(run_dir, "resume") if e["time"] > second_at]
    assert resumed and resumed[0]["tier"] == "memory", f"from node memory: {resumed}\n" + job.logs_tail()
    report = check_audit(run_dir)
    assert report.ok and report.finished, report.render()
