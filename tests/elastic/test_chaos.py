"""elastic-runner chaos: every fault type leaves the job whole (on c10d; every type on etcd-v3 in one job, and a
checker that fails on a repeated sample: tests/elastic/test_soak.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic_runner.observe.events import read_events

from ..support import mount_small_volume, run_bounded, unmount, write_config

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]


@pytest.fixture(scope="module")
def chaos_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # ~600 steps: long enough for a fault and its recovery, short enough for CI.
    return write_config(tmp_path_factory.mktemp("chaos") / "chaos.yaml",
                        train={"epochs": 14, "max_steps": None, "eval_every_steps": 0},
                        snapshot={"every_steps": 25}, logging={"every_steps": 25},
                        dist={"heartbeat_seconds": 2})


def chaos(*args: str, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    return run_bounded([sys.executable, "-m", "elastic_runner", "chaos", *args], timeout=timeout)


def paced_chaos(config: Path, run_dir: Path, *args: str, epochs: int = 5) -> subprocess.CompletedProcess[str]:
    """A chaos run of a job paced to >= 40 ms a step: a fault at 2-3 s always lands in a running job (its fault-free
    reference run is not paced)."""
    return chaos("--config", str(config), "--run-dir", str(run_dir), *args, "--set", f"train.epochs={epochs}",
                 "--set", "data.sampler=tests.broken_components:FaultPacedSampler")


# On c10d, the faults that change who is in the job (the agent hosting the store stays). Every fault type,
# on etcd-v3, in one supervised job: tests/elastic/test_soak.py.
FAULT_RUNS = {
    "kill-agent": "2:kill-agent",
    "kill-node": "2:kill-node",
    "join": "2:join",
}


@pytest.mark.parametrize("fault", list(FAULT_RUNS))
def test_each_fault_type_leaves_the_job_whole(fault: str, chaos_config: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    agents = "1" if fault == "join" else "2"
    # Paced (>= 40 ms a step, 1.8 s an epoch), the job cannot end before its fault however fast this machine
    # trains (unpaced, the 14 epochs took 3 s here and the fault found no job). A joining agent needs its own
    # start-up (~8 s here, slower on a loaded machine) before the job can grow: 16 epochs (>= 28 s) outlast it
    # several times over; any other fault lands 2-3 s in, and 5 epochs (>= 9 s) outlast it.
    longer = ["--set", f"train.epochs={16 if fault == 'join' else 5}", "--set",
              "data.sampler=tests.broken_components:FaultPacedSampler"]
    # Hung well past the watchdog's 2 s heartbeat timeout, so detection never races the wake-up.
    result = chaos("--config", str(chaos_config), "--run-dir", str(run_dir), "--agents", agents, "--nnodes", "1:2",
                   "--at", FAULT_RUNS[fault], "--hang-seconds", "5", *longer)
    assert result.returncode == 0, result.stdout[-4000:]
    assert f"fault  {fault}" in result.stdout and f"recovered from {fault}" in result.stdout
    report = json.loads((run_dir / "chaos" / "report.json").read_text())
    assert report["ok"] and all(check["ok"] for check in report["checks"].values())
    (injected,) = report["faults"]
    assert injected["type"] == fault and injected["recovery_s"] is not None and injected["outcome"] == "recovered"
    assert (run_dir / "chaos" / "report.md").read_text().startswith("# Chaos report: PASSED")


def test_bad_scenarios_are_refused_with_what_to_change(chaos_config: Path, tmp_path: Path) -> None:
    result = chaos("--config", str(chaos_config), "--run-dir", str(tmp_path / "r"), "--at", "2:explode", timeout=60)
    assert result.returncode == 2 and "unknown fault 'explode'" in result.stdout
    result = chaos("--config", str(chaos_config), "--run-dir", str(tmp_path / "r"), "--at", "2:restart-etcd", timeout=60)
    assert result.returncode == 2 and "restart-etcd needs --rdzv-backend etcd-v3" in result.stdout
    result = chaos("--config", str(chaos_config), "--run-dir", str(tmp_path / "r"), "--at", "2:slow-node", timeout=60)
    assert result.returncode == 2 and "slow-node: recovery.straggler_window_seconds (60) is not shorter than " \
        "slow_seconds (10)" in result.stdout, result.stdout
    result = chaos("--config", str(chaos_config), "--run-dir", str(tmp_path / "r"), "--at", "2:corrupt-param",
                   "--set", "recovery.fingerprint_every_steps=null", timeout=60)
    assert result.returncode == 2 and "corrupt-param: the job compares no fingerprints" in result.stdout, result.stdout
    result = chaos("--config", str(chaos_config), "--run-dir", str(tmp_path / "r"), "--at",
                   "step:10:corrupt-param,step:20:corrupt-param,step:30:corrupt-param,step:40:corrupt-param", timeout=60)
    assert result.returncode == 2 and "--set recovery.max_rollbacks=4" in result.stdout, result.stdout
    result = chaos("--config", str(chaos_config), "--run-dir", str(tmp_path / "r"), "--at", "step:10:nan-batch",
                   timeout=60)
    assert result.returncode == 2 and "nan-batch: the job's train.on_nonfinite is stop" in result.stdout, result.stdout


def test_a_hang_with_no_peer_to_notice_is_absorbed_not_waited_for(chaos_config: Path, tmp_path: Path) -> None:
    """Before: the scheduler waited ~120 s for a recovery that never came and reported it as one."""
    run_dir = tmp_path / "run"
    started = time.monotonic()
    result = paced_chaos(chaos_config, run_dir, "--agents", "1", "--nnodes", "1:1", "--at", "2:hang,6:kill-worker",
                         "--hang-seconds", "1")
    assert result.returncode == 0, result.stdout[-4000:]
    report = json.loads((run_dir / "chaos" / "report.json").read_text())
    hang, kill = report["faults"]
    assert hang["outcome"] == "absorbed" and kill["outcome"] == "recovered", report["faults"]
    assert "absorbed hang: training went on in the same attempt" in result.stdout
    assert report["recovery"]["count"] == 1, "an absorbed fault is not a recovery"
    assert time.monotonic() - started < 100


def test_a_full_snapshot_volume_is_ridden_out_and_snapshots_resume_once_space_is_back(
        chaos_config: Path, tmp_path: Path) -> None:
    volume = tmp_path / "volume"
    mount_small_volume(volume, "4m")  # room for keep_last + 1 snapshots of the small CNN (0.3 MB each)
    try:
        run_dir = tmp_path / "run"
        result = paced_chaos(chaos_config, run_dir, "--agents", "2", "--nnodes", "1:2", "--at", "2:fill-disk",
                             "--fill-seconds", "4", "--set", f"snapshot.dir={volume / 'snapshots'}", epochs=8)
        assert result.returncode == 0, result.stdout[-4000:]
        assert not list((volume / "snapshots").glob(".chaos-fill*")), "the filler is gone with the fault"
    finally:
        unmount(volume)
    report = json.loads((run_dir / "chaos" / "report.json").read_text())
    (fill,) = report["faults"]
    assert fill["type"] == "fill-disk" and fill["outcome"] == "absorbed", "training went on through it"
    check = report["checks"]["snapshots durable again after a full volume"]
    assert check["ok"] and not check["detail"].startswith("0 "), check["detail"]
    failed = [e for e in read_events(run_dir) if e["kind"] == "snapshot_failed"]
    assert failed and all("No space left" in e["error"] or "disk full" in e["error"] for e in failed), failed[:2]


def test_a_slow_node_is_named_a_straggler_and_the_job_rides_it_out(chaos_config: Path, tmp_path: Path) -> None:
    """slow-node slows one node's worker to a quarter of its speed for 6 s: nothing fails, the job slows, and
    that worker (and no other) is named a straggler while it is slow (at 1.5x the median for 3 s: at the default
    minute, a step of milliseconds would need a longer run)."""
    run_dir = tmp_path / "run"
    result = chaos("--config", str(chaos_config), "--run-dir", str(run_dir), "--agents", "2", "--nnodes", "2:2",
                   "--at", "step:100:slow-node", "--slow-seconds", "6", "--set", "train.epochs=25",
                   "--set", "recovery.straggler_ratio=1.5", "--set", "recovery.straggler_window_seconds=3")
    assert result.returncode == 0, result.stdout[-4000:]
    report = json.loads((run_dir / "chaos" / "report.json").read_text())
    (slow,) = report["faults"]
    assert slow["type"] == "slow-node" and slow["outcome"] == "absorbed" and len(slow["targets"]) == 1, slow
    check = report["checks"]["slow nodes named stragglers, and only they"]
    assert check["ok"] and check["detail"].startswith("1 of 1"), check
    named = [e for e in read_events(run_dir) if e["kind"] == "straggler" and e["status"] == "named"]
    assert [e["pid"] for e in named] == slow["targets"], named
    (target,) = slow["targets"]
    slowed = [(e["pid"], e["factor"]) for e in read_events(run_dir) if e["kind"] == "chaos_slowed"]
    assert slowed == [(target, 4.0), (target, 1.0)], f"the worker slowed, then let go: {slowed}"


def test_a_spare_takes_a_lost_nodes_place_and_the_final_model_is_the_reference_bit_for_bit(
        chaos_config: Path, tmp_path: Path) -> None:
    """spare-takeover: a third agent started beside a full round of two nodes of two processes each waits as a spare;
    a seated node is lost and the spare's two workers take its two ranks, so the world size never changes and the run
    is the fault-free reference's."""
    run_dir = tmp_path / "run"
    # A spare needs its agent's start-up (~8 s here) before the node is lost: 16 paced epochs (>= 28 s) outlast it.
    result = paced_chaos(chaos_config, run_dir, "--agents", "2", "--nnodes", "2:2", "--nproc-per-node", "2",
                         "--at", "2:spare-takeover", "--bitwise", epochs=16)
    assert result.returncode == 0, result.stdout[-4000:]
    report = json.loads((run_dir / "chaos" / "report.json").read_text())
    (taken,) = report["faults"]
    assert taken["type"] == "spare-takeover" and taken["outcome"] == "recovered" and taken["world_size"] == 4, taken
    check = report["checks"]["spares took lost nodes' places at the same world size"]
    assert check["ok"] and check["detail"].startswith("1 of 1"), check
    assert report["checks"]["bitwise at the end"]["ok"], report["checks"]


