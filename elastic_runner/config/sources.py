"""``data.sources`` and ``data.pack``: a corpus of shard files or a user's stream, mixed by weight, packed.

Each entry of ``data.sources`` is a mapping, checked here key by key (an error names ``data.sources[1].weight``):

- a corpus of shards: ``path`` (a file, a glob, or an ``s3://``/``gs://`` URL with a glob) and ``format``:
  ``tokens`` (flat token files, ``.bin`` with ``dtype`` or ``.npy``), ``jsonl`` or ``parquet`` (a text field,
  ``text_field``, tokenized and packed); ``format`` may be left out where the files' suffix says it;
- or a user's stream: ``name`` (an import path to a factory, called with ``params``) returning an object with
  ``shards() -> list[str]`` and ``open(shard, offset) -> Iterator[item]``;
- ``weight`` (> 0; default 1): the source's share of every global batch, the weights normalised to sum to 1;
- ``label``: how the audit and the report name it (default: the path, or the stream's import path);
- ``index``: where the source's shard index is kept (default: beside the corpus where it is writable, else this
  user's cache directory).

``data.pack``: ``{block_size: N}`` — documents are tokenized with ``data.tokenizer``, joined with an end-of-document
token and cut into windows of ``N + 1`` tokens (input and the target shifted by one); ``mask: documents`` also
leaves out of the loss every target that belongs to the next document.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .base import ConfigError, is_import_path

FORMATS = ("tokens", "jsonl", "parquet")
#: A file suffix that says the format (``format`` may then be left out).
SUFFIXES = {".bin": "tokens", ".npy": "tokens", ".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
TOKEN_DTYPES = ("uint16", "uint32")
_SOURCE_KEYS = {"path", "format", "name", "params", "weight", "label", "text_field", "dtype", "index"}
_PACK_KEYS = {"block_size", "mask"}


@dataclass(frozen=True)
class SourceSpec:
    """One checked entry of ``data.sources``."""

    position: int  #: its place in the list: keys are named ``data.sources[position].key``
    label: str
    weight: float
    path: str | None = None
    format: str | None = None  #: tokens, jsonl, parquet; None for a stream
    name: str | None = None  #: a stream factory's import path
    params: tuple[tuple[str, Any], ...] = ()
    text_field: str = "text"
    dtype: str | None = None  #: a ``.bin`` token file's dtype (None: a meta.json beside the files, else uint16)
    index: str | None = None

    @property
    def key(self) -> str:
        return f"data.sources[{self.position}]"

    @property
    def is_stream(self) -> bool:
        return self.name is not None


@dataclass(frozen=True)
class PackSpec:
    block_size: int
    mask: str = "none"  #: none | documents


def parse_sources(value: Any) -> list[SourceSpec]:
    """``data.sources`` as checked specs; a ConfigError that names the entry and key otherwise."""
    if not isinstance(value, list) or not value:
        raise ConfigError("data.sources", f"got {type(value).__name__}, expected a non-empty list of sources",
                          "Write e.g. data.sources: [{path: 'corpus/*.bin', format: tokens, weight: 0.7}, "
                          "{path: 'web/*.jsonl', weight: 0.3}]")
    specs = [_parse_source(i, entry) for i, entry in enumerate(value)]
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        twice = sorted({label for label in labels if labels.count(label) > 1})
        raise ConfigError("data.sources", f"two sources are both labelled {twice[0]!r}",
                          "Give each source its own label (data.sources[i].label)")
    return specs


def _parse_source(i: int, entry: Any) -> SourceSpec:
    key = f"data.sources[{i}]"
    if not isinstance(entry, dict):
        raise ConfigError(key, f"got {entry!r}, expected a mapping",
                          "Write a source as {path: 'corpus/*.jsonl', weight: 1} or {name: 'mymod:stream'}")
    unknown = set(entry) - _SOURCE_KEYS
    if unknown:
        raise ConfigError(f"{key}.{sorted(unknown)[0]}", "is not a source key",
                          f"Valid keys: {', '.join(sorted(_SOURCE_KEYS))}")
    path, name = entry.get("path"), entry.get("name")
    if (path is None) == (name is None):
        raise ConfigError(key, "needs either path (shard files) or name (a stream's import path), not both"
                          if path is not None else "has neither path nor name",
                          "Set path: 'corpus/*.bin' with a format, or name: 'package.module:factory'")
    weight = entry.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0 or weight != weight \
            or weight == float("inf"):
        raise ConfigError(f"{key}.weight", f"got {weight!r}, must be a positive number",
                          "Set the source's share of every batch, e.g. weight: 0.3 (weights are normalised)")
    params = entry.get("params", {}) or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{key}.params", f"got {params!r}, expected a mapping", "Write params: {arg: value}")
    text_field = entry.get("text_field", "text")
    if not isinstance(text_field, str) or not text_field:
        raise ConfigError(f"{key}.text_field", f"got {text_field!r}", "Name the field that holds the text")
    index = entry.get("index")
    if index is not None and (not isinstance(index, str) or not index.strip()):
        raise ConfigError(f"{key}.index", f"got {index!r}", "Give a directory for the source's shard index")
    label = entry.get("label", path if path is not None else name)
    if not isinstance(label, str) or not label:
        raise ConfigError(f"{key}.label", f"got {label!r}", "Give the source a short name, e.g. label: web")
    if name is not None:
        if not isinstance(name, str) or not is_import_path(name):
            raise ConfigError(f"{key}.name", f"got {name!r}, not an import path",
                              "Write it as 'package.module:factory' returning an object with shards() and "
                              "open(shard, offset)")
        for field_name in ("format", "dtype"):
            if field_name in entry:
                raise ConfigError(f"{key}.{field_name}", "applies to shard files (path), not to a stream",
                                  f"Remove {field_name}, or give the files as path")
        return SourceSpec(i, label, float(weight), name=name, params=tuple(sorted(params.items())),
                          text_field=text_field, index=index)
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(f"{key}.path", f"got {path!r}", "Give a file, a glob or a URL, e.g. 'corpus/*.jsonl'")
    fmt = entry.get("format")
    if fmt is None:
        suffix = "." + path.rsplit(".", 1)[-1] if "." in path.rsplit("/", 1)[-1] else ""
        fmt = SUFFIXES.get(suffix)
        if fmt is None:
            raise ConfigError(f"{key}.format", f"is not given and {path!r} does not say it",
                              f"Set format to one of {', '.join(FORMATS)}")
    if fmt not in FORMATS:
        raise ConfigError(f"{key}.format", f"unknown format {fmt!r}", f"Use one of {', '.join(FORMATS)}")
    dtype = entry.get("dtype")
    if dtype is not None and (fmt != "tokens" or dtype not in TOKEN_DTYPES):
        raise ConfigError(f"{key}.dtype", f"got {dtype!r}" + ("" if fmt == "tokens" else f" for format {fmt}"),
                          f"A tokens source's dtype is one of {', '.join(TOKEN_DTYPES)} (a .npy file says its own)")
    if params:
        raise ConfigError(f"{key}.params", "applies to a stream (name), not to shard files",
                          "Remove params")
    return SourceSpec(i, label, float(weight), path=path, format=fmt, text_field=text_field, dtype=dtype,
                      index=index)


def parse_pack(value: Any) -> PackSpec | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ConfigError("data.pack", f"got {value!r}, expected a mapping", "Write data.pack: {block_size: 1024}")
    unknown = set(value) - _PACK_KEYS
    if unknown:
        raise ConfigError(f"data.pack.{sorted(unknown)[0]}", "is not a pack key",
                          f"Valid keys: {', '.join(sorted(_PACK_KEYS))}")
    size = value.get("block_size")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError("data.pack.block_size", f"got {size!r}, must be a positive integer",
                          "Set the window's length in tokens, e.g. data.pack.block_size: 1024")
    mask = value.get("mask", "none")
    if mask not in ("none", "documents"):
        raise ConfigError("data.pack.mask", f"got {mask!r}",
                          "Use none (every target counts) or documents (no loss on a target from the next document)")
    return PackSpec(size, mask)


def check_sources(sources: Any, pack: Any, tokenizer: str) -> None:
    """The whole of ``data.sources``, ``data.pack`` and ``data.tokenizer`` together."""
    specs = parse_sources(sources)
    packing = parse_pack(pack)
    if tokenizer != "bytes" and not is_import_path(tokenizer):
        raise ConfigError("data.tokenizer", f"got {tokenizer!r}",
                          "Use bytes (the built-in byte-level tokenizer) or an import path 'package.module:fn'")
    files = [s for s in specs if not s.is_stream]
    if files and packing is None:
        raise ConfigError("data.pack", f"is required for {files[0].key} ({files[0].format}): its documents are "
                          "cut into windows", "Set data.pack: {block_size: 1024}")
