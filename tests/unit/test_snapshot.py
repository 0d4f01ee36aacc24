"""Snapshots: atomic publish, async write, verified load, fencing, and nothing older lost."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from elastic_runner.snapshot import (
    LocalStore,
    SnapshotError,
    SnapshotRef,
    SnapshotWriter,
    StaleWriterError,
    find_newest,
    load_snapshot,
    require_ok,
)
from elastic_runner.snapshot.cli import export, inspect


def state_at(step: int, size: int = 4) -> dict[str, Any]:
    return {"model": {"w": torch.full((size,), float(step)), "module_like": torch.arange(3)},
            "optimizer": {"state": {}, "param_groups": []}, "train": {"step": step}}


def capture(step: int, size: int = 4):  # noqa: ANN201
    return lambda: (state_at(step, size), {"epoch": 0, "consumed": step * 8, "world_size": 2, "world_history": []})


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    s = LocalStore(tmp_path / "snapshots")
    s.ensure()
    return s


def writer_for(store: LocalStore, generation: int | None = None, **kwargs: Any) -> SnapshotWriter:
    gen = generation if generation is not None else store.claim_generation({})
    return SnapshotWriter(store, generation=gen, keep_last=kwargs.pop("keep_last", 3), **kwargs)


def test_published_snapshot_has_marker_checksum_and_loads_weights_only(store: LocalStore) -> None:
    w = writer_for(store)
    require_ok(w.save(10, capture(10), sync=True))
    (ref,) = store.complete()
    assert ref == SnapshotRef(generation=1, step=10) and ref.name == "step-000000010-gen-000001"
    meta, state = load_snapshot(store.path(ref))
    assert meta["step"] == 10 and len(meta["sha256"]) == 64 and meta["size_bytes"] > 0
    assert torch.equal(state["model"]["w"], torch.full((4,), 10.0))


def test_async_save_blocks_only_for_the_copy_and_at_most_one_write_is_in_flight(store: LocalStore) -> None:
    w = writer_for(store)
    live = {"w": torch.zeros(1000)}
    result = w.save(1, lambda: ({"model": live}, {}))
    live["w"] += 1  # training goes on while the write is in flight: the snapshot must not see it
    w.save(2, capture(2))  # waits for the first write before starting the second
    w.close()
    _, first = load_snapshot(store.path(SnapshotRef(1, 1)))
    assert torch.equal(first["model"]["w"], torch.zeros(1000))
    assert result.error is None and result.blocking_s <= result.blocking_s + result.write_s


def test_host_buffers_are_reused_and_never_overwritten_while_a_write_is_in_flight(store: LocalStore) -> None:
    from elastic_runner.snapshot.writer import HostStaging

    staging = HostStaging()
    live = {"model": {"w": torch.zeros(1000), "b": torch.ones(3)}, "step": 1}
    first = staging.copy(live)
    live["model"]["w"] += 1
    second = staging.copy(live)
    assert second["model"]["w"].data_ptr() == first["model"]["w"].data_ptr(), "the same buffer, already touched"
    assert torch.equal(second["model"]["w"], torch.ones(1000)) and second["step"] == 1
    del live["model"]["b"]
    live["model"]["w"] = torch.zeros(10)  # the state changed shape: a new buffer, the vanished part let go
    third = staging.copy(live)
    assert third["model"]["w"].shape == (10,) and list(staging._buffers) == [("model", "w")]

    # Through the writer: back-to-back async saves each keep their own values (the second copy waits for the
    # first write, whose buffers it reuses).
    w = writer_for(store)
    tensor = torch.zeros(100_000)
    for step in (1, 2, 3):
        tensor.fill_(float(step))
        w.save(step, lambda: ({"model": {"w": tensor}}, {}))
    w.close()
    for step in (1, 2, 3):
        _, state = load_snapshot(store.path(SnapshotRef(1, step)))
        assert torch.equal(state["model"]["w"], torch.full((100_000,), float(step))), step


def test_keeps_the_last_k_and_deletes_older_only_after_a_newer_is_complete(store: LocalStore) -> None:
    w = writer_for(store, keep_last=2)
    for step in (10, 20, 30, 40):
        require_ok(w.save(step, capture(step), sync=True))
    assert [r.step for r in store.complete()] == [30, 40]


def test_the_newest_snapshot_a_fingerprint_check_vouched_for_outlives_keep_last(store: LocalStore) -> None:
    """Snapshots every 10 steps, checks every 50: a rollback at step 95 returns to step 50, however many snapshots
    were taken since (recovery.fingerprint_every_steps; the meta says which step the last check agreed at)."""
    w = writer_for(store, keep_last=2)
    for step in range(10, 100, 10):
        verified = step // 50 * 50

        def vouched(step: int = step, verified: int = verified):  # noqa: ANN202
            state, meta = capture(step)()
            return state, meta | {"verified_step": verified}
        require_ok(w.save(step, vouched, sync=True))
    assert [r.step for r in store.complete()] == [50, 80, 90]


def test_readers_never_see_a_staging_directory(store: LocalStore) -> None:
    staging = store.staging(SnapshotRef(1, 50))
    (staging / "state.pt").write_bytes(b"half")
    assert store.complete() == [] and store.incomplete() == [staging.name]


def test_corrupt_newest_falls_back_to_the_previous_and_is_moved_aside(store: LocalStore) -> None:
    w = writer_for(store)
    for step in (10, 20):
        require_ok(w.save(step, capture(step), sync=True))
    newest = store.path(SnapshotRef(1, 20)) / "state.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    rejected: list[str] = []
    loaded = find_newest(store, on_rejected=lambda ref, why: rejected.append(why))
    assert loaded is not None and loaded.ref.step == 10
    assert "checksum mismatch" in rejected[0]
    assert store.corrupt() == ["corrupt-step-000000020-gen-000001"]
    assert "checksum" in (store.root / "corrupt-step-000000020-gen-000001" / "REASON").read_text()


@pytest.mark.parametrize("damage", ["truncate", "delete_marker", "garbage_marker", "unsafe_pickle"])
def test_every_kind_of_damage_is_reported_and_the_previous_one_used(store: LocalStore, damage: str) -> None:
    w = writer_for(store)
    for step in (10, 20):
        require_ok(w.save(step, capture(step), sync=True))
    directory = store.path(SnapshotRef(1, 20))
    if damage == "truncate":
        with open(directory / "state.pt", "r+b") as fh:
            fh.truncate(100)
    elif damage == "delete_marker":
        (directory / "meta.json").unlink()
    elif damage == "garbage_marker":
        (directory / "meta.json").write_text("{not json")
    else:
        # A pickle that would run code: rejected by weights_only even with a matching checksum.
        import hashlib
        import pickle

        class Evil:
            def __reduce__(self):  # noqa: ANN204
                return (os.system, ("echo pwned",))

        payload = pickle.dumps({"model": Evil()})
        (directory / "state.pt").write_bytes(payload)
        meta = json.loads((directory / "meta.json").read_text())
        meta.update(sha256=hashlib.sha256(payload).hexdigest(), size_bytes=len(payload))
        (directory / "meta.json").write_text(json.dumps(meta))
    loaded = find_newest(store)
    assert loaded is not None and loaded.ref.step == 10


@contextlib.contextmanager
def storages_tagged_as(location: str) -> Iterator[None]:
    """Make torch.save record CPU storages as living on ``location`` (e.g. another GPU)."""
    import torch.serialization as ser

    def tagger(obj: Any) -> str | None:
        return location if getattr(obj, "device", None) is not None and obj.device.type == "cpu" else None

    ser.register_package(0, tagger, lambda obj, loc: None)
    try:
        yield
    finally:
        ser._package_registry[:] = [p for p in ser._package_registry if p[1] is not tagger]


def test_snapshot_saved_on_another_device_index_loads_onto_the_local_device(store: LocalStore) -> None:
    w = writer_for(store)
    with storages_tagged_as("cuda:1"):  # as if rank 0 had saved from cuda:1
        require_ok(w.save(5, capture(5), sync=True))
    path = store.path(SnapshotRef(1, 5))
    if not torch.cuda.is_available():
        # Proof that the file really names cuda:1: without map_location it cannot load here.
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(path / "state.pt", weights_only=True)
    local = torch.device("cuda", torch.cuda.device_count() - 1) if torch.cuda.is_available() else torch.device("cpu")
    loaded = find_newest(store, map_location=local)
    assert loaded is not None and loaded.ref.step == 5
    assert loaded.state["model"]["w"].device == local
    assert torch.equal(loaded.state["model"]["w"].cpu(), torch.full((4,), 5.0))


def test_stale_generation_cannot_publish_and_nothing_complete_is_lost(store: LocalStore) -> None:
    old = writer_for(store)  # generation 1: e.g. a node cut off by a split brain
    require_ok(old.save(10, capture(10), sync=True))
    new = writer_for(store)  # generation 2 claims the run directory
    require_ok(new.save(10, capture(10), sync=True))
    with pytest.raises(SnapshotError, match="stale"):
        require_ok(old.save(20, capture(20), sync=True))
    with pytest.raises(StaleWriterError):
        old.raise_if_fatal()
    assert [r.name for r in store.complete()] == ["step-000000010-gen-000001", "step-000000010-gen-000002"]
    assert store.complete()[-1].generation == 2


class NewRoundStartsMidWrite(LocalStore):
    """A store in which a newer round starts (claims its generation and sweeps older rounds'
    staging directories, as train.py does) just after a writer created its staging directory."""

    def staging(self, ref: SnapshotRef) -> Path:
        path = super().staging(ref)
        self.sweep(self.claim_generation({}))
        return path


def test_a_write_cut_short_by_a_newer_round_is_the_stale_writer_error_not_a_disk_failure(tmp_path: Path) -> None:
    store = NewRoundStartsMidWrite(tmp_path / "snapshots")
    store.ensure()
    old = writer_for(store)
    result = old.save(10, capture(10), sync=True)
    assert isinstance(result.error, StaleWriterError), result.error
    with pytest.raises(StaleWriterError, match="is stale: generation 2"):
        old.raise_if_fatal()
    assert store.complete() == [] and store.incomplete() == []


def test_concurrent_writers_of_two_rounds_only_the_newer_becomes_latest(store: LocalStore) -> None:
    old_gen = store.claim_generation({})
    new_gen = store.claim_generation({})
    old = SnapshotWriter(store, generation=old_gen, keep_last=10)
    new = SnapshotWriter(store, generation=new_gen, keep_last=10)
    barrier = threading.Barrier(2)
    results = {}

    def run(name: str, w: SnapshotWriter, step: int) -> None:
        barrier.wait()
        results[name] = w.save(step, capture(step, size=200_000), sync=True)

    threads = [threading.Thread(target=run, args=("old", old, 100)), threading.Thread(target=run, args=("new", new, 60))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert isinstance(results["old"].error, StaleWriterError)
    assert results["new"].error is None
    loaded = find_newest(store)
    assert loaded is not None and loaded.ref == SnapshotRef(generation=new_gen, step=60)


def test_generation_claims_are_exclusive_under_contention(store: LocalStore) -> None:
    claimed: list[int] = []
    lock = threading.Lock()

    def claim() -> None:
        g = store.claim_generation({})
        with lock:
            claimed.append(g)

    threads = [threading.Thread(target=claim) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(claimed) == list(range(1, 17))


def test_unwritable_directory_is_a_clear_error(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        # root ignores permission bits: use a path below a regular file instead
        (tmp_path / "file").write_text("x")
        target = tmp_path / "file" / "snapshots"
    else:
        (tmp_path / "ro").mkdir(mode=0o500)
        target = tmp_path / "ro" / "snapshots"
    with pytest.raises(SnapshotError, match="run.dir"):
        LocalStore(target).ensure()


@contextlib.contextmanager
def tiny_filesystem(path: Path, size: str = "256k") -> Iterator[Path]:
    """A real ENOSPC: a small tmpfs (needs root), else writes that go to /dev/full."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True).returncode == 0
    try:
        yield path if mounted else None  # type: ignore[misc]
    finally:
        if mounted:
            subprocess.run(["umount", str(path)], check=False)


