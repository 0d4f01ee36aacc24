"""Which snapshot a job resumes from when some are damaged or unreadable: nothing moved aside for a passing error, no fresh start over damaged state."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_runner.snapshot import (
    LocalStore,
    SnapshotError,
    SnapshotRef,
    SnapshotUnavailableError,
    SnapshotWriter,
    find_newest,
    require_ok,
)

from ..support import capture


def test_a_transient_read_error_moves_nothing_aside(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "s")
    store.ensure()
    w = SnapshotWriter(store, generation=store.claim_generation({}), keep_last=3)
    require_ok(w.save(10, capture(10), sync=True))
    state = store.path(SnapshotRef(1, 10)) / "state.pt"
    state.unlink()
    state.mkdir()  # reading it now fails with an OSError, as on a flaky NFS mount
    with pytest.raises(SnapshotUnavailableError):
        find_newest(store)
    assert store.complete() == [SnapshotRef(1, 10)] and store.corrupt() == []


def test_when_every_snapshot_is_damaged_the_run_stops_instead_of_starting_over(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "s")
    store.ensure()
    w = SnapshotWriter(store, generation=store.claim_generation({}), keep_last=3)
    for step in (10, 20):
        require_ok(w.save(step, capture(step), sync=True))
        (store.path(SnapshotRef(1, step)) / "state.pt").write_bytes(b"garbage")
    with pytest.raises(SnapshotError, match="all 2 snapshot"):
        find_newest(store)
