"""In-process recovery (``recovery.in_process``): a killed worker is started again alone by its agent, the other
workers keep their process and rebuild their process group with it, and the run is the uninterrupted run's."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from elastic_runner.observe.audit import check_audit
from elastic_runner.observe.events import read_events
from elastic_runner.testing.localjob import alive, descendants

from ..support import (
    assert_bitwise_equal,
    continue_workers,
    events,
    exported_model,
    job_key_file,
    job_step,
    kill_worker_at_step,
    of_agent,
    run_uninterrupted,
    start_agent_while_paused,
    stop_workers_at_step,
    tcp_sockets,
    wait_for_world,
    wait_until_blocked,
    write_config,
)
from .conftest import RESUME_SECTIONS

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _started(local_job: Any, resume_config: Path, launcher: str = "elastic-runner", *overrides: str,
             key_file: Path | None = None, etcd: Any = None, nnodes: str = "2:2") -> Any:
    """Two agents of one worker each, with in-process recovery (and the job's key in ``key_file``, where given), on
    torchrun's c10d rendezvous or on ``etcd`` (an :class:`~elastic_runner.testing.etcd.EtcdServer`) where given."""
    conf = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"
    backend = {} if etcd is None else {"rdzv_backend": "etcd-v3", "rdzv_endpoint": etcd.endpoint}
    job = local_job(config=str(resume_config), nnodes=nnodes, launcher=launcher,
                    overrides=["recovery.in_process=true", *overrides],
                    rdzv_conf=conf + (f",auth_key_file={key_file}" if key_file else ""), **backend)
    job.start_agent()
    job.start_agent()
    return job


def _ends_as_the_uninterrupted_run(job: Any, reference_model: Any, tmp_path: Path) -> Path:
    """The job finishes, its audit is clean and its model is the uninterrupted run's bit for bit; its run.dir."""
    assert job.wait(timeout=240) == [0, 0], job.logs_tail()
    run_dir = Path(job.run_dir)
    report = check_audit(run_dir)
    assert report.ok and report.finished, report.render()
    assert_bitwise_equal(exported_model(run_dir, tmp_path), reference_model)
    return run_dir


def _agent_events(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_events(run_dir) if e["kind"] == f"agent_{kind}"]


def _stopped_with_standbys_ready(job: Any, step: int, count: int = 2,
                                 at_least: float = 0.0) -> tuple[list[Any], dict[int, int]]:
    """Stop the job's workers at ``step`` (for ``at_least`` seconds) and wait until every agent's standby is ready;
    the stopped workers and each agent's standby pid (by agent pid). The stop may last longer than
    dist.heartbeat_seconds: the watchdogs do not count a pause of their own process against their peers."""
    workers, _ = stop_workers_at_step(job, step, count=count)
    stopped = time.monotonic()
    deadline = stopped + 60
    while time.monotonic() < deadline:
        ready = {int(e["source"].rsplit("-", 1)[1]): e["pid"] for e in _agent_events(Path(job.run_dir), "standby_ready")}
        if len(ready) == len(job.agents):
            assert all(e["built"] for e in _agent_events(Path(job.run_dir), "standby_ready"))
            time.sleep(max(0.0, stopped + at_least - time.monotonic()))
            return workers, ready
        time.sleep(0.05)
    pytest.fail("the agents' standbys were not ready within 60 s\n" + job.logs_tail())


def _kill(job: Any, workers: list[Any], rank: int) -> Any:
    victim = next(w for w in workers if w.rank == rank)
    job.signal_worker(victim, signal.SIGKILL)
    continue_workers(job, [w for w in workers if w is not victim])
    return victim


@pytest.mark.parametrize("launcher", ["elastic-runner", "torchrun"])
def test_a_killed_worker_is_replaced_alone_its_peer_keeps_its_process_and_the_run_ends_bitwise_identical(
        launcher: str, resume_config: Path, reference_model: Any, local_job: Any, tmp_path: Path) -> None:
    # The job is stopped longer than its heartbeat: a watchdog that counted the pause would restart every worker.
    # Under plain torchrun the job has its key: the announcement, generations and handles the survivor and the
    # replacement rebuild their group by are signed ones (elastic_runner.recovery.channel).
    key_file = job_key_file(tmp_path) if launcher == "torchrun" else None
    job = _started(local_job, resume_config, launcher, "dist.heartbeat_seconds=2", key_file=key_file)
    workers, standbys = _stopped_with_standbys_ready(job, 130, at_least=3.0)
    victim = _kill(job, workers, rank=1)
    run_dir = _ends_as_the_uninterrupted_run(job, reference_model, tmp_path)

    starts = events(run_dir, "start")
    assert len({e["pid"] for e in starts if e["rank"] == 0}) == 1, "rank 0 kept its process\n" + job.logs_tail()
    pids_of_rank_1 = [e["pid"] for e in starts if e["rank"] == 1]
    assert victim.pid in pids_of_rank_1 and len(set(pids_of_rank_1)) == 2, "rank 1 was started again, once"
    assert len({e["generation"] for e in starts}) == 2, "one recovery: a second attempt"
    rounds = _agent_events(run_dir, "rendezvous")
    assert len(rounds) == 2, f"one rendezvous round per agent, none for the recovery: {rounds}"
    replaced = _agent_events(run_dir, "worker_replaced")
    assert [(e["rank"], e["pid"], e["standby"]) for e in replaced] == [(1, victim.pid, True)], replaced
    assert replaced[0]["new_pid"] == standbys[victim.agent.pid], "the node's standby took the place"
    assert standbys[victim.agent.pid] in pids_of_rank_1, "and trained as rank 1"
    assert sum("→ recovered in process in " in agent.log_text() for agent in job.agents) == 1, job.logs_tail()
    resume = [e for e in events(run_dir, "resume") if e["generation"] > 1]
    assert resume and resume[0]["tier"] == "memory" and resume[0]["steps_recomputed"] <= 1, resume


def test_a_worker_whose_device_fails_is_never_kept_a_new_process_takes_its_place_and_the_run_ends_bitwise(
        reference_model: Any, local_job: Any, tmp_path: Path) -> None:
    """A sticky CUDA error (simulated: rank 1's model raises what NCCL raises after an illegal memory access) leaves
    the process's CUDA context unusable: that process exits and its agent starts a new one, however much the error
    reads like a peer's; rank 0, whose peer failed, keeps its process."""
    model = {"name": "tests.broken_components:fails_on_its_device_once",
             "params": {"channels": 16, "hidden": 64, "rank": 1, "at_forward": 130,
                        "once_file": str(tmp_path / "failed-once")}}
    config = write_config(tmp_path / "sticky.yaml", **RESUME_SECTIONS, model=model)
    job = _started(local_job, config, "elastic-runner", "dist.heartbeat_seconds=2")
    run_dir = _ends_as_the_uninterrupted_run(job, reference_model, tmp_path)
    starts = events(run_dir, "start")
    assert len({e["pid"] for e in starts if e["rank"] == 0}) == 1, "rank 0 kept its process\n" + job.logs_tail()
    assert len({e["pid"] for e in starts if e["rank"] == 1}) == 2, "rank 1's process was replaced"
    logs = "\n".join(agent.log_text() for agent in job.agents)
    assert "this process's device is unusable (Cuda failure 'an illegal memory access was encountered')" in logs, \
        job.logs_tail()


def test_a_survivors_dataloader_workers_live_through_the_recovery_and_one_that_dies_ends_in_a_recovered_job(
        resume_config: Path, reference_model: Any, local_job: Any, tmp_path: Path) -> None:
    # A collate function takes the DataLoader path (in-memory tensors skip it): two loader processes per worker.
    job = _started(local_job, resume_config, "elastic-runner", "dist.heartbeat_seconds=2", "data.num_workers=2",
                   "data.collate=torch.utils.data:default_collate")
    workers, _ = _stopped_with_standbys_ready(job, 130, at_least=3.0)
    survivor = next(w for w in workers if w.rank == 0)
    loaders = descendants(survivor.pid)
    assert len(loaders) == 2, f"expected the survivor's 2 loader processes, found {loaders}"
    _kill(job, workers, rank=1)
    # Several epochs later (an epoch is a few dozen steps): the same loader processes serve the survivor.
    later, _ = stop_workers_at_step(job, 260, count=2, timeout=120)
    assert survivor.pid in {w.pid for w in later}, "rank 0 kept its process\n" + job.logs_tail()
    assert sorted(descendants(survivor.pid)) == sorted(loaders), "its DataLoader workers lived through the recovery and the epochs"
    # One of them dies: the survivor's step fails (torch reports the loader's death at once) and its agent replaces
    # it, today's path for that rank; the other rank keeps its process.
    os.kill(loaders[0], signal.SIGKILL)
    continue_workers(job, later)
    run_dir = _ends_as_the_uninterrupted_run(job, reference_model, tmp_path)
    starts = events(run_dir, "start")
    assert len({e["pid"] for e in starts if e["rank"] == 0}) == 2, "rank 0 started anew once, for its dead loader"
    assert len({e["generation"] for e in starts}) == 3, "two recoveries\n" + job.logs_tail()


@pytest.fixture(scope="module")
def reference_2x2(resume_config: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The uninterrupted run of ``resume_config`` on two agents of two workers each (world size 4)."""
    where = tmp_path_factory.mktemp("uninterrupted-2x2")
    return exported_model(run_uninterrupted(resume_config, where / "run", agents=2, nproc=2, timeout=240), where)


@pytest.mark.parametrize("standby", [False, True], ids=["new-process", "standby"])
def test_at_four_ranks_on_two_nodes_a_killed_worker_leaves_its_node_sibling_and_the_other_node_running_bitwise(
        standby: bool, resume_config: Path, reference_2x2: Any, local_job: Any, tmp_path: Path) -> None:
    # Two workers per node: the victim's sibling shares its agent's process context, which must keep it; the sums
    # run over four ranks, so a changed order would show in the bits. The standby was built with local rank 0's
    # environment and takes local rank 1's place; without it the replacement is a new process (the fork path).
    job = local_job(config=str(resume_config), nnodes="2:2", nproc_per_node=2, launcher="elastic-runner",
                    overrides=["recovery.in_process=true", f"recovery.standby={str(standby).lower()}",
                               # the fork path also recreates the group (auto reconfigures it on torch 2.14)
                               f"recovery.regroup={'auto' if standby else 'recreate'}"])
    job.start_agent()
    job.start_agent()
    if standby:
        workers, standbys = _stopped_with_standbys_ready(job, 130, count=4)
        victim = _kill(job, workers, rank=3)
    else:
        victim = kill_worker_at_step(job, 130, rank=3, count=4)
    run_dir = _ends_as_the_uninterrupted_run(job, reference_2x2, tmp_path)

    starts = events(run_dir, "start")
    assert all(len({e["pid"] for e in starts if e["rank"] == rank}) == 1 for rank in (0, 1, 2)), \
        "ranks 0-2 kept their processes (rank 2 beside the victim)\n" + job.logs_tail()
    assert {e["pid"] for e in starts if e["rank"] == 3} - {victim.pid}, "rank 3 was started again"
    replaced = _agent_events(run_dir, "worker_replaced")
    assert [(e["rank"], e["standby"]) for e in replaced] == [(3, standby)]
    if standby:
        assert replaced[0]["new_pid"] == standbys[victim.agent.pid], "the node's standby became rank 3"
        assert {e["local_rank"] for e in starts if e["pid"] == replaced[0]["new_pid"]} == {1}
    else:
        assert not _agent_events(run_dir, "standby_started"), "recovery.standby: false"
    assert len(_agent_events(run_dir, "rendezvous")) == 2, "no rendezvous round for the recovery"


def test_a_standby_that_died_leaves_the_place_to_a_new_process(
        resume_config: Path, reference_model: Any, local_job: Any, tmp_path: Path) -> None:
    job = _started(local_job, resume_config, "elastic-runner")
    workers, standbys = _stopped_with_standbys_ready(job, 130)
    node = next(w for w in workers if w.rank == 1).agent
    os.kill(standbys[node.pid], signal.SIGKILL)  # as the kernel's OOM killer would
    victim = _kill(job, workers, rank=1)
    run_dir = _ends_as_the_uninterrupted_run(job, reference_model, tmp_path)

    replaced = _agent_events(run_dir, "worker_replaced")
    assert [(e["pid"], e["standby"]) for e in replaced] == [(victim.pid, False)], replaced
    assert replaced[0]["new_pid"] != standbys[node.pid]
    lost = [e for e in _agent_events(run_dir, "standby_lost") if e["source"].endswith(f"-{node.pid}")]
    assert [e["exitcode"] for e in lost] == [-signal.SIGKILL], "the agent saw it go (and starts another: unit-tested)"
    starts = events(run_dir, "start")
    assert len({e["pid"] for e in starts if e["rank"] == 0}) == 1, "rank 0 kept its process"


def _gated_job(local_job: Any, tmp_path: Path, etcd: Any = None, nnodes: str = "2:2",
               heartbeat_seconds: float = 2) -> tuple[Any, Path]:
    """Two nodes of one worker, whose model's build waits while the returned gate file exists; a survivor waits
    ``heartbeat_seconds`` in the regroup for a failed peer's replacement."""
    gate = tmp_path / "gate"
    model = {"name": "tests.broken_components:built_while_no_gate",
             "params": {"channels": 16, "hidden": 64, "gate_file": str(gate)}}
    config = write_config(tmp_path / "gated.yaml", **RESUME_SECTIONS, model=model)
    return _started(local_job, config, "elastic-runner", f"dist.heartbeat_seconds={heartbeat_seconds:g}", etcd=etcd,
                    nnodes=nnodes), gate


def _rank_1_replaced_while_its_next_standby_builds(job: Any, gate: Path, rank: int = 1,
                                                  count: int = 2) -> tuple[Any, list[Any], int, int]:
    """Rank 1's worker (or ``rank``'s, of ``count``) killed (its node's ready standby takes the place), and the job
    held a few steps later while the standby its agent started next still builds (held at ``gate``). The victim, the
    held workers, the first standby's and the building one's pids."""
    run_dir = Path(job.run_dir)
    workers, standbys = _stopped_with_standbys_ready(job, 130, count=count)
    node = next(w for w in workers if w.rank == rank).agent
    gate.touch()  # every build from now on waits: the next standby's
    first = _kill(job, workers, rank=rank)
    # Held a few steps after the recovery while the agent starts the next standby (0.5 s after the place was
    # taken): free-running, a fast machine could finish the run first.
    workers, _ = stop_workers_at_step(job, job_step(job) + 3, count=count, replacing=[first])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        started = [e["pid"] for e in _agent_events(run_dir, "standby_started")
                   if e["source"].endswith(f"-{node.pid}") and e["pid"] != standbys[node.pid]]
        if started:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the node started no second standby within 60 s\n" + job.logs_tail())
    building = started[0]
    assert not [e for e in _agent_events(run_dir, "standby_ready") if e["pid"] == building], \
        "the second standby is still building (held at the gate)"
    return first, workers, standbys[node.pid], building


def _rank_1_killed_while_its_next_standby_builds(job: Any, gate: Path, rank: int = 1,
                                                count: int = 2) -> tuple[Any, Any, int, int, Any, float]:
    """Rank 1's worker (or ``rank``'s, of ``count``) killed (its node's ready standby takes the place), and killed
    again while the standby its agent started next still builds (held at ``gate``): the place goes to that one, and
    rank 0's worker, once it has kept its step in node memory, waits for it in the regroup. The two victims, the
    first standby's and the held one's pids, rank 0's worker, and the step it kept."""
    run_dir = Path(job.run_dir)
    first, workers, ready, building = _rank_1_replaced_while_its_next_standby_builds(job, gate, rank, count)
    second = _kill(job, workers, rank=rank)
    killed_at = time.time()
    survivor = next(w for w in workers if w.rank == 0)
    deadline = time.monotonic() + 30
    while not (kept := [e for e in events(run_dir, "kept_in_memory") if e["pid"] == survivor.pid
                        and e["reason"] == "failure" and e["time"] > killed_at]):
        assert time.monotonic() < deadline, "rank 0 did not keep its step within 30 s\n" + job.logs_tail()
        time.sleep(0.05)
    time.sleep(0.5)  # (from its step kept to its wait for the place's new holder, which still builds)
    return first, second, ready, building, survivor, kept[0]["step"]


@pytest.mark.slow
def test_a_worker_killed_while_its_nodes_standby_still_builds_gets_that_standby_once_built_and_ends_bitwise(
        reference_model: Any, local_job: Any, tmp_path: Path) -> None:
    """The standby warm-up cell: rank 1's worker is killed, its node's standby takes the place and the agent starts
    another, whose build the test holds (its model waits on a gate file); rank 1's worker is killed again while that
    one still builds. The agent hands it the place anyway, the survivor waits, and once it is built it trains as
    rank 1: no new process, no restart of the others, the run the uninterrupted one."""
    job, gate = _gated_job(local_job, tmp_path)
    run_dir = Path(job.run_dir)
    try:
        first, second, ready, building, _, _ = _rank_1_killed_while_its_next_standby_builds(job, gate)
    finally:
        gate.unlink(missing_ok=True)
    _ends_as_the_uninterrupted_run(job, reference_model, tmp_path)

    replaced = _agent_events(run_dir, "worker_replaced")
    assert [(e["pid"], e["new_pid"], e["standby"]) for e in replaced] == [
        (first.pid, ready, True), (second.pid, building, True)], replaced
    assert not [e for e in _agent_events(run_dir, "standby_ready") if e["pid"] == building], \
        "it was given the place before it was built"
    starts = events(run_dir, "start")
    assert len({e["pid"] for e in starts if e["rank"] == 0}) == 1, "rank 0 kept its process\n" + job.logs_tail()
    assert building in [e["pid"] for e in starts if e["rank"] == 1], "the held standby trained as rank 1"
    assert sum(agent.log_text().count("→ recovered in process in ") for agent in job.agents) == 2, job.logs_tail()


def _with_a_new_node_in_its_place_ends_as_the_uninterrupted_run(job: Any, gone: Any, reference_model: Any,
                                                                 tmp_path: Path) -> None:
    """A new node takes ``gone``'s place (nnodes 2:2); every other agent ends well, the audit is clean and the model
    is the uninterrupted run's bit for bit."""
    job.start_agent()
    codes = job.wait(timeout=240)
    assert [c for a, c in zip(job.agents, codes) if a is not gone] == [0, 0], f"{codes}\n{job.logs_tail()}"
    report = check_audit(Path(job.run_dir))
    assert report.ok and report.finished, report.render()
    assert_bitwise_equal(exported_model(Path(job.run_dir), tmp_path), reference_model)


@pytest.mark.slow
def test_a_survivor_killed_while_it_waits_in_the_regroup_ends_in_a_recovered_job_bitwise(
        reference_model: Any, local_job: Any, tmp_path: Path) -> None:
    """The regroup cell of a second fault: rank 1's place is held by a standby that still builds (as above), and
    rank 0's worker, waiting for it in the regroup with its step kept in node memory, is killed too. Rank 0's worker
    hosts the job's store, so no group can be rebuilt around the place: every worker restarts (the held standby
    never trains), the job resumes from node memory at the step the survivor kept, and the run is the uninterrupted
    one."""
    job, gate = _gated_job(local_job, tmp_path)
    run_dir = Path(job.run_dir)
    try:
        _, _, _, building, survivor, kept = _rank_1_killed_while_its_next_standby_builds(job, gate)
        killed_at = time.time()
        job.signal_worker(survivor, signal.SIGKILL)  # the second fault, while it waits for the held standby
        time.sleep(1.0)
    finally:
        gate.unlink(missing_ok=True)
    _ends_as_the_uninterrupted_run(job, reference_model, tmp_path)

    after = [e for e in events(run_dir, "start") if e["time"] > killed_at]
    assert sorted(e["rank"] for e in after) == [0, 1], "every worker restarted, once\n" + job.logs_tail()
    assert not {survivor.pid, building} & {e["pid"] for e in after}, "new processes, not the killed or the held one"
    resumed = [e for e in events(run_dir, "resume") if e["time"] > killed_at]
    assert [(e["tier"], e["step"]) for e in resumed] == [("memory", kept)], \
        "resumed from node memory at the step the survivor kept, none lost\n" + job.logs_tail()
    assert "rank 0's worker hosts the job's store); every worker restarts" in "".join(
        agent.log_text() for agent in job.agents), job.logs_tail()


@pytest.mark.slow
def test_of_three_nodes_a_survivor_that_does_not_host_the_store_killed_in_the_regroup_is_replaced_too(
        resume_config: Path, local_job: Any, tmp_path: Path) -> None:
    """The regroup cell of a second fault on three nodes: rank 2's place is held by a standby that still builds (as
    above), and rank 1's worker, waiting for it in the regroup with its step kept in node memory, is killed too. Rank 1
    does not host the job's store (rank 0's worker does), so the regroup goes on around both places: rank 1's agent
    gives its place to its node's ready standby, rank 0's worker keeps its process, the held standby trains once
    built, no rendezvous round, and the run is the uninterrupted one."""
    job, gate = _gated_job(local_job, tmp_path, nnodes="3:3")
    job.start_agent()  # the third node
    run_dir = Path(job.run_dir)
    try:
        _, _, _, building, _, _ = _rank_1_killed_while_its_next_standby_builds(job, gate, rank=2, count=3)
        waiting = next(w for w in job.workers() if w.rank == 1)
        killed_at = time.time()
        job.signal_worker(waiting, signal.SIGKILL)  # the second fault, while it waits for the held standby
        time.sleep(1.0)
    finally:
        gate.unlink(missing_ok=True)
    assert job.wait(timeout=240) == [0, 0, 0], job.logs_tail()
    report = check_audit(run_dir)
    assert report.ok and report.finished, report.render()
    # (Against an uninterrupted run at three: the two-node reference's model is not the three-node run's.)
    uninterrupted = run_uninterrupted(resume_config, tmp_path / "uninterrupted" / "run", agents=3, timeout=240)
    assert_bitwise_equal(exported_model(run_dir, tmp_path), exported_model(uninterrupted, tmp_path))

    starts = events(run_dir, "start")
    assert len({e["pid"] for e in starts if e["rank"] == 0}) == 1, "rank 0 kept its process\n" + job.logs_tail()
    after = [e for e in starts if e["time"] > killed_at]
    assert building in {e["pid"] for e in starts if e["rank"] == 2}, "the held standby trained as rank 2"
    assert waiting.pid not in {e["pid"] for e in after} and 1 in {e["rank"] for e in after}, \
        "rank 1 in a new process\n" + job.logs_tail()
    replaced = [e for e in _agent_events(run_dir, "worker_replaced") if e["time"] > killed_at - 1.0]
    assert waiting.pid in {e["pid"] for e in replaced}, replaced
    assert len(_agent_events(run_dir, "rendezvous")) == 3, "one round per agent, none for the recoveries"
    resumed = [e for e in events(run_dir, "resume") if e["time"] > killed_at]
    assert resumed and all(e["tier"] == "memory" for e in resumed), resumed


@pytest.mark.slow
def test_a_replacement_killed_before_it_joins_is_replaced_again_into_the_same_regroup_and_the_run_ends_bitwise(
        reference_model: Any, local_job: Any, tmp_path: Path) -> None:
    """The first branch of "a replacement killed while it joins", apart: the place of rank 1 is held by a standby
    that still builds (as above), and that standby is killed before it reached the group, while rank 0's worker
    waits for it in the regroup (``dist.heartbeat_seconds`` 20: long enough for the next one). Rank 1's agent
    replaces it again, for the same generation (the killed one never said it joined one), and the survivor's wait
    ends with that one: rank 0's worker keeps its process through all three replacements, the killed standby never
    trains, no rendezvous round, and the run is the uninterrupted one. (The other branch, a replacement killed once it
    is in the group, is an ordinary peer's failure: the survivor rebuilds again, the first test of this file.)"""
    job, gate = _gated_job(local_job, tmp_path, heartbeat_seconds=20)
    run_dir = Path(job.run_dir)
    try:
        first, second, ready, building, survivor, _ = _rank_1_killed_while_its_next_standby_builds(job, gate)
        killed_at = time.time()
        os.kill(building, signal.SIGKILL)  # given the place, still building: it has not reached the group
    finally:
        gate.unlink(missing_ok=True)
    _ends_as_the_uninterrupted_run(job, reference_model, tmp_path)

    replaced = _agent_events(run_dir, "worker_replaced")
    assert [(e["pid"], e["new_pid"]) for e in replaced[:2]] == [(first.pid, ready), (second.pid, building)], replaced
    assert [e["pid"] for e in replaced[2:]] == [building], f"the killed standby replaced once: {replaced}"
    third = replaced[2]["new_pid"]
    starts = events(run_dir, "start")
    assert {e["pid"] for e in starts if e["rank"] == 0} == {survivor.pid}, "rank 0 kept its process\n" + job.logs_tail()
    assert building not in {e["pid"] for e in starts}, "the killed standby never trained"
    assert third in {e["pid"] for e in starts if e["rank"] == 1 and e["time"] > killed_at}, \
        "its replacement trained as rank 1\n" + job.logs_tail()
    assert not _agent_events(run_dir, "restart"), "no rendezvous round, no worker restarted\n" + job.logs_tail()
    # Two recoveries, as the survivor lived them: the killed standby's generation was completed by its successor.
    assert sum(agent.log_text().count("→ recovered in process in ") for agent in job.agents) == 2, job.logs_tail()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["preempted", "lost", "agent killed"])
def test_a_node_that_goes_while_a_survivor_waits_in_the_regroup_ends_in_a_recovered_job_bitwise(
        how: str, reference_model: Any, local_job: Any, etcd: Any, tmp_path: Path) -> None:
    """The regroup cells of a node that goes: rank 0's worker waits in the regroup for rank 1's place, held by a
    standby that still builds (as above), when rank 1's node goes, on etcd-v3 as in production: preempted (SIGTERM to
    its agent, which stops its workers, the held standby among them, and leaves the rendezvous), lost (its agent and
    every process of it SIGKILLed: rank 0's worker sees the agent's beat stand still), or its agent killed alone (its
    processes follow it). Rank 0's worker, whose awaited peer will never come, parks in its process, and with a new
    node in the gone one's place the job goes on from rank 0's node memory at the step it kept: the run is the
    uninterrupted one."""
    job, gate = _gated_job(local_job, tmp_path, etcd=etcd)
    run_dir = Path(job.run_dir)
    try:
        _, second, _, building, survivor, kept = _rank_1_killed_while_its_next_standby_builds(job, gate)
        gone = second.agent
        preempted_at = time.time()
        job.kill_agent(gone, signal.SIGTERM if how == "preempted" else signal.SIGKILL, with_workers=how == "lost")
        gone.proc.wait(timeout=60)
    finally:
        gate.unlink(missing_ok=True)
    _with_a_new_node_in_its_place_ends_as_the_uninterrupted_run(job, gone, reference_model, tmp_path)

    if how == "preempted":
        assert "has left the rendezvous" in gone.log_text(), gone.log_text()[-3000:]
    assert {e["pid"] for e in events(run_dir, "start") if of_agent(e, survivor.agent)} == {survivor.pid}, \
        "the survivor's worker kept its process, through the preemption too\n" + job.logs_tail()
    assert building not in {e["pid"] for e in events(run_dir, "start")}, "the held standby never trained"
    resumed = [e for e in events(run_dir, "resume") if e["time"] > preempted_at]
    assert [(e["tier"], e["step"]) for e in resumed] == [("memory", kept)], \
        "the job went on from node memory at the step the survivor kept, none lost\n" + job.logs_tail()


@pytest.mark.slow
@pytest.mark.parametrize("second_fault", ["etcd down", "node joined"])
def test_a_second_fault_while_a_survivor_waits_in_the_regroup_leaves_its_process_training(
        second_fault: str, reference_model: Any, local_job: Any, etcd: Any, tmp_path: Path) -> None:
    """The regroup cells of a second fault that kills nothing: rank 0's worker waits in the regroup (up to 20 s) for
    rank 1's place, held by a standby that still builds (as above), on etcd-v3, when

    - etcd crashes and starts again 3 s later on its data: the regroup needs the job's store, not etcd; once the held
      standby is built it takes the place, the group is rebuilt in process, no rendezvous round at all, and the run
      is the uninterrupted one bit for bit;
    - a new node joins (nnodes 2:3): the survivor's agent asks it to park, which ends its wait at once; it keeps
      its process into the round of three (the held standby, which cannot park while it builds, makes way for a new
      process), which goes on from node memory at the step it kept.

    Either way the survivor keeps its process and the audit is clean: no sample lost or repeated."""
    joined = second_fault == "node joined"
    job, gate = _gated_job(local_job, tmp_path, etcd=etcd, nnodes="2:3" if joined else "2:2", heartbeat_seconds=20)
    run_dir = Path(job.run_dir)
    try:
        _, _, _, building, survivor, kept = _rank_1_killed_while_its_next_standby_builds(job, gate)
        at = time.time()
        if joined:
            joiner = job.start_agent()
            deadline = time.monotonic() + 60
            while not [e for e in _agent_events(run_dir, "workers_kept")
                       if e["time"] > at and e["source"].endswith(f"-{survivor.agent.pid}")]:
                assert joiner.running() and time.monotonic() < deadline, \
                    "the survivor was not kept for the round of three within 60 s\n" + job.logs_tail()
                time.sleep(0.05)
        else:
            etcd.restart(down_seconds=3, crash=True)
        assert not [e for e in _agent_events(run_dir, "standby_ready") if e["pid"] == building], \
            "the second fault came while the standby still built"
    finally:
        gate.unlink(missing_ok=True)  # (the round of three's new processes build their models too)
    codes = job.wait(timeout=240)
    assert codes == [0] * len(job.agents), f"{codes}\n{job.logs_tail()}"
    report = check_audit(run_dir)
    assert report.ok and report.finished, report.render()

    starts = [e for e in events(run_dir, "start") if e["time"] > at]
    assert {e["pid"] for e in starts if of_agent(e, survivor.agent)} == {survivor.pid}, \
        "the survivor's worker kept its process\n" + job.logs_tail()
    resumed = [e for e in events(run_dir, "resume") if e["time"] > at]
    if joined:
        assert {e["world_size"] for e in starts} == {3}, "one round, of three\n" + job.logs_tail()
        assert {e["pid"] for e in starts if of_agent(e, joiner)}, "the joining node trained\n" + job.logs_tail()
        assert building not in {e["pid"] for e in starts}, "the held standby made way for a new process"
        assert [(e["tier"], e["step"]) for e in resumed] == [("memory", kept)], \
            "the round of three went on from node memory at the step the survivor kept\n" + job.logs_tail()
    else:
        assert_bitwise_equal(exported_model(run_dir, tmp_path), reference_model)
        assert {e["pid"]: e["rank"] for e in starts} == {survivor.pid: 0, building: 1}, \
            "the held standby, once built, took rank 1's place\n" + job.logs_tail()
        assert not [e for e in _agent_events(run_dir, "rendezvous") if e["time"] > at], \
            "the group was rebuilt in process: no rendezvous round\n" + job.logs_tail()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["lost", "agent killed", "preempted"])
