"""Snapshots in a bucket (a real S3 server, SeaweedFS on loopback): the directory's guarantees without a filesystem.

Each test gets its own bucket; "a node" is an :class:`ObjectStore` with its own private local directory, so two of
them share nothing but the bucket.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_runner.config import ConfigError, load_config
from elastic_runner.config import locations
from elastic_runner.snapshot import (SnapshotError, SnapshotRef, SnapshotWriter, StaleWriterError, find_newest,
                                     load_snapshot, open_store, require_ok)
from elastic_runner.snapshot.object_store import ObjectStore
from elastic_runner.snapshot.format import write_snapshot_files
from elastic_runner.snapshot.publish import write_and_publish
from elastic_runner.snapshot.store import AlreadyCommittedError, StoreAccessError
from elastic_runner.testing.s3_server import S3Server

from ..support import QUICKSTART, capture

pytestmark = [pytest.mark.timeout(180)]


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The AWS conventions pointed at the local server, as a user's environment would be."""
    env = s3_server.env()
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


@pytest.fixture
def url(s3_prefix: str, s3_env: dict[str, str]) -> str:
    return f"{s3_prefix}/team/run-1/snapshots"


def node(url: str, tmp_path: Path, name: str = "node-a") -> ObjectStore:
    store = ObjectStore(url, local=tmp_path / name / ".objects")
    store.ensure()
    return store


@pytest.fixture
def store(url: str, tmp_path: Path) -> ObjectStore:
    return node(url, tmp_path)


def objects(s3_server: S3Server, url: str) -> list[str]:
    fs: Any = s3_server.filesystem()
    prefix = url.removeprefix("s3://")
    return sorted(k[len(prefix) + 1:] for k in fs.find(prefix))


def writer_for(store: ObjectStore, generation: int | None = None, **kwargs: Any) -> SnapshotWriter:
    gen = generation if generation is not None else store.claim_generation({})
    return SnapshotWriter(store, generation=gen, keep_last=kwargs.pop("keep_last", 3), **kwargs)


def test_a_snapshot_counts_once_its_marker_is_uploaded_last_and_loads_bit_for_bit_on_another_node(
        store: ObjectStore, url: str, tmp_path: Path, s3_server: S3Server) -> None:
    require_ok(writer_for(store).save(10, capture(10), sync=True))
    assert store.complete() == [SnapshotRef(generation=1, step=10)]
    assert objects(s3_server, url) == ["generations/000001", "step-000000010-gen-000001/meta.json",
                                       "step-000000010-gen-000001/state.pt"]
    other = node(url, tmp_path, "node-b")  # nothing on its disk: it downloads
    meta, state = load_snapshot(other.path(SnapshotRef(1, 10)))
    assert meta["step"] == 10 and torch.equal(state["model"]["w"], torch.full((4,), 10.0))
    assert not list((tmp_path / "node-a" / ".objects" / "staging").iterdir()), "the staging copy is gone"

    # An upload that died before its marker: never complete, listed as incomplete, swept by the next round.
    fs: Any = s3_server.filesystem()
    fs.pipe_file(url.removeprefix("s3://") + "/step-000000020-gen-000001/state.pt", b"half an upload")
    assert store.complete() == [SnapshotRef(1, 10)] and store.incomplete() == ["step-000000020-gen-000001"]
    assert store.sweep(store.claim_generation({})) == ["step-000000020-gen-000001"]
    assert store.incomplete() == []


def test_publishing_never_replaces_a_snapshot_and_keeps_the_last_k(store: ObjectStore, tmp_path: Path) -> None:
    w = writer_for(store, keep_last=2)
    require_ok(w.save(10, capture(10), sync=True))
    ref = SnapshotRef(w.generation, 10)
    staging = store.staging(ref)  # a second writer of the same step, with other bytes
    write_snapshot_files(staging, {"model": {"w": torch.zeros(2)}}, {"step": 10, "epoch": 0, "consumed": 0})
    with pytest.raises(AlreadyCommittedError):
        store.publish(staging, ref)
    _, state = load_snapshot(node(store.location, tmp_path, "fresh").path(ref))
    assert torch.equal(state["model"]["w"], torch.full((4,), 10.0)), "the first publish stands"
    for step in (20, 30, 40):
        require_ok(w.save(step, capture(step), sync=True))
    assert [r.step for r in store.complete()] == [30, 40]


