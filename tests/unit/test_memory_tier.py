"""The node-memory tier: one writer per node, a dead writer's lock, copies of another run swept."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

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