class DevFullStore(LocalStore):
    """Every staged state.pt is a link to /dev/full: each write fails with ENOSPC."""

    def staging(self, ref: SnapshotRef) -> Path:
        path = super().staging(ref)
        (path / "state.pt").symlink_to("/dev/full")
        return path


def test_disk_full_during_write_keeps_the_previous_snapshot(tmp_path: Path) -> None:
    with tiny_filesystem(tmp_path / "tiny") as mount:
        store: LocalStore = LocalStore(mount / "snapshots") if mount else DevFullStore(tmp_path / "snapshots")
        store.ensure()
        w = writer_for(store)
        if mount:
            require_ok(w.save(10, capture(10, size=100), sync=True))  # small: fits
            failing = w.save(20, capture(20, size=1_000_000), sync=True)  # 4 MB: does not
        else:
            store_ok = LocalStore(tmp_path / "snapshots")
            require_ok(SnapshotWriter(store_ok, generation=w.generation, keep_last=3).save(10, capture(10), sync=True))
            failing = w.save(20, capture(20), sync=True)
        assert failing.error is not None and "disk full" in str(failing.error)
        assert [r.step for r in store.complete()] == [10]
        assert store.incomplete() == []  # the staging directory was cleaned up
        loaded = find_newest(store)
        assert loaded is not None and loaded.ref.step == 10
        assert w.failures == 1