def test_the_writer_process_uploads_off_the_training_interpreter(store: ObjectStore) -> None:
    w = writer_for(store, writer="process")
    try:
        big = {"model": {"w": torch.arange(3_000_000, dtype=torch.float32)}}
        for step in (1, 2, 3):  # the first saves may go through the thread while the process imports torch
            big["model"]["w"] += 1
            w.save(step, lambda: (big, {}))
            w.wait()
        assert w._process is not None and w._process.alive(), "the writer process took the saves"
    finally:
        w.close()
    loaded = find_newest(store)
    assert loaded is not None and loaded.ref.step == 3
    assert torch.equal(loaded.state["model"]["w"], torch.arange(3_000_000, dtype=torch.float32) + 3)


def test_two_writers_of_one_name_never_mix_their_objects_and_only_a_retry_replaces_its_own(
        url: str, tmp_path: Path) -> None:
    """On a stop every node's first worker writes the same snapshot, each with bytes of its own. In a bucket the
    second writer's ``state.pt`` would land under the first one's marker (a checksum mismatch on resume, found by a
    stop-and-restart test): the second stops instead, and only the writer whose marker never came may upload again."""
    first, second, operator = node(url, tmp_path, "first"), node(url, tmp_path, "second"), node(url, tmp_path, "op")
    gen = first.claim_generation({})
    ref, leftover = SnapshotRef(gen, 10), SnapshotRef(gen, 20)

    def staged(store: ObjectStore, at: SnapshotRef, value: float) -> Path:
        staging = store.staging(at)
        write_snapshot_files(staging, {"model": {"w": torch.full((4,), value)}},
                             {"step": at.step, "generation": at.generation, "epoch": 0, "consumed": 0})
        return staging

    def store_down(generation: int) -> None:
        raise StoreAccessError("the store went away before the marker")

    first.check_fence = store_down  # type: ignore[method-assign] - its objects are up, its marker is not
    for at in (ref, leftover):
        with pytest.raises(StoreAccessError):
            first.publish(staged(first, at, 1.0), at)
    with pytest.raises(AlreadyCommittedError, match="another writer"):
        second.publish(staged(second, ref, 2.0), ref)
    assert second.complete() == [], "no marker over objects of another writer"
    del first.check_fence
    first.publish(staged(first, ref, 1.0), ref)  # its own retry
    operator.publish(staged(operator, leftover, 3.0), leftover, replace_incomplete=True)  # `snapshot persist`
    reader = node(url, tmp_path, "reader")
    for at, value in ((ref, 1.0), (leftover, 3.0)):
        _, state = load_snapshot(reader.path(at))
        assert torch.equal(state["model"]["w"], torch.full((4,), value)), at.name


