"""A stopped worker's node memory made durable (elastic_runner.snapshot.persist): only when nothing durable is as
new, only this run's copy, never past the fence of a job that went on without the node, never a node's shards."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_runner.snapshot import LocalStore, SnapshotRef
from elastic_runner.snapshot.memory import MemoryTier
from elastic_runner.snapshot.persist import persist_newest

from ..support import capture


def _node_with_a_copy(tmp_path: Path, generation: int, step: int) -> tuple[LocalStore, Path]:
    """The run's snapshot store (run id "run-a", ``generation`` claimed) and a node-memory copy of ``step`` of it."""
    store = LocalStore(tmp_path / "snapshots")
    store.ensure()
    (store.root / "run-id").write_text("run-a")
    while store.newest_generation() < generation:
        store.claim_generation({})
    tier = MemoryTier(tmp_path / "memory", generation, "run-a")
    assert tier.save(step, capture(step))
    return store, tier.root


def test_a_copy_newer_than_the_disk_is_written_there_and_verified(tmp_path: Path) -> None:
    store, memory = _node_with_a_copy(tmp_path, generation=3, step=41)
    done = persist_newest(store, memory, job_ended=False, own_generation=3)
    assert done.written and done.step == 41 and done.to == store.location
    assert store.complete() == [SnapshotRef(generation=3, step=41)]
    assert LocalStore(memory).complete() == [SnapshotRef(generation=3, step=41)], "the copy itself stays"


def test_nothing_is_written_when_the_disk_holds_a_state_as_new(tmp_path: Path) -> None:
    store, memory = _node_with_a_copy(tmp_path, generation=3, step=41)
    assert persist_newest(store, memory, job_ended=False, own_generation=3).written
    again = persist_newest(store, memory, job_ended=False, own_generation=3)
    assert not again.written and again.durable_already and "already has step-000000041-gen-000003" in again.why


def test_a_job_that_went_on_without_the_node_fences_its_copy_out(tmp_path: Path) -> None:
    """A generation newer than the copy's and the worker's own: another round owns the snapshots (a split brain's
    stale side must not write); the worker's own newer generation (its next attempt claimed it) does not fence."""
    store, memory = _node_with_a_copy(tmp_path, generation=3, step=41)
    store.claim_generation({"host": "elsewhere"})  # generation 4
    refused = persist_newest(store, memory, job_ended=False, own_generation=3)
    assert not refused.written and not refused.durable_already
    assert "the job went on without this node" in refused.why and "generation 4" in refused.why
    assert store.complete() == []
    assert persist_newest(store, memory, job_ended=False, own_generation=4).written


def test_a_sharded_models_node_memory_is_never_written_as_a_snapshot(tmp_path: Path) -> None:
    """A sharded copy holds this node's shards only: as a durable snapshot it would be incomplete."""
    store = LocalStore(tmp_path / "snapshots")
    store.ensure()
    (store.root / "run-id").write_text("run-a")
    tier = MemoryTier(tmp_path / "memory", 1, "run-a")
    state, meta = capture(7)()
    assert tier.save(7, lambda: (state, meta | {"sharded": {"parts": {}, "part_ids": [0]}}))
    done = persist_newest(store, tier.root, job_ended=False, own_generation=1)
    assert not done.written and "shards" in done.why and store.complete() == []


def test_a_worker_that_is_not_its_nodes_first_or_has_no_copy_says_nothing(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from elastic_runner.config import load_config
    from elastic_runner.env import WorkerEnv
    from elastic_runner.worker.run_dir import save_node_memory

    monkeypatch.setenv("ELASTIC_RUNNER_SHM_DIR", str(tmp_path / "shm"))
    cfg = load_config(None, ["train.epochs=1", f"run.dir={tmp_path / 'run'}"])
    first = WorkerEnv(rank=0, local_rank=0, world_size=2, local_world_size=2)
    second = WorkerEnv(rank=1, local_rank=1, world_size=2, local_world_size=2)
    assert save_node_memory(cfg, first, 1) == "", "no copy in node memory: nothing to say"
    store = LocalStore(cfg.snapshot_dir)
    store.ensure()
    generation = store.claim_generation({})
    from elastic_runner.snapshot.memory import memory_root

    tier = MemoryTier(memory_root(cfg.snapshot_dir), generation, store.run_uid())
    state, meta = capture(12)()
    assert tier.save(12, lambda: (state, meta | {"run_uid": store.run_uid()}))
    assert save_node_memory(cfg, second, generation) == "", "the node's first worker writes it"
    assert store.complete() == []
    said = save_node_memory(cfg, first, generation)
    assert said.startswith(f"saved step 12 from node memory to {store.location}")
    assert [r.step for r in store.complete()] == [12]
