"""Sharded snapshots (``parallel.strategy: fsdp | hsdp``): every rank writes its own shards, nobody gathers the
model, and a load takes exactly the slice the loading rank needs, at any world size and strategy.

A sharded snapshot is a snapshot directory like any other (``state.pt``, ``meta.json`` last) plus one part
file per writing rank:

- ``state.pt`` (rank 0): the training state with each sharded tensor replaced by a *marker*
  ``{"__shard__": key, "shape": [...], "dtype": "float32"}`` — the sampler, schedule, TrainState, random
  generators, the optimizer's scalars and every unsharded tensor as today;
- ``part-RRRRR.bin``: that rank's slices, each with where it sits in the whole tensor (FSDP2's ``Shard(0)``: rows;
  any box works), in :mod:`.part_file`'s format: a JSON header and the tensors' raw bytes;
- ``meta.json``: as always, plus ``sharded: {format, world_size, parts: [{file, sha256, size_bytes}]}``. Its
  own checksum (and the job key's signature) covers every part's SHA-256, so a part cannot be swapped.

Nothing is unpickled: ``state.pt`` loads with ``weights_only=True`` and a part is JSON and raw bytes. (That is why
this is not ``torch.distributed.checkpoint``'s file layout: its ``.metadata`` is a pickle that its reader unpickles,
which our trust rule forbids for anything read from a shared disk.) The resharding is DCP's idea,
box intersection: a loading rank asks for the box its new placement holds (:func:`target_box`), and each part
that overlaps it contributes its rows (:class:`PartReader`, files memory-mapped: only the pages read count).

HSDP's replicas hold the same shards: only the ranks of the first replica write parts.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import time
import weakref
from pathlib import Path
from typing import Any, Callable

import torch

from ..files import open_file
from ..printable import printable
from . import part_file
from .store import STATE, CorruptSnapshotError, SnapshotError, SnapshotUnavailableError

MARKER = "__shard__"
#: 2: part files in :mod:`.part_file`'s raw format (``part-RRRRR.bin``); 1: ``torch.save`` (``part-RRRRR.pt``), still read.
SHARD_FORMAT = 2
#: Rank 0 waits at least this long for the other ranks' parts before it gives a snapshot up (longer when writing
#: its own part took long: :func:`~.publish.write_sharded`).
PART_WAIT_MIN_S = 60.0


#: The names of parts (``part_name``; ``.pt``: the older format).
_PART_FILE = re.compile(r"part-[0-9]{5,9}\.(bin|pt)")


def part_name(rank: int) -> str:
    return f"part-{rank:05d}.bin"


def record_name(rank: int) -> str:
    """What a writing rank leaves beside its part for rank 0 (the part's SHA-256 and size)."""
    return f"part-{rank:05d}.json"


# -- splitting a live state ---------------------------------------------------------------------------------------


def is_dtensor(value: Any) -> bool:
    """A sharded tensor (torch's DTensor), told apart without importing torch.distributed.tensor."""
    return type(value).__name__ == "DTensor" and hasattr(value, "device_mesh")


#: Offsets by (shape, this rank's place in the mesh, placements): the same for every snapshot of an attempt, and
#: torch's computation of them is the slowest part of a capture (~50 µs a tensor).
_OFFSETS: dict[tuple[Any, ...], list[int]] = {}
#: A mesh's (shape, this rank's coordinate) by ``id``, with a weak reference that tells a reused id apart: torch 2.14
#: computes ``DeviceMesh.mesh`` on every access (~75 µs), which for a few hundred tensors was most of a capture.
_MESHES: dict[int, tuple[Callable[[], Any], tuple[Any, ...]]] = {}


def _mesh_key(mesh: Any) -> tuple[Any, ...]:
    known = _MESHES.get(id(mesh))
    if known is not None and known[0]() is mesh:
        return known[1]
    key = (tuple(mesh.mesh.shape), tuple(mesh.get_coordinate() or ()))
    _MESHES[id(mesh)] = (weakref.ref(mesh), key)
    return key


def _box_of(tensor: Any) -> list[int]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    key = (tuple(tensor.shape), _mesh_key(tensor.device_mesh), tuple(tensor.placements))
    offset = _OFFSETS.get(key)
    if offset is None:
        _, found = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        offset = _OFFSETS[key] = [int(o) for o in found]
    return list(offset)


def _local(tensor: Any) -> torch.Tensor:
    """A DTensor's local slice, without the autograd function ``to_local`` runs (not detached: whoever copies or
    serialises it does)."""
    local = getattr(tensor, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else tensor.to_local().detach()


#: What :func:`split` found for each DTensor of the last capture, by ``id``: (a weak reference to it, its spec, where
#: its local slice sits, its shape, its dtype's name). A live model's parameters (``state_dict(keep_vars=True)``) and
#: its optimizer's state are the same objects from one capture to the next; each DTensor costs torch ~10 µs to ask,
#: and at 4 ranks on 2 cores the step waited ~20 ms for that.
_SEEN: dict[int, tuple[Any, ...]] = {}


def _facts(value: Any, seen: dict[int, tuple[Any, ...]]) -> tuple[Any, ...]:
    known = _SEEN.get(id(value))
    spec = getattr(value, "_spec", None)
    if known is None or known[0]() is not value or known[1] is not spec or spec is None:
        known = (weakref.ref(value), spec, _box_of(value), list(value.shape), str(value.dtype).removeprefix("torch."))
    seen[id(value)] = known
    return known


def split(state: Any) -> tuple[Any, dict[str, torch.Tensor], dict[str, list[int]]]:
    """``state`` with every DTensor replaced by a marker; this rank's slices and where they sit."""
    global _SEEN
    tensors: dict[str, torch.Tensor] = {}
    offsets: dict[str, list[int]] = {}
    seen: dict[int, tuple[Any, ...]] = {}

    def walk(value: Any, path: tuple[str, ...]) -> Any:
        if is_dtensor(value):
            key = "/".join(path)
            _, _, box, shape, dtype = _facts(value, seen)
            tensors[key] = _local(value)
            offsets[key] = list(box)
            return {MARKER: key, "shape": list(shape), "dtype": dtype}
        if isinstance(value, dict):
            return {k: walk(v, (*path, str(k))) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v, (*path, str(i))) for i, v in enumerate(value)]
        if isinstance(value, tuple):
            return tuple(walk(v, (*path, str(i))) for i, v in enumerate(value))
        return value

    split_state = walk(state, ())
    _SEEN = seen  # only what this capture had: ids of tensors gone since are not kept
    return split_state, tensors, offsets


def is_marker(value: Any) -> bool:
    return isinstance(value, dict) and isinstance(value.get(MARKER), str)


# -- writing and finding parts -----------------------------------------------------------------------------------


def write_part(directory: Path, rank: int, part: dict[str, Any]) -> dict[str, Any]:
    """``part-RRRRR.bin`` (:mod:`.part_file`) and its record ``part-RRRRR.json`` (SHA-256, size), each written aside
    and renamed into place, so a reader never sees half of one; returns the record."""
    name = part_name(rank)
    tmp = directory / f".{name}.{os.getpid()}.tmp"
    try:
        with open_file(tmp, "wb", exclusive=True) as fh:
            sha, size = part_file.write(fh, part_file.encode(rank, part["tensors"], part["offsets"]))
        os.replace(tmp, directory / name)
        record = {"file": name, "sha256": sha, "size_bytes": size}
        # Not fsynced: only rank 0 reads it, to copy it into meta.json, which is (a crash before that leaves a
        # staging directory that is never published).
        tmp_record = directory / f".{record_name(rank)}.{os.getpid()}.tmp"
        with open_file(tmp_record, "w", exclusive=True) as fh:
            json.dump(record, fh)
        os.replace(tmp_record, directory / record_name(rank))
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise SnapshotError(f"writing {name} into {directory} failed ({exc.strerror}); free space or fix the "
                            "directory. The previous snapshots are untouched") from exc
    return record


def part_bytes(rank: int, part: dict[str, Any]) -> bytes:
    """A part file's bytes (what :func:`write_part` writes), for sending to another node's memory."""
    return part_file.to_bytes(rank, part["tensors"], part["offsets"])


def write_part_bytes(directory: Path, rank: int, data: bytes) -> dict[str, Any]:
    """:func:`write_part` for a part already serialised (:func:`part_bytes`), e.g. received from another node."""
    name = part_name(rank)
    record = {"file": name, "sha256": hashlib.sha256(data).hexdigest(), "size_bytes": len(data)}
    try:
        for target, body in ((name, data), (record_name(rank), json.dumps(record).encode())):
            tmp = directory / f".{target}.{os.getpid()}.tmp"
            with open_file(tmp, "wb", exclusive=True) as fh:
                fh.write(body)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, directory / target)
    except OSError as exc:
        raise SnapshotError(f"writing {name} into {directory} failed ({exc.strerror})") from exc
    return record