def test_inspect_reports_each_snapshot_and_export_strips_nothing_it_should_keep(store: LocalStore, tmp_path: Path) -> None:
    w = writer_for(store)
    for step in (10, 20):
        require_ok(w.save(step, capture(step), sync=True))
    store.staging(SnapshotRef(1, 30))
    report = inspect(str(store.root.parent))
    assert report["latest"] == "step-000000020-gen-000001" and report["step"] == 20
    assert report["consumed_samples"] == 160 and report["generation"] == 1
    assert [e["complete"] for e in report["snapshots"]] == [True, True, False]
    out = tmp_path / "model.pt"
    summary = export(str(store.root.parent), str(out))
    assert summary["step"] == 20
    model = torch.load(out, weights_only=True)
    assert set(model) == {"w", "module_like"} and torch.equal(model["w"], torch.full((4,), 20.0))


@pytest.mark.parametrize("protocol_name", ["SnapshotStore", "ShardedStore"])
def test_a_directory_and_a_bucket_each_provide_every_method_a_store_protocol_names(protocol_name: str) -> None:
    """The two stores keep one contract: every method of each protocol, with the same parameters (a method a store
    lacks, or names differently, would fail only on that store's path: a bucket's, which most tests do not take)."""
    import inspect as signatures

    from elastic_runner.snapshot import ObjectStore, store as stores

    protocol = getattr(stores, protocol_name)
    members = [name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_")]
    assert members, "the protocol names methods"
    for implementation in (stores.LocalStore, ObjectStore):
        for name in members:
            assert hasattr(implementation, name), f"{implementation.__name__} has no {name}"
            wanted = list(signatures.signature(getattr(protocol, name)).parameters)
            have = list(signatures.signature(getattr(implementation, name)).parameters)
            assert have == wanted, f"{implementation.__name__}.{name}{have} against {protocol_name}.{name}{wanted}"


def test_what_sharded_snapshots_add_is_not_asked_of_every_store() -> None:
    from elastic_runner.snapshot.store import ShardedStore, SnapshotStore

    common = {n for n, v in vars(SnapshotStore).items() if callable(v) and not n.startswith("_")}
    added = {n for n, v in vars(ShardedStore).items() if callable(v) and not n.startswith("_")}
    assert added == {"shared_staging", "share_part", "part_records"} and not added & common
