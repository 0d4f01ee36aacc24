"""What is inside a snapshot, and how it is written and verified.

``state.pt`` is a ``torch.save`` of plain containers and tensors only, so it
loads with ``weights_only=True``: a tampered file cannot run code. ``meta.json``
is the completion marker and carries what ``snapshot inspect`` shows without
reading tensors: step, epoch, position, generation, world-size history, config
fingerprint, size and the SHA-256 of ``state.pt``. Its own SHA-256 (``meta_sha256``,
over the canonical JSON of every other field) covers the rest of it, so a
``meta.json`` changed after the fact is a damaged snapshot like a changed
``state.pt`` (format 2; format 1 snapshots, written before, load without it).
With the job's key (``ELASTIC_RUNNER_AUTH_KEY_FILE``: the rendezvous' ``auth_key_file``,
which the agent passes on to its workers by path) ``meta.json`` is also signed
(``meta_hmac``, HMAC-SHA256 over the same JSON, which holds ``state.pt``'s SHA-256):
a reader that has the key takes no snapshot that is not signed with it, so whoever
can write the snapshot directory but lacks the key cannot make a resuming job (or
``load_model``) take numbers of their choosing.
Nothing in either file ever chooses code to run: a model is rebuilt from a
snapshot's config only when it is a built-in one (:func:`elastic_runner.load_model`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import io
import json
import os
import stat
import time
from pathlib import Path
from collections.abc import Iterator
from typing import Any, BinaryIO, Callable

import torch

from ..files import open_file
from .store import (MAX_META_BYTES, META, STATE, CorruptSnapshotError, SnapshotError, SnapshotRef,
                    SnapshotUnavailableError, fsync_dir, in_background)

FORMAT_VERSION = 2
#: Formats this version reads: 1 lacks ``meta_sha256``.
READABLE_FORMATS = (1, 2)


def meta_digest(meta: dict[str, Any]) -> str:
    """SHA-256 of ``meta`` without its own digest, as canonical JSON (sorted keys, no spaces)."""
    body = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


#: The environment variable that names the job's key file (a path, never the key itself).
KEY_FILE_VAR = "ELASTIC_RUNNER_AUTH_KEY_FILE"
_signing_key: bytes | None = None


def set_signing_key(key: bytes | None) -> None:
    """The job's key, for signing and checking snapshot metadata in this process (None: unsigned)."""
    global _signing_key
    _signing_key = key


@contextlib.contextmanager
def signing_key(key: bytes | None) -> Iterator[None]:
    """:func:`set_signing_key` for a block only (a library call must not change what the rest of the process
    signs and accepts)."""
    global _signing_key
    before, _signing_key = _signing_key, key
    try:
        yield
    finally:
        _signing_key = before


def signing_key_from_environment() -> bytes | None:
    """The key named by :data:`KEY_FILE_VAR` (``SnapshotError`` naming the variable if it cannot be read)."""
    path = os.environ.get(KEY_FILE_VAR)
    if not path:
        return None
    from ..rendezvous.seal import read_key

    try:
        return read_key(path)
    except (OSError, ValueError) as exc:
        raise SnapshotError(f"{KEY_FILE_VAR}={path}: the job's key cannot be read ({exc}); fix the path or unset "
                            "it") from exc


def meta_signature(meta: dict[str, Any], key: bytes) -> str:
    """HMAC-SHA256 under the job's key of ``meta`` without its digest and signature (canonical JSON)."""
    body = {k: v for k, v in meta.items() if k not in ("meta_sha256", "meta_hmac")}
    return hmac.new(key, json.dumps(body, sort_keys=True, separators=(",", ":")).encode(), hashlib.sha256).hexdigest()


def current_signing_key() -> bytes | None:
    """The job's key this process signs and checks with (None: unsigned)."""
    return _signing_key


