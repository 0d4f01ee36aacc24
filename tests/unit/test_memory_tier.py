"""The node-memory tier: one writer per node, a dead writer's lock, copies of another run swept."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from elastic_runner.snapshot.memory import MemoryTier

from ..support import capture


def test_one_writer_per_node_others_wait_for_it(tmp_path: Path) -> None:
    writes = []

    def slow_capture() -> tuple[dict[str, Any], dict[str, Any]]:
        writes.append(threading.get_ident())
        time.sleep(0.3)
        return capture(3)()

    tier = MemoryTier(tmp_path / "mem", 1, "run-a")
    results = []
    threads = [threading.Thread(target=lambda: results.append(tier.save(3, slow_capture))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * 4 and len(writes) == 1


def test_a_dead_writers_lock_does_not_block_the_others(tmp_path: Path) -> None:
    tier = MemoryTier(tmp_path / "mem", 1, "run-a")
    tier.store.ensure()
    (tier.root / ".writing-g1-s3").write_text("999999999")  # a pid that does not exist
    assert tier.save(3, capture(3), wait_for_other=5)


def test_copies_of_another_run_on_the_same_path_are_swept(tmp_path: Path) -> None:
    old = MemoryTier(tmp_path / "mem", 5, "run-old")
    assert old.save(8, lambda: ({"model": {}}, {"run_uid": "run-old"}))
    new = MemoryTier(tmp_path / "mem", 1, "run-new")
    new.sweep()
    assert new.newest(0) is None


def _persistable(tmp_path: Path, run_uid_on_disk: str | None, run_uid_in_copy: str) -> tuple[Path, Path]:
    """A run directory (its snapshots dir with or without run-id) and a node-memory copy of step 9."""
    import torch

    from elastic_runner.snapshot.memory import memory_root

    run_dir = tmp_path / "run"
    snapshots = run_dir / "snapshots"
    snapshots.mkdir(parents=True)
    if run_uid_on_disk is not None:
        (snapshots / "run-id").write_text(run_uid_on_disk)
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    tier = MemoryTier(memory_root(str(snapshots), str(shm)), generation=3, run_uid=run_uid_in_copy)
    state = {"model": {"w": torch.ones(2)}}
    assert tier.save(9, lambda: (state, {"run_uid": run_uid_in_copy} if run_uid_in_copy else {}))
    return run_dir, shm


def test_persist_writes_only_a_copy_proven_to_be_this_runs(tmp_path: Path) -> None:
    from elastic_runner.snapshot import LocalStore, SnapshotError
    from elastic_runner.snapshot.cli import persist

    for on_disk, in_copy, why in ((None, "run-a", "run-id is missing"), ("run-a", "", "carries no run id"),
                                  ("run-b", "run-a", "belongs to another run")):
        case = tmp_path / f"{on_disk}-{in_copy}"
        run_dir, shm = _persistable(case, on_disk, in_copy)
        with pytest.raises(SnapshotError, match=why):
            persist(str(run_dir), str(shm))
        assert not LocalStore(run_dir / "snapshots").complete(), "nothing was written"
    run_dir, shm = _persistable(tmp_path / "same", "run-a", "run-a")
    assert persist(str(run_dir), str(shm))["step"] == 9
    assert [r.step for r in LocalStore(run_dir / "snapshots").complete()] == [9]