def read_record(directory: Path, missing: list[int]) -> dict[int, dict[str, Any]]:
    """The part records of ``missing`` ranks that are in ``directory`` by now."""
    found = {}
    for rank in missing:
        try:
            found[rank] = json.loads((directory / record_name(rank)).read_text())
        except (FileNotFoundError, ValueError):
            pass
    return found


def wait_for_parts(directory: Path, writers: list[int], *, timeout_s: float = PART_WAIT_MIN_S,
                   still_wanted: Callable[[], None] = lambda: None,
                   records_of: Callable[[list[int]], dict[int, dict[str, Any]]] | None = None,
                   poll_s: float = 0.005) -> list[dict[str, Any]]:
    """The records of every writer's part, once all are there (rank 0, before it publishes). ``still_wanted``
    raises when the snapshot should be given up (a newer generation owns the run). ``records_of``: where the
    records are looked for (default: ``directory``; a bucket for a store without a shared directory)."""
    deadline = time.monotonic() + timeout_s
    records: dict[int, dict[str, Any]] = {}
    next_check = 0.0
    look = records_of or (lambda missing: read_record(directory, missing))
    while True:
        missing = [r for r in writers if r not in records]
        if missing:
            records |= look(missing)
        if len(records) == len(writers):
            return [records[r] for r in writers]
        now = time.monotonic()
        if now > deadline:
            missing = [r for r in writers if r not in records]
            raise SnapshotError(f"rank(s) {', '.join(map(str, missing))} did not write their part of "
                                f"{directory.name} within {timeout_s:.0f} s; this snapshot is given up")
        if now >= next_check:
            still_wanted()
            next_check = now + 1.0
        time.sleep(poll_s)  # a few small files read: cheap, and the snapshot is durable that much sooner


