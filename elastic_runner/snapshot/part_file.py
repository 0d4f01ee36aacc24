"""The bytes of a sharded snapshot's part file (format 2): a JSON header, then each tensor's raw bytes.

    b"ERPART02" | header length (8 bytes, little-endian) | header (UTF-8 JSON) | padding | tensor bytes, each at a
    multiple of 64

The header lists, per tensor, its key, dtype, shape, where it sits in the whole tensor (``offset``: the box of
:mod:`.shards`) and its byte range in the file. Why not ``torch.save``: a part is most of a snapshot's bytes, and
torch's zip writer pickles, computes a CRC-32 of every record and, through a hashing file object, hands each piece to
Python; this format is the tensors' own memory written as it is (about dd's speed) and hashed beside the disk's
fsync. Reading needs no unpickler at all (not even ``weights_only``'s): the header is JSON, every field checked, and a
tensor is a view of the memory-mapped file, so a rank reads only the pages of the rows it needs.

Format 1 (``torch.save`` of ``{"format", "rank", "tensors", "offsets"}``) is still read (:func:`read`).
"""

from __future__ import annotations

import hashlib
import io
import json
import mmap
import os
import sys
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ..printable import printable
from .store import in_background

MAGIC = b"ERPART02"
FORMAT = 2
ALIGN = 64
#: A header is a few hundred bytes a tensor: this bounds what a damaged length field can make a reader allocate.
MAX_HEADER_BYTES = 64 << 20
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.complex64, torch.complex128)}


class PartFormatError(ValueError):
    """The bytes are not a part file this reader can take (the message says what is wrong)."""


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return memoryview(flat.view(torch.uint8).numpy()).cast("B") if flat.numel() else memoryview(b"")


def encode(rank: int, tensors: dict[str, torch.Tensor], offsets: dict[str, list[int]]) -> list[memoryview | bytes]:
    """A part file's bytes as pieces to write in order: the header and padding, then each tensor's memory (no copy of
    a contiguous CPU tensor)."""
    if sys.byteorder != "little":
        raise PartFormatError("sharded snapshots are written on little-endian hosts only")
    entries, data, at = [], [], 0
    for key, tensor in tensors.items():
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise PartFormatError(f"shard {key}: dtype {dtype} cannot be written in a sharded snapshot")
        raw = _as_bytes(tensor)
        pad = -at % ALIGN
        if pad:
            data.append(bytes(pad))
            at += pad
        entries.append({"key": key, "dtype": dtype, "shape": list(tensor.shape), "offset": [int(o) for o in offsets[key]],
                        "start": at, "nbytes": raw.nbytes})
        data.append(raw)
        at += raw.nbytes
    header = json.dumps({"format": FORMAT, "rank": rank, "tensors": entries}, separators=(",", ":")).encode()
    head = MAGIC + len(header).to_bytes(8, "little") + header
    # Data offsets in the header count from the first byte after the padded header: known before the header is.
    head += bytes(-len(head) % ALIGN)
    return [head, *data]


def to_bytes(rank: int, tensors: dict[str, torch.Tensor], offsets: dict[str, list[int]]) -> bytes:
    """:func:`encode` as one buffer (a part sent to another node's memory)."""
    return b"".join(encode(rank, tensors, offsets))


def write(fh: BinaryIO, pieces: list[memoryview | bytes]) -> tuple[str, int]:
    """Write ``pieces`` to ``fh`` and make them durable: the SHA-256 is computed while the disk syncs (hashlib and fsync
    both release the GIL). Returns (SHA-256 hex, size)."""
    size = 0
    for piece in pieces:
        view = memoryview(piece)
        while view.nbytes:
            written = fh.write(view)
            if not written:
                raise OSError(28, "the disk took no bytes")
            view = view[written:]
            size += written
    fh.flush()
    synced = in_background(os.fsync, fh.fileno())
    sha = hashlib.sha256()
    for piece in pieces:
        sha.update(piece)
    synced()
    return sha.hexdigest(), size


