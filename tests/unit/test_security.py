"""Let no one in: nothing from etcd or a shared disk runs code or is trusted unchecked; what a run
writes is private; secrets stay out of the command line; bad bytes are refused, not crash-looped."""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import stat
import struct
import subprocess
import sys
import tracemalloc
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.elastic.rendezvous import RendezvousParameters, RendezvousStateError

from elastic_runner import files
from elastic_runner.files import UnsafeDirectoryError
from elastic_runner.observe.audit import AuditWriter, check_audit
from elastic_runner.rendezvous.backend import CheckedStates, EtcdRendezvousBackend, decode_state, encode_state
from elastic_runner.rendezvous.options import parse_options
from elastic_runner.rendezvous.seal import Sealer
from elastic_runner.rendezvous.store import EtcdStore, EtcdStoreAuthError
from elastic_runner.snapshot import LocalStore, SnapshotError, SnapshotRef, SnapshotWriter, find_newest, require_ok
from elastic_runner.snapshot.memory import MemoryTier, memory_root
from elastic_runner.testing.memory_etcd import MemoryEtcd

KEY = b"k" * 32
STATE_KEY = "/p/run/state"


class Exploit:
    """What an attacker plants: unpickling it runs a command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def planted_blob(marker: Path) -> bytes:
    """A blob framed exactly as the backend frames a state, with a valid CRC-32: a CRC is not a signature."""
    payload = zlib.compress(pickle.dumps(Exploit(marker)))
    return struct.pack(">4sBI", b"ERV3", 1, zlib.crc32(payload)) + payload


# -- the rendezvous state --------------------------------------------------------------------------------------


def test_a_planted_pickle_is_refused_before_torch_unpickles_it_and_nothing_runs(tmp_path: Path) -> None:
    server = MemoryEtcd()
    marker = tmp_path / "pwned"
    server.raw_put(STATE_KEY.encode(), planted_blob(marker))
    backend = CheckedStates(EtcdRendezvousBackend(server.client(), "run", "/p"))
    with pytest.raises(RendezvousStateError, match=r"/p/run/state' is refused unread: it would build posix.system"):
        backend.get_state()
    assert not marker.exists()


def test_a_real_state_still_passes_the_check() -> None:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

    state = _RendezvousState()
    state.participants[_NodeDesc("10.0.0.1", 7, 0)] = 0
    backend = CheckedStates(EtcdRendezvousBackend(MemoryEtcd().client(), "run", "/p"))
    data, token, has_set = backend.set_state(pickle.dumps(state))
    assert has_set and backend.get_state() == (data, token)


def test_with_a_key_only_states_signed_with_it_are_read(tmp_path: Path) -> None:
    good = Sealer(KEY)
    signed = encode_state(b"state", good, STATE_KEY)
    assert decode_state(signed, STATE_KEY, good) == b"state"
    with pytest.raises(RendezvousStateError, match="is not signed, but this agent requires"):
        decode_state(planted_blob(tmp_path / "x"), STATE_KEY, good)  # a valid CRC, no signature
    with pytest.raises(RendezvousStateError, match="does not carry a valid signature"):
        decode_state(encode_state(b"state", Sealer(b"o" * 32), STATE_KEY), STATE_KEY, good)
    tampered = bytearray(signed)
    tampered[-1] ^= 1
    with pytest.raises(RendezvousStateError, match="does not carry a valid signature"):
        decode_state(bytes(tampered), STATE_KEY, good)
    with pytest.raises(RendezvousStateError, match="is signed, but this agent has no key"):
        decode_state(signed, STATE_KEY, None)
    with pytest.raises(RendezvousStateError, match="does not carry a valid signature"):
        decode_state(signed, "/p/other-run/state", good)  # a signed state moved to another run


def test_a_decompression_bomb_is_refused_within_bounded_memory() -> None:
    payload = zlib.compress(b"\0" * (1 << 30), 9)  # 1 GiB of zeros in about a megabyte
    blob = struct.pack(">4sBI", b"ERV3", 1, zlib.crc32(payload)) + payload
    tracemalloc.start()
    try:
        with pytest.raises(RendezvousStateError, match="decompresses to more than 16 MiB"):
            decode_state(blob, STATE_KEY)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"peak {peak >> 20} MiB while refusing"


def test_store_values_are_signed_and_checked() -> None:
    server = MemoryEtcd()
    store = EtcdStore(server.client(), "/p/run", sealer=Sealer(KEY), read_timeout=1)
    store.set("MASTER_ADDR", b"10.0.0.1")
    assert store.get("MASTER_ADDR") == b"10.0.0.1" and store.add("counter", 2) == 2 and store.add("counter", 3) == 5
    assert store.compare_set("cas", "", "a") == b"a" and store.compare_set("cas", "a", "b") == b"b"
    server.raw_put(b"/p/run/store/MASTER_ADDR", b"attacker.example")  # planted by someone without the key
    with pytest.raises(EtcdStoreAuthError, match="store/MASTER_ADDR' is refused: it is not signed"):
        store.get("MASTER_ADDR")
    signed = server.client().get(b"/p/run/store/cas")[0].value
    server.raw_put(b"/p/run/store/MASTER_ADDR", signed)  # a signed value moved to another key
    with pytest.raises(EtcdStoreAuthError, match="signature does not verify"):
        store.get("MASTER_ADDR")


# -- options: secrets ----------------------------------------------------------------------------------------------


def params(endpoint: str = "127.0.0.1:2379", **conf: str) -> RendezvousParameters:
    return RendezvousParameters("etcd-v3", endpoint, "run", 1, 1, **conf)


def test_a_password_on_the_command_line_is_refused() -> None:
    with pytest.raises(ValueError, match=r"password=\.\.\.: .*process list.*password_file"):
        parse_options(params(user="root", password="s3cret"))


def test_credentials_over_plain_http_are_refused(tmp_path: Path) -> None:
    pw = tmp_path / "pw"
    pw.write_text("s3cret\n")
    pw.chmod(0o600)
    with pytest.raises(ValueError, match="over plain http to http://etcd.example:2379; use https://"):
        parse_options(params("etcd.example:2379", user="root", password_file=str(pw)))
    with pytest.raises(ValueError, match="insecure_loopback_auth=true"):
        parse_options(params("etcd.example:2379", user="root", password_file=str(pw), insecure_loopback_auth="true"))
    assert parse_options(params(user="root", password_file=str(pw), insecure_loopback_auth="true")).password == "s3cret"
    assert "s3cret" not in repr(parse_options(params(user="root", password_file=str(pw), insecure_loopback_auth="true")))


def test_secret_files_readable_by_others_are_named_in_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    key = tmp_path / "rdzv.key"
    key.write_text("a" * 64)
    key.chmod(0o644)
    with caplog.at_level(logging.WARNING):
        options = parse_options(params(auth_key_file=str(key)))
    assert options.auth_key == b"a" * 64
    assert f"'{key}' holds a secret but every user of this machine may read or change it (mode 0644)" in caplog.text
    key.chmod(0o440)  # how Kubernetes mounts a Secret for a non-root container (group = the pod's fsGroup)
    caplog.clear()
    parse_options(params(auth_key_file=str(key)))
    assert "holds a secret" not in caplog.text
    key.write_text("short")
    with pytest.raises(ValueError, match="has 5 bytes; use at least 32"):
        parse_options(params(auth_key_file=str(key)))


# -- private files ---------------------------------------------------------------------------------------------------


def capture(step: int):  # noqa: ANN201
    return lambda: ({"model": {"w": torch.full((2,), float(step))}}, {"fingerprint": {"m": "x"}, "run_uid": "u"})


@pytest.mark.parametrize(("sharing", "file_mode", "dir_mode"), [("private", 0o600, 0o700), ("group", 0o640, 0o750)])
def test_snapshot_files_and_directories_get_the_sharing_mode(tmp_path: Path, sharing: str, file_mode: int,
                                                              dir_mode: int) -> None:
    files.set_sharing(sharing)
    try:
        store = LocalStore(tmp_path / "snaps")
        store.ensure()
        writer = SnapshotWriter(store, generation=store.claim_generation({}), keep_last=2)
        require_ok(writer.save(3, capture(3), sync=True))
        store.run_uid()
        audit = AuditWriter(tmp_path / "run", generation=1, rank=0, world_size=1, header={})
        audit.close()
        for path in [*(tmp_path / "snaps").rglob("*"), *(tmp_path / "run").rglob("*")]:
            expected = dir_mode if path.is_dir() else file_mode
            assert stat.S_IMODE(path.stat().st_mode) == expected, f"{path}: {oct(path.stat().st_mode)}"
    finally:
        files.set_sharing("private")


def test_the_memory_tier_lives_in_a_private_directory_of_this_user(tmp_path: Path) -> None:
    root = memory_root("/runs/x/snapshots", base=str(tmp_path / "node-0"))  # a base that does not exist yet
    tier = MemoryTier(root, 1, "u")
    assert tier.save(5, capture(5))
    assert stat.S_IMODE(root.parent.stat().st_mode) == 0o700 and stat.S_IMODE(root.stat().st_mode) == 0o700
    for path in root.rglob("*"):
        assert stat.S_IMODE(path.stat().st_mode) == (0o700 if path.is_dir() else 0o600), path


def test_a_memory_directory_planted_beforehand_is_refused_and_nothing_is_deleted(tmp_path: Path) -> None:
    base = tmp_path / "shm"
    base.mkdir()
    mine = base / f"elastic-runner-{os.getuid()}"
    mine.mkdir(mode=0o777)
    mine.chmod(0o777)  # created first by another local user, open to all
    with pytest.raises(UnsafeDirectoryError, match="mode 0777: other users may write into it"):
        memory_root("/runs/x/snapshots", base=str(base))
    mine.rmdir()
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "step-000000010-gen-000001").mkdir()
    (victim / "precious.txt").write_text("keep me")
    mine.symlink_to(victim)  # the per-user directory swapped for a link into real data
    with pytest.raises(UnsafeDirectoryError, match="is a symbolic link"):
        memory_root("/runs/x/snapshots", base=str(base))
    mine.unlink()
    key_dir = memory_root("/runs/x/snapshots", base=str(base))
    shutil.rmtree(key_dir)
    key_dir.symlink_to(victim)  # or the run's directory inside it
    with pytest.raises(UnsafeDirectoryError, match="is a symbolic link"):
        memory_root("/runs/x/snapshots", base=str(base))
    assert sorted(p.name for p in victim.iterdir()) == ["precious.txt", "step-000000010-gen-000001"]
    if os.getuid() == 0:  # root can make the directory someone else's, as another user would have
        key_dir.unlink()
        foreign = memory_root("/runs/x/snapshots", base=str(base))
        os.chown(foreign, 4242, 4242)
        with pytest.raises(UnsafeDirectoryError, match="belongs to uid 4242"):
            memory_root("/runs/x/snapshots", base=str(base))


# -- bad bytes on disk ------------------------------------------------------------------------------------------------

MALFORMED = {
    "sha256 is a number": lambda m: m | {"sha256": 12345},
    "size_bytes is a string": lambda m: m | {"size_bytes": "9" * 30},
    "step is negative": lambda m: m | {"step": -4},
    "generation is a float": lambda m: m | {"generation": 1.5},
    "fingerprint is a list": lambda m: m | {"fingerprint": ["m", "x"]},
    "sha256 is not hex": lambda m: m | {"sha256": "z" * 64},
    "format is a string": lambda m: m | {"format": "1"},
    "not an object": lambda m: [m],
}


@pytest.mark.parametrize("damage", list(MALFORMED) + ["recursion"])
def test_a_malformed_meta_json_is_quarantined_with_a_reason_and_the_previous_snapshot_used(
        tmp_path: Path, damage: str) -> None:
    store = LocalStore(tmp_path / "s")
    store.ensure()
    writer = SnapshotWriter(store, generation=store.claim_generation({}), keep_last=3)
    for step in (10, 20):
        require_ok(writer.save(step, capture(step), sync=True))
    meta_path = store.path(SnapshotRef(1, 20)) / "meta.json"
    if damage == "recursion":
        meta_path.write_text('{"sha256": ' + "[" * 200000 + "]" * 200000 + "}")
    else:
        meta_path.write_text(json.dumps(MALFORMED[damage](json.loads(meta_path.read_text()))))
    loaded = find_newest(store)
    assert loaded is not None and loaded.ref == SnapshotRef(1, 10)
    assert store.corrupt() == ["corrupt-step-000000020-gen-000001"]
    assert (store.root / "corrupt-step-000000020-gen-000001" / "REASON").read_text().strip()


def test_the_state_file_size_is_checked_before_it_is_read(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "s")
    store.ensure()
    writer = SnapshotWriter(store, generation=store.claim_generation({}), keep_last=3)
    require_ok(writer.save(10, capture(10), sync=True))
    state = store.path(SnapshotRef(1, 10)) / "state.pt"
    with open(state, "r+b") as fh:
        fh.truncate(4 << 30)  # 4 GiB (sparse: no disk used), far past what the marker says
    tracemalloc.start()
    try:
        with pytest.raises(SnapshotError, match="all 1 snapshot"):
            find_newest(store)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"an oversized state.pt is refused by its size, unread ({peak >> 20} MiB allocated)"
    assert f"state.pt has {4 << 30} bytes, the marker says" in (
        store.root / "corrupt-step-000000010-gen-000001" / "REASON").read_text()


def test_snapshot_names_are_exactly_ascii() -> None:
    assert SnapshotRef.parse("step-000000001-gen-000001") == SnapshotRef(1, 1)
    assert SnapshotRef.parse("step-000000001-gen-000001\n") is None
    assert SnapshotRef.parse("step-00000000١-gen-000001") is None  # an Arabic-Indic digit


def test_audit_files_are_rotated_and_checked_in_a_stream(tmp_path: Path) -> None:
    from elastic_runner.data.sampler import ElasticSampler

    sampler = ElasticSampler(40, 8, seed=1)
    audit = AuditWriter(tmp_path, generation=1, rank=0, world_size=1, max_file_bytes=600,
                        header={"num_samples": 40, "seed": 1, "shuffle": True, "partial_batch": "drop", "global_batch": 8})
    step = 0
    for _ in range(2):
        for plan in list(sampler.plans()):
            step += 1
            audit.step(step=step, epoch=plan.epoch, start=plan.start, global_count=plan.global_count,
                       indices=plan.indices, micro_batch=8, accumulation=1)
            sampler.advance(plan)
        sampler.next_epoch()
    audit.end(step)
    audit.close()
    parts = sorted(p.name for p in (tmp_path / "audit").iterdir())
    assert len(parts) > 2 and all(os.path.getsize(tmp_path / "audit" / p) <= 600 for p in parts), parts
    report = check_audit(tmp_path)
    assert report.ok and report.finished and report.final_step == 10, report.render()


def test_the_effective_config_is_not_written_through_a_planted_link(tmp_path: Path) -> None:
    from elastic_runner.config import Config, write_effective_config

    run = tmp_path / "run"
    run.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (run / f".config.yaml.{os.getpid()}.tmp").symlink_to(victim)  # the old, predictable temporary name
    write_effective_config(Config(), str(run))
    assert victim.read_text() == "precious"
    assert stat.S_IMODE((run / "config.yaml").stat().st_mode) == 0o600


def test_object_collectives_carry_json_not_pickles() -> None:
    code = ("import json, math; from elastic_runner.worker.group import up; from elastic_runner.env import WorkerEnv\n"
            "d = up(WorkerEnv())\n"
            "print(json.dumps([d.broadcast_object(('ok', 3, {'a': [1.5, None]})), d.all_gather_object(float('nan'))],"
            " allow_nan=True)); d.down()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == '[["ok", 3, {"a": [1.5, null]}], [NaN]]'
