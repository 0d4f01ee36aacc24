"""The run's records without a shared directory: each node's run.dir uploaded to the bucket, read back as one run."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from elastic_runner.observe.records import RecordSync, own_records
from elastic_runner.observe.records_view import RecordsError, bucket_view, fetch_records, run_view
from elastic_runner.snapshot.store import StoreAccessError
from elastic_runner.testing.s3_server import S3Server

pytestmark = [pytest.mark.timeout(180)]


def append(path: Path, *lines: dict[str, Any], torn: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        for line in lines:
            fh.write(json.dumps(line) + "\n")
        fh.write(torn)


@pytest.fixture
def records(s3_prefix: str) -> str:
    return f"{s3_prefix}/snapshots/records"


def test_two_nodes_records_come_back_as_one_run_with_only_whole_lines(
        records: str, s3_server: S3Server, tmp_path: Path) -> None:
    fs = s3_server.filesystem()
    a, b = tmp_path / "node-a", tmp_path / "node-b"
    (a / "config.yaml").parent.mkdir(parents=True)
    (a / "config.yaml").write_text("run: {dir: x}\n")
    append(a / "events/gen-000001-rank-00000.jsonl", {"kind": "start", "rank": 0}, torn='{"kind": "st')
    append(b / "events/gen-000001-rank-00001.jsonl", {"kind": "start", "rank": 1})
    sync_a, sync_b = RecordSync(a, records, fs=fs), RecordSync(b, records, fs=fs)
    assert sync_a.sync() > 0 and sync_b.sync() > 0
    view = fetch_records(records, tmp_path / "view", fs=fs)
    assert (view / "config.yaml").read_text() == "run: {dir: x}\n"
    first = (view / "events/gen-000001-rank-00000.jsonl").read_text()
    assert first == '{"kind": "start", "rank": 0}\n', "the line still being written stays on the node"

    # The line completes, more follow: only the new bytes go, as a new range.
    append(a / "events/gen-000001-rank-00000.jsonl", torn='art"}\n')
    append(a / "events/gen-000001-rank-00000.jsonl", {"kind": "end", "rank": 0})
    before = len(fs.find(records.removeprefix("s3://")))
    sync_a.sync()
    assert len(fs.find(records.removeprefix("s3://"))) == before + 1
    view = fetch_records(records, tmp_path / "view", fs=fs)
    assert (view / "events/gen-000001-rank-00000.jsonl").read_bytes() == \
        (a / "events/gen-000001-rank-00000.jsonl").read_bytes()
    assert (view / "events/gen-000001-rank-00001.jsonl").read_bytes() == \
        (b / "events/gen-000001-rank-00001.jsonl").read_bytes()


def test_a_restarted_worker_goes_on_where_the_bucket_ends_and_overlapping_ranges_rebuild_the_file(
        records: str, s3_server: S3Server, tmp_path: Path) -> None:
    fs = s3_server.filesystem()
    node = tmp_path / "node"
    log = node / "audit/gen-000002-rank-00003.jsonl"
    append(log, *({"step": s} for s in range(50)))
    RecordSync(node, records, fs=fs).sync()
    append(log, *({"step": s} for s in range(50, 80)))
    # Two processes of the node upload the same new lines (the node's first worker and the rank itself, at its end).
    mine = RecordSync(node, records, fs=fs, wanted=own_records(2, 3))
    in_bucket = fs.du(records.removeprefix("s3://"))
    assert mine.sync() == len(log.read_bytes()) - in_bucket, "only what is new"
    RecordSync(node, records, fs=fs).sync()
    assert RecordSync(node, records, fs=fs).sync() == 0, "nothing new, nothing sent"
    view = fetch_records(records, tmp_path / "view", fs=fs)
    assert (view / "audit/gen-000002-rank-00003.jsonl").read_bytes() == log.read_bytes()
    assert RecordSync(node, records, fs=fs, wanted=own_records(2, 4)).sync() == 0, "another rank's file is not mine"


def test_objects_planted_in_the_records_never_name_a_path_outside_the_view(
        records: str, s3_server: S3Server, tmp_path: Path) -> None:
    fs = s3_server.filesystem()
    prefix = records.removeprefix("s3://")
    inc = "0123456789abcdef"
    fs.pipe_file(f"{prefix}/events/deeper/escape.jsonl/{inc}/000000000000000-000000000000003", b"x\n")
    fs.pipe_file(f"{prefix}/secrets/key.jsonl/{inc}/000000000000000-000000000000003", b"x\n")
    fs.pipe_file(f"{prefix}/events/.hidden.jsonl/{inc}/000000000000000-000000000000003", b"x\n")
    fs.pipe_file(f"{prefix}/events/ok.jsonl/extra/{inc}/000000000000000-000000000000003", b"x\n")
    fs.pipe_file(f"{prefix}/events/ok.jsonl/{inc}/000000000000000-000000000000011", b'{"kind":1}\n')
    # A chunk of another size than its name says is a gap, never read (nor does it hang the reader).
    fs.pipe_file(f"{prefix}/events/short.jsonl/{inc}/000000000000000-000000000000100", b'{"kind":2}\n{"ki')
    view = fetch_records(records, tmp_path / "deep" / "view", fs=fs)
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file() and ".chunks" not in str(p))
    assert written == ["deep/view/.records-from", "deep/view/events/ok.jsonl", "deep/view/events/short.jsonl"]
    assert (view / "events/short.jsonl").read_bytes() == b""
    assert (view.stat().st_mode & 0o077) == 0
    assert bucket_view(view)["cut_short"] == ["events/short.jsonl"], "a short chunk is a gap, said so"


def test_a_gap_in_the_bucket_is_said_and_what_the_bucket_no_longer_has_leaves_the_view(
        records: str, s3_server: S3Server, tmp_path: Path) -> None:
    fs = s3_server.filesystem()
    node = tmp_path / "node"
    log = node / "audit/gen-000001-rank-00002.jsonl"
    append(log, *({"step": s} for s in range(10)))
    sync = RecordSync(node, records, fs=fs)
    sync.sync()
    append(log, *({"step": s} for s in range(10, 20)))
    sync.sync()
    append(log, *({"step": s} for s in range(20, 30)))
    sync.sync()
    view = fetch_records(records, tmp_path / "view", fs=fs)
    assert bucket_view(view) == {"url": records, "cut_short": []}
    assert (view / "audit/gen-000001-rank-00002.jsonl").read_bytes() == log.read_bytes()

    prefix = records.removeprefix("s3://")
    chunks = sorted(k for k in fs.find(prefix) if "/audit/" in k)
    assert len(chunks) == 3
    fs.rm_file(chunks[1])  # the middle range is gone: the file ends after the first, and the view says why
    view = fetch_records(records, tmp_path / "view", fs=fs)
    assert bucket_view(view)["cut_short"] == ["audit/gen-000001-rank-00002.jsonl"]
    assert (view / "audit/gen-000001-rank-00002.jsonl").read_text().count("\n") == 10

    fs.rm(prefix, recursive=True)  # the prefix emptied (and perhaps used again): nothing of the old run stays
    view = fetch_records(records, tmp_path / "view", fs=fs)
    assert not (view / "audit/gen-000001-rank-00002.jsonl").exists()
    assert not [p for p in (view / ".chunks").rglob("*") if p.is_file()]

    # Used again by a run whose file has the same name, header and ranges but other bytes: they are what the view
    # shows, not the copies kept from the earlier run.
    first, second = tmp_path / "first", tmp_path / "second"
    for run, mark in ((first, "a"), (second, "b")):
        append(run / "audit/gen-000001-rank-00002.jsonl", {"type": "header"},
               *({"step": s, "x": mark} for s in range(10)))
    RecordSync(first, records, fs=fs).sync()
    fetch_records(records, tmp_path / "view", fs=fs)
    names = fs.find(prefix)
    fs.rm(prefix, recursive=True)
    RecordSync(second, records, fs=fs).sync()
    assert fs.find(prefix) == names, "the same object name as the first run's"
    view = fetch_records(records, tmp_path / "view", fs=fs)
    assert (view / "audit/gen-000001-rank-00002.jsonl").read_bytes() == \
        (second / "audit/gen-000001-rank-00002.jsonl").read_bytes()


def test_an_unreachable_store_is_counted_and_said_once_then_the_records_go_when_it_is_back(
        records: str, s3_server: S3Server, tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    node = tmp_path / "node"
    append(node / "events/gen-000001-rank-00000.jsonl", {"kind": "start"})
    sync = RecordSync(node, records)  # its own client, as in a worker
    sync.sync()
    s3_server.stop()
    try:
        append(node / "events/gen-000001-rank-00000.jsonl", {"kind": "step"})
        with caplog.at_level(logging.WARNING, logger="elastic_runner.records"):
            began = time.monotonic()
            sync.close(final=True, timeout_s=3.0)  # the worker's end: one bounded attempt, not a hang
            assert time.monotonic() - began < 6.0
            sync._attempt()
    finally:
        s3_server.start()
    assert sync.failures >= 1
    assert len([r for r in caplog.records if "could not upload the run's records" in r.message]) == 1
    sync.sync()
    view = fetch_records(records, tmp_path / "view", fs=s3_server.filesystem())
    assert (view / "events/gen-000001-rank-00000.jsonl").read_text().count("\n") == 2


def test_a_run_directory_that_names_a_bucket_adds_what_it_holds_beyond_the_bucket(
        records: str, s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    snapshots = records.removesuffix("/records")
    run = tmp_path / "run"  # a node's own directory, or a shared one: its lines may not all be uploaded yet
    append(run / "audit/gen-000001-rank-00000.jsonl", *({"step": s} for s in range(5)))
    RecordSync(run, records, fs=s3_server.filesystem()).sync()
    append(run / "audit/gen-000001-rank-00000.jsonl", *({"step": s} for s in range(5, 9)), torn='{"st')
    append(run / "audit/gen-000001-rank-00001.jsonl", {"step": 1})  # never uploaded at all
    (run / "config.yaml").write_text(f"snapshot: {{dir: '{snapshots}'}}\n")
    view = Path(run_view(str(run)))
    assert view != run and (view / "audit/gen-000001-rank-00000.jsonl").read_text().count("\n") == 9
    assert (view / "audit/gen-000001-rank-00001.jsonl").read_text() == '{"step": 1}\n'
    assert bucket_view(view) is not None
    assert run_view(snapshots) == str(view)  # the URL alone: what the bucket has (the files above left the view)
    assert (view / "audit/gen-000001-rank-00000.jsonl").read_text().count("\n") == 5
    assert not (view / "audit/gen-000001-rank-00001.jsonl").exists()


def syncing_after_an_earlier_attempt(tmp_path: Path, records: str, fs: Any,
                                     earlier_steps: int) -> tuple[Path, RecordSync]:
    """A node whose attempt 2 left ``earlier_steps`` audit records and whose attempt 3 (the fresh one) has begun,
    its records' upload started with a long interval (600 s)."""
    node = tmp_path / "node"
    append(node / "audit/gen-000002-rank-00000.jsonl", *({"step": s} for s in range(earlier_steps)))
    append(node / "audit/gen-000003-rank-00000.jsonl", {"type": "header"})
    sync = RecordSync(node, records, fs=fs, every_s=600,
                      fresh=lambda relative: relative.endswith("gen-000003-rank-00000.jsonl")).start()
    return node, sync


