"""A full snapshot volume: training goes on, says so once a minute, and a finished run whose final
snapshot cannot be written keeps it in node memory, says where and how to write it out, and exits 4."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from elastic_runner.lifecycle import EXIT_NOT_DURABLE

from ..support import events, mount_small_volume, run_bounded, unmount

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


@pytest.fixture
def small_volume(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs: smaller than one snapshot of the quickstart model (0.3 MB)."""
    volume = tmp_path / "volume"
    mount_small_volume(volume, "256k")
    try:
        yield volume
    finally:
        unmount(volume)


def test_a_full_volume_keeps_the_finished_state_in_memory_and_says_how_to_write_it_out(
        small_config: Path, small_volume: Path, tmp_path: Path) -> None:
    run_dir, shm = tmp_path / "run", tmp_path / "shm"
    env = os.environ | {"ELASTIC_RUNNER_SHM_DIR": str(shm), "PYTHONUNBUFFERED": "1"}
    result = run_bounded([sys.executable, "-m", "elastic_runner.train", "--config", str(small_config),
                          "--set", f"run.dir={run_dir}", "--set", f"snapshot.dir={small_volume / 'snapshots'}",
                          "--set", "train.max_steps=50"], timeout=180, env=env)
    out = result.stdout
    assert result.returncode == EXIT_NOT_DURABLE, out[-3000:]
    assert "the snapshot volume" in out and "snapshot.keep_last: 3 needs about (3 + 1) x" in out, "warned at the start"
    failed = [line for line in out.splitlines() if "SNAPSHOT WRITE FAILED" in line]
    assert len(failed) == 1 and "MB free on" in failed[0], "one line while writes keep failing, with the numbers"
    assert " saved (" not in out, "nothing was saved durably, and no line says so"
    final = [line for line in out.splitlines() if line.startswith("elastic_runner: training finished at step 50")]
    assert len(final) == 1, out[-3000:]
    assert "No space left on device" in final[0] and "kept in node memory" in final[0]
    assert f"elastic-runner snapshot persist {run_dir}" in final[0]
    assert "Traceback" not in out
    (end,) = events(run_dir, "end")
    assert end["status"] == "finished_not_durable"

    # Space is freed: the command the line named writes the finished state out, checked.
    subprocess.run(["mount", "-o", "remount,size=8m", str(small_volume)], check=True)
    persisted = run_bounded([sys.executable, "-m", "elastic_runner", "snapshot", "persist", str(run_dir)], 60, env=env)
    assert persisted.returncode == 0, persisted.stdout[-3000:]
    assert json.loads(persisted.stdout.strip().splitlines()[-1])["step"] == 50
    inspected = run_bounded([sys.executable, "-m", "elastic_runner", "snapshot", "inspect", str(run_dir), "--verify"],
                            60, env=env)
    assert inspected.returncode == 0 and json.loads(inspected.stdout)["step"] == 50, inspected.stdout[-3000:]