def test_bitwise_at_the_end_holds_for_worker_kills_a_flipped_bit_and_a_nan_batch_at_world_four(
        chaos_config: Path, tmp_path: Path) -> None:
    """--bitwise: two worker kills, a flipped bit in one replica (corrupt-param) and a NaN loss on one rank
    (nan-batch) at 2 agents x 2 processes; the flip is named at the next fingerprint check (the job checks at every
    logging step here) and rolled back, the NaN rolled back in process and its step skipped by rule, and the final
    model is exactly that of a fault-free reference run told to skip the same step (run after the job: the world
    size never changed)."""
    run_dir = tmp_path / "run"
    result = paced_chaos(chaos_config, run_dir, "--agents", "2", "--nnodes", "2:2", "--nproc-per-node", "2",
                         "--at", "step:50:kill-worker,step:110:corrupt-param,step:140:nan-batch,step:170:kill-worker",
                         "--bitwise", "--set", "train.on_nonfinite=rollback", epochs=5)
    assert result.returncode == 0, result.stdout[-4000:]
    report = json.loads((run_dir / "chaos" / "report.json").read_text())
    assert report["checks"]["bitwise at the end"]["ok"], report["checks"]
    assert report["reference"]["mode"] == "bitwise"
    assert [f["outcome"] for f in report["faults"]] == ["recovered"] * 4, report["faults"]
    check = report["checks"]["NaN batches rolled back at the next logging step and skipped"]
    assert check["ok"] and check["detail"].startswith("1 of 1 NaN batch(es) rolled back"), check
    (nan,) = [e for e in read_events(run_dir) if e["kind"] == "chaos_nan"]
    assert report["audit"]["skipped_steps"] == [nan["step"]], report["audit"]["skipped_steps"]
    check = report["checks"]["corrupted replicas named at the next fingerprint check"]
    assert check["ok"] and check["detail"].startswith("1 of 1 flipped bit(s) found"), check
    (flip,) = [e for e in read_events(run_dir) if e["kind"] == "chaos_corrupted"]
    (found,) = [e for e in read_events(run_dir) if e["kind"] == "replica_mismatch" and e["rank"] == 0
                and e["status"] == "rolled_back"]
    assert found["suspects"] == [flip["rank"]] and 0 <= found["step"] - flip["step"] <= 25, (flip, found)