def test_an_attempt_s_first_step_is_uploaded_at_once_not_at_the_end_of_the_interval(
        records: str, s3_server: S3Server, tmp_path: Path) -> None:
    fs = s3_server.filesystem()
    node, sync = syncing_after_an_earlier_attempt(tmp_path, records, fs, earlier_steps=100)
    try:
        append(node / "audit/gen-000003-rank-00000.jsonl", {"type": "step", "step": 1})
        sync.soon()
        deadline = time.monotonic() + 20
        while sync.uploaded_bytes < len((node / "audit/gen-000003-rank-00000.jsonl").read_bytes()):
            assert time.monotonic() < deadline, "soon() did not upload within 20 s (the interval is 600 s)"
            time.sleep(0.05)
        # Only this attempt's file, with no listing of the bucket (off the recovery's requests); the rest waits for
        # the interval's full sync, which lists once and sends only what the bucket lacks.
        assert sync._sent is None
        assert [k.split("/records/", 1)[1].split("/")[1] for k in fs.find(records.removeprefix("s3://"))] == [
            "gen-000003-rank-00000.jsonl"]
        assert sync.sync() == len((node / "audit/gen-000002-rank-00000.jsonl").read_bytes())
    finally:
        sync.close(final=False)
    assert sync._thread is not None
    sync._thread.join(5)
    assert not sync._thread.is_alive(), "close() ends the thread without waiting out its interval"