def test_a_node_that_goes_while_its_next_standby_still_builds_ends_in_a_recovered_job_bitwise(
        how: str, reference_model: Any, local_job: Any, etcd: Any, tmp_path: Path) -> None:
    """The standby warm-up cells of a node that goes: rank 1's worker is killed, its node's standby takes the place
    and the agent starts another, whose build the test holds; while that one still builds, rank 1's node goes, on
    etcd-v3: lost (its agent and every process of it SIGKILLed), its agent killed alone (its processes follow it),
    or preempted (SIGTERM to its agent: it stops its workers, the building standby among them, and leaves). Rank 0's
    worker parks in its process, and with a new node in the gone one's place the job goes on from rank 0's node
    memory: the held standby never trains, and the run is the uninterrupted one."""
    job, gate = _gated_job(local_job, tmp_path, etcd=etcd)
    run_dir = Path(job.run_dir)
    try:
        _, workers, _, building = _rank_1_replaced_while_its_next_standby_builds(job, gate)
        gone = next(w for w in workers if w.rank == 1).agent
        survivor = next(w for w in workers if w.rank == 0)
        gone_at = time.time()
        if how == "preempted":
            continue_workers(job, workers)  # a stopped worker would hold its agent's SIGTERM path for its timeout
            assert building in job.kill_agent(gone, signal.SIGTERM), "the held standby is the node's"
            gone.proc.wait(timeout=60)
        else:
            assert building in job.kill_agent(gone, signal.SIGKILL, with_workers=how == "lost"), \
                "the held standby is the node's"
            continue_workers(job, [survivor])
    finally:
        gate.unlink(missing_ok=True)
    _with_a_new_node_in_its_place_ends_as_the_uninterrupted_run(job, gone, reference_model, tmp_path)

    assert {e["pid"] for e in events(run_dir, "start") if of_agent(e, survivor.agent)} == {survivor.pid}, \
        "the survivor's worker kept its process\n" + job.logs_tail()
    assert building not in {e["pid"] for e in events(run_dir, "start")}, "the held standby never trained"
    assert not alive(building), "the held standby went with its node"
    kept = [e["step"] for e in events(run_dir, "kept_in_memory") if e["pid"] == survivor.pid and e["time"] > gone_at]
    resumed = [e for e in events(run_dir, "resume") if e["time"] > gone_at]
    assert [e["tier"] for e in resumed] == ["memory"] and resumed[0]["step"] in kept, \
        "the job went on from node memory at a step the survivor kept\n" + job.logs_tail()