def check_sharded_meta(name: str, meta: dict[str, Any]) -> list[dict[str, Any]]:
    """The parts a sharded ``meta.json`` lists, each field checked (:class:`CorruptSnapshotError` if not)."""
    sharded = meta.get("sharded")
    if not isinstance(sharded, dict) or sharded.get("format") not in (1, SHARD_FORMAT) \
            or not isinstance(sharded.get("parts"), list):
        raise CorruptSnapshotError(f"{name}: meta.json field 'sharded' is malformed")
    parts = sharded["parts"]
    for part in parts:
        ok = isinstance(part, dict) and isinstance(part.get("file"), str) and type(part.get("size_bytes")) is int \
            and part["size_bytes"] >= 0 and isinstance(part.get("sha256"), str) and len(part["sha256"]) == 64
        if not ok or not _PART_FILE.fullmatch(part["file"]):  # a name of ours: no path, no NUL, no odd length
            raise CorruptSnapshotError(f"{name}: meta.json lists a malformed part {str(part)[:80]!r}")
    if not parts:
        raise CorruptSnapshotError(f"{name}: meta.json lists no parts")
    return parts


def check_part_sizes(name: str, meta: dict[str, Any], sizes: dict[str, int]) -> None:
    """Every part of a sharded snapshot is there with its size, by a listing (``sizes``: file name -> bytes)."""
    for part in check_sharded_meta(name, meta):
        size = sizes.get(part["file"])
        if size is None:
            raise CorruptSnapshotError(f"{name}: {part['file']} is missing (a rank's part)")
        if size != part["size_bytes"]:
            raise CorruptSnapshotError(f"{name}: {part['file']} has {size} bytes, the marker says "
                                       f"{part['size_bytes']} (truncated or replaced)")


def listed_objects(name: str, meta: dict[str, Any], sizes: dict[str, int]) -> list[str]:
    """The files snapshot ``name``'s checked marker lists (``state.pt`` and any parts), each seen in a listing
    (``sizes``: file name -> bytes) at the size the marker says: what a copy of it fetches, and nothing else."""
    if sizes.get(STATE) != meta["size_bytes"]:
        found = "is missing" if STATE not in sizes else f"has {sizes[STATE]} bytes"
        raise CorruptSnapshotError(f"{name}: {STATE} {found}, the marker says {meta['size_bytes']} bytes")
    if "sharded" not in meta:
        return [STATE]
    check_part_sizes(name, meta, sizes)
    return [STATE, *(part["file"] for part in meta["sharded"]["parts"])]