def test_a_run_directory_without_a_bucket_is_read_as_it_is(tmp_path: Path) -> None:
    plain = tmp_path / "run"
    plain.mkdir()
    (plain / "config.yaml").write_text("snapshot: {dir: null}\n")
    assert run_view(str(plain)) == str(plain)


def test_a_log_of_the_same_name_written_anew_on_a_replaced_node_is_kept_beside_the_first_not_spliced_into_it(
        records: str, s3_server: S3Server, tmp_path: Path) -> None:
    fs = s3_server.filesystem()
    # A replaced pod: the same hostname and pid, so the agent's log has the same name; its disk was new.
    old, new = tmp_path / "pod-1", tmp_path / "pod-1-replaced"
    append(old / "events/agent-host-7.jsonl", *({"kind": "old", "n": n} for n in range(20)))
    RecordSync(old, records, fs=fs).sync()
    append(new / "events/agent-host-7.jsonl", {"kind": "new", "n": 0})
    RecordSync(new, records, fs=fs).sync()
    append(new / "events/agent-host-7.jsonl", *({"kind": "new", "n": n} for n in range(1, 30)))
    RecordSync(new, records, fs=fs).sync()
    lines = [json.loads(line) for line in
             (fetch_records(records, tmp_path / "view", fs=fs) / "events/agent-host-7.jsonl").read_text().splitlines()]
    assert sorted((e["kind"], e["n"]) for e in lines) == sorted(
        [("old", n) for n in range(20)] + [("new", n) for n in range(30)]), "every line of both, none torn"