@pytest.mark.slow
def test_a_worker_hung_while_its_next_standby_still_builds_ends_in_a_restarted_job_bitwise(
        reference_model: Any, local_job: Any, tmp_path: Path) -> None:
    """The standby warm-up cell of a hang: rank 1's worker is killed, its node's standby takes the place and the
    agent starts another, whose build the test holds; while that one still builds, rank 1's new worker hangs
    (SIGSTOP: alive, so its agent replaces nothing). Rank 0's worker keeps its step in node memory once it finds its
    peer lost, and as for any hang every worker restarts (the hung one killed, the building standby stopped unused);
    the new processes resume from node memory at that step, and the run is the uninterrupted one."""
    job, gate = _gated_job(local_job, tmp_path)
    run_dir = Path(job.run_dir)
    try:
        _, workers, _, building = _rank_1_replaced_while_its_next_standby_builds(job, gate)
        hung = next(w for w in workers if w.rank == 1)
        survivor = next(w for w in workers if w.rank == 0)
        hung_at = time.time()
        continue_workers(job, [survivor])
        deadline = time.monotonic() + 60
        while len([e for e in _agent_events(run_dir, "restart") if e["time"] > hung_at]) < 2:
            assert time.monotonic() < deadline, "no restart by both agents within 60 s\n" + job.logs_tail()
            time.sleep(0.05)
        assert not [e for e in _agent_events(run_dir, "standby_ready") if e["pid"] == building], \
            "the hang was found while the standby still built"
    finally:
        gate.unlink(missing_ok=True)  # the new workers' builds wait for it too
    codes = job.wait(timeout=240)
    assert codes == [0, 0], f"{codes}\n{job.logs_tail()}"
    report = check_audit(run_dir)
    assert report.ok and report.finished, report.render()
    assert_bitwise_equal(exported_model(run_dir, tmp_path), reference_model)

    kept = [e["step"] for e in events(run_dir, "kept_in_memory")
            if e["pid"] == survivor.pid and e["time"] > hung_at and e["reason"] == "peer lost"]
    assert len(kept) == 1, "rank 0's worker found its peer lost and kept its step\n" + job.logs_tail()
    started = {e["pid"]: e["rank"] for e in events(run_dir, "start") if e["time"] > hung_at}
    assert sorted(started.values()) == [0, 1] and not {hung.pid, survivor.pid, building} & set(started), \
        f"every worker restarted in a new process, the building standby unused: {started}\n" + job.logs_tail()
    assert not alive(hung.pid) and not alive(building), "the hung worker and the held standby were ended"
    resumed = [e for e in events(run_dir, "resume") if e["time"] > hung_at]
    assert [(e["tier"], e["step"]) for e in resumed] == [("memory", kept[0])], \
        "the new processes went on from node memory at the step rank 0 kept\n" + job.logs_tail()