class _HashingWriter:
    """File wrapper that hashes what torch.save writes, so no second read is needed."""

    def __init__(self, fh: BinaryIO) -> None:
        self.fh = fh
        self.sha = hashlib.sha256()
        self.size = 0
        #: The real I/O error: torch's C++ zip writer replaces it by "unexpected pos".
        self.os_error: OSError | None = None

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        try:
            return self.fh.write(data)
        except OSError as exc:
            self.os_error = exc
            raise

    def flush(self) -> None:
        self.fh.flush()


def write_snapshot_files(directory: Path, state: dict[str, Any], meta: dict[str, Any],
                         more_meta: Callable[[], dict[str, Any]] | None = None, sync: bool = True) -> dict[str, Any]:
    """Write state.pt, then meta.json (the marker) into ``directory``; fsync both. ``more_meta``: called between the
    two, for fields known only then (a sharded snapshot's parts, which its other ranks write meanwhile). ``sync``
    False: no fsync (a staging copy that an upload makes durable, not the disk)."""
    state_path = directory / STATE
    writer: _HashingWriter | None = None
    try:
        with open_file(state_path, "wb", exclusive=True) as fh:
            writer = _HashingWriter(fh)
            try:
                torch.save(state, writer)
            except RuntimeError as exc:
                if writer.os_error is not None:
                    raise writer.os_error from exc
                raise
            fh.flush()
            if sync:
                os.fsync(fh.fileno())
        full_meta = dict(meta) | (more_meta() if more_meta is not None else {}) | {
            "format": FORMAT_VERSION,
            "sha256": writer.sha.hexdigest(),
            "size_bytes": writer.size,
            "written_at": time.time(),
        }
        if _signing_key is not None:
            full_meta["meta_hmac"] = meta_signature(full_meta, _signing_key)
        full_meta["meta_sha256"] = meta_digest(full_meta)
        # Straight into place: ``directory`` is a staging directory that nobody reads before it is published, and a
        # crash leaves it unpublished. The directory (its entries: every file of the snapshot) is fsynced beside the
        # file, not after it: one journal commit's wait instead of two (the caller publishes with
        # ``entries_synced=True``).
        with open_file(directory / META, "w", exclusive=True) as fh:
            json.dump(full_meta, fh, indent=1, sort_keys=True)
            fh.flush()
            if sync:
                synced_dir = in_background(fsync_dir, directory)
                os.fsync(fh.fileno())
                synced_dir()
    except OSError as exc:
        reason = "disk full" if exc.errno == errno.ENOSPC else (exc.strerror or str(exc))
        raise SnapshotError(
            f"writing the snapshot into {directory} failed: {reason} "
            f"({exc.strerror}); free space or fix the directory. The previous snapshots are untouched"
        ) from exc
    return full_meta



#: The fields a snapshot's meta.json must hold, and their types (``int`` excludes ``bool``).
_META_FIELDS: dict[str, type | tuple[type, ...]] = {
    "format": int, "sha256": str, "size_bytes": int, "step": int, "generation": int, "written_at": (int, float),
}
_OPTIONAL_FIELDS: dict[str, type | tuple[type, ...]] = {
    "fingerprint": dict, "run_uid": str, "config": dict, "world_history": list, "epoch": int, "consumed": int,
    "world_size": int, "samples_total": int, "model_build": dict, "script": dict, "sharded": dict,
}


def read_meta(directory: Path) -> dict[str, Any]:
    """``meta.json``, checked field by field: anything malformed is :class:`CorruptSnapshotError` (the
    snapshot is moved aside with the reason), never an exception that would crash-loop the job."""
    path = directory / META
    try:
        size = path.stat().st_size
        if size > MAX_META_BYTES:
            raise CorruptSnapshotError(f"{directory.name}: {META} has {size} bytes, far more than any marker")
        data = path.read_bytes()
    except FileNotFoundError as exc:
        raise CorruptSnapshotError(f"{directory.name}: no {META} (incomplete snapshot)") from exc
    except OSError as exc:
        raise SnapshotUnavailableError(f"{directory.name}: cannot read {META} ({exc.strerror}); is the filesystem healthy?") from exc
    return parse_meta(directory.name, data)


