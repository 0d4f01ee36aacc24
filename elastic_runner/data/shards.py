"""A source's shards as one index space: which shards there are, how many samples each holds, and the shard index.

The sampler needs only the number of samples of each shard (windows of ``data.pack.block_size + 1`` tokens, or a
stream's items): :class:`Source` is opened from a listing of the shards (``stat`` of local files, one listing of a
bucket) and the **shard index**, a small record per shard built once and kept on disk, never by reading every
shard at a job's start. For a ``tokens`` file it holds its size and token count; for documents (``jsonl``,
``parquet``, a user's stream) also each document's place (a JSONL line's byte offset) and the running count of its
tokens, with which a window reads only the documents it covers (:mod:`.packing`).

Each shard's index records the shard's size and a sampled checksum (:func:`.readers.sampled_checksum`). A listing
that disagrees with an index's size is refused by name at start; a shard whose ends changed under the same size is
refused by name at its first read in a process. Both say to build the index again — a run whose data changed cannot
resume exactly, so the new index belongs to a new run.

Where the index lives: the source's ``index`` key, else ``.elastic-runner-index/`` beside the corpus where that is a
writable directory, else ``$XDG_CACHE_HOME/elastic-runner/index/`` (``~/.cache``) on each node. Its files are
written atomically and privately; they are read as JSON and ``.npy`` arrays (no pickle) and checked for
consistency (a document past the end of its shard, counts that go down), and an index that fails the check is built
again. ``elastic-runner data index --config FILE`` builds every source's index ahead of a job; otherwise the job's
first worker on each node builds what is missing (under a file lock: the others wait for it, then read).
"""

from __future__ import annotations

import contextlib
import fcntl
import glob as globbing
import hashlib
import io
import json
import os
import zipfile
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from ..config import ConfigError
from ..config.imports import resolve
from ..config.locations import is_url, location_problem
from ..config.sources import PackSpec, SourceSpec
from ..files import makedirs, open_file, write_file_atomically
from .packing import Tokenizer, as_item, window
from .readers import (DataError, JsonlShard, ParquetShard, StreamShard, TokensShard, check_stream, item_digest,
                      read_range, sampled_checksum, size_of, text_of)

INDEX_VERSION = 2  #: 2: a stream's items are fingerprinted
INDEX_DIR = ".elastic-runner-index"


@dataclass
class Shard:
    """One shard as its index knows it."""

    name: str
    size: int  #: bytes (-1: a stream's shard)
    check: str  #: sampled checksum ("" for a stream)
    tokens: int  #: tokens of its packed stream (documents and end-of-document tokens); items of an unpacked stream
    dtype: str = ""  #: a token file's dtype
    arrays: Path | None = None  #: the .npz of its documents' offsets and cumulative tokens

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "size": self.size, "check": self.check, "tokens": self.tokens}


# -- listing --------------------------------------------------------------------------------------------------


def list_shards(spec: SourceSpec) -> list[tuple[str, int]]:
    """(name, size) of every shard file of ``spec``, in name order; a ConfigError when there is none."""
    assert spec.path is not None
    if is_url(spec.path):
        problem = location_problem(spec.path)
        if problem is not None:
            raise ConfigError(f"{spec.key}.path", problem[0], problem[1])
        from ..object_client import open_filesystem

        fs, pattern = open_filesystem(spec.path)
        scheme = spec.path.split("://", 1)[0]
        try:
            found = fs.glob(pattern, detail=True) if globbing.has_magic(pattern) else {pattern: fs.info(pattern)}
        except FileNotFoundError:
            found = {}
        shards = sorted((f"{scheme}://{name}", int(info.get("size") or 0)) for name, info in found.items()
                        if info.get("type", "file") == "file")
    else:
        names = sorted(globbing.glob(spec.path)) if globbing.has_magic(spec.path) else [spec.path]
        shards = [(name, os.stat(name).st_size) for name in names if os.path.isfile(name)]
    if not shards:
        raise ConfigError(f"{spec.key}.path", f"{spec.path!r} matches no file",
                          "Check the path or glob (relative paths are from the working directory)")
    return shards