def test_a_compiled_model_recovers_in_process_through_the_standby_bitwise(
        local_job: Any, tmp_path: Path) -> None:
    # The standby traced the compiled model ahead; whatever it ran then must not reach the training.
    config = write_config(tmp_path / "compiled.yaml", **RESUME_SECTIONS | {
        "model": {"compile": True}, "train": RESUME_SECTIONS["train"] | {"max_steps": 200}})
    reference = exported_model(run_uninterrupted(config, tmp_path / "uninterrupted" / "run", timeout=240),
                               tmp_path / "uninterrupted")
    job = local_job(config=str(config), nnodes="2:2", launcher="elastic-runner",
                    overrides=["recovery.in_process=true"])
    job.start_agent()
    job.start_agent()
    workers, standbys = _stopped_with_standbys_ready(job, 100)
    victim = _kill(job, workers, rank=1)
    run_dir = _ends_as_the_uninterrupted_run(job, reference, tmp_path)
    replaced = _agent_events(run_dir, "worker_replaced")
    assert [(e["new_pid"], e["standby"]) for e in replaced] == [(standbys[victim.agent.pid], True)], replaced
    assert len({e["pid"] for e in events(run_dir, "start") if e["rank"] == 0}) == 1, "rank 0 kept its process"


def test_with_rank_0s_worker_killed_a_new_round_keeps_the_other_nodes_worker_and_the_run_ends_bitwise_identical(
        resume_config: Path, reference_model: Any, local_job: Any, tmp_path: Path) -> None:
    # Rank 0's worker hosts the job's store: nothing can be rebuilt without it, so no replacement joins the old
    # group. Its agent starts a new round (and a new worker); the other node's worker parks and takes its place in
    # that round in the same process (its rank may change: the round decides).
    job = _started(local_job, resume_config)
    victim = kill_worker_at_step(job, 130, rank=0)
    run_dir = _ends_as_the_uninterrupted_run(job, reference_model, tmp_path)

    starts = events(run_dir, "start")
    by_node = {agent.pid: {e["pid"] for e in starts if of_agent(e, agent)}
               for agent in job.agents}
    assert len(by_node[victim.agent.pid]) == 2, f"the victim's node started a new worker: {by_node}"
    other = next(pid for pid in by_node if pid != victim.agent.pid)
    assert len(by_node[other]) == 1, f"the other node's worker kept its process: {by_node}\n{job.logs_tail()}"
    assert not _agent_events(run_dir, "worker_replaced")
    assert len(_agent_events(run_dir, "rendezvous")) == 4, "a second round"
    kept = _agent_events(run_dir, "workers_kept")
    assert [e["source"].rsplit("-", 1)[1] for e in kept] == [str(other)], kept
    # The survivor found the job's store gone and asked rank 0's agent on its liveness port: alive, so its node was
    # not counted out of the round it asks for (recovery/liveness.py).
    assert not _agent_events(run_dir, "members_counted_out"), _agent_events(run_dir, "members_counted_out")
    assert any("node 0's agent is alive" in a.log_text() for a in job.agents), job.logs_tail()


