"""The runner under real torchrun: one code path alone, standalone, and multi-agent elastic."""

from __future__ import annotations

import sys
from typing import Callable
from pathlib import Path

import pytest

from elastic_runner.observe.audit import check_audit

from ..support import end_events, events, run_bounded, torchrun_standalone

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


def test_alone_without_torchrun_trains_at_world_size_one(small_config: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "alone"
    result = run_bounded([sys.executable, "-m", "elastic_runner.train", "--config", str(small_config),
                          "--set", f"run.dir={run_dir}", "--set", "train.max_steps=20"], timeout=120)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "finished step=20" in result.stdout
    (start,) = events(run_dir, "start")
    assert start["world_size"] == 1 and start["backend"] == "gloo"
    assert (run_dir / "config.yaml").is_file()


def test_console_script_and_legacy_local_rank_argument(small_config: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "legacy"
    result = run_bounded([sys.executable, "-m", "elastic_runner", "train", "--config", str(small_config),
                          "--local_rank=0", "--set", f"run.dir={run_dir}", "--set", "train.max_steps=3"], timeout=120)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "finished step=3" in result.stdout


def test_two_processes_keep_identical_replicas_and_agree_on_metrics(small_config: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "two"
    result = torchrun_standalone(small_config, run_dir, nproc=2, overrides=["train.max_steps=30"])
    assert result.returncode == 0, result.stdout[-3000:]
    ends = end_events(run_dir)
    assert sorted(e["rank"] for e in ends) == [0, 1]
    assert len({e["params_sha256"] for e in ends}) == 1, "replicas diverged"
    assert len({(e["eval_loss"], e["eval_accuracy"], e["eval_samples"]) for e in ends}) == 1
    assert ends[0]["eval_samples"] == 359  # every test sample evaluated exactly once across ranks
    assert check_audit(run_dir).ok


def test_config_error_is_one_line_without_traceback(quickstart: Path, tmp_path: Path) -> None:
    result = run_bounded([sys.executable, "-m", "elastic_runner.train", "--config", str(quickstart),
                          "--set", "batch.global_size=-4", "--set", f"run.dir={tmp_path}"], timeout=60)
    assert result.returncode == 2
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, result.stdout
    assert "batch.global_size" in lines[0] and "Traceback" not in result.stdout
    assert not (tmp_path / "snapshots").exists(), "nothing may be written before the config is valid"


def test_two_elastic_agents_run_one_job_at_world_size_two(small_config: Path, local_job) -> None:  # noqa: ANN001
    # 2:2: with a lower minimum, an agent that starts a moment late misses the first round (1 s last
    # call) and a 40-step job may be over before it arrives.
    job = local_job(config=str(small_config), nnodes="2:2", overrides=["train.max_steps=40"])
    job.start_agent()
    job.start_agent()
    codes = job.wait(timeout=180)
    assert codes == [0, 0], job.logs_tail()
    run_dir = Path(job.run_dir)
    starts = events(run_dir, "start")
    assert sorted(e["rank"] for e in starts) == [0, 1] and {e["world_size"] for e in starts} == {2}
    assert len({e["params_sha256"] for e in end_events(run_dir)}) == 1
    assert check_audit(run_dir).ok


def test_unwritable_run_dir_stops_every_rank_with_one_message(small_config: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = torchrun_standalone(small_config, blocker / "run", nproc=2)
    assert result.returncode != 0
    assert "cannot prepare run.dir" in result.stdout
    assert blocker.read_text() == "not a directory"


# Runs the worker's main in a fresh interpreter and lists the native threads left when it returns.
# (gloo's transport loop ends on its own a moment after the group is destroyed: wait a little.)
_THREADS_AFTER_MAIN = """
import os, sys, time
from elastic_runner.train import main

def gloo_threads():
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            names.append(open(f"/proc/self/task/{task}/comm").read().strip())
        except FileNotFoundError:  # a thread that just ended
            pass
    return sorted(n for n in names if "gloo" in n)

code = main(sys.argv[1:])
deadline = time.monotonic() + 5
while gloo_threads() and time.monotonic() < deadline:
    time.sleep(0.05)
print("exit", code, "gloo threads", gloo_threads())
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="lists threads through Linux's /proc")
def test_no_gloo_thread_outlives_the_worker_so_its_exit_status_is_the_real_one(small_config: Path, tmp_path: Path) -> None:
    # A gloo thread alive during interpreter shutdown now and then aborts the process
    # (pytorch/pytorch#190489): torchrun then sees SIGABRT instead of 0 or 2 and restarts the worker.
    run_dir = tmp_path / "run"

    def worker(*overrides: str) -> str:
        cmd = [sys.executable, "-c", _THREADS_AFTER_MAIN, "--config", str(small_config), "--set", f"run.dir={run_dir}",
               "--set", "train.max_steps=10"]
        for item in overrides:
            cmd += ["--set", item]
        result = run_bounded(cmd, timeout=120)
        assert result.returncode in (0, 2), result.stdout[-3000:]
        return result.stdout

    assert "exit 0 gloo threads []" in worker()
    assert "exit 2 gloo threads []" in worker("model.params.hidden=8"), "a usage error (snapshot of another model)"


def test_a_stop_before_training_ends_the_worker_at_once_even_while_it_waits_for_a_peer(
        small_config: Path, tmp_path: Path) -> None:
    """Before: a worker stopped while its process group waited for a peer that was gone (the agent stops the group
    for a membership change just as a fault kills the new rank 2) sat in native code until the 30 s start-up
    deadline, and the agent with it: the soak's seven ~31 s recoveries."""
    import os
    import signal
    import subprocess
    import time

    from elastic_runner.testing.localjob import free_port
    from elastic_runner.lifecycle import EXIT_OK

    port = free_port()
    env = os.environ | {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PYTHONUNBUFFERED": "1"}

    def store_listening() -> bool:  # rank 0 hosts the process group's store: it now waits for rank 1
        lines = []
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with open(table) as fh:
                lines += fh.readlines()[1:]
        return any(line.split()[1].endswith(f":{port:04X}") and line.split()[3] == "0A" for line in lines)

    worker = subprocess.Popen([sys.executable, "-m", "elastic_runner.train", "--config", str(small_config),
                               "--set", f"run.dir={tmp_path / 'run'}"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not store_listening() and time.monotonic() < deadline:
            time.sleep(0.1)  # the worker has started and is now waiting for rank 1, who never comes
        time.sleep(1.0)
        worker.send_signal(signal.SIGTERM)
        out, _ = worker.communicate(timeout=25)  # well before the 30 s start-up deadline
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
    assert worker.returncode == EXIT_OK, out[-3000:]
    assert "received SIGTERM before training started: nothing to save, stopping now" in out


def test_a_stop_while_a_survivor_rebuilds_its_process_group_ends_it_at_once(small_config: Path, tmp_path: Path) -> None:
    """Before: an agent that stopped every worker (another one had failed for good) while a survivor of in-process
    recovery waited for its peers to arrive in the rebuilt group waited with it, dist.heartbeat_seconds (here 30 s).
    The test plays the agent: it kills rank 1 mid-training and announces a replacement that never comes."""
    import datetime
    import os
    import signal
    import subprocess
    import time

    import torch.distributed as tdist

    from elastic_runner.observe.events import read_events
    from elastic_runner.testing.localjob import free_port
    from elastic_runner.env import AGENT_ID_VAR
    from elastic_runner.lifecycle import EXIT_OK
    from elastic_runner.recovery.channel import Channel
    from elastic_runner.recovery.regroup import announce_replacement

    port, run_dir = free_port(), tmp_path / "run"
    workers = []
    try:
        for rank in (0, 1):
            env = os.environ | {"RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
                                "GROUP_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                "PYTHONUNBUFFERED": "1", AGENT_ID_VAR: f"test-agent-{rank}"}
            workers.append(subprocess.Popen(
                [sys.executable, "-m", "elastic_runner.train", "--config", str(small_config),
                 "--set", f"run.dir={run_dir}", "--set", "train.max_steps=100000", "--set", "train.epochs=1000",
                 "--set", "recovery.in_process=true", "--set", "dist.heartbeat_seconds=30",
                 "--set", "snapshot.every_steps=25", "--set", "logging.every_steps=5"],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True))
        deadline = time.monotonic() + 90

        def rank_0_reached(kind: str) -> bool:
            return any(e.get("kind") == kind and e.get("rank") == 0 for e in read_events(run_dir))

        def stepped_past_its_snapshot() -> bool:  # its node memory will hold a step newer than the disk
            events = read_events(run_dir)
            saved = [e["step"] for e in events if e.get("kind") == "snapshot_saved"]
            return bool(saved) and any(e.get("kind") == "progress" and e["step"] > max(saved) for e in events)

        while not stepped_past_its_snapshot():
            assert time.monotonic() < deadline and workers[0].poll() is None, "rank 0 did not train"
            time.sleep(0.05)
        store = tdist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10),
                               wait_for_workers=False)
        os.killpg(workers[1].pid, signal.SIGKILL)
        workers[1].wait()
        generation = announce_replacement(Channel(store, None), 1)  # as the agent does; the replacement never comes
        # Rank 0 kept its step and now waits for its peer in the new group (recreate: it said it arrived;
        # reconfigure: it posted its handle).
        arrived = [f"regroup/{generation}/arrived/0", f"regroup/{generation}/0"]
        while not any(store.check([key]) for key in arrived):
            assert time.monotonic() < deadline and workers[0].poll() is None, "rank 0 did not rebuild its group"
            time.sleep(0.05)
        time.sleep(0.5)
        workers[0].send_signal(signal.SIGTERM)
        out, _ = workers[0].communicate(timeout=20)  # well before the 30 s wait for the peer
    finally:
        for worker in workers:
            if worker.poll() is None:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait()
    assert workers[0].returncode == EXIT_OK, out[-3000:]
    # What it kept in node memory was newer than its last snapshot on disk: a stop is how a node is preempted, and
    # its memory goes with it, so the worker left that state in the run's snapshots on its way out.
    kept = [e["step"] for e in read_events(run_dir) if e.get("kind") == "kept_in_memory" and e.get("rank") == 0]
    saved = [e["step"] for e in read_events(run_dir) if e.get("kind") == "snapshot_saved"]
    assert kept and max(saved) < kept[-1], (kept, saved)
    assert (f"received SIGTERM between two attempts (in-process recovery): saved step {kept[-1]} from node memory "
            f"to {run_dir / 'snapshots'}") in out, out[-3000:]
    from elastic_runner.snapshot import LocalStore, load_exact

    durable = LocalStore(run_dir / "snapshots").complete()
    assert durable[-1].step == kept[-1]
    assert load_exact(LocalStore(run_dir / "snapshots"), durable[-1], map_location="cpu", verify=True) is not None


def test_a_replacement_whose_survivors_never_rebuild_the_group_ends_so_that_every_worker_restarts(
        small_config: Path, tmp_path: Path) -> None:
    """Before: a replacement whose survivors had been restarted for a new round (a node joined as a worker was
    killed: a 60-fault soak) waited dist.heartbeat_seconds for them and exited 1, and its agent replaced it again,
    fifteen times over 31 s. Exit 76 makes the agent restart every worker at once. The test hosts the job's store,
    as rank 0's worker would, and no survivor comes."""
    import datetime
    import os

    import torch.distributed as tdist

    from elastic_runner.env import AGENT_ID_VAR, REPLACES_VAR
    from elastic_runner.lifecycle import EXIT_PEER_LOST

    store = tdist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30),
                           wait_for_workers=False, multi_tenant=True)
    env = os.environ | {"RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
                        "GROUP_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
                        "PYTHONUNBUFFERED": "1", AGENT_ID_VAR: "test-agent-1", REPLACES_VAR: "12345"}

    def replacement() -> str:
        result = run_bounded([sys.executable, "-m", "elastic_runner.train", "--config", str(small_config),
                              "--set", f"run.dir={tmp_path / 'run'}", "--set", "recovery.in_process=true",
                              "--set", "dist.heartbeat_seconds=1"], timeout=60, env=env)
        assert result.returncode == EXIT_PEER_LOST, result.stdout[-3000:]
        assert "every worker restarts" in result.stdout
        return result.stdout

    # The predecessor died before the round's first group was formed (the soak's case): its peers wait for it in
    # that group's start, so the replacement does not wait for them at all.
    assert "rank 1 ended before the round's first process group was formed" in replacement()
    from elastic_runner.recovery.channel import Channel, InGeneration

    # The predecessor had formed it: the replacement waits for the survivors.
    Channel(store, None).send(InGeneration(1, 0))
    assert "rank 1: could not rebuild the process group for generation 1" in replacement()


def test_a_kept_worker_asked_to_park_again_while_its_group_comes_up_in_a_new_round_keeps_its_process(
        small_config: Path, tmp_path: Path) -> None:
    """Before: a kept worker placed in a new round whose new peer was still starting waited for it in torch's group
    start (native code) and could not be asked anything; a second node joining or lost then made its agent kill it and
    start a new process. Now it says it can park while it waits, and parks again when asked. The test plays the
    agent: it parks the worker training alone, places it at rank 0 of two (nobody comes as rank 1), asks it to park
    again, and places it alone; it resumes from node memory and finishes, in the same process throughout."""
    import os
    import signal
    import subprocess
    import time

    from elastic_runner.env import AGENT_ID_VAR
    from elastic_runner.lifecycle import EXIT_OK
    from elastic_runner.recovery.handover import HANDOVER_DIR_VAR, Handover
    from elastic_runner.testing.localjob import free_port

    handover_dir, run_dir = tmp_path / "handover", tmp_path / "run"
    handover_dir.mkdir(mode=0o700)
    place = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0",
             "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    env = os.environ | place | {"PYTHONUNBUFFERED": "1", AGENT_ID_VAR: "test-agent-0",
                                HANDOVER_DIR_VAR: str(handover_dir)}
    worker = subprocess.Popen(
        [sys.executable, "-m", "elastic_runner.train", "--config", str(small_config), "--set", f"run.dir={run_dir}",
         "--set", "recovery.in_process=true", "--set", "logging.every_steps=50",
         "--set", "dist.init_timeout_seconds=60", "--set", "dist.heartbeat_seconds=60"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    handover = Handover(handover_dir, 0)

    def until(what: str, done: Callable[[], bool], seconds: float) -> float:
        started = time.monotonic()
        while not done():
            assert worker.poll() is None, f"the worker ended while the test waited for {what}"
            assert time.monotonic() - started < seconds, f"no {what} within {seconds:g}s"
            time.sleep(0.01)
        return time.monotonic() - started

    try:
        until("ready to park in its training loop", lambda: handover.ready_pid() == worker.pid, 90)
        handover.ask_to_park("a node joins")
        until("park", lambda: handover.parked_pid() == worker.pid, 30)
        handover.give_place(place | {"WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "2", "MASTER_PORT": str(free_port())})
        # It brings the round of two up, as rank 0: it hosts the store and waits for rank 1, who is still starting.
        until("ready to park while its group comes up", lambda: handover.ready_pid() == worker.pid, 30)
        time.sleep(0.5)
        handover.ask_to_park("another node joins")
        parked_after = until("park again", lambda: handover.parked_pid() == worker.pid, 30)
        handover.give_place(place | {"MASTER_PORT": str(free_port())})
        out, _ = worker.communicate(timeout=120)
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
    assert worker.returncode == EXIT_OK, out[-3000:]
    assert parked_after < 5, f"it parked {parked_after:.1f}s after it was asked: its group's start held it"
    assert "asked it to park while it waited for the others); parking again for the round after" in out, out[-3000:]
    assert "this worker kept its process and is rank 0 of 1 in the new round" in out, out[-3000:]
    kept = [e["step"] for e in events(run_dir, "kept_in_memory")]
    resumed = events(run_dir, "resume")[-1]
    assert (resumed["tier"], resumed["step"], resumed["steps_recomputed"]) == ("memory", kept[-1], 0), resumed
    (end,) = end_events(run_dir)
    assert end["generation"] == resumed["generation"], "it finished in the attempt that resumed alone"
