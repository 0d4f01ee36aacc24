"""A small corpus of the kinds LLM teams train on, for the tests of data.sources: flat token shards, JSONL shards of
text, and a user's shard-addressable stream (:func:`stream`), with a config that mixes them."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import yaml

WORDS = ("the quick brown fox jumps over a lazy dog while elastic runner trains its models on many machines that "
         "come and go").split()


def _text(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def write_corpus(root: Path, seed: int = 0) -> Path:
    """``root/tok/*.bin`` (byte tokens, uint16), ``root/web/*.jsonl`` (documents of 3..60 words); returns root."""
    rng = random.Random(seed)
    (root / "tok").mkdir(parents=True, exist_ok=True)
    (root / "web").mkdir(parents=True, exist_ok=True)
    for k in range(3):
        text = _text(rng, 500, 700).encode()
        np.frombuffer(text, dtype=np.uint8).astype(np.uint16).tofile(root / "tok" / f"shard-{k}.bin")
    for k in range(2):
        with open(root / "web" / f"part-{k}.jsonl", "w") as fh:
            for d in range(40):
                fh.write(json.dumps({"text": _text(rng, 3, 60), "id": f"{k}-{d}"}) + "\n")
    return root


def mixture_config(path: Path, sources: list[dict[str, Any]], **sections: dict[str, Any]) -> Path:
    """A tiny GPT on packed ``sources``: windows of 16 tokens, a global batch of 8."""
    data: dict[str, Any] = {
        "run": {"dir": str(path.parent / "run"), "seed": 0},
        "data": {"sources": sources, "pack": {"block_size": 16}},
        "model": {"name": "gpt", "params": {"n_layer": 1, "n_head": 2, "n_embd": 16}},
        "optim": {"name": "adamw", "lr": 0.003},
        "batch": {"global_size": 8},
        "train": {"max_steps": 300, "eval_every_steps": 0},
        "snapshot": {"every_steps": 25, "keep_last": 3},
        "audit": {"samples": True},
        "logging": {"every_steps": 25},
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    path.write_text(yaml.safe_dump(data))
    return path


class Stream:
    """A user's shard-addressable stream (the bring-your-own protocol): ``shards`` shards of ``items`` documents,
    each a pure function of (seed, shard, offset), as a dataset in a store would be."""

    def __init__(self, shards: int = 4, items: int = 30, seed: int = 1) -> None:
        self.count, self.items, self.seed = shards, items, seed

    def shards(self) -> list[str]:
        return [f"stream-{k:03d}" for k in range(self.count)]

    def open(self, shard: str, offset: int) -> Iterator[dict[str, str]]:
        k = int(shard.rsplit("-", 1)[1])
        for i in range(offset, self.items):
            yield {"text": _text(random.Random(f"{self.seed}-{k}-{i}"), 3, 40)}


def stream(**params: Any) -> Stream:
    return Stream(**params)