def test_at_four_ranks_on_two_nodes_rank_0s_worker_killed_every_other_worker_is_kept_through_a_new_round_bitwise(
        resume_config: Path, reference_2x2: Any, local_job: Any, tmp_path: Path) -> None:
    # The kept round at four ranks, two per node: no replacement can join the old group (its store went with rank
    # 0's worker), so both agents start a new round; the victim's sibling and the other node's two workers park and
    # take their places in it (ranks may move between the nodes), only the victim's place gets a new process. The
    # sums run over four ranks, so a resumed state or a gradient layout that differed in any rank would show in the
    # bits.
    job = local_job(config=str(resume_config), nnodes="2:2", nproc_per_node=2, launcher="elastic-runner",
                    overrides=["recovery.in_process=true"])
    job.start_agent()
    job.start_agent()
    victim = kill_worker_at_step(job, 130, rank=0, count=4)
    run_dir = _ends_as_the_uninterrupted_run(job, reference_2x2, tmp_path)

    starts = events(run_dir, "start")
    pids = {e["pid"] for e in starts}
    assert victim.pid in pids and len(pids) == 5, f"one new process, for the victim's place: {pids}\n{job.logs_tail()}"
    kept = _agent_events(run_dir, "workers_kept")
    assert sorted(len(e["kept"]) for e in kept) == [1, 2], kept
    assert sorted(len(e["started"]) for e in kept) == [0, 1], kept


