"""Reading one shard of a source: its bytes (a local file or an object in a bucket), its documents, its tokens.

A reader is what a process holds open for a shard — a file descriptor, a memory map, a Parquet row group, a
stream's iterator — opened on first use (a DataLoader worker opens its own; nothing open is pickled) and asked for a
range: documents ``[first, last)`` (``jsonl``, ``parquet``, a user's stream) or tokens ``[start, end)``
(``tokens``). Counting a shard's documents and tokens for its index (:mod:`.shards`) reads it through the same code
from the start, once.

Data problems are :class:`DataError` (a ConfigError: one line naming the source key, the file and what to fix,
exit 2): a JSONL line that is not JSON or has no text field (file and line), a truncated token file, a stream that
yields fewer items than its index says.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ..config import ConfigError
from ..config.locations import is_url

#: The bytes at each end of a file that its sampled checksum covers (with its size): a changed shard is caught at
#: its first read in each process without reading it whole.
CHECK_BYTES = 64 << 10


class DataError(ConfigError):
    """Data that is not what its source promised (the key names the source)."""


def _fs(location: str) -> tuple[Any, str]:
    from ..object_client import open_filesystem

    return open_filesystem(location)


def read_range(name: str, start: int, end: int, handle: Any = None) -> bytes:
    """Bytes ``[start, end)`` of a local file (``handle``: its descriptor) or of an object (one range request)."""
    if end <= start:
        return b""
    if is_url(name):
        fs, path = _fs(name)
        return bytes(fs.cat_file(path, start=start, end=end))
    fd = handle if handle is not None else os.open(name, os.O_RDONLY)
    try:
        out = bytearray()
        while len(out) < end - start:
            piece = os.pread(fd, end - start - len(out), start + len(out))
            if not piece:
                break
            out += piece
        return bytes(out)
    finally:
        if handle is None:
            os.close(fd)


def size_of(name: str) -> int:
    if is_url(name):
        fs, path = _fs(name)
        return int(fs.info(path)["size"])
    return os.stat(name).st_size


def sampled_checksum(name: str, size: int, handle: Any = None) -> str:
    """SHA-256 of the size and the first and last :data:`CHECK_BYTES` bytes: cheap enough for every process to check
    at its first read of a shard, and it changes with any append, truncation or rewrite of either end."""
    sha = hashlib.sha256(str(size).encode())
    sha.update(read_range(name, 0, min(size, CHECK_BYTES), handle))
    sha.update(read_range(name, max(0, size - CHECK_BYTES), size, handle))
    return sha.hexdigest()[:32]


def text_of(record: Any, field: str, where: Callable[[], str], key: str) -> str:
    """The text field of one document (a JSON object, a Parquet row, a stream's item); a DataError naming it."""
    if isinstance(record, str):
        return record
    value = record.get(field) if isinstance(record, dict) else None
    if not isinstance(value, str):
        found = "no" if not isinstance(record, dict) or field not in record else f"a {type(value).__name__}"
        raise DataError(f"{key}.text_field", f"{where()} has {found} {field!r} text field",
                        "Give every document its text under that field, or set the source's text_field")
    return value


# -- the formats ------------------------------------------------------------------------------------------------


class JsonlShard:
    """Documents of a JSONL file: line ``d`` is bytes ``[offsets[d], offsets[d + 1])``."""

    def __init__(self, name: str, key: str, text_field: str) -> None:
        self.name, self.key, self.text_field = name, key, text_field
        self._fd: int | None = None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def documents(self, offsets: np.ndarray, first: int, last: int) -> list[str]:
        if self._fd is None and not is_url(self.name):
            self._fd = os.open(self.name, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        data = read_range(self.name, int(offsets[first]), int(offsets[last]), self._fd)
        lines = [line for line in data.split(b"\n") if line.strip()][:last - first]
        return [self._text(line, first + i + 1) for i, line in enumerate(lines)]

    def _text(self, line: bytes, document: int, what: str = "document") -> str:
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise DataError(f"{self.key}.path", f"{self.name} {what} {document} is not JSON ({exc})",
                            "Fix or remove the line (one JSON object per line)") from None
        value = record.get(self.text_field) if isinstance(record, dict) else None
        if isinstance(value, str):
            return value
        return text_of(record, self.text_field, lambda: f"{self.name} {what} {document}", self.key)

    def scan(self, count_tokens: Callable[[str], int]) -> tuple[np.ndarray, np.ndarray]:
        """Every document's byte offset and the cumulative tokens (with its end-of-document token), in one pass."""
        offsets, cum = [], [0]
        position = 0
        with _reader(self.name) as fh:
            for number, line in enumerate(fh, start=1):
                if line.strip():  # a blank line is no document
                    offsets.append(position)
                    cum.append(cum[-1] + count_tokens(self._text(line.rstrip(b"\r\n"), number, "line")) + 1)
                position += len(line)
        offsets.append(position)
        return np.asarray(offsets, dtype=np.int64), np.asarray(cum, dtype=np.int64)


class _reader:  # noqa: N801 - a context manager that reads a local file or an object sequentially
    def __init__(self, name: str) -> None:
        self.name = name
        self.fh: Any = None

    def __enter__(self) -> Any:
        if is_url(self.name):
            fs, path = _fs(self.name)
            self.fh = fs.open(path, "rb", block_size=8 << 20)
        else:
            self.fh = open(self.name, "rb")
        return self.fh

    def __exit__(self, *exc: object) -> None:
        self.fh.close()


class ParquetShard:
    """Documents of a Parquet file, rows of its text column; a row group is read once and kept while used."""

    def __init__(self, name: str, key: str, text_field: str) -> None:
        self.name, self.key, self.text_field = name, key, text_field
        self._file: Any = None
        self._groups: np.ndarray | None = None  # the first row of each row group, and the count
        self._cached: tuple[int, list[Any]] | None = None

    def close(self) -> None:
        self._file, self._cached = None, None

    def _open(self) -> Any:
        if self._file is None:
            try:
                import pyarrow.parquet as pq
            except ImportError as exc:
                raise DataError(f"{self.key}.format", "parquet needs pyarrow, which is not installed",
                                "pip install 'elastic-runner[parquet]'") from exc
            source: Any = self.name
            if is_url(self.name):
                fs, path = _fs(self.name)
                source = fs.open(path, "rb")
            self._file = pq.ParquetFile(source)
            if self.text_field not in self._file.schema_arrow.names:
                raise DataError(f"{self.key}.text_field", f"{self.name} has no column {self.text_field!r} (its "
                                f"columns: {', '.join(self._file.schema_arrow.names[:8])})",
                                "Set the source's text_field to the column that holds the text")
            rows = [self._file.metadata.row_group(g).num_rows for g in range(self._file.num_row_groups)]
            self._groups = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
        return self._file

    def _group(self, g: int) -> list[Any]:
        if self._cached is None or self._cached[0] != g:
            table = self._open().read_row_group(g, columns=[self.text_field])
            self._cached = (g, table.column(0).to_pylist())
        return self._cached[1]

    def documents(self, first: int, last: int) -> list[str]:
        self._open()
        assert self._groups is not None
        out: list[str] = []
        row = first
        while row < last:
            g = int(np.searchsorted(self._groups, row, side="right") - 1)
            values = self._group(g)
            take = min(last, int(self._groups[g + 1])) - row
            base = row - int(self._groups[g])
            for i, value in enumerate(values[base:base + take]):
                out.append(text_of(value, self.text_field, lambda n=row + i: f"{self.name} row {n}", self.key))
            row += take
        return out

    def scan(self, count_tokens: Callable[[str], int]) -> np.ndarray:
        self._open()
        cum = [0]
        for g in range(self._file.num_row_groups):
            for i, value in enumerate(self._group(g)):
                text = text_of(value, self.text_field, lambda n=i: f"{self.name} row group {g} row {n}", self.key)
                cum.append(cum[-1] + count_tokens(text) + 1)
        self._cached = None
        return np.asarray(cum, dtype=np.int64)


class TokensShard:
    """A flat token file: ``.bin`` (raw little-endian ``dtype``) or ``.npy`` (its header says the dtype)."""

    def __init__(self, name: str, key: str, dtype: str) -> None:
        self.name, self.key, self.dtype = name, key, np.dtype(dtype).newbyteorder("<")
        self.header = 0
        if name.endswith(".npy"):
            self.header, self.dtype = _npy_header(name, key)
        self._map: np.ndarray | None = None

    def close(self) -> None:
        self._map = None

    def count(self, size: int) -> int:
        return (size - self.header) // self.dtype.itemsize

    def tokens(self, start: int, end: int) -> np.ndarray:
        if not is_url(self.name):
            if self._map is None:  # a plain array over the map: a slice of a memmap object costs more per call
                self._map = np.memmap(self.name, dtype=self.dtype, mode="r", offset=self.header).view(np.ndarray)
            out = self._map[start:end].astype(np.int64)
        else:
            item = self.dtype.itemsize
            data = read_range(self.name, self.header + start * item, self.header + end * item)
            out = np.frombuffer(data, dtype=self.dtype).astype(np.int64)
        if len(out) != end - start:
            raise DataError(f"{self.key}.path", f"{self.name} ends at token {start + len(out)}, its index says "
                            f"{end} or more (truncated)", "Restore the file, or build the source's index again")
        return out


def _npy_header(name: str, key: str) -> tuple[int, np.dtype]:
    head = read_range(name, 0, 4096)
    try:
        stream = io.BytesIO(head)
        version = np.lib.format.read_magic(stream)
        read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                       (2, 0): np.lib.format.read_array_header_2_0}.get(version)
        if read_header is None:
            raise ValueError(f".npy format version {version}")
        shape, fortran, dtype = read_header(stream)
    except (ValueError, OSError) as exc:
        raise DataError(f"{key}.path", f"{name} is not a .npy file ({exc})", "Give .npy or .bin token files") from exc
    if len(shape) != 1 or dtype.kind not in "ui" or fortran:
        raise DataError(f"{key}.path", f"{name} holds an array of shape {shape} and dtype {dtype}",
                        "A token file is one flat array of integer token ids")
    return stream.tell(), dtype


class StreamShard:
    """A user's stream, one shard: ``open(shard, offset)`` yields its items from ``offset`` on. An iterator is kept
    where the last read ended, so that reading on from there costs no new ``open``."""

    def __init__(self, stream: Any, shard: str, key: str) -> None:
        self.stream, self.shard, self.key = stream, shard, key
        self._iterator: Iterator[Any] | None = None
        self._at = -1

    def close(self) -> None:
        self._iterator, self._at = None, -1

    def items(self, first: int, last: int) -> list[Any]:
        if self._iterator is None or self._at != first:
            self._iterator, self._at = iter(self.stream.open(self.shard, first)), first
        out = []
        for _ in range(last - first):
            try:
                out.append(next(self._iterator))
            except StopIteration:
                self.close()
                raise DataError(self.key, f"the stream's shard {self.shard!r} ended at item {first + len(out)}; "
                                f"its index counted {last} or more items (the stream changed)",
                                "Keep a stream's shards as they were for the whole run, or build its index "
                                "again in a new run") from None
        self._at = last
        return out

    def scan(self) -> Iterator[Any]:
        return iter(self.stream.open(self.shard, 0))


def item_digest(item: Any) -> int:
    """A 64-bit fingerprint of a stream's item (its text, tensors, numbers and their nesting): what the shard index
    records for each item, so that a stream that changes under a run is caught where it is read."""
    sha = hashlib.blake2b(digest_size=8)

    def feed(value: Any) -> None:
        if isinstance(value, str):
            sha.update(b"s" + value.encode("utf-8", "surrogatepass"))
        elif isinstance(value, (bytes, bytearray)):
            sha.update(b"b" + bytes(value))
        elif isinstance(value, dict):
            sha.update(b"d%d" % len(value))
            for key in sorted(value, key=str):
                feed(str(key))
                feed(value[key])
        elif isinstance(value, (list, tuple)):
            sha.update(b"l%d" % len(value))
            for part in value:
                feed(part)
        elif hasattr(value, "detach") and hasattr(value, "cpu"):  # a tensor
            array = value.detach().cpu().contiguous().numpy()
            sha.update(b"t" + str(array.dtype).encode() + str(array.shape).encode() + array.tobytes())
        elif isinstance(value, np.ndarray):
            sha.update(b"a" + str(value.dtype).encode() + str(value.shape).encode() + value.tobytes())
        else:
            sha.update(b"r" + repr(value).encode())
    feed(item)
    return int.from_bytes(sha.digest(), "little")


def check_stream(stream: Any, name: str, key: str) -> Sequence[str]:
    """The shard names of a user's stream, checked: the protocol, and names that are strings."""
    for method in ("shards", "open"):
        if not callable(getattr(stream, method, None)):
            raise DataError(f"{key}.name", f"{name} returned {type(stream).__name__}, which has no {method}() method",
                            "Return an object with shards() -> list[str] and open(shard, offset) -> iterator of "
                            "items (see the bring-your-own guide)")
    shards = list(stream.shards())
    if not shards or not all(isinstance(s, str) for s in shards):
        raise DataError(f"{key}.name", f"{name}'s shards() returned {shards[:3]!r}",
                        "Return a non-empty list of shard names (strings)")
    return shards