def verify_parts(directory: Path, meta: dict[str, Any], verify: bool = True) -> None:
    """Every part is there with its size, and (``verify``) its SHA-256; read in pieces, never whole."""
    for part in check_sharded_meta(directory.name, meta):
        path = directory / part["file"]
        try:
            with open(path, "rb", opener=lambda p, f: os.open(p, f | getattr(os, "O_NOFOLLOW", 0))) as fh:
                size = os.fstat(fh.fileno()).st_size
                if size != part["size_bytes"]:
                    raise CorruptSnapshotError(f"{directory.name}: {part['file']} has {size} bytes, the marker says "
                                               f"{part['size_bytes']} (truncated or replaced)")
                if verify:
                    sha = hashlib.sha256()
                    while piece := fh.read(16 << 20):
                        sha.update(piece)
                    if sha.hexdigest() != part["sha256"]:
                        raise CorruptSnapshotError(f"{directory.name}: checksum mismatch in {part['file']}, the file "
                                                   "was modified or damaged")
        except FileNotFoundError as exc:
            raise CorruptSnapshotError(f"{directory.name}: {part['file']} is missing (a rank's part)") from exc
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EISDIR):  # a link or a directory where the part should be: planted
                raise CorruptSnapshotError(f"{directory.name}: {part['file']} is not a regular file "
                                           f"({exc.strerror})") from exc
            raise SnapshotUnavailableError(f"{directory.name}: cannot read {part['file']} ({exc.strerror}); is the "
                                           "filesystem healthy?") from exc


# -- reading: the box a rank needs -------------------------------------------------------------------------------


class PartReader:
    """The parts of one sharded snapshot, memory-mapped on first use; :meth:`box` assembles any box of a tensor.

    The parts were verified (size, SHA-256) by whoever selected the snapshot (:func:`verify_parts`)."""

    def __init__(self, directory: Path, meta: dict[str, Any], loaded: list[dict[str, Any]] | None = None) -> None:
        self.directory = directory
        parts = check_sharded_meta(directory.name, meta)
        self.names = [p["file"] for p in parts]
        #: What the parts hold in all: no tensor a marker describes can be larger.
        self.total_bytes = sum(p["size_bytes"] for p in parts)
        #: Parts already in memory (received from the nodes that held them), instead of the files.
        self._parts: list[dict[str, Any]] | None = loaded

    def _load(self) -> list[dict[str, Any]]:
        if self._parts is None:
            parts = []
            for name in self.names:
                try:
                    part = part_file.read(self.directory / name, name)
                except FileNotFoundError as exc:
                    raise CorruptSnapshotError(f"{self.directory.name}: {name} is missing (a rank's part)") from exc
                except Exception as exc:  # noqa: BLE001 - a damaged or foreign file
                    raise CorruptSnapshotError(f"{self.directory.name}: {name} cannot be loaded safely "
                                               f"({type(exc).__name__}: {str(exc)[:160]})") from exc
                if not isinstance(part, dict) or not isinstance(part.get("tensors"), dict) \
                        or not isinstance(part.get("offsets"), dict):
                    raise CorruptSnapshotError(f"{self.directory.name}: {name} does not hold shards")
                parts.append(part)
            self._parts = parts
        return self._parts

    def box(self, marker: dict[str, Any], offset: list[int], shape: list[int]) -> torch.Tensor:
        """The part ``[offset, offset + shape)`` of the tensor ``marker`` stands for, from every part that has
        some of it; :class:`CorruptSnapshotError` if the parts do not cover it."""
        key = marker[MARKER]
        dtype = getattr(torch, str(marker.get("dtype")), None)
        if not isinstance(dtype, torch.dtype):
            raise CorruptSnapshotError(f"{self.directory.name}: shard {printable(key, 80)} has an unknown dtype "
                                       f"{marker.get('dtype')!r}")
        numel = 1
        for n in shape:
            numel *= n
        if numel * torch.empty((), dtype=dtype).element_size() > self.total_bytes:  # before any allocation
            raise CorruptSnapshotError(f"{self.directory.name}: shard {key} is described as larger ({shape}) than "
                                       "every part together")
        out = torch.empty(shape, dtype=dtype)
        covered = 0
        filled: list[list[tuple[int, int]]] = []  # the boxes written so far: two parts never write the same value
        for part in self._load():
            piece, where = part["tensors"].get(key), part["offsets"].get(key)
            if piece is None or where is None:
                continue
            if not isinstance(piece, torch.Tensor) or len(where) != len(shape) or piece.dim() != len(shape):
                raise CorruptSnapshotError(f"{self.directory.name}: shard {key} has a malformed slice")
            src, dst = [], []
            for lo, n, plo, pn in zip(offset, shape, where, piece.shape):
                a, b = max(lo, plo), min(lo + n, plo + pn)
                if a >= b:
                    break
                src.append(slice(a - plo, b - plo))
                dst.append(slice(a - lo, b - lo))
            else:
                box = [(d.start, d.stop) for d in dst]
                if any(all(a < d and c < b for (a, b), (c, d) in zip(box, other)) for other in filled):
                    raise CorruptSnapshotError(f"{self.directory.name}: two parts hold the same values of {key} (a "
                                               "part was copied in, or does not belong to this snapshot)")
                filled.append(box)
                block = piece[tuple(src)]
                out[tuple(dst)] = block
                covered += block.numel()
        if covered != out.numel():
            raise CorruptSnapshotError(f"{self.directory.name}: the parts hold {covered} of the {out.numel()} values of "
                                       f"{key} this rank needs (a part is missing or does not belong to this snapshot)")
        return out