def test_a_replacement_killed_while_it_joins_ends_in_a_recovered_job(
        resume_config: Path, reference_model: Any, local_job: Any, tmp_path: Path) -> None:
    # Killed as soon as it exists: before it reached the group (the survivor stops waiting after
    # dist.heartbeat_seconds and every worker restarts) or after (a second in-process recovery).
    job = _started(local_job, resume_config)
    victim = kill_worker_at_step(job, 130)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        replacement = [w for w in job.workers() if w.rank == 1 and w.pid != victim.pid]
        if replacement:
            job.signal_worker(replacement[0], signal.SIGKILL)
            break
        time.sleep(0.01)
    else:
        pytest.fail("no replacement of rank 1 within 60 s\n" + job.logs_tail())
    _ends_as_the_uninterrupted_run(job, reference_model, tmp_path)


def _listens(pid: int) -> bool:
    """Whether process ``pid`` holds a listening TCP socket (rank 0's worker hosts the job's store)."""
    return any(state == "0A" for state, _, _ in tcp_sockets(pid))


def _held_in_the_first_group(job: Any) -> tuple[Any, Any]:
    """Rank 1's worker stopped (SIGSTOP) as soon as it exists, and rank 0's worker waiting for it inside the first
    process group's creation (hosting the job's store, listening); the two workers."""
    deadline = time.monotonic() + 90
    held = None
    while held is None:
        held = next((w for w in job.workers() if w.rank == 1), None)
        assert time.monotonic() < deadline, "no worker of rank 1 within 90 s\n" + job.logs_tail()
        time.sleep(0.005)
    job.signal_worker(held, signal.SIGSTOP)
    waiting = next(w for w in job.wait_for_workers(2, timeout=60) if w.rank == 0)
    while not _listens(waiting.pid):
        assert time.monotonic() < deadline, "rank 0's worker never hosted the job's store\n" + job.logs_tail()
        time.sleep(0.02)
    time.sleep(1.0)  # inside init_process_group: it waits for rank 1, which is stopped
    assert not events(Path(job.run_dir), "start"), "the first process group came up before the fault"
    return held, waiting


@pytest.mark.parametrize("victim", [0, 1])
def test_a_worker_killed_while_the_first_process_group_comes_up_ends_in_a_recovered_job(
        victim: int, resume_config: Path, reference_model: Any, local_job: Any, tmp_path: Path) -> None:
    """The start-up cell: one worker is stopped (SIGSTOP) as soon as it exists, so its peer waits inside the first
    process group's creation (rank 0's worker hosting the job's store, listening); the waiting one is killed there
    (``victim`` 0: the store goes with it) or the stopped one is (1), and the other is let go. No step was taken, so
    nothing is lost either way the group comes up: where the killed one's replacement reaches the group's creation
    within its wait (``dist.init_timeout_seconds``; a replacement of rank 0 hosts the store again on the same port)
    the group forms with it and the other keeps its process; where it does not, the other ends its attempt and its
    agent restarts it (~10 s here). Which one happens is a matter of timing (a loaded CI machine gets the first, this
    one mostly the second): either way the killed process never trains, the first attempt is the only one, it starts
    at the first step, and the run is the uninterrupted one."""
    job = _started(local_job, resume_config, "elastic-runner", "dist.heartbeat_seconds=2")
    run_dir = Path(job.run_dir)
    held, waiting = _held_in_the_first_group(job)
    if victim == 0:
        job.signal_worker(waiting, signal.SIGKILL)
        job.signal_worker(held, signal.SIGCONT)
    else:
        job.signal_worker(held, signal.SIGKILL)  # (a stopped process dies of it as it is)
    _ends_as_the_uninterrupted_run(job, reference_model, tmp_path)
    starts = events(run_dir, "start")
    # One attempt, the first: no start before the kill (asserted above), so the killed process never trained; the
    # other rank trains in the process it had or in a new one (both are right, see above).
    assert sorted(e["rank"] for e in starts) == [0, 1] and {e["generation"] for e in starts} == {1}, \
        f"one attempt, the first, with both ranks: {starts}"
    assert not events(run_dir, "resume"), "nothing to resume from: the run began at its first step"