def index_directory(spec: SourceSpec, tokenizer: Tokenizer | None) -> Path:
    """Where ``spec``'s shard index lives (see the module docstring), one directory per way of counting."""
    way = json.dumps({"version": INDEX_VERSION, "format": spec.format or "stream", "field": spec.text_field,
                      "tokenizer": tokenizer.name if tokenizer is not None else None,
                      "stream": [spec.name, spec.params] if spec.is_stream else None}, sort_keys=True, default=str)
    leaf = hashlib.sha256(way.encode()).hexdigest()[:16]
    if spec.index:
        return Path(spec.index) / leaf
    if spec.path is not None and not is_url(spec.path):
        beside = Path(os.path.dirname(spec.path.split("*", 1)[0]) or ".") if globbing.has_magic(spec.path) \
            else Path(spec.path).parent
        if os.access(beside, os.W_OK | os.X_OK):
            return beside / INDEX_DIR / leaf
    where = spec.path or json.dumps([spec.name, spec.params], default=str)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "elastic-runner" / "index"
    return cache / hashlib.sha256(where.encode()).hexdigest()[:16] / leaf


# -- the source ---------------------------------------------------------------------------------------------------


class Source:
    """One of ``data.sources``, opened: its shards, their samples, and sample ``i`` read (see the module docstring).

    Picklable for DataLoader workers: each process opens its own readers."""

    def __init__(self, spec: SourceSpec, pack: PackSpec | None, tokenizer: Tokenizer | None, shards: list[Shard],
                 stream: Any = None) -> None:
        self.spec, self.pack, self.tokenizer, self.shards = spec, pack, tokenizer, shards
        self._stream = stream
        # A token file's vocabulary and end-of-document id are its meta.json's, where it says them; else the
        # tokenizer's (documents are tokenized with it).
        meta = token_meta(shards[0].name) if spec.format == "tokens" and shards else {}
        self.vocab_size: int | None = meta.get("vocab_size", tokenizer.vocab_size if tokenizer else None)
        self.eod: int = meta.get("eod", tokenizer.eod if tokenizer else -1)
        window_tokens = pack.block_size + 1 if pack is not None else 0
        # Window w of a shard: tokens [w * B, w * B + B + 1) of its stream; an unpacked stream: one sample an item.
        per_shard = [max(0, (s.tokens - 1) // pack.block_size) if window_tokens and s.tokens >= window_tokens else
                     (0 if window_tokens else s.tokens) for s in shards]
        self.starts = [0]  # a list: bisect per sample (numpy's searchsorted costs microseconds a call)
        for count in per_shard:
            self.starts.append(self.starts[-1] + count)
        self._readers: dict[int, Any] = {}
        self._arrays: dict[int, dict[str, np.ndarray]] = {}
        self._checked: set[int] = set()

    def __len__(self) -> int:
        return self.starts[-1]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_readers"], state["_arrays"], state["_checked"] = {}, {}, set()
        if self.spec.is_stream:
            state["_stream"] = None  # made again in the worker: a user's object need not pickle
        return state

    def locate(self, i: int) -> tuple[int, int]:
        """(shard, sample within it) of sample ``i``."""
        if not 0 <= i < self.starts[-1]:
            raise IndexError(f"sample {i} of a source of {len(self)}")
        shard = bisect_right(self.starts, i) - 1
        return shard, i - self.starts[shard]

    def __getitem__(self, i: int) -> Any:
        shard, j = self.locate(i)
        if self.pack is None:  # an unpacked stream: the item as it is
            return self._stream_items(shard, j, j + 1)[0]
        b = self.pack.block_size
        return as_item(self._tokens(shard, j * b, j * b + b + 1), self.eod, self.pack.mask == "documents")

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()

    # -- reading ----------------------------------------------------------------------------------------------

    def stream(self) -> Any:
        if self._stream is None:
            self._stream = make_stream(self.spec)
        return self._stream

    def _reader(self, shard: int) -> Any:
        reader = self._readers.get(shard)
        if reader is None:
            s, spec = self.shards[shard], self.spec
            if spec.is_stream:
                reader = StreamShard(self.stream(), s.name, spec.key)
            elif shard not in self._checked:
                if sampled_checksum(s.name, s.size) != s.check:
                    raise DataError(f"{spec.key}.path", f"the shard {s.name} changed since its index was built "
                                    "(same size, other bytes)", "Restore it, or start a new run (its index is built "
                                    "again): a run cannot resume exactly on other data")
                self._checked.add(shard)
            if reader is None:
                reader = {"tokens": lambda: TokensShard(s.name, spec.key, s.dtype or "uint16"),
                          "jsonl": lambda: JsonlShard(s.name, spec.key, spec.text_field),
                          "parquet": lambda: ParquetShard(s.name, spec.key, spec.text_field)}[spec.format or ""]()
            self._readers[shard] = reader
        return reader

    def _documents(self, shard: int) -> dict[str, np.ndarray]:
        arrays = self._arrays.get(shard)
        if arrays is None:
            path = self.shards[shard].arrays
            assert path is not None
            with np.load(path, allow_pickle=False) as data:
                arrays = {k: data[k] for k in data.files}
            self._arrays[shard] = arrays
        return arrays

    def _tokens(self, shard: int, start: int, end: int) -> np.ndarray:
        reader = self._reader(shard)
        if isinstance(reader, TokensShard):
            return reader.tokens(start, end)
        arrays = self._documents(shard)
        cum = arrays["cum"]
        first = int(cum.searchsorted(start, side="right")) - 1
        last = int(cum.searchsorted(end, side="left"))
        if isinstance(reader, StreamShard):
            texts = [stream_text(self.spec, item) for item in self._stream_items(shard, first, last)]
        elif isinstance(reader, JsonlShard):
            texts = reader.documents(arrays["offsets"], first, last)
        else:
            texts = reader.documents(first, last)
        assert self.tokenizer is not None
        docs = [self.tokenizer.tokens(t) for t in texts]
        bounds = cum[first:last + 1].tolist()
        lengths = [b - a - 1 for a, b in zip(bounds, bounds[1:])]
        if [len(d) for d in docs] != lengths:
            raise DataError(self.spec.key, f"documents {first}..{last - 1} of {self.shards[shard].name} tokenize to "
                            f"{[len(d) for d in docs][:4]} tokens, the index counted {lengths[:4]} (the data or the "
                            "tokenizer changed)", "Keep data and data.tokenizer as they were for the run")
        return window(docs, bounds[0], start, end - start, self.tokenizer.eod)

    def _stream_items(self, shard: int, first: int, last: int) -> list[Any]:
        """Items ``[first, last)`` of a stream's shard, each as it was when the index counted it: a stream that gives
        other items at the same place (a store that changed, an ``open`` whose offset is off) is refused by name,
        never trained on."""
        items = self._reader(shard).items(first, last)
        recorded = self._documents(shard)["digest"][first:last].tolist()
        for k, (item, digest) in enumerate(zip(items, recorded)):
            if item_digest(item) != digest:
                raise DataError(f"{self.spec.key}.name", f"the stream's shard {self.shards[shard].name!r} gave at "
                                f"offset {first + k} an item other than the one its index read there (the stream "
                                "changed, or its open(shard, offset) does not start at offset)",
                                "Keep the stream's items where they were for the whole run, and make open(shard, "
                                "offset) yield the items from that offset")
        return items

    def identity(self) -> list[dict[str, Any]]:
        """What the source was when the run started: each shard's name, size, checksum and tokens."""
        return [s.to_json() for s in self.shards]


def stream_text(spec: SourceSpec, item: Any) -> str:
    """A stream item's text: the item itself, or its ``text_field``."""
    return text_of(item, spec.text_field, lambda: f"an item of {spec.label}", spec.key)


def make_stream(spec: SourceSpec) -> Any:
    from ..config.imports import working_directory_on_path

    with working_directory_on_path():
        factory = resolve(spec.name or "", f"{spec.key}.name")
    try:
        return factory(**dict(spec.params))
    except TypeError as exc:
        raise ConfigError(f"{spec.key}.params", f"{spec.name} does not take them ({exc})",
                          "Give the factory's own keyword arguments") from exc


@contextlib.contextmanager
def _locked(directory: Path, spec: SourceSpec) -> Iterator[None]:
    try:
        makedirs(directory)
        fh = open_file(directory / ".lock", "a")
    except OSError as exc:
        raise DataError(f"{spec.key}.index", f"the shard index cannot be written to {directory} "
                        f"({exc.strerror or exc})", "Set the source's index to a directory this user may write, or "
                        "build it there first with elastic-runner data index") from exc
    with fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# -- the shard index ---------------------------------------------------------------------------------------------


def open_source(spec: SourceSpec, pack: PackSpec | None, tokenizer: Tokenizer | None) -> Source:
    """``spec`` opened: its shards listed, their index read, and built first where it is missing or stale."""
    stream = None
    if spec.is_stream:
        stream = make_stream(spec)
        listing = [(name, -1) for name in check_stream(stream, spec.name or "", spec.key)]
    else:
        listing = list_shards(spec)
    counting = tokenizer if pack is not None and spec.format != "tokens" else None
    directory = index_directory(spec, counting)
    wanted = frozenset({"jsonl": {"offsets", "cum"}, "parquet": {"cum"}, "tokens": set()}.get(
        spec.format or "", {"digest"} | ({"cum"} if counting is not None else set())))
    shards: list[Shard | None] = [_read_index(directory, name, size, wanted) for name, size in listing]
    if any(s is None for s in shards):
        with _locked(directory, spec):  # another worker of this node may be building it: wait, then read it
            for k, (name, size) in enumerate(listing):
                try:
                    shards[k] = shards[k] or _read_index(directory, name, size, wanted) or \
                        _build_index(directory, spec, counting, name, size, stream)
                except (PermissionError, FileNotFoundError, IsADirectoryError) as exc:
                    raise DataError(f"{spec.key}.path", f"cannot read {name} ({exc.strerror or exc})",
                                    "Make the shard readable by this user, or leave it out of the glob") from exc
    return Source(spec, pack, tokenizer, [s for s in shards if s is not None], stream)


def _index_path(directory: Path, name: str) -> Path:
    return directory / f"{hashlib.sha256(name.encode()).hexdigest()[:24]}.json"


def _read_index(directory: Path, name: str, size: int, wanted: frozenset[str] = frozenset()) -> Shard | None:
    """The index of shard ``name`` if it is there, consistent, of this size and with the arrays ``wanted`` (what this
    source reads); None: build it (again)."""
    path = _index_path(directory, name)
    try:
        record = json.loads(path.read_bytes()[:1 << 16])
        if not isinstance(record, dict) or record.get("version") != INDEX_VERSION or record.get("name") != name or record.get("size") != size:
            return None
        shard = Shard(name, size, str(record["check"]), int(record["tokens"]), str(record.get("dtype", "")))
        if record.get("arrays"):
            shard.arrays = path.with_suffix(".npz")
            with np.load(shard.arrays, allow_pickle=False) as data:
                arrays = {k: data[k] for k in ("cum", "offsets", "digest") if k in data.files}
            if not wanted <= arrays.keys():
                return None
            cum, offsets, digests = arrays.get("cum"), arrays.get("offsets"), arrays.get("digest")
            if any(a.ndim != 1 or not len(a) or not np.issubdtype(a.dtype, np.integer)
                   for a in (cum, offsets) if a is not None) or (offsets is not None and offsets[0] < 0):
                return None  # not arrays of positions: built again
            if (cum is not None and (cum[0] != 0 or int(cum[-1]) != shard.tokens or np.any(np.diff(cum) < 1))) or (
                    offsets is not None and (cum is None or len(offsets) != len(cum) or np.any(np.diff(offsets) < 0)
                                             or offsets[-1] > size)) or (
                    digests is not None and len(digests) != (len(cum) - 1 if cum is not None else shard.tokens)):
                return None  # not what this code writes: built again
        elif wanted:
            return None
        return shard
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError, RecursionError, OverflowError,
            EOFError, NotImplementedError, zipfile.BadZipFile):
        return None  # a damaged or planted index (or one a crash cut short): built again