def target_box(like: Any, shape: list[int]) -> tuple[list[int], list[int]]:
    """(offset, shape) of the slice a DTensor laid out like ``like`` holds of a tensor of ``shape`` here."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local, offset = compute_local_shape_and_global_offset(torch.Size(shape), like.device_mesh, like.placements)
    return [int(o) for o in offset], [int(n) for n in local]


def place(value: Any, like: Any, reader: PartReader | None) -> Any:
    """One saved value in the layout of ``like`` (this rank's live tensor, or None for a whole tensor):

    a marker becomes this rank's box of it (a DTensor if ``like`` is one, else the whole tensor); a whole tensor
    for a sharded ``like`` becomes this rank's slice of it (a replicated snapshot loading into a sharded model)."""
    if is_marker(value):
        if reader is None:
            raise CorruptSnapshotError(f"shard {printable(value[MARKER], 80)} in a snapshot that lists no parts")
        shape = value.get("shape", [])
        if not isinstance(shape, list) or not all(type(n) is int and 0 <= n < 1 << 48 for n in shape):
            raise CorruptSnapshotError(f"shard {printable(value[MARKER], 80)} has a malformed shape {printable(shape, 80)}")
        if is_dtensor(like) and list(like.shape) == shape:
            offset, local = target_box(like, shape)
            return _as_dtensor(reader.box(value, offset, local), like, shape)
        return reader.box(value, [0] * len(shape), shape)
    if isinstance(value, torch.Tensor) and is_dtensor(like) and list(like.shape) == list(value.shape):
        offset, local = target_box(like, list(value.shape))
        index = tuple(slice(o, o + n) for o, n in zip(offset, local))
        return _as_dtensor(value[index].clone(), like, list(value.shape))
    return value


def _as_dtensor(local: torch.Tensor, like: Any, shape: list[int]) -> Any:
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local.to(like.device), like.device_mesh, like.placements, run_check=False,
                              shape=torch.Size(shape), stride=like.stride())


def whole(state: Any, reader: PartReader | None) -> Any:
    """``state`` with every marker replaced by its whole tensor (export, ``load_model``, a replicated run)."""
    if is_marker(state):
        return place(state, None, reader)
    if isinstance(state, dict):
        return {k: whole(v, reader) for k, v in state.items()}
    if isinstance(state, list):
        return [whole(v, reader) for v in state]
    if isinstance(state, tuple):
        return tuple(whole(v, reader) for v in state)
    return state


def has_markers(state: Any) -> bool:
    if is_marker(state):
        return True
    if isinstance(state, dict):
        return any(has_markers(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return any(has_markers(v) for v in state)
    return False