@pytest.mark.slow
def test_an_agent_killed_while_the_first_process_group_comes_up_ends_in_a_recovered_job(
        resume_config: Path, reference_model: Any, local_job: Any, tmp_path: Path) -> None:
    """The start-up cell of an agent's SIGKILL: rank 1's worker stopped as soon as it exists, rank 0's waiting for it
    inside the first group's creation, and rank 1's agent killed alone (its worker follows it). A new node takes its
    place: no step was taken, so the job begins again at its first step, the lost agent's worker never trained, and
    the run is the uninterrupted one."""
    job = _started(local_job, resume_config, "elastic-runner", "dist.heartbeat_seconds=2")
    run_dir = Path(job.run_dir)
    held, _ = _held_in_the_first_group(job)
    gone = held.agent
    job.kill_agent(gone, signal.SIGKILL, with_workers=False)
    deadline = time.monotonic() + 30
    while alive(held.pid):
        assert time.monotonic() < deadline, "the lost agent's worker outlived it\n" + job.logs_tail()
        time.sleep(0.05)
    _with_a_new_node_in_its_place_ends_as_the_uninterrupted_run(job, gone, reference_model, tmp_path)
    starts = events(run_dir, "start")
    assert held.pid not in {e["pid"] for e in starts}, "the lost agent's worker never trained"
    assert sorted(e["rank"] for e in starts) == [0, 1], f"one attempt, with both ranks: {starts}"
    assert not events(run_dir, "resume"), "nothing to resume from: the run began at its first step"


def test_a_peer_stopped_inside_a_collective_ends_in_a_recovered_job(
        resume_config: Path, reference_model: Any, local_job: Any, tmp_path: Path) -> None:
    # SIGSTOP: alive, so its agent replaces nothing; the survivor's watchdog finds it lost after
    # dist.heartbeat_seconds and, no replacement coming for a live process, every worker restarts at once (the
    # stopped one killed).
    job = _started(local_job, resume_config, "elastic-runner", "dist.heartbeat_seconds=2")
    workers, _ = stop_workers_at_step(job, 130, count=2)
    continue_workers(job, [w for w in workers if w.rank == 0])
    run_dir = _ends_as_the_uninterrupted_run(job, reference_model, tmp_path)
    assert [e for e in events(run_dir, "resume") if e["generation"] > 1], "the job resumed after the stop"
    logs = "".join(agent.log_text() for agent in job.agents)
    assert "no replacement was announced" not in logs, "a live peer gets no replacement: the survivor did not wait"


def _killed_while_its_peer_waits_inside_a_collective(job: Any, rank: int) -> tuple[Any, Any, dict[int, int], float]:
    """Both workers stopped at step 130 (their standbys ready), the other rank let go: once its main thread is
    blocked in the next collective, waiting there for ``rank``, ``rank``'s worker is SIGKILLed. The survivor, the
    victim, the standbys by agent pid, and when it was killed. (A heartbeat longer than the test's wait: the kill,
    not the watchdog, must end the attempt.)"""
    workers, standbys = _stopped_with_standbys_ready(job, 130)
    victim = next(w for w in workers if w.rank == rank)
    survivor = next(w for w in workers if w.rank != rank)
    continue_workers(job, [survivor])
    wait_until_blocked(survivor.pid)
    killed_at = time.time()
    job.signal_worker(victim, signal.SIGKILL)
    return survivor, victim, standbys, killed_at


def test_a_worker_killed_while_its_peer_waits_for_it_inside_a_collective_is_replaced_alone(
        resume_config: Path, reference_model: Any, local_job: Any, tmp_path: Path) -> None:
    """Both workers stopped at step 130, then rank 0 let go: it runs into the next collective and waits there for
    rank 1. Once rank 0's main thread is blocked inside it, rank 1 is SIGKILLed: the collective fails under rank 0
    (its peer's connections closed), rank 0 keeps its process, rank 1's standby takes its place, and the job resumes
    from node memory and ends bitwise. (A heartbeat longer than the test's wait: the kill, not the watchdog, must
    end the attempt.)"""
    job = _started(local_job, resume_config, "elastic-runner", "dist.heartbeat_seconds=20")
    survivor, victim, standbys, killed_at = _killed_while_its_peer_waits_inside_a_collective(job, 1)
    run_dir = _ends_as_the_uninterrupted_run(job, reference_model, tmp_path)

    starts = events(run_dir, "start")
    assert {e["pid"] for e in starts if e["rank"] == 0} == {survivor.pid}, "rank 0 kept its process\n" + job.logs_tail()
    replaced = _agent_events(run_dir, "worker_replaced")
    assert [(e["rank"], e["pid"], e["new_pid"]) for e in replaced] == [(1, victim.pid, standbys[victim.agent.pid])], \
        replaced
    assert len(_agent_events(run_dir, "rendezvous")) == 2, "no rendezvous round for the recovery"
    broke = [e for e in events(run_dir, "failure") if e["rank"] == 0 and e["time"] > killed_at]
    assert len(broke) == 1 and broke[0].get("detected_by") != "watchdog" and "Connection" in broke[0]["error"], \
        f"the collective failed under rank 0 (gloo: its peer's connection reset), not its watchdog: {broke}"
    resume = [e for e in events(run_dir, "resume") if e["time"] > killed_at]
    assert resume and all(e["tier"] == "memory" and e["steps_recomputed"] <= 1 for e in resume), resume


