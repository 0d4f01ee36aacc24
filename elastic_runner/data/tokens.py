"""Token data for language models: flat token files, memory-mapped, read as windows.

A tokens directory (nanoGPT's layout)::

    train.bin   the training tokens, one flat array of token ids
    val.bin     the validation tokens
    meta.json   {"vocab_size": 65, "dtype": "uint16", "tokenizer": "char", "chars": "..."}

``dtype`` is ``uint16`` when the vocabulary has at most 65,536 tokens, else ``uint32`` (little
endian). The files are memory-mapped, never read whole, and each process opens its own map (a
DataLoader worker too). Item ``i`` of a split is the window of ``block_size + 1`` tokens starting
at ``i * block_size``: ``(input = tokens[:-1], target = tokens[1:])``. Windows do not overlap, so an
epoch of the elastic sampler sees every window exactly once.

``elastic-runner data prepare-text IN.txt --out DIR`` builds such a directory from UTF-8 text with
a character vocabulary (the last ``--val-fraction`` of the text is the validation split).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ..config import ConfigError

META = "meta.json"
DTYPES = {"uint16": (np.uint16, 1 << 16), "uint32": (np.uint32, 1 << 32)}


class TokenWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping windows of ``block_size + 1`` tokens of one memory-mapped split."""

    def __init__(self, path: Path, dtype: str, block_size: int) -> None:
        self.path = path
        self.dtype = DTYPES[dtype][0]
        self.block_size = block_size
        self.tokens = int(path.stat().st_size // np.dtype(self.dtype).itemsize)
        self._map: np.memmap | None = None

    def __len__(self) -> int:
        return max(0, (self.tokens - 1) // self.block_size)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} of {len(self)}")
        if self._map is None:
            self._map = np.memmap(self.path, dtype=self.dtype, mode="r")
        start = index * self.block_size
        window = torch.from_numpy(self._map[start:start + self.block_size + 1].astype(np.int64))
        return window[:-1], window[1:]

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__ | {"_map": None}  # a worker process maps the file itself


def read_meta(directory: Path) -> dict[str, Any]:
    """``meta.json`` of a tokens directory, checked; errors name the file and what to do."""
    path = directory / META
    rebuild = f"Build the directory with: elastic-runner data prepare-text TEXT.txt --out {directory}"
    if not path.is_file():
        raise ConfigError("data.path", f"{directory} has no {META}", rebuild)
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError("data.path", f"{path} is not readable JSON ({exc})", rebuild) from exc
    vocab, dtype = meta.get("vocab_size") if isinstance(meta, dict) else None, meta.get("dtype", "uint16")
    if not isinstance(vocab, int) or vocab <= 0:
        raise ConfigError("data.path", f"{path}: vocab_size is {vocab!r}, not a positive integer", rebuild)
    if dtype not in DTYPES:
        raise ConfigError("data.path", f"{path}: dtype {dtype!r} is not one of {sorted(DTYPES)}", rebuild)
    if vocab > DTYPES[dtype][1]:
        raise ConfigError("data.path", f"{path}: vocab_size {vocab} does not fit dtype {dtype} "
                          f"(at most {DTYPES[dtype][1]} token ids)",
                          "Write the tokens as uint32 and set \"dtype\": \"uint32\" in meta.json")
    for split in ("train.bin", "val.bin"):
        if not (directory / split).is_file():
            raise ConfigError("data.path", f"{directory} has no {split}", rebuild)
    return meta


def token_datasets(directory: Path, block_size: int) -> tuple[TokenWindows, TokenWindows, dict[str, Any]]:
    if not isinstance(block_size, int) or block_size <= 0:
        raise ConfigError("data.params.block_size", f"got {block_size!r}, must be a positive integer",
                          "Set data.params.block_size to e.g. 128")
    meta = read_meta(directory)
    train = TokenWindows(directory / "train.bin", meta.get("dtype", "uint16"), block_size)
    val = TokenWindows(directory / "val.bin", meta.get("dtype", "uint16"), block_size)
    if len(train) == 0:
        raise ConfigError("data.params.block_size", f"{directory / 'train.bin'} holds {train.tokens} tokens, fewer "
                          f"than one window of {block_size + 1}", "Use a smaller block_size or more text")
    return train, val, meta


def prepare_text(source: str | os.PathLike[str], out: str | os.PathLike[str], val_fraction: float = 0.1) -> dict[str, Any]:
    """Character-level token files from a UTF-8 text; returns the meta written."""
    src, target = Path(source), Path(out)
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError("--val-fraction", f"got {val_fraction}, must be between 0 and 1", "Use e.g. 0.1")
    try:
        raw = src.read_bytes()
    except OSError as exc:
        raise ConfigError(str(src), f"cannot read it ({exc.strerror})", "Give an existing text file") from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(str(src), f"is not UTF-8: byte {exc.start} (0x{raw[exc.start]:02x}) cannot be decoded",
                          "Convert it first, e.g. iconv -f latin1 -t utf-8 IN > OUT") from exc
    if len(text) < 2:
        raise ConfigError(str(src), "holds fewer than 2 characters", "Give a longer text")
    chars = "".join(sorted(set(text)))
    dtype = "uint16" if len(chars) <= DTYPES["uint16"][1] else "uint32"
    lookup = {c: i for i, c in enumerate(chars)}
    ids = np.fromiter((lookup[c] for c in text), dtype=DTYPES[dtype][0], count=len(text))
    split = max(1, min(len(ids) - 1, int(len(ids) * (1 - val_fraction))))
    target.mkdir(parents=True, exist_ok=True)
    meta = {"vocab_size": len(chars), "dtype": dtype, "tokenizer": "char", "chars": chars, "source": src.name,
            "train_tokens": split, "val_tokens": len(ids) - split}
    for name, data in (("train.bin", ids[:split]), ("val.bin", ids[split:])):
        _write_atomically(target / name, data.tobytes())
    _write_atomically(target / META, json.dumps(meta, indent=1).encode())
    return meta


def prepare_once(source: str | os.PathLike[str], out: str | os.PathLike[str]) -> bool:
    """``prepare_text(source, out)`` unless ``out`` already holds token files; True when this call wrote them.

    ``data.params.text`` prepares a config's corpus on first use: every worker of every node may get here at
    once, so each writes into a private directory beside ``out`` and renames it into place; the first rename
    wins and the others drop their copy (same text, same files)."""
    target = Path(out)
    if (target / META).is_file():
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        prepare_text(source, staging)
        try:
            os.rename(staging, target)
        except OSError as exc:
            if not (target / META).is_file():
                raise ConfigError("data.path", f"cannot create {target} ({exc.strerror})",
                                  "Point data.path at a directory that can be created, or remove what is there") from exc
            return False  # another worker put the same files in place first
        return True
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def decode(ids: Any, meta: dict[str, Any]) -> str:
    chars = meta["chars"]
    return "".join(chars[int(i)] for i in ids)


def encode(text: str, meta: dict[str, Any]) -> list[int]:
    lookup = {c: i for i, c in enumerate(meta["chars"])}
    return [lookup[c] for c in text if c in lookup]


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
