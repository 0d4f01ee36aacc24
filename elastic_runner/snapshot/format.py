"""What is inside a snapshot, and how it is written and verified.

``state.pt`` is a ``torch.save`` of plain containers and tensors only, so it
loads with ``weights_only=True``: a tampered file cannot run code. ``meta.json``
is the completion marker and carries what ``snapshot inspect`` shows without
reading tensors: step, epoch, position, generation, world-size history, config
fingerprint, size and the SHA-256 of ``state.pt``.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import time
from pathlib import Path
from typing import Any, BinaryIO

import torch

from .store import META, STATE, CorruptSnapshotError, SnapshotError, SnapshotUnavailableError

FORMAT_VERSION = 1


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


def write_snapshot_files(directory: Path, state: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """Write state.pt, then meta.json (the marker) into ``directory``; fsync both."""
    state_path = directory / STATE
    writer: _HashingWriter | None = None
    try:
        with open(state_path, "wb") as fh:
            writer = _HashingWriter(fh)
            try:
                torch.save(state, writer)
            except RuntimeError as exc:
                if writer.os_error is not None:
                    raise writer.os_error from exc
                raise
            fh.flush()
            os.fsync(fh.fileno())
        full_meta = dict(meta) | {
            "format": FORMAT_VERSION,
            "sha256": writer.sha.hexdigest(),
            "size_bytes": writer.size,
            "written_at": time.time(),
        }
        tmp_meta = directory / (META + ".tmp")
        with open(tmp_meta, "w") as fh:
            json.dump(full_meta, fh, indent=1, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp_meta, directory / META)
    except OSError as exc:
        reason = "disk full" if exc.errno == errno.ENOSPC else (exc.strerror or str(exc))
        raise SnapshotError(
            f"writing the snapshot into {directory} failed: {reason} "
            f"({exc.strerror}); free space or fix the directory. The previous snapshots are untouched"
        ) from exc
    return full_meta


def read_meta(directory: Path) -> dict[str, Any]:
    try:
        meta = json.loads((directory / META).read_text())
    except FileNotFoundError as exc:
        raise CorruptSnapshotError(f"{directory.name}: no {META} (incomplete snapshot)") from exc
    except ValueError as exc:
        raise CorruptSnapshotError(f"{directory.name}: unreadable {META} ({exc})") from exc
    except OSError as exc:
        raise SnapshotUnavailableError(f"{directory.name}: cannot read {META} ({exc.strerror}); is the filesystem healthy?") from exc
    if not isinstance(meta, dict) or "sha256" not in meta:
        raise CorruptSnapshotError(f"{directory.name}: {META} lacks its checksum")
    if meta.get("format") != FORMAT_VERSION:
        raise SnapshotError(f"{directory.name}: format {meta.get('format')} is not supported (expected {FORMAT_VERSION}); "
                            "resume with the elastic_runner version that wrote it")
    return meta


def read_verified_bytes(directory: Path, meta: dict[str, Any], verify: bool = True) -> bytes:
    path = directory / STATE
    try:
        data = path.read_bytes()
    except FileNotFoundError as exc:
        raise CorruptSnapshotError(f"{directory.name}: {STATE} is missing") from exc
    except (OSError, MemoryError) as exc:
        raise SnapshotUnavailableError(f"{directory.name}: cannot read {STATE} ({exc}); is the filesystem healthy?") from exc
    if len(data) != meta.get("size_bytes"):
        raise CorruptSnapshotError(f"{directory.name}: {STATE} has {len(data)} bytes, the marker says {meta.get('size_bytes')} (truncated)")
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
    meta = read_meta(directory)
    data = read_verified_bytes(directory, meta, verify)
    return meta, load_state_bytes(data, directory.name, map_location)
