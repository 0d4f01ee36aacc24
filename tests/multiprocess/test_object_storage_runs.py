"""Real runs (torchrun, 2 workers) whose snapshots live in a bucket of a real S3 server, not in a shared directory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from elastic_runner.snapshot import SnapshotRef
from elastic_runner.snapshot.object_store import ObjectStore
from elastic_runner.testing.s3_server import S3Server

from ..support import end_events, events, torchrun_standalone

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]


def run(config: Path, run_dir: Path, env: dict[str, str], steps: int, *more: str) -> None:
    result = torchrun_standalone(config, run_dir, nproc=2, timeout=240, extra_env=env,
                                 overrides=[f"train.max_steps={steps}", *more])
    assert result.returncode == 0, result.stdout[-4000:]


def test_a_job_with_no_shared_directory_resumes_from_the_bucket_on_a_node_with_an_empty_disk(
        small_config: Path, s3_server: S3Server, s3_prefix: str, tmp_path: Path) -> None:
    url = f"{s3_prefix}/snapshots"
    # Every start is a fresh node: its own empty run.dir and its own empty node memory.
    def node_env(name: str) -> dict[str, str]:
        shm = tmp_path / f"shm-{name}"
        shm.mkdir(mode=0o700)
        return s3_server.env() | {"ELASTIC_RUNNER_SHM_DIR": str(shm)}

    first, second = tmp_path / "node-1", tmp_path / "node-2"
    run(small_config, first, node_env("1"), 30, f"snapshot.dir={url}")
    run(small_config, second, node_env("2"), 60, f"snapshot.dir={url}")
    (resume,) = [e for e in events(second, "resume") if e["rank"] == 0]
    assert resume["tier"] == "disk" and resume["step"] == 30, resume
    assert not (second / "snapshots").exists() and not (first / "snapshots").exists(), "nothing of it on a node"

    # The same two runs with a directory (max_steps shapes the schedule: 30 then 60 is not 60 in one go): the
    # same model, bit for bit.
    reference = tmp_path / "reference"
    run(small_config, reference, node_env("ref-1"), 30)
    run(small_config, reference, node_env("ref-2"), 60)
    ours, theirs = end_events(second), end_events(reference)
    assert {e["params_sha256"] for e in ours} == {e["params_sha256"] for e in theirs}, "the bucket changed the model"

    fs: Any = s3_server.filesystem()
    store = ObjectStore(url, local=tmp_path / "inspect", fs=fs)
    assert store.complete()[-1] == SnapshotRef(generation=2, step=60)
    assert os.stat(tmp_path / "node-2" / ".objects").st_mode & 0o077 == 0, "the node's copies are private"