def decode(buffer: Any, name: str) -> dict[str, Any]:
    """``{"format", "rank", "tensors": {key: tensor}, "offsets": {key: [...]}}`` from a part's bytes; the tensors are
    views of ``buffer`` (writable: an ``mmap`` opened ACCESS_COPY or a bytearray). :class:`PartFormatError` naming what
    is wrong for anything that is not a well-formed part."""
    view = memoryview(buffer).cast("B")
    if view[:8].tobytes() != MAGIC:
        raise PartFormatError(f"{name} is not a part file (no {MAGIC.decode()} header)")
    length = int.from_bytes(view[8:16], "little")
    if length > min(MAX_HEADER_BYTES, view.nbytes - 16):
        raise PartFormatError(f"{name}: header length {length} does not fit the file ({view.nbytes} bytes)")
    try:
        header = json.loads(view[16:16 + length].tobytes())
    except (ValueError, RecursionError) as exc:
        raise PartFormatError(f"{name}: the header is not JSON ({exc})") from exc
    if not isinstance(header, dict) or header.get("format") != FORMAT or not isinstance(header.get("tensors"), list) \
            or not isinstance(header.get("rank"), int):
        raise PartFormatError(f"{name}: the header is malformed")
    base = 16 + length
    base += -base % ALIGN
    tensors, offsets = {}, {}
    for entry in header["tensors"]:
        tensor, offset = _entry(entry, view, base, name)
        tensors[entry["key"]] = tensor
        offsets[entry["key"]] = offset
    return {"format": FORMAT, "rank": header["rank"], "tensors": tensors, "offsets": offsets}


def _is_ints(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)


def _entry(entry: Any, view: memoryview, base: int, name: str) -> tuple[torch.Tensor, list[int]]:
    if not isinstance(entry, dict) or not isinstance(entry.get("key"), str) or not isinstance(entry.get("dtype"), str) \
            or entry.get("dtype") not in _DTYPES \
            or not _is_ints(entry.get("shape")) or not _is_ints(entry.get("offset")) \
            or not _is_ints([entry.get("start"), entry.get("nbytes")]) \
            or len(entry["offset"]) != len(entry["shape"]):
        raise PartFormatError(f"{name}: a malformed tensor entry {str(entry)[:120]!r}")
    dtype = _DTYPES[entry["dtype"]]
    numel = 1
    for n in entry["shape"]:
        numel *= n
    itemsize = torch.empty((), dtype=dtype).element_size()
    start, nbytes = base + entry["start"], entry["nbytes"]
    if nbytes != numel * itemsize or start + nbytes > view.nbytes or start % itemsize:
        raise PartFormatError(f"{name}: tensor {printable(entry['key'], 80)} does not fit the file (shape {entry['shape']}, "
                              f"bytes {start}..{start + nbytes} of {view.nbytes})")
    if not numel:
        return torch.empty(entry["shape"], dtype=dtype), entry["offset"]
    flat = torch.frombuffer(view, dtype=dtype, count=numel, offset=start)
    return flat.view(entry["shape"]), entry["offset"]


def read(path: Path, name: str) -> dict[str, Any]:
    """A part file, memory-mapped (only the pages read count); format 1 through ``torch.load(weights_only=True)``."""
    with open(path, "rb", opener=lambda p, f: os.open(p, f | getattr(os, "O_NOFOLLOW", 0))) as fh:
        if fh.read(8) != MAGIC:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # type: ignore[no-any-return]
        # ACCESS_COPY: writable pages (torch.frombuffer wants them), never written back to the file.
        mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
    return decode(mapped, name)


def read_bytes(data: Any, name: str) -> dict[str, Any]:
    """A part received as a buffer (from another node's memory; copied once if it is read-only); format 1 through
    ``torch.load(weights_only=True)``."""
    view = memoryview(data).cast("B")
    if view[:8].tobytes() != MAGIC:
        return torch.load(io.BytesIO(view.tobytes()), map_location="cpu", weights_only=True)  # type: ignore[no-any-return]
    return decode(bytearray(view) if view.readonly else view, name)
