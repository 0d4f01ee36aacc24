"""A snapshot is bound to its place: its signed fields (run id, step, generation) must agree with its directory's
name and with the run reading it. Whatever a writer of the snapshot directory plants — a signed snapshot copied
under a newer name, another run's snapshot, an unsigned marker that claims a newer format, a link where the state
file should be — is moved aside with the reason, the job's own newest snapshot is the one resumed, and
``keep_last`` never deletes the job's own snapshots because of it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

from elastic_runner.snapshot import LocalStore, SnapshotRef, SnapshotWriter, find_newest, require_ok
from elastic_runner.snapshot.format import signing_key

KEY = b"k" * 32


def capture(step: int, run_uid: str = "ours") -> Callable[[], tuple[dict[str, Any], dict[str, Any]]]:
    return lambda: ({"model": {"w": torch.full((2,), float(step))}},
                    {"fingerprint": {"m": "x"}, "run_uid": run_uid})


@pytest.fixture(autouse=True)
def keyed() -> Iterator[None]:
    with signing_key(KEY):
        yield


def written(root: Path, steps: list[int], run_uid: str = "ours", keep_last: int = 5) -> tuple[LocalStore, SnapshotWriter]:
    store = LocalStore(root)
    store.ensure()
    writer = SnapshotWriter(store, generation=store.claim_generation({}), keep_last=keep_last)
    for step in steps:
        require_ok(writer.save(step, capture(step, run_uid), sync=True))
    return store, writer


def reason(store: LocalStore, name: str) -> str:
    return (store.root / f"corrupt-{name}" / "REASON").read_text()


def test_a_signed_snapshot_copied_under_a_newer_name_is_moved_aside_not_resumed(tmp_path: Path) -> None:
    store, _ = written(tmp_path / "s", [10, 20, 30])
    shutil.copytree(store.path(SnapshotRef(1, 10)), store.root / "step-000000010-gen-000099")  # rolled back
    shutil.copytree(store.path(SnapshotRef(1, 10)), store.root / "step-000000090-gen-000001")  # renamed forward

    loaded = find_newest(store, run_uid="ours")

    assert loaded is not None and loaded.ref == SnapshotRef(1, 30)
    assert "is the snapshot of step 10, generation 1, not of its directory's name" in reason(
        store, "step-000000010-gen-000099")
    assert "not of its directory's name" in reason(store, "step-000000090-gen-000001")


def test_keep_last_keeps_the_jobs_own_snapshots_when_a_newer_name_is_planted(tmp_path: Path) -> None:
    store, writer = written(tmp_path / "s", [10, 20], keep_last=2)
    shutil.copytree(store.path(SnapshotRef(1, 10)), store.root / "step-000000010-gen-000099")
    shutil.copytree(store.path(SnapshotRef(1, 10)), store.root / "step-000000099-gen-000001")
    for step in (30, 40):
        require_ok(writer.save(step, capture(step), sync=True))

    names = [ref.name for ref in store.complete()]
    # Before: the planted names counted among the newest two, and the job's step 30 was deleted.
    assert names == ["step-000000030-gen-000001", "step-000000040-gen-000001", "step-000000099-gen-000001",
                     "step-000000010-gen-000099"]
    loaded = find_newest(store, run_uid="ours")
    assert loaded is not None and loaded.ref == SnapshotRef(1, 40)


def test_another_runs_signed_snapshot_is_moved_aside_with_both_run_ids(tmp_path: Path) -> None:
    store, _ = written(tmp_path / "ours", [10, 20])
    theirs, _ = written(tmp_path / "theirs", [10, 20, 50], run_uid="theirs")  # the same key: a reused secret
    shutil.copytree(theirs.path(SnapshotRef(1, 50)), store.root / "step-000000050-gen-000001")

    loaded = find_newest(store, run_uid="ours")

    assert loaded is not None and loaded.ref == SnapshotRef(1, 20)
    assert "written by another run (run id theirs; this run's is ours)" in reason(store, "step-000000050-gen-000001")


def test_reading_another_runs_store_on_purpose_changes_nothing_there(tmp_path: Path) -> None:
    theirs, _ = written(tmp_path / "theirs", [10, 20], run_uid="theirs")
    (theirs.path(SnapshotRef(1, 20)) / "state.pt").write_bytes(b"damaged")
    before = sorted(p.name for p in theirs.root.iterdir())

    loaded = find_newest(theirs, readonly=True)

    assert loaded is not None and loaded.ref == SnapshotRef(1, 10)
    assert sorted(p.name for p in theirs.root.iterdir()) == before


def test_an_unsigned_marker_claiming_a_newer_format_is_moved_aside_not_an_error(tmp_path: Path) -> None:
    store, _ = written(tmp_path / "s", [10])
    planted = store.root / "step-000000099-gen-000001"
    planted.mkdir()
    (planted / "meta.json").write_text(json.dumps({"sha256": "0" * 64, "format": 3}))  # 30 bytes, no signature

    loaded = find_newest(store, run_uid="ours")

    assert loaded is not None and loaded.ref == SnapshotRef(1, 10)
    assert "is not signed with the job's key" in reason(store, "step-000000099-gen-000001")


@pytest.mark.parametrize("where", ["link", "directory"])
def test_a_state_file_that_is_a_link_or_a_directory_is_damage_not_a_temporary_failure(tmp_path: Path,
                                                                                    where: str) -> None:
    store, _ = written(tmp_path / "s", [10, 20])
    state = store.path(SnapshotRef(1, 20)) / "state.pt"
    elsewhere = tmp_path / "elsewhere.pt"
    shutil.move(state, elsewhere)
    if where == "link":
        os.symlink(elsewhere, state)  # the same bytes, through a link: still not the snapshot's own file
    else:
        state.mkdir()

    loaded = find_newest(store, run_uid="ours")

    assert loaded is not None and loaded.ref == SnapshotRef(1, 10)
    assert "state.pt is not a regular file" in reason(store, "step-000000020-gen-000001")


def test_a_name_taken_by_an_earlier_move_does_not_keep_a_damaged_snapshot_in_place(tmp_path: Path) -> None:
    store, _ = written(tmp_path / "s", [10, 20])
    (store.root / "corrupt-step-000000020-gen-000001").mkdir()  # planted, or left by an earlier move
    (store.path(SnapshotRef(1, 20)) / "state.pt").write_bytes(b"damaged")

    loaded = find_newest(store, run_uid="ours")

    assert loaded is not None and loaded.ref == SnapshotRef(1, 10)
    assert [ref.name for ref in store.complete()] == ["step-000000010-gen-000001"]
    assert (store.root / "corrupt-step-000000020-gen-000001-2" / "REASON").is_file()