def test_a_stale_generation_cannot_publish_and_of_two_racing_rounds_only_the_newer_becomes_latest(
        url: str, tmp_path: Path) -> None:
    old_node, new_node = node(url, tmp_path, "old"), node(url, tmp_path, "new")
    old = writer_for(old_node)  # generation 1: a node cut off by a split brain
    require_ok(old.save(10, capture(10), sync=True))
    new = writer_for(new_node)  # generation 2, claimed from another node
    require_ok(new.save(10, capture(10), sync=True))
    with pytest.raises(SnapshotError, match="stale"):
        require_ok(old.save(20, capture(20), sync=True))
    with pytest.raises(StaleWriterError):
        old.raise_if_fatal()
    assert [r.name for r in new_node.complete()] == ["step-000000010-gen-000001", "step-000000010-gen-000002"]

    # Both rounds write at once, the older one a later step: the newer round's snapshot is the one resumed.
    g_old, g_new = old_node.claim_generation({}), new_node.claim_generation({})
    barrier, results = threading.Barrier(2), {}

    def run(name: str, store: ObjectStore, gen: int, step: int) -> None:
        w = SnapshotWriter(store, generation=gen, keep_last=10)
        barrier.wait()
        results[name] = w.save(step, capture(step), sync=True)

    threads = [threading.Thread(target=run, args=("old", old_node, g_old, 100)),
               threading.Thread(target=run, args=("new", new_node, g_new, 60))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert isinstance(results["old"].error, StaleWriterError) and results["new"].error is None
    loaded = find_newest(node(url, tmp_path, "reader"))
    assert loaded is not None and loaded.ref == SnapshotRef(generation=g_new, step=60)


def test_generation_claims_from_many_nodes_at_once_are_exclusive(url: str, tmp_path: Path) -> None:
    stores = [node(url, tmp_path, f"n{i}") for i in range(12)]
    claimed: list[int] = []
    lock, barrier = threading.Lock(), threading.Barrier(len(stores))

    def claim(store: ObjectStore) -> None:
        barrier.wait()
        g = store.claim_generation({})
        with lock:
            claimed.append(g)

    threads = [threading.Thread(target=claim, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(claimed) == list(range(1, 13))
    assert len({s.run_uid() for s in stores}) == 1, "one run id, created once"


def _tamper(s3_server: S3Server, url: str, ref: SnapshotRef, how: str) -> None:
    fs: Any = s3_server.filesystem()
    key = f"{url.removeprefix('s3://')}/{ref.name}"
    if how == "flip_a_byte":
        data = bytearray(fs.cat_file(f"{key}/state.pt"))
        data[len(data) // 2] ^= 0xFF
        fs.pipe_file(f"{key}/state.pt", bytes(data))
    else:  # a planted pickle that would run code, with a checksum that matches it
        class Evil:
            def __reduce__(self):  # noqa: ANN204
                return (os.system, ("echo pwned",))

        payload = pickle.dumps({"model": Evil()})
        meta = json.loads(fs.cat_file(f"{key}/meta.json"))
        meta.update(sha256=hashlib.sha256(payload).hexdigest(), size_bytes=len(payload))
        fs.pipe_file(f"{key}/state.pt", payload)
        fs.pipe_file(f"{key}/meta.json", json.dumps(meta).encode())


@pytest.mark.parametrize("how", ["flip_a_byte", "planted_pickle"])
def test_a_tampered_snapshot_in_the_bucket_is_never_loaded_and_is_moved_aside(
        store: ObjectStore, url: str, tmp_path: Path, s3_server: S3Server, how: str) -> None:
    w = writer_for(store)
    for step in (10, 20):
        require_ok(w.save(step, capture(step), sync=True))
    _tamper(s3_server, url, SnapshotRef(1, 20), how)
    reader = node(url, tmp_path, "node-b")
    rejected: list[str] = []
    loaded = find_newest(reader, on_rejected=lambda ref, why: rejected.append(why))
    assert loaded is not None and loaded.ref.step == 10 and len(rejected) == 1
    assert reader.complete() == [SnapshotRef(1, 10)]
    assert reader.corrupt() == ["corrupt-step-000000020-gen-000001"]
    keys = objects(s3_server, url)
    assert "corrupt-step-000000020-gen-000001/REASON" in keys and "corrupt-step-000000020-gen-000001/state.pt" in keys


def test_wrong_credentials_a_read_only_identity_and_a_missing_bucket_are_one_clear_error_each(
        url: str, s3_server: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(StoreAccessError, match="refused access.*AWS_ACCESS_KEY_ID") as wrong:
        node(url, tmp_path)
    assert "not-the-secret" not in str(wrong.value), "a secret never reaches a message"

    for key, value in s3_server.env("reader").items():
        monkeypatch.setenv(key, value)
    reader = node(url, tmp_path)  # may list
    with pytest.raises(StoreAccessError, match="refused access"):
        reader.claim_generation({})

    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    with pytest.raises(StoreAccessError, match="bucket 'no-such-bucket' does not exist"):
        node("s3://no-such-bucket/x", tmp_path)


def test_the_warm_up_connects_the_client_it_shares_with_the_store_and_leaves_no_coroutine_unawaited(url: str) -> None:
    import gc
    import warnings

    from elastic_runner.object_client import open_filesystem, prewarm

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prewarm(url).join(timeout=60)
        gc.collect()  # an unawaited coroutine is reported when it is collected
    fs, _ = open_filesystem(url)
    assert getattr(fs, "_s3", None) is not None, "the client was created by the warm-up, not by the first request"
    assert not [w for w in caught if "never awaited" in str(w.message)], [str(w.message) for w in caught]


def test_any_bucket_name_works_and_only_a_missing_bucket_is_called_missing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bucket's name decides nothing: ``my-bucket`` (the docs' own example), ``mybucket`` and ``a.b.c`` each hold a
    run from its empty first listing to a snapshot read back on another node; only a bucket the store says is not
    there is refused, in one sentence that names it. (A server of its own: the session's gives each bucket volumes.)"""
    with S3Server(tmp_path / "seaweedfs" / "data") as server:
        for key, value in server.env().items():
            monkeypatch.setenv(key, value)
        for bucket in ("my-bucket", "mybucket", "a.b.c"):
            server.create_bucket(bucket)
            url = f"s3://{bucket}/team/run-1/snapshots"
            store = node(url, tmp_path, f"{bucket}-a")  # the first listing of a prefix that holds nothing yet
            assert store.complete() == [] and store.corrupt() == []
            require_ok(writer_for(store).save(10, capture(10), sync=True))
            meta, state = load_snapshot(node(url, tmp_path, f"{bucket}-b").path(SnapshotRef(1, 10)))
            assert meta["step"] == 10 and torch.equal(state["model"]["w"], torch.full((4,), 10.0)), bucket
        with pytest.raises(StoreAccessError) as missing:
            node("s3://my-missing-bucket/team/run-1/snapshots", tmp_path)
        message = str(missing.value)
        assert "the bucket 'my-missing-bucket' does not exist" in message and "\n" not in message


@pytest.mark.parametrize("location, expected", [
    ("ftp://host/snapshots", "scheme ftp://"),
    ("s3://AKIA:secret@bucket/prefix", "carries credentials"),
    ("s3:///prefix", "names no bucket"),
    ("s3://bucket/prefix?versionId=3", "query or fragment"),
])
def test_a_location_that_cannot_work_is_a_config_error_before_anything_starts(
        tmp_path: Path, location: str, expected: str) -> None:
    with pytest.raises(ConfigError, match="snapshot.dir") as caught:
        load_config(QUICKSTART, [f"snapshot.dir={location}", f"run.dir={tmp_path}"])
    assert expected in str(caught.value) and "secret" not in str(caught.value), "a secret never reaches a message"


def test_a_missing_extra_names_the_package_and_the_pip_command(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    monkeypatch.setitem(locations.SCHEMES, "s3", ("no_such_module_for_s3", "s3"))
    with pytest.raises(ConfigError, match=r"no_such_module_for_s3 package.*pip install 'elastic-runner\[s3\]'"):
        load_config(QUICKSTART, ["snapshot.dir=s3://bucket/prefix", f"run.dir={tmp_path}"])


def test_open_store_picks_the_directory_or_the_bucket(url: str, tmp_path: Path) -> None:
    assert open_store(f"file://{tmp_path}/snaps").location == f"{tmp_path}/snaps"
    assert isinstance(open_store(url, local=tmp_path / "local"), ObjectStore)



def test_a_sharded_snapshot_goes_to_the_bucket_part_by_part_and_reshards_from_it_exactly(
        url: str, tmp_path: Path, s3_server: S3Server) -> None:
    """fsdp at 4 ranks, each with a disk of its own: every rank uploads its part, rank 0 publishes once all are
    there; the snapshot loads into fsdp at 3 and ddp at 1 (other "nodes", empty disks), every tensor exact."""
    from ..unit.test_sharding import _assert_same, _load_worker, _save_worker, _spawn

    node(url, tmp_path, "claim").claim_generation({})
    saved_at = tmp_path / "saved.pt"
    _spawn(_save_worker, 4, tmp_path, dict(strategy="fsdp", local_world=4, dir=url, local=str(tmp_path / "save"),
                                           out=str(saved_at)))
    saved = torch.load(saved_at)
    keys = objects(s3_server, url)
    assert [k for k in keys if "/part-" in k and k.endswith(".bin")] == [
        f"step-000000001-gen-000001/part-0000{r}.bin" for r in range(4)]
    meta = json.loads(s3_server.filesystem().cat_file(f"{url.removeprefix('s3://')}/step-000000001-gen-000001/meta.json"))
    assert len(meta["sharded"]["parts"]) == 4
    assert not [p for p in (tmp_path / "save").rglob("part-*")], "no rank keeps a staging copy"
    for strategy, world in (("fsdp", 3), ("ddp", 1)):
        out = tmp_path / f"loaded-{strategy}-{world}.pt"
        _spawn(_load_worker, world, tmp_path, dict(strategy=strategy, local_world=world, dir=url,
                                                   local=str(tmp_path / f"load-{strategy}"), out=str(out)))
        _assert_same(torch.load(out), saved, f"fsdp at 4 -> {strategy} at {world}, through the bucket")


def test_no_credentials_at_all_is_a_clear_error_naming_where_they_come_from(
        url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    with pytest.raises(StoreAccessError, match="no credentials .* were found.*AWS_ACCESS_KEY_ID"):
        node(url, tmp_path)


def test_a_round_that_begins_while_a_snapshot_uploads_stops_it_before_its_marker(
        url: str, tmp_path: Path, s3_server: S3Server) -> None:
    writer_node, newer = node(url, tmp_path, "slow"), node(url, tmp_path, "newer")
    gen = writer_node.claim_generation({})
    upload = writer_node.fs.put_file

    def upload_then_a_newer_round_starts(*args: Any, **kwargs: Any) -> Any:
        done = upload(*args, **kwargs)
        newer.sweep(newer.claim_generation({}))  # what a new attempt's rank 0 does: claim, then sweep
        return done

    writer_node.fs.put_file = upload_then_a_newer_round_starts
    try:
        with pytest.raises(StaleWriterError):
            write_and_publish(writer_node, gen, 3, SnapshotRef(gen, 10), *capture(10)())
    finally:
        del writer_node.fs.put_file
    assert writer_node.complete() == [], "no marker over what the newer round swept"


def test_only_the_store_s_own_precondition_answer_means_the_object_exists() -> None:
    from elastic_runner.object_client import is_precondition_failure

    class ClientError(Exception):
        def __init__(self, code: str, status: int) -> None:
            super().__init__(code)
            self.response = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}

    def wrapped(cause: BaseException) -> OSError:
        try:
            raise OSError(22, "translated") from cause
        except OSError as exc:
            return exc

    assert is_precondition_failure(wrapped(ClientError("PreconditionFailed", 412)))
    assert is_precondition_failure(FileExistsError("x"))
    timeout = ConnectionError('Read timeout on endpoint URL: "http://s3/ml-412/step-000004120-gen-000001/meta.json"')
    assert not is_precondition_failure(wrapped(timeout)), "a connection error is never 'already there'"
    assert not is_precondition_failure(wrapped(ClientError("InternalError", 500)))


def test_gcs_answers_for_refused_credentials_and_a_missing_bucket_are_set_up_errors(tmp_path: Path) -> None:
    """What gcsfs raises (gcsfs.retry.validate_response, reproduced here: the extra is not installed for the tests):
    403 -> OSError("Forbidden: ..."), 401 -> HttpError(code=401), 404 on a create -> FileNotFoundError(path). Each is a
    StoreAccessError (exit 2 at start), not a store that may come back."""

    class HttpError(Exception):
        def __init__(self, code: int) -> None:
            super().__init__(f"Unauthorized, {code}")
            self.code = code

    class Answering:
        def __init__(self, error: BaseException) -> None:
            self.error = error

        def ls(self, *args: Any, **kwargs: Any) -> list[str]:
            raise self.error

        def pipe_file(self, *args: Any, **kwargs: Any) -> None:
            raise self.error

    def store(error: BaseException) -> ObjectStore:
        return ObjectStore("s3://bucket/run/snapshots", local=tmp_path / "node", fs=Answering(error))

    for refused in (OSError("Forbidden: bucket/run/snapshots\nno storage.objects.list"), HttpError(401)):
        with pytest.raises(StoreAccessError, match="refused access"):
            store(refused).ensure()
        with pytest.raises(StoreAccessError, match="refused access"):
            store(refused).claim_generation({})
    with pytest.raises(StoreAccessError, match="does not exist"):
        store(FileNotFoundError("bucket/run/snapshots/generations/000001")).claim_generation({})
    with pytest.raises(SnapshotError) as unavailable:
        store(OSError("Service Unavailable, 503")).ensure()
    assert not isinstance(unavailable.value, StoreAccessError), "a store that may come back is retried"


def test_a_node_reads_any_snapshot_the_bucket_keeps_even_beyond_its_cache_of_three(
        store: ObjectStore, url: str, tmp_path: Path) -> None:
    w = writer_for(store, keep_last=5)
    for step in (10, 20, 30, 40, 50):
        require_ok(w.save(step, capture(step), sync=True))
    reader = node(url, tmp_path, "reader")
    for ref in reversed(reader.complete()):  # newest first, as a reader falls back
        meta, state = load_snapshot(reader.path(ref))
        assert meta["step"] == ref.step and torch.equal(state["model"]["w"], torch.full((4,), float(ref.step)))
    cached = sorted(p.name for p in (tmp_path / "reader" / ".objects" / "cache").iterdir())
    assert len(cached) == 3 and cached[0] == "step-000000010-gen-000001", "the newest fetch stays, two others"


def test_inspect_reads_a_bucket_from_markers_and_sizes_and_downloads_only_to_verify(
        store: ObjectStore, url: str, s3_server: S3Server) -> None:
    from elastic_runner.snapshot.cli import inspect
    from elastic_runner.object_client import default_local

    writer = writer_for(store, keep_last=5)
    for step in (10, 20, 30, 40):
        require_ok(writer.save(step, capture(step), sync=True))
    fs: Any = s3_server.filesystem()
    prefix = url.removeprefix("s3://")
    torn = f"{prefix}/step-000000030-gen-000001/state.pt"
    fs.pipe_file(torn, fs.cat_file(torn)[:100])  # replaced by a torn copy: the marker's size no longer matches
    store.quarantine(SnapshotRef(1, 10), "planted: state.pt's checksum does not match")
    cache = default_local(url) / "cache"
    shutil.rmtree(cache, ignore_errors=True)  # this user's cache of the URL, from an earlier run of this test

    report = inspect(url)
    by_name = {e["name"]: e for e in report["snapshots"]}
    assert [n for n, e in by_name.items() if e["complete"]] == ["step-000000020-gen-000001", "step-000000040-gen-000001"]
    assert "state.pt has 100 bytes" in by_name["step-000000030-gen-000001"]["error"]
    assert by_name["corrupt-step-000000010-gen-000001"]["error"] == "planted: state.pt's checksum does not match"
    assert report["latest"] == "step-000000040-gen-000001" and report["step"] == 40
    assert not cache.is_dir() or not [p for p in cache.iterdir() if p.name.startswith("step-")], \
        "listing the snapshots downloads none of them"

    verified = {e["name"]: e for e in inspect(url, verify=True)["snapshots"]}
    assert verified["step-000000040-gen-000001"].get("verified") and verified["step-000000020-gen-000001"].get("verified")
    assert not verified["step-000000030-gen-000001"]["complete"]


def test_a_copy_fetches_only_what_its_marker_lists_at_the_sizes_it_says(store: ObjectStore, url: str, tmp_path: Path,
                                                                         s3_server: S3Server) -> None:
    """A writer of the bucket adds a large object under a snapshot's name, or swaps a listed one for a larger one:
    a reader downloads neither (before: every object under the name was fetched, and then checked). With the
    job's key, an unsigned marker that claims a newer format is damage, moved aside, not a reason to stop."""
    from elastic_runner.snapshot.format import signing_key

    with signing_key(b"k" * 32):
        _fetch_only_the_listed(store, url, tmp_path, s3_server)


def _fetch_only_the_listed(store: ObjectStore, url: str, tmp_path: Path, s3_server: S3Server) -> None:
    w = writer_for(store)
    for step in (10, 20, 30):
        require_ok(w.save(step, capture(step), sync=True))
    fs: Any = s3_server.filesystem()
    prefix = url.removeprefix("s3://")
    fs.pipe_file(f"{prefix}/step-000000030-gen-000001/extra.bin", b"\0" * (4 << 20))  # unlisted
    fs.pipe_file(f"{prefix}/step-000000020-gen-000001/state.pt", b"\0" * (4 << 20))  # listed, another size
    reader = node(url, tmp_path, "reader")

    newest = reader.path(SnapshotRef(1, 30))
    assert sorted(p.name for p in newest.iterdir()) == ["meta.json", "state.pt"]
    with pytest.raises(SnapshotError, match="state.pt has 4194304 bytes, the marker says"):
        reader.path(SnapshotRef(1, 20))
    assert sorted(p.name for p in (tmp_path / "reader" / ".objects" / "cache").iterdir()) == [
        "step-000000030-gen-000001"], "nothing of the swapped snapshot was downloaded"
    (newest / "meta.json").unlink()  # out of the cache: the next read lists and fetches again
    shutil.rmtree(newest)
    fs.rm(f"{prefix}/step-000000030-gen-000001/extra.bin")
    fs.pipe_file(f"{prefix}/step-000000030-gen-000001/meta.json", b'{"sha256": "' + b"0" * 64 + b'", "format": 3}')
    rejected: list[str] = []
    loaded = find_newest(reader, on_rejected=lambda ref, why: rejected.append(f"{ref.name}: {why}"))
    assert loaded is not None and loaded.ref == SnapshotRef(1, 10)
    assert len(rejected) == 2 and reader.corrupt() == ["corrupt-step-000000020-gen-000001",
                                                       "corrupt-step-000000030-gen-000001"]
