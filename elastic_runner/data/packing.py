"""Packing: documents tokenized, joined with an end-of-document token and cut into fixed windows.

A source's shard is read as one stream of tokens: each document's tokens followed by the end-of-document token
(``eod``). Window ``w`` of a shard is tokens ``[w * B, w * B + B + 1)`` of that stream (``B``: ``data.pack.
block_size``), an item ``(input = window[:-1], target = window[1:])``: windows do not overlap, a document may span
several, the last ``< B + 1`` tokens of a shard are in no window (the same every epoch). A window is a pure function
of its position — the shard's index says which documents it covers (their cumulative token counts), and nothing
else is read. With ``data.pack.mask: documents`` a target whose input is an end-of-document token (the next
document's first token, which nothing before it predicts) is ``-100``, left out of the built-in loss;
:func:`document_ids` gives each token's document within a window, for a model that masks attention by document.

The tokenizer (``data.tokenizer``) is ``bytes`` — UTF-8 bytes are tokens 0..255, end of document 256, a vocabulary of
257, no files — or an import path to ``fn(text) -> list[int]`` whose attributes ``vocab_size`` and ``eod`` say the
rest. It runs where the windows are read: in DataLoader workers when ``data.num_workers`` > 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..config import ConfigError
from ..config.imports import resolve

IGNORE_INDEX = -100


@dataclass
class Tokenizer:
    """What packing needs of a tokenizer: text to ids, the vocabulary size, the end-of-document id."""

    name: str  #: bytes, or the import path: part of the shard index's key (another tokenizer, other counts)
    encode: Callable[[str], Any]
    vocab_size: int
    eod: int

    def tokens(self, text: str) -> np.ndarray:
        """The ids of ``text`` (an array of any integer dtype)."""
        ids = self.encode(text)
        return ids if isinstance(ids, np.ndarray) else np.asarray(ids, dtype=np.int64)

    def __reduce__(self) -> tuple[Any, ...]:  # to DataLoader workers: by name, resolved again there
        return (load_tokenizer, (self.name,))


def _bytes(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def load_tokenizer(name: str) -> Tokenizer:
    """``data.tokenizer``: the built-in byte-level tokenizer or a user's function (a ConfigError says what is
    missing)."""
    if name == "bytes":
        return Tokenizer("bytes", _bytes, 257, 256)
    fn = resolve(name, "data.tokenizer")
    if not callable(fn):
        raise ConfigError("data.tokenizer", f"{name} is {type(fn).__name__}, not a function",
                          "Point it at fn(text) -> list[int]")
    vocab, eod = getattr(fn, "vocab_size", None), getattr(fn, "eod", None)
    for attr, value in (("vocab_size", vocab), ("eod", eod)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError("data.tokenizer", f"{name} has no integer attribute {attr} (got {value!r})",
                              f"Set {attr} on the function, e.g. {name.split(':')[1]}.{attr} = ... (vocab_size: "
                              "the model's vocabulary, eod: the end-of-document id)")
    if not 0 <= eod < vocab:  # type: ignore[operator]
        raise ConfigError("data.tokenizer", f"{name}.eod = {eod} is outside its vocabulary of {vocab}",
                          "Use an id below vocab_size")
    return Tokenizer(name, fn, int(vocab), int(eod))  # type: ignore[arg-type]


def window(documents: Sequence[np.ndarray], first_start: int, start: int, length: int, eod: int) -> np.ndarray:
    """Tokens ``[start, start + length)`` of a shard's stream, from the documents that cover them (``first_start``:
    where the first of them starts in the stream). Each document is followed by ``eod``."""
    stream = np.empty(sum(len(doc) + 1 for doc in documents), dtype=np.int64)
    at = 0
    for doc in documents:
        stream[at:at + len(doc)] = doc
        stream[at + len(doc)] = eod
        at += len(doc) + 1
    out = stream[start - first_start:start - first_start + length]
    if len(out) != length:
        raise ValueError(f"the documents cover {len(stream)} tokens from {first_start}, not [{start}, "
                         f"{start + length})")
    return out


def as_item(tokens: np.ndarray, eod: int, mask_documents: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input, target)`` of a window of ``B + 1`` tokens."""
    win = torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64))
    inputs, targets = win[:-1], win[1:]
    if mask_documents:
        targets = targets.clone()
        targets[inputs == eod] = IGNORE_INDEX
    return inputs, targets


def document_ids(inputs: torch.Tensor, eod: int) -> torch.Tensor:
    """Each token's document within its window (0 for the first, counted up after each end-of-document token): two
    positions may attend to each other where their ids are equal. Works on ``[T]`` and ``[B, T]``."""
    ends = (inputs == eod).to(torch.int64)
    return torch.cumsum(ends, dim=-1) - ends
