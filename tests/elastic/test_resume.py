"""Exact resume under real torchrun agents on loopback (gloo): the product's core promise."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from elastic_runner.observe.audit import check_audit
from elastic_runner.snapshot import LocalStore

from ..support import (
    assert_bitwise_equal,
    assert_no_tracebacks,
    continue_workers,
    end_events,
    events,
    exported_model,
    run_bounded,
    start_agent_while_paused,
    stop_workers_at_step,
    told,
    write_config,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def losses_by_step(run_dir: Path, every: int = 10) -> dict[int, float]:
    """The training loss logged at each step by the generation that finally owns it
    (full logging windows only: the first line after a restart averages fewer steps)."""
    out: dict[int, tuple[int, float]] = {}
    for e in events(run_dir, "progress"):
        if e["window_steps"] != every and e["step"] % every == 0:
            continue
        prev = out.get(e["step"])
        if prev is None or e["generation"] >= prev[0]:
            out[e["step"]] = (e["generation"], e["loss"])
    return {step: loss for step, (_, loss) in out.items()}


def test_worker_sigkill_resumes_from_the_newest_snapshot_and_ends_bitwise_identical(
        resume_config: Path, reference_model, local_job, tmp_path: Path) -> None:  # noqa: ANN001
    job = local_job(config=str(resume_config), nnodes="2:2")
    job.start_agent()
    job.start_agent()
    run_dir = Path(job.run_dir)
    # Freeze both workers so that the step at the kill is known: no rank has started a step past
    # the newest audit record, so no survivor can hold a newer state than that.
    workers, killed_at = stop_workers_at_step(job, 130, count=2, timeout=120)
    victim = next(w for w in workers if w.rank == 1)
    job.signal_worker(victim, signal.SIGKILL)
    continue_workers(job, [w for w in workers if w is not victim])
    assert job.wait(timeout=180) == [0, 0], job.logs_tail()

    saved_before = [e["step"] for e in events(run_dir, "snapshot_saved") if e["generation"] == 1]
    loads = [e for e in events(run_dir, "snapshot_loaded") if e["generation"] > 1]
    first_resume = min(e["generation"] for e in loads)
    resumed = [e for e in loads if e["generation"] == first_resume]
    assert sorted(e["rank"] for e in resumed) == [0, 1], "every rank resumes"
    assert len({e["snapshot"] for e in resumed}) == 1, "from the same snapshot"
    assert max(saved_before) <= resumed[0]["step"] <= killed_at

    report = check_audit(run_dir)
    assert report.ok, report.render()
    assert report.finished and report.final_step == 400 and len(report.generations) >= 2
    assert_bitwise_equal(exported_model(run_dir, tmp_path), reference_model)


def test_node_loss_then_join_keeps_global_batch_and_tracks_the_uninterrupted_loss(
        resume_config: Path, reference_run: Path, local_job) -> None:  # noqa: ANN001
    job = local_job(config=str(resume_config), nnodes="1:2")
    job.start_agent()
    second = job.start_agent()
    run_dir = Path(job.run_dir)
    paused, _ = stop_workers_at_step(job, 80, count=2, timeout=120)  # two workers: a world of 2
    killed_at = time.time()
    job.kill_agent(second)  # node loss: agent and its worker, SIGKILL (agent 0 hosts the c10d store)
    continue_workers(job, paused)

    def alone() -> list[dict]:  # the first agent may have trained alone before the second joined
        return [e for e in events(run_dir, "world") if e["world_size"] == 1 and e["time"] > killed_at]

    deadline = time.monotonic() + 90
    while not alone():
        assert time.monotonic() < deadline, job.logs_tail()
        time.sleep(0.1)
    at_one = max(e["step"] for e in alone())
    start_agent_while_paused(job, at_step=at_one + 40, count=1)  # node join
    codes = job.wait(timeout=240)
    assert codes[0] == 0 and codes[2] == 0, job.logs_tail()
    # The terminal's story: the node loss and the join, one line each; the survivor kept its process through both
    # (in-process recovery, the default) and says so, not that somebody sent SIGTERM; no traceback of the handled
    # failure.
    left = told(job, r"a node left \(world size 2 → 1\) at step \d+ → recovered in process in \d+\.\d+ s at world "
                     r"size 1, resumed step \d+ from memory, \d+ steps lost")
    joined = told(job, r"a node joined \(world size 1 → 2\) at step \d+ → training at world size 2, resumed step \d+ ")
    assert len(left) == 1 and len(joined) == 1, job.logs_tail()
    assert told(job, r"the membership changed \(.*\); this worker kept its process and is rank \d+ of 2 in the new "
                     r"round"), job.logs_tail()
    assert not told(job, "received SIGTERM"), job.logs_tail()
    assert_no_tracebacks(job)

    worlds = events(run_dir, "world")
    assert {e["world_size"] for e in worlds} >= {1, 2}
    for e in worlds:  # the global batch is the optimisation contract, at every world size
        assert e["global_batch"] == 32
        assert e["micro_batch"] * e["accumulation"] * e["world_size"] == 32
    report = check_audit(run_dir)
    assert report.ok, report.render()
    assert set(report.global_batches) == {32}

    ours, ref = losses_by_step(run_dir), losses_by_step(reference_run)
    common = sorted(set(ours) & set(ref))
    assert len(common) >= 30
    assert all(abs(ours[s] - ref[s]) < 0.05 for s in common), [(s, ours[s], ref[s]) for s in common if abs(ours[s] - ref[s]) >= 0.05]
    assert abs(ours[400] - ref[400]) <= 0.1 * ref[400] + 1e-3
    assert len({e["params_sha256"] for e in end_events(run_dir)}) == 1


def test_rank0_killed_while_writing_a_large_snapshot_resumes_from_the_previous_one(local_job, tmp_path: Path) -> None:  # noqa: ANN001
    # ~13M parameters + momentum: a ~100 MB snapshot that takes a while to write.
    # The memory tier is off: with it the survivor's copy (newer still) would be used, and
    # this test is about the disk path never picking the torn write.
    config = write_config(tmp_path / "big.yaml", model={"name": "mlp", "params": {"hidden": 2048, "depth": 3}},
                          train={"epochs": 100, "max_steps": 24, "eval_every_steps": 0},
                          snapshot={"every_steps": 4, "keep_last": 2, "in_memory": False}, logging={"every_steps": 4})
    job = local_job(config=str(config), nnodes="1:1", nproc_per_node=2)
    job.start_agent()
    store = LocalStore(Path(job.run_dir) / "snapshots")
    deadline = time.monotonic() + 120
    while not store.complete():
        assert time.monotonic() < deadline, job.logs_tail()
        time.sleep(0.01)
    first = store.complete()[-1]
    rank0 = next(w for w in job.workers() if w.rank == 0)  # looked up first: the kill follows the sighting at once
    while not [n for n in store.incomplete() if n.startswith(".tmp-step")]:
        assert time.monotonic() < deadline, job.logs_tail()
        time.sleep(0.002)
    job.signal_worker(rank0, signal.SIGKILL)
    # Only rank 0 writes: what is complete now is what the restart may use.
    complete_at_kill = store.complete()[-1]
    assert [n for n in store.incomplete() if n.startswith(".tmp-step")], "killed in the middle of a write"
    assert job.wait(timeout=180) == [0], job.logs_tail()

    resumed = [e for e in events(Path(job.run_dir), "snapshot_loaded") if e["generation"] == 2]
    assert resumed and resumed[0]["snapshot"] == complete_at_kill.name
    assert complete_at_kill.step >= first.step
    assert not [n for n in store.incomplete() if "gen-000001" in n], "the torn write was swept"
    assert check_audit(job.run_dir).ok


def test_sigterm_saves_within_the_grace_period_exits_zero_and_resumes_without_loss(resume_config: Path, local_job) -> None:  # noqa: ANN001
    job = local_job(config=str(resume_config), nnodes="1:1", nproc_per_node=2)
    agent = job.start_agent()
    run_dir = Path(job.run_dir)
    paused, _ = stop_workers_at_step(job, 60, count=2, timeout=120)
    # Running again first: our agent (plain torchrun's too, through the entry-point hook) SIGKILLs workers that
    # are stopped when it shuts the group down, since they cannot answer SIGTERM.
    continue_workers(job, paused)
    sent = time.monotonic()
    agent.proc.send_signal(signal.SIGTERM)  # what Kubernetes sends on preemption
    job.wait(timeout=60)
    assert time.monotonic() - sent < 30
    assert not job.leftover_processes()
    stops = [e for e in events(run_dir, "stop")]
    assert sorted(e["rank"] for e in stops) == [0, 1]
    # Each worker knew the SIGTERM was its agent's, and why (in the agent's private directory, env.stop_announced).
    assert [e["by_agent"] for e in stops] == ["the agent is shutting down on SIGTERM"] * 2, stops
    ends = [e for e in events(run_dir, "end") if e.get("status") == "stopped"]
    assert sorted(e["rank"] for e in ends) == [0, 1], "both workers exited through the graceful path"
    stop_step = max(e["step"] for e in stops)
    assert LocalStore(run_dir / "snapshots").complete()[-1].step == stop_step

    job.start_agent()  # the job comes back later and continues where it stopped
    assert job.wait(timeout=180)[-1] == 0, job.logs_tail()
    resumed = [e for e in events(run_dir, "snapshot_loaded") if e["generation"] == 2]
    assert resumed[0]["step"] == stop_step, "no step lost on a graceful stop"
    assert check_audit(run_dir).ok


def _alone(config: Path, run_dir: Path, *overrides: str) -> "object":
    cmd = [sys.executable, "-m", "elastic_runner.train", "--config", str(config), "--set", f"run.dir={run_dir}"]
    for o in overrides:
        cmd += ["--set", o]
    return run_bounded(cmd, timeout=120)


def test_damaged_newest_snapshot_is_reported_and_the_previous_one_used(small_config: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = _alone(small_config, run_dir, "train.max_steps=30")
    assert first.returncode == 0, first.stdout[-2000:]
    store = LocalStore(run_dir / "snapshots")
    newest = store.complete()[-1]
    assert newest.step == 30
    with open(store.path(newest) / "state.pt", "r+b") as fh:
        fh.truncate(1000)
    second = _alone(small_config, run_dir, "train.max_steps=40")
    assert second.returncode == 0, second.stdout[-2000:]
    assert "is damaged and is moved aside" in second.stdout
    (loaded,) = [e for e in events(run_dir, "snapshot_loaded") if e["generation"] == 2]
    assert loaded["step"] == 20
    assert [e["snapshot"] for e in events(run_dir, "snapshot_rejected")] == [newest.name]
    assert check_audit(run_dir).ok


def test_snapshot_of_another_configuration_stops_with_the_differing_keys(small_config: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = _alone(small_config, run_dir, "train.max_steps=10")
    assert first.returncode == 0, first.stdout[-3000:]
    other_model = _alone(small_config, run_dir, "train.max_steps=20", "model.params.hidden=8")
    assert other_model.returncode == 2, other_model.stdout[-6000:]
    assert "model.params" in other_model.stdout and "snapshot.allow_mismatch" in other_model.stdout
    other_lr = _alone(small_config, run_dir, "train.max_steps=20", "optim.lr=0.05")
    assert other_lr.returncode == 2 and "optim.lr" in other_lr.stdout, other_lr.stdout[-6000:]
    allowed = _alone(small_config, run_dir, "train.max_steps=20", "optim.lr=0.05", "snapshot.allow_mismatch=true")
    assert allowed.returncode == 0, allowed.stdout[-2000:]
    assert "finished step=20" in allowed.stdout
    # nothing that was saved before was lost along the way
    assert [r.step for r in LocalStore(run_dir / "snapshots").complete()][-2:] == [10, 20]
