"""A rollback's first act (Checkpointer.set_aside_after): each node's first rank, rank 0 or not, moves this attempt's
snapshots taken after the last agreeing check aside before anything waits for a peer — rank 0, who writes them, may
hold the corrupted replica and be the next node lost."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from elastic_runner.snapshot import LocalStore, SnapshotWriter, require_ok
from elastic_runner.training.checkpointer import Checkpointer

from ..support import capture


def _store_with(tmp_path: Path, snapshots: list[tuple[int, int]]) -> LocalStore:
    store = LocalStore(tmp_path / "snapshots")
    store.ensure()
    for generation, step in snapshots:
        writer = SnapshotWriter(store, generation=generation, keep_last=10, async_write=False, durable=False)
        require_ok(writer.save(step, capture(step), sync=True))
    return store


def _rank(store: LocalStore, generation: int, rank: int, local_rank: int) -> SimpleNamespace:
    """A Checkpointer's view of one rank, as set_aside_after reads it."""
    kept: list[int] = []
    return SimpleNamespace(store=store, generation=generation, kept_at_most=kept,
                           env=SimpleNamespace(rank=rank, is_local_leader=local_rank == 0),
                           keep_nothing_after=kept.append)


def test_a_survivors_first_rank_sets_the_unvouched_snapshots_of_its_attempt_aside(tmp_path: Path) -> None:
    store = _store_with(tmp_path, [(6, 40), (7, 50), (7, 60), (7, 75)])
    survivor = _rank(store, generation=7, rank=1, local_rank=0)  # node 1's first rank; rank 0 may be gone
    moved = Checkpointer.set_aside_after(survivor, 60, "taken after step 60, the last whose fingerprints agreed")
    assert moved == ["step-000000075-gen-000007"]
    assert [(r.generation, r.step) for r in store.complete()] == [(6, 40), (7, 50), (7, 60)]
    reason = (store.root / "corrupt-step-000000075-gen-000007" / "REASON").read_text()
    assert "the last whose fingerprints agreed" in reason
    assert survivor.kept_at_most == [60], "and no thread of it keeps a state after the check in node memory"


def test_another_rank_of_the_node_only_stops_keeping_and_a_second_pass_finds_nothing(tmp_path: Path) -> None:
    store = _store_with(tmp_path, [(7, 50), (7, 75)])
    second = _rank(store, generation=7, rank=2, local_rank=1)
    assert Checkpointer.set_aside_after(second, 60, "why") == [] and len(store.complete()) == 2
    assert second.kept_at_most == [60]
    first = _rank(store, generation=7, rank=0, local_rank=0)
    assert Checkpointer.set_aside_after(first, 60, "why") == ["step-000000075-gen-000007"]
    assert Checkpointer.set_aside_after(_rank(store, 7, 1, 0), 60, "why") == [], "moved already: nothing twice"


def test_snapshots_of_earlier_attempts_stay_whatever_their_step(tmp_path: Path) -> None:
    """Another attempt's snapshot was vouched for (or not) in its own attempt; only this attempt's are suspect."""
    store = _store_with(tmp_path, [(6, 90), (7, 75)])
    assert Checkpointer.set_aside_after(_rank(store, 7, 1, 0), 60, "why") == ["step-000000075-gen-000007"]
    assert [(r.generation, r.step) for r in store.complete()] == [(6, 90)]