def parse_meta(name: str, data: bytes) -> dict[str, Any]:
    """The checks of :func:`read_meta` on the bytes of snapshot ``name``'s marker (fetched from a bucket alone)."""
    if len(data) > MAX_META_BYTES:
        raise CorruptSnapshotError(f"{name}: {META} has {len(data)} bytes, far more than any marker")
    try:
        meta = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise CorruptSnapshotError(f"{name}: unreadable {META} ({type(exc).__name__}: {str(exc)[:120]})") from exc
    if not isinstance(meta, dict) or "sha256" not in meta:
        raise CorruptSnapshotError(f"{name}: {META} lacks its checksum")
    try:
        json.dumps(meta, ensure_ascii=False).encode()
    except (UnicodeEncodeError, ValueError, RecursionError) as exc:  # a lone surrogate ("\ud800"): no text of ours
        raise CorruptSnapshotError(f"{name}: {META} holds text that is not UTF-8 ({type(exc).__name__})") from exc
    if _signing_key is not None:  # first: nothing unsigned decides anything, not even "a newer format"
        try:
            signature = meta.get("meta_hmac")
            signed = isinstance(signature, str) and hmac.compare_digest(signature, meta_signature(meta, _signing_key))
        except (TypeError, ValueError, RecursionError):
            signed = False
        if not signed:
            raise CorruptSnapshotError(f"{name}: {META} is not signed with the job's key (written without "
                                       f"it, with another, or changed); a reader with {KEY_FILE_VAR} takes only "
                                       "snapshots signed with it")
    if meta.get("format") not in READABLE_FORMATS and isinstance(meta.get("format"), int):
        raise SnapshotError(f"{name}: format {meta.get('format')} is not supported (this version reads "
                            f"{', '.join(map(str, READABLE_FORMATS))}); resume with the elastic_runner version that wrote it")
    for fields, required in ((_META_FIELDS, True), (_OPTIONAL_FIELDS, False)):
        for field, kind in fields.items():
            if field not in meta and not required:
                continue
            value = meta.get(field)
            if not isinstance(value, kind) or isinstance(value, bool) and kind in (int, (int, float)):
                raise CorruptSnapshotError(f"{name}: {META} field '{field}' is {type(value).__name__} "
                                           f"{str(value)[:40]!r}, not {getattr(kind, '__name__', kind)}")
    if not (len(meta["sha256"]) == 64 and all(c in "0123456789abcdef" for c in meta["sha256"])):
        raise CorruptSnapshotError(f"{name}: {META} field 'sha256' is not a SHA-256 hex digest")
    if meta["size_bytes"] < 0 or meta["step"] < 0 or meta["generation"] < 0:
        raise CorruptSnapshotError(f"{name}: {META} has a negative size, step or generation")
    fingerprint = meta.get("fingerprint", {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in fingerprint.items()):
        raise CorruptSnapshotError(f"{name}: {META} field 'fingerprint' is not a mapping of strings")
    if meta["format"] >= 2:
        if not isinstance(meta.get("meta_sha256"), str):
            raise CorruptSnapshotError(f"{name}: {META} lacks its own checksum (meta_sha256)")
        try:
            digest = meta_digest(meta)
        except (TypeError, ValueError, RecursionError) as exc:
            raise CorruptSnapshotError(f"{name}: {META} cannot be checked ({type(exc).__name__})") from exc
        if digest != meta["meta_sha256"]:
            raise CorruptSnapshotError(f"{name}: {META} was modified or damaged (its checksum does not match)")
    ref = SnapshotRef.parse(name)
    if ref is not None and (meta["step"], meta["generation"]) != (ref.step, ref.generation):
        # The step and generation are signed; the directory's name is not: a snapshot copied under another name
        # (a newer generation, to be taken first) says so here.
        raise CorruptSnapshotError(f"{name}: {META} is the snapshot of step {meta['step']}, generation "
                                   f"{meta['generation']}, not of its directory's name (copied or renamed)")
    return meta


def _open_unfollowed(path: Path) -> BinaryIO:
    """``path`` for reading, never through a symbolic link (ELOOP: a link planted where a snapshot's file is)."""
    return open(path, "rb", opener=lambda p, f: os.open(p, f | getattr(os, "O_NOFOLLOW", 0)))


def read_verified_bytes(directory: Path, meta: dict[str, Any], verify: bool = True) -> bytes:
    """``state.pt``: its size checked against the marker before it is read, its SHA-256 after."""
    path = directory / STATE
    try:
        # One open file for the size check and the read: a file swapped in between cannot slip through.
        with _open_unfollowed(path) as fh:
            info = os.fstat(fh.fileno())
            if stat.S_ISREG(info.st_mode) and info.st_size != meta["size_bytes"]:
                raise CorruptSnapshotError(f"{directory.name}: {STATE} has {info.st_size} bytes, the marker says "
                                           f"{meta['size_bytes']} (truncated or replaced)")
            data = fh.read(meta["size_bytes"] + 1)
    except FileNotFoundError as exc:
        raise CorruptSnapshotError(f"{directory.name}: {STATE} is missing") from exc
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EISDIR):  # a link or a directory where the file should be: planted
            raise CorruptSnapshotError(f"{directory.name}: {STATE} is not a regular file ({exc.strerror})") from exc
        raise SnapshotUnavailableError(f"{directory.name}: cannot read {STATE} ({exc}); is the filesystem healthy?") from exc
    except MemoryError as exc:
        raise SnapshotUnavailableError(f"{directory.name}: cannot read {STATE} ({exc}); is the filesystem healthy?") from exc
    if len(data) != meta["size_bytes"]:
        raise CorruptSnapshotError(f"{directory.name}: {STATE} has {len(data)} bytes, the marker says {meta['size_bytes']} (truncated)")
    if verify:
        digest = hashlib.sha256(data).hexdigest()
        if digest != meta["sha256"]:
            raise CorruptSnapshotError(f"{directory.name}: checksum mismatch ({digest[:12]}… != {meta['sha256'][:12]}…), the file was modified or damaged")
    return data


