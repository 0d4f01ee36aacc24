"""Which snapshot a job resumes from when some are damaged or unreadable: nothing moved aside for a passing error, no fresh start over damaged state."""

from __future__ import annotations

import errno
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
from elastic_runner.snapshot import format as snapshot_format

from ..support import capture


def test_a_transient_read_error_moves_nothing_aside(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = LocalStore(tmp_path / "s")
    store.ensure()
    w = SnapshotWriter(store, generation=store.claim_generation({}), keep_last=3)
    require_ok(w.save(10, capture(10), sync=True))

    def flaky(path: object, *args: object, **kwargs: object) -> None:
        raise OSError(errno.EIO, "Input/output error", str(path))  # as a flaky NFS mount answers

    monkeypatch.setattr(snapshot_format, "_open_unfollowed", flaky)
    with pytest.raises(SnapshotUnavailableError, match="Input/output error"):
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