@pytest.mark.slow
def test_the_jobs_store_lost_while_a_peer_waits_inside_a_collective_for_its_host_keeps_that_peer_in_a_new_round(
        resume_config: Path, reference_model: Any, local_job: Any, tmp_path: Path) -> None:
    """The mirror of the test above: rank 1 blocked inside the step's collective waiting for rank 0, stopped, whose
    process hosts the job's store; rank 0's worker SIGKILLed takes the store with it. The collective fails under rank
    1, which finds the store gone and asks rank 0's agent on its liveness port: alive, so its node is not counted
    out. No replacement can join the old group (its store is gone): both agents start a new round, rank 1 keeps its
    process into it, rank 0's place gets a new process, and the run is the uninterrupted one."""
    job = _started(local_job, resume_config, "elastic-runner", "dist.heartbeat_seconds=20")
    survivor, victim, _, killed_at = _killed_while_its_peer_waits_inside_a_collective(job, 0)
    run_dir = _ends_as_the_uninterrupted_run(job, reference_model, tmp_path)

    starts = events(run_dir, "start")
    assert {e["pid"] for e in starts if of_agent(e, survivor.agent)} == {survivor.pid}, \
        "the peer kept its process through the new round\n" + job.logs_tail()
    assert len({e["pid"] for e in starts if of_agent(e, victim.agent)}) == 2, "rank 0's place got a new process"
    assert not _agent_events(run_dir, "worker_replaced"), "nothing can join a group whose store is gone"
    assert len(_agent_events(run_dir, "rendezvous")) == 4, "a second round"
    assert not _agent_events(run_dir, "members_counted_out"), "rank 0's node is alive: not counted out"
    broke = [e for e in events(run_dir, "failure") if e["pid"] == survivor.pid and e["time"] > killed_at]
    assert len(broke) == 1 and broke[0].get("detected_by") != "watchdog", \
        f"the collective failed under rank 1 (its peer's connections closed), not its watchdog: {broke}"
    assert any("node 0's agent is alive" in a.log_text() for a in job.agents), job.logs_tail()
    resumed = [e for e in events(run_dir, "resume") if e["time"] > killed_at]
    assert resumed and all(e["tier"] == "memory" and e["steps_recomputed"] <= 1 for e in resumed), resumed


@pytest.mark.slow
@pytest.mark.parametrize("how", ["lost", "agent killed", "preempted"])
def test_a_node_that_goes_while_its_peer_waits_for_it_inside_a_collective_ends_in_a_recovered_job_bitwise(
        how: str, resume_config: Path, reference_model: Any, local_job: Any, etcd: Any, tmp_path: Path) -> None:
    """As above, rank 0 blocked inside the step's collective waiting for rank 1, stopped; then rank 1's node goes, on
    etcd-v3: lost (its agent and every process of it SIGKILLed), its agent killed alone (its processes follow it), or
    preempted (SIGTERM to its agent, which ends its worker and leaves the rendezvous).
    The collective fails under rank 0, which keeps its process and parks, and with a new node in the gone one's place
    the job goes on from rank 0's node memory: the run is the uninterrupted one."""
    job = _started(local_job, resume_config, "elastic-runner", "dist.heartbeat_seconds=20", etcd=etcd)
    workers, _ = _stopped_with_standbys_ready(job, 130)
    survivor, victim = (next(w for w in workers if w.rank == rank) for rank in (0, 1))
    continue_workers(job, [survivor])
    wait_until_blocked(survivor.pid)
    gone_at = time.time()
    job.kill_agent(victim.agent, signal.SIGTERM if how == "preempted" else signal.SIGKILL, with_workers=how == "lost")
    victim.agent.proc.wait(timeout=60)
    _with_a_new_node_in_its_place_ends_as_the_uninterrupted_run(job, victim.agent, reference_model, tmp_path)

    run_dir = Path(job.run_dir)
    assert {e["pid"] for e in events(run_dir, "start") if of_agent(e, survivor.agent)} == {survivor.pid}, \
        "the survivor's worker kept its process\n" + job.logs_tail()
    broke = [e for e in events(run_dir, "failure") if e["rank"] == 0 and e["time"] > gone_at]
    assert broke and broke[0].get("detected_by") != "watchdog", f"the collective failed under rank 0: {broke}"
    resumed = [e for e in events(run_dir, "resume") if e["time"] > gone_at]
    assert resumed and all(e["tier"] == "memory" and e["steps_recomputed"] <= 1 for e in resumed), resumed


@pytest.mark.slow
def test_a_node_joining_while_a_rank_waits_inside_a_collective_for_a_frozen_peer_gets_a_round_of_three(
        resume_config: Path, local_job: Any, etcd: Any, tmp_path: Path) -> None:
    """Rank 0 blocked inside the step's collective waiting for rank 1, frozen (SIGSTOP), when a third node joins
    (etcd-v3, nnodes 2:3). A frozen process cannot park: its agent says so and kills it. Rank 0 keeps its process
    into the round of three, a new process takes rank 1's place there, and the job resumes from node memory; every
    sample once."""
    job = _started(local_job, resume_config, "elastic-runner", "dist.heartbeat_seconds=20", etcd=etcd, nnodes="2:3")
    run_dir = Path(job.run_dir)
    workers, _ = _stopped_with_standbys_ready(job, 130)
    waiting, frozen = (next(w for w in workers if w.rank == rank) for rank in (0, 1))
    continue_workers(job, [waiting])
    wait_until_blocked(waiting.pid)
    joined_at = time.time()
    job.start_agent()
    wait_for_world(run_dir, 3, joined_at, job)
    assert job.wait(timeout=240) == [0, 0, 0], job.logs_tail()
    report = check_audit(run_dir)
    assert report.ok and report.finished, report.render()

    assert f"worker pid {frozen.pid} is stopped (SIGSTOP?) and cannot handle SIGTERM; killing it" in \
        frozen.agent.log_text(), frozen.agent.log_text()[-3000:]
    in_three = {e["pid"]: e["rank"] for e in events(run_dir, "start") if e["time"] > joined_at and e["world_size"] == 3}
    assert waiting.pid in in_three and frozen.pid not in in_three and len(in_three) == 3, \
        "rank 0 kept its process into the round of three, the frozen one did not\n" + job.logs_tail()
    resumed = [e for e in events(run_dir, "resume") if e["time"] > joined_at]
    assert resumed and all(e["tier"] == "memory" for e in resumed), resumed


@pytest.mark.parametrize("launcher", ["elastic-runner", "torchrun"])
def test_a_node_lost_and_a_node_joining_leave_the_survivors_worker_in_its_process(
        launcher: str, resume_config: Path, local_job: Any) -> None:
    job = local_job(config=str(resume_config), nnodes="1:2", launcher=launcher,
                    overrides=["recovery.in_process=true"])
    survivor_node = job.start_agent()
    lost_node = job.start_agent()
    run_dir = Path(job.run_dir)
    workers, _ = stop_workers_at_step(job, 90, count=2, timeout=120)
    survivor = next(w for w in workers if w.agent is survivor_node)
    lost_at = time.time()
    job.kill_agent(lost_node)  # the node, its agent and its worker at once
    continue_workers(job, [survivor])
    wait_for_world(run_dir, 1, lost_at, job)
    joined_at = time.time()
    start_agent_while_paused(job, at_step=0, count=1)  # the survivor alone could finish before a node starts
    wait_for_world(run_dir, 2, joined_at, job)
    codes = job.wait(timeout=240)
    assert codes[0] == 0 and codes[2] == 0, job.logs_tail()

    starts = events(run_dir, "start")
    survivor_starts = [e for e in starts if of_agent(e, survivor_node)]
    assert {e["pid"] for e in survivor_starts} == {survivor.pid}, \
        "the survivor's worker kept its process through the loss and the join\n" + job.logs_tail()
    assert [e["world_size"] for e in survivor_starts if e["time"] > lost_at][:2] == [1, 2], survivor_starts
    assert all(e["process_start"] > lost_at for e in survivor_starts if e["time"] > lost_at), \
        "a kept worker's start in a new attempt is when it took its place, not its process's start long before"
    kept = _agent_events(run_dir, "workers_kept")
    assert len([e for e in kept if e["source"].endswith(f"-{survivor_node.pid}")]) >= 2, kept
    resumed = [e for e in events(run_dir, "resume") if e["time"] > lost_at]
    assert resumed and all(e["tier"] == "memory" for e in resumed), resumed
    report = check_audit(run_dir)
    assert report.ok and report.finished, report.render()