def test_what_a_writer_of_the_bucket_adds_is_bounded_before_it_is_downloaded(
        records: str, s3_server: S3Server, tmp_path: Path) -> None:
    fs = s3_server.filesystem()
    prefix = records.removeprefix("s3://")
    node = tmp_path / "node"
    append(node / "events/gen-000001-rank-00000.jsonl", *({"kind": "progress", "step": s} for s in range(20)))
    (node / "config.yaml").write_text("run: {dir: x}\n")
    RecordSync(node, records, fs=fs).sync()
    inc = "0123456789abcdef"
    fs.pipe_file(f"{prefix}/events/big.jsonl/{inc}/000000000000000-000000000000010", b"x" * (2 << 20))  # not 10
    view = fetch_records(records, tmp_path / "view", fs=fs)
    assert not [p for p in (view / ".chunks").rglob("*big*") if p.is_file()], "never downloaded"
    assert bucket_view(view)["cut_short"] == ["events/big.jsonl"]
    assert (view / "events/gen-000001-rank-00000.jsonl").read_bytes() == \
        (node / "events/gen-000001-rank-00000.jsonl").read_bytes()

    fs.pipe_file(f"{prefix}/config.yaml", b"#" * (2 << 20))  # a whole file far larger than a config
    view = fetch_records(records, tmp_path / "view", fs=fs)
    assert not (view / "config.yaml").exists()
    with pytest.raises(RecordsError, match="add up to more than 0 MiB"):
        fetch_records(records, tmp_path / "other-view", fs=fs, max_bytes=100)


@pytest.mark.parametrize("named", ["http://169.254.169.254/latest/meta-data", "local:///etc",
                                   "s3://user:secret@bucket/x"])
def test_report_and_audit_follow_no_location_a_job_could_not_have_written_to(tmp_path: Path, named: str) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(f"snapshot: {{dir: '{named}'}}\n")
    with pytest.raises(StoreAccessError, match="config.yaml: snapshot.dir: .* it is not followed") as refused:
        run_view(str(run))
    assert "secret" not in str(refused.value)
    for command in (["audit", str(run)], ["report", str(run)]):
        result = subprocess.run([sys.executable, "-m", "elastic_runner", *command], capture_output=True, text=True,
                                timeout=120)
        assert result.returncode != 0 and "it is not followed" in result.stderr and "Traceback" not in result.stderr
        assert "secret" not in result.stderr


def test_the_bucket_named_on_the_command_line_is_read_instead_of_the_configs(
        records: str, s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    node = tmp_path / "node"
    append(node / "audit/gen-000001-rank-00000.jsonl", *({"step": s} for s in range(3)))
    RecordSync(node, records, fs=s3_server.filesystem()).sync()
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("snapshot: {dir: 'http://example.invalid/x'}\n")
    view = Path(run_view(str(run), records_from=records.removesuffix("/records")))
    assert (view / "audit/gen-000001-rank-00000.jsonl").read_text().count("\n") == 3
    with pytest.raises(StoreAccessError, match="--records-from"):
        run_view(str(run), records_from="http://example.invalid/x")


def test_an_earlier_attempts_records_follow_the_first_step_of_the_next_one_not_the_interval(
        records: str, s3_server: S3Server, tmp_path: Path) -> None:
    """A worker ended by a peer's failure leaves its records to the node's next worker; attempts shorter than the
    interval would hand them on until a node lost with its disk took them along (before: 1,365 steps of a soak's
    records never reached the bucket). The next attempt uploads them a moment after its first step."""
    fs = s3_server.filesystem()
    node, sync = syncing_after_an_earlier_attempt(tmp_path, records, fs, earlier_steps=300)
    try:
        sync.soon(then_all_after=0.5)
        deadline = time.monotonic() + 20
        earlier = len((node / "audit/gen-000002-rank-00000.jsonl").read_bytes())
        while sync.uploaded_bytes < earlier:
            assert time.monotonic() < deadline, "the earlier attempt's records did not follow within 20 s"
            time.sleep(0.05)
    finally:
        sync.close(final=False)
    view = fetch_records(records, tmp_path / "view", fs=fs)
    assert (view / "audit/gen-000002-rank-00000.jsonl").read_bytes() == \
        (node / "audit/gen-000002-rank-00000.jsonl").read_bytes()
