"""A keyed job resumes from its own newest snapshot, whatever a writer of its run directory planted beside it (a
signed snapshot of its own copied under a newer name, another run's signed snapshot, an unsigned marker that claims
a newer format); a run starts from another run's snapshot only when told to (``snapshot.resume_from``), and its
audit begins where it started."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from elastic_runner.snapshot import LocalStore, SnapshotRef

from ..support import QUICKSTART, run_bounded

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]


@pytest.fixture
def keyed_env(tmp_path: Path) -> dict[str, str]:
    key = tmp_path / "job.key"
    key.write_text("k" * 64 + "\n")
    key.chmod(0o600)
    return os.environ | {"ELASTIC_RUNNER_AUTH_KEY_FILE": str(key)}


def train(run_dir: Path, env: dict[str, str], steps: int, *overrides: str) -> str:
    result = run_bounded([sys.executable, "-m", "elastic_runner.train", "--config", str(QUICKSTART), "--set",
                          f"run.dir={run_dir}", f"train.max_steps={steps}", "train.epochs=1", "snapshot.every_steps=5",
                          "snapshot.keep_last=2", *overrides], timeout=180, env=env)
    assert result.returncode == 0, result.stdout[-3000:]
    return result.stdout


def events(run_dir: Path, kind: str) -> list[dict[str, object]]:
    return [e for path in sorted((run_dir / "events").glob("*.jsonl")) for line in path.read_text().splitlines()
            if (e := json.loads(line))["kind"] == kind]


def cli(*args: str, env: dict[str, str] | None = None) -> str:
    result = run_bounded([sys.executable, "-m", "elastic_runner", *args], timeout=120, env=env)
    return result.stdout


def test_a_keyed_job_resumes_its_own_newest_snapshot_past_planted_rolled_back_and_foreign_ones(
        tmp_path: Path, keyed_env: dict[str, str]) -> None:
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    train(ours, keyed_env, 10)
    train(theirs, keyed_env, 20)  # another job with the same key (one secret reused across Jobs)
    snapshots = ours / "snapshots"
    assert [r.name for r in LocalStore(snapshots).complete()] == ["step-000000005-gen-000001",
                                                                  "step-000000010-gen-000001"]
    shutil.copytree(snapshots / "step-000000005-gen-000001", snapshots / "step-000000005-gen-000099")  # rolled back
    shutil.copytree(theirs / "snapshots" / "step-000000020-gen-000001", snapshots / "step-000000020-gen-000001")
    planted = snapshots / "step-000000099-gen-000001"
    planted.mkdir()
    (planted / "meta.json").write_text(json.dumps({"sha256": "0" * 64, "format": 3}))

    said = train(ours, keyed_env, 14)

    loaded = events(ours, "snapshot_loaded")
    assert [e["snapshot"] for e in loaded] == ["step-000000010-gen-000001"], said[-3000:]
    reasons = {e["snapshot"]: e["reason"] for e in events(ours, "snapshot_rejected")}
    assert sorted(reasons) == ["step-000000005-gen-000099", "step-000000020-gen-000001", "step-000000099-gen-000001"]
    assert "not of its directory's name" in reasons["step-000000005-gen-000099"]
    assert "written by another run" in reasons["step-000000020-gen-000001"]
    assert "not signed with the job's key" in reasons["step-000000099-gen-000001"]
    assert max(LocalStore(snapshots).complete()) == SnapshotRef(2, 14), "the job's own snapshots go on"
    assert "audit: CLEAN" in cli("audit", str(ours), env=keyed_env)


def test_a_run_starts_from_another_runs_snapshot_only_when_told_and_audits_from_there(
        tmp_path: Path, keyed_env: dict[str, str]) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    train(first, keyed_env, 10)
    before = sorted(p.name for p in (first / "snapshots").iterdir())

    said = train(second, keyed_env, 14, f"snapshot.resume_from={first / 'snapshots'}")

    assert "starts from another run's snapshot step-000000010-gen-000001" in said
    assert [e["step"] for e in events(second, "snapshot_loaded")] == [10]
    assert sorted(p.name for p in (first / "snapshots").iterdir()) == before, "the other run's directory is read only"
    assert (second / "snapshots" / "run-id").read_text() != (first / "snapshots" / "run-id").read_text()
    audit = cli("audit", str(second), env=keyed_env)
    assert "audit: CLEAN" in audit and "steps 1-10 and the first 320 samples of epoch 0 are that run's" in audit
    # Once the run has a snapshot of its own, it resumes from it; the option no longer decides anything.
    train(second, keyed_env, 18, f"snapshot.resume_from={first / 'snapshots'}")
    assert [e["step"] for e in events(second, "snapshot_loaded")] == [10, 14]

    empty = tmp_path / "empty"
    empty.mkdir()
    failed = run_bounded([sys.executable, "-m", "elastic_runner.train", "--config", str(QUICKSTART), "--set",
                          f"run.dir={tmp_path / 'third'}", "train.max_steps=4", f"snapshot.resume_from={empty}"],
                         timeout=180, env=keyed_env)
    assert failed.returncode != 0 and "holds no intact snapshot to start from" in failed.stdout, failed.stdout[-2000:]
