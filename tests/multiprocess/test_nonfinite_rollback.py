"""A poisoned sample for real (tests.broken_components:digits_with_poisoned_samples: its input is all NaN, so the loss
of the rank that draws it is NaN). With ``train.on_nonfinite: rollback`` the job does not stop: at the next logging
step every worker, in its process, resumes from the newest snapshot (before the bad step) and skips that step by
rule, its samples marked skipped in the audit trail; the run ends with the model of an uninterrupted run told to skip
that step (``train.skip_steps``), bitwise. A run that keeps meeting non-finite steps stops after
``recovery.max_rollbacks`` with exit status 3."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_runner.data.datasets import DIGITS_SPLIT_SEED, _split, load_digits_tensors
from elastic_runner.data.order import DEFAULT_ORDER, epoch_order
from elastic_runner.observe.audit import check_audit
from elastic_runner.observe.events import read_events

from ..support import end_events, torchrun_standalone, write_config

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

GLOBAL_BATCH = 32


def sample_of_step(step: int, position: int = 3) -> int:
    """The training sample at ``position`` of ``step``'s global batch in epoch 0 (run.seed 0, shuffled)."""
    x, y = load_digits_tensors()
    train, _ = _split(x, y, 0.2, DIGITS_SPLIT_SEED)
    order = epoch_order(DEFAULT_ORDER, len(train), 0, 0, True)
    return int(order.slice((step - 1) * GLOBAL_BATCH + position, 1)[0])


def config(tmp_path: Path, name: str, poisoned_steps: list[int], **train: object) -> Path:
    # Snapshots and the non-finite check every 10 steps: a NaN at step 26 is read at step 30, where no snapshot is
    # taken of the diverged state; the newest is step 20's.
    return write_config(tmp_path / f"{name}.yaml",
                        data={"name": "tests.broken_components:digits_with_poisoned_samples",
                              "params": {"poisoned": [sample_of_step(s) for s in poisoned_steps]}},
                        batch={"global_size": GLOBAL_BATCH},
                        train={"epochs": None, "max_steps": 40, "eval_every_steps": 0} | train,
                        snapshot={"every_steps": 10}, logging={"every_steps": 10},
                        recovery={"straggler_ratio": None})


def rollbacks(run_dir: Path) -> list[dict]:
    return [e for e in read_events(run_dir) if e["kind"] == "nonfinite_rollback"]


def test_a_poisoned_batch_is_rolled_back_and_skipped_by_rule_and_the_run_ends_as_one_told_to_skip_it(
        tmp_path: Path, local_job) -> None:  # noqa: ANN001
    job = local_job(config=str(config(tmp_path, "poisoned", [26], on_nonfinite="rollback")), nnodes="1:1",
                    nproc_per_node=3, max_restarts=0)
    job.start_agent()
    assert job.wait(timeout=200) == [0], job.logs_tail()
    run_dir = Path(job.run_dir)

    assert [(e["step"], e["status"], e["rollbacks_before"]) for e in rollbacks(run_dir)] == [(26, "rolled_back", 0)]
    resumes = [e for e in read_events(run_dir) if e["kind"] == "resume" and e.get("rank") == 0]
    assert [(e["step"], e["generation"]) for e in resumes] == [(20, 2)], "in its process, from the newest snapshot"
    starts = {e["pid"] for e in read_events(run_dir) if e["kind"] == "start"}
    assert len(starts) == 3, "no worker was restarted: the rollback runs in the workers' own processes"
    skipped = [e for e in read_events(run_dir) if e["kind"] == "step_skipped"]
    assert [(e["step"], e["samples"]) for e in skipped] == [(26, GLOBAL_BATCH)], skipped
    log = job.agents[0].log_text()
    assert "step 26: the loss of rank" in log and "rolling back" in log, log[-3000:]
    assert "the loss of step 26 was not finite (rank" in log and "a rollback that skips its batch" in log, log[-3000:]

    report = check_audit(run_dir)
    assert report.ok and report.final_step == 40 and report.skipped_steps == [26], report.render()
    assert report.epochs[0].skipped == GLOBAL_BATCH and "skipped by rule" in report.render()

    reference = local_job(config=str(config(tmp_path, "told", [26], skip_steps=[26])), nnodes="1:1",
                          nproc_per_node=3, max_restarts=0, run_dir=str(tmp_path / "reference"))
    reference.start_agent()
    assert reference.wait(timeout=200) == [0], reference.logs_tail()
    digests = {e["params_sha256"] for e in end_events(run_dir)}
    assert digests == {e["params_sha256"] for e in end_events(Path(reference.run_dir))} and len(digests) == 1, \
        "the rolled-back run ends with the model of a run told to skip the step, on every rank"


def test_a_run_that_keeps_meeting_nonfinite_steps_stops_after_max_rollbacks_with_exit_3(
        tmp_path: Path, local_job) -> None:  # noqa: ANN001
    path = config(tmp_path, "twice", [16, 33], on_nonfinite="rollback")
    job = local_job(config=str(path), nnodes="1:1", nproc_per_node=2, max_restarts=3,
                    overrides=["recovery.max_rollbacks=1"])
    job.start_agent()
    assert job.wait(timeout=200) == [3], job.logs_tail()
    assert [(e["step"], e["status"]) for e in rollbacks(Path(job.run_dir))] == [(16, "rolled_back"), (33, "stopped")]
    log = job.agents[0].log_text()
    assert "stopping (exit status 3, not restarted): 1 rollbacks in the last 3600 s" in log, log[-3000:]


def test_a_logging_window_of_only_skipped_steps_reports_no_loss_rather_than_zero(tmp_path: Path) -> None:
    path = config(tmp_path, "window", [], skip_steps=list(range(11, 21)), max_steps=30)
    result = torchrun_standalone(path, tmp_path / "run", nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    progress = {e["step"]: e for e in read_events(tmp_path / "run") if e["kind"] == "progress"}
    assert sorted(progress) == [10, 20, 30]
    assert "loss" not in progress[20] and progress[20]["trained"] is False, progress[20]
    assert all(progress[s]["loss"] > 0 for s in (10, 30)), progress
    assert "no step trained" in result.stdout + result.stderr or "trained=False" in result.stdout + result.stderr