def test_under_hsdp_a_flipped_bit_in_one_shard_copy_is_named_among_three_nodes_and_rolled_back_bitwise(
        chaos_config: Path, tmp_path: Path) -> None:
    """hsdp on 3 agents x 2 processes: each shard lives on every node, so a flip in rank 3's shard (node 1) is
    outvoted by that shard's copies on nodes 0 and 2; the job rolls back and ends with the reference run's model."""
    run_dir = tmp_path / "run"
    result = paced_chaos(chaos_config, run_dir, "--agents", "3", "--nnodes", "3:3", "--nproc-per-node", "2",
                         "--at", "step:110:corrupt-param", "--bitwise", "--set", "parallel.strategy=hsdp", epochs=5)
    assert result.returncode == 0, result.stdout[-4000:]
    report = json.loads((run_dir / "chaos" / "report.json").read_text())
    assert report["checks"]["bitwise at the end"]["ok"], report["checks"]
    (flip,) = [e for e in read_events(run_dir) if e["kind"] == "chaos_corrupted"]
    (found,) = [e for e in read_events(run_dir) if e["kind"] == "replica_mismatch" and e["rank"] == 0
                and e["status"] == "rolled_back"]
    assert found["suspects"] == [flip["rank"]] and found["nodes"] == [flip["rank"] // 2] and found["copies"] == 3, \
        (flip, found)