def load_state_bytes(data: bytes, name: str, map_location: torch.device | str | None) -> dict[str, Any]:
    try:
        state = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except MemoryError as exc:
        raise SnapshotUnavailableError(f"{name}: not enough host memory to load {STATE}") from exc
    except torch.OutOfMemoryError as exc:
        raise SnapshotUnavailableError(f"{name}: not enough device memory to load {STATE} (load to CPU first)") from exc
    except Exception as exc:  # damaged zip, unsafe or foreign pickle: the bytes themselves are bad
        first = (str(exc).splitlines() or [""])[0][:200]
        raise CorruptSnapshotError(f"{name}: {STATE} cannot be loaded safely ({type(exc).__name__}: {first})") from exc
    if not isinstance(state, dict) or "model" not in state:
        raise CorruptSnapshotError(f"{name}: {STATE} does not hold a training state")
    return state


def load_snapshot(directory: Path, map_location: torch.device | str | None = "cpu", verify: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(meta, state)`` with every tensor whole: a sharded snapshot's parts are verified and assembled."""
    from .shards import PartReader, verify_parts, whole

    meta = read_meta(directory)
    data = read_verified_bytes(directory, meta, verify)
    state = load_state_bytes(data, directory.name, map_location)
    if "sharded" in meta:
        verify_parts(directory, meta, verify)
        state = whole(state, PartReader(directory, meta))
    return meta, state
