"""Silent corruption for real: one rank's replica gets a bit of a weight flipped mid-run (tests.broken_components:
corrupts_one_rank), nothing crashes, and the loss stays finite. The next fingerprint check names that rank and its
node, the snapshots taken after the last check that agreed are moved aside, every worker restarts from the newest
vouched-for state, and the run ends with the model an uninterrupted run makes, every sample seen exactly once. A
rank that corrupts its replica in every process stops the job after recovery.max_rollbacks, with exit status 3."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_runner.observe.audit import check_audit
from elastic_runner.observe.events import read_events

from ..support import end_events, write_config

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def mismatches(run_dir: Path) -> list[dict]:
    return [e for e in read_events(run_dir) if e["kind"] == "replica_mismatch"]


def corrupting_config(tmp_path: Path, name: str, once_file: str, **recovery: object) -> Path:
    # 3 ranks: a majority names the odd one. A check every 20 steps, snapshots every 25: the flip at the 75th step
    # is found at step 80, after the step-75 snapshot (which holds it) and before the step-100 one.
    return write_config(tmp_path / f"{name}.yaml", train={"epochs": None, "max_steps": 160, "eval_every_steps": 0},
                        model={"name": "tests.broken_components:corrupts_one_rank",
                               "params": {"rank": 2, "at_forward": 75, "once_file": once_file}},
                        snapshot={"every_steps": 25}, logging={"every_steps": 10},
                        recovery={"fingerprint_every_steps": 20, "straggler_ratio": None} | recovery)


def test_a_flipped_bit_is_named_at_the_next_check_and_the_job_rolls_back_to_the_model_of_an_uninterrupted_run(
        tmp_path: Path, local_job) -> None:  # noqa: ANN001
    clean_file = tmp_path / "clean-already"
    clean_file.touch()  # the reference run: the flip "happened already", so never
    reference = local_job(config=str(corrupting_config(tmp_path, "clean", str(clean_file))), nnodes="1:1",
                          nproc_per_node=3, max_restarts=0, run_dir=str(tmp_path / "reference"))
    reference.start_agent()
    assert reference.wait(timeout=200) == [0], reference.logs_tail()

    job = local_job(config=str(corrupting_config(tmp_path, "bad", str(tmp_path / "flipped"))), nnodes="1:1",
                    nproc_per_node=3, max_restarts=2)
    job.start_agent()
    assert job.wait(timeout=240) == [0], job.logs_tail()
    run_dir = Path(job.run_dir)

    # Every rank records what it found at once (the record survives whichever node is lost next); rank 0 the outcome.
    events = sorted(mismatches(run_dir), key=lambda e: e["rank"])
    assert [(e["rank"], e["step"], e["verified_step"], e["suspects"], e["nodes"], e["status"]) for e in events] == [
        (0, 80, 60, [2], [0], "found"), (0, 80, 60, [2], [0], "rolled_back"), (1, 80, 60, [2], [0], "found"),
        (2, 80, 60, [2], [0], "found")], events
    assert events[3]["host"] and events[1]["moved_aside"] == ["step-000000075-gen-000001"], events
    # The node's first rank set the snapshot after the agreeing check aside before anything waited for a peer.
    assert events[0]["moved_aside"] == ["step-000000075-gen-000001"], events
    aside = run_dir / "snapshots" / "corrupt-step-000000075-gen-000001"
    assert "the last whose replicas' fingerprints agreed" in (aside / "REASON").read_text()
    log = job.agents[0].log_text()
    assert "rank 2 (node 0) holds a state that differs from the other ranks'" in log, log[-3000:]
    kept = [e for e in read_events(run_dir) if e["kind"] == "kept_in_memory" and e["generation"] == 1]
    assert not kept, "no worker kept the state no check vouched for (a watchdog seeing its peers leave first)"
    resumes = [e for e in read_events(run_dir) if e["kind"] == "resume" and e.get("rank") == 0]
    assert [e["step"] for e in resumes] == [50], "the newest snapshot at or before step 60"

    digests = {e["params_sha256"] for e in end_events(run_dir)}
    assert digests == {e["params_sha256"] for e in end_events(Path(reference.run_dir))} and len(digests) == 1, \
        "the rolled-back run ends with the uninterrupted run's model on every rank"
    report = check_audit(run_dir)
    assert report.ok and report.final_step == 160, report.render()


def test_a_rank_that_keeps_corrupting_its_replica_stops_the_job_after_max_rollbacks_with_exit_3(
        tmp_path: Path, local_job) -> None:  # noqa: ANN001
    config = corrupting_config(tmp_path, "always", "", max_rollbacks=1)
    job = local_job(config=str(config), nnodes="1:1", nproc_per_node=3, max_restarts=5)
    job.start_agent()
    assert job.wait(timeout=240) == [3], job.logs_tail()
    statuses = [e["status"] for e in mismatches(Path(job.run_dir)) if e["rank"] == 0 and e["status"] != "found"]
    assert statuses == ["rolled_back", "stopped"], statuses
    log = job.agents[0].log_text()
    assert "stopping (exit status 3, not restarted): 1 rollbacks in the last 3600 s" in log, log[-3000:]