def _build_index(directory: Path, spec: SourceSpec, tokenizer: Tokenizer | None, name: str, size: int,
                 stream: Any) -> Shard:
    """Read shard ``name`` once from its start: its tokens (and documents), written as its index."""
    arrays: dict[str, np.ndarray] = {}
    count = (lambda text: len(tokenizer.tokens(text))) if tokenizer is not None else None
    dtype = ""
    if spec.format == "tokens":
        dtype = spec.dtype or _meta_dtype(name)
        tokens = TokensShard(name, spec.key, dtype).count(size)
    elif spec.format == "jsonl":
        assert count is not None
        arrays["offsets"], arrays["cum"] = JsonlShard(name, spec.key, spec.text_field).scan(count)
    elif spec.format == "parquet":
        assert count is not None
        arrays["cum"] = ParquetShard(name, spec.key, spec.text_field).scan(count)
    else:  # a stream: its items counted and fingerprinted (and their tokens, packed)
        digests, cum = [], [0]
        for item in StreamShard(stream, name, spec.key).scan():
            digests.append(item_digest(item))
            if count is not None:
                cum.append(cum[-1] + count(stream_text(spec, item)) + 1)
        arrays["digest"] = np.asarray(digests, dtype=np.uint64)
        tokens = len(digests)
        if count is not None:
            arrays["cum"] = np.asarray(cum, dtype=np.int64)
    if "cum" in arrays:
        tokens = int(arrays["cum"][-1])
    check = sampled_checksum(name, size) if size >= 0 else ""
    path = _index_path(directory, name)
    makedirs(directory)
    if arrays:
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        write_file_atomically(path.with_suffix(".npz"), buffer.getvalue())
    record = {"version": INDEX_VERSION, "name": name, "size": size, "check": check, "tokens": tokens,
              "dtype": dtype, "arrays": bool(arrays)}
    write_file_atomically(path, json.dumps(record).encode())
    return Shard(name, size, check, tokens, dtype, path.with_suffix(".npz") if arrays else None)


def token_meta(name: str) -> dict[str, Any]:
    """``meta.json`` beside a token file (nanoGPT's layout: ``vocab_size``, ``dtype``, and ``eod`` where the files
    end their documents with one); {} where there is none or it is not one."""
    meta = (name.rsplit("/", 1)[0] if "/" in name else ".") + "/meta.json"
    try:
        record = json.loads(read_range(meta, 0, min(size_of(meta), 1 << 16)))
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(record, dict):
        return {}
    return {k: record[k] for k in ("vocab_size", "eod") if isinstance(record.get(k), int) and record[k] >= 0} | (
        {"dtype": record["dtype"]} if record.get("dtype") in ("uint16", "uint32") else {})


def _meta_dtype(name: str) -> str:
    """A ``.bin`` token file's dtype where the source gives none: ``meta.json``'s, else uint16."""
    return "uint16" if name.endswith(".npy") else token_meta(name).get("dtype", "uint16")
