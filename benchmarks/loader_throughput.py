"""Loader throughput of data.sources against a plain DataLoader over the same files, same workers (issue 46).

Two corpora, each read both ways in one run, alternating, ``--repeats`` times; the figure is tokens delivered to the
training process per second (batches of windows of ``--block-size`` + 1 tokens, collated, no training):

- **packed JSONL** (byte-level tokenizer): elastic_runner's ``data.sources`` (a window read from the documents its
  shard index says it covers, tokenized in the DataLoader workers, in the epoch's order) against a plain
  ``IterableDataset`` that reads each worker's share of the files line by line, tokenizes and packs them — what a
  script does when it needs no resume;
- **token shards** (``uint16`` ``.bin``): data.sources against a plain map-style dataset of memory-mapped windows
  under torch's ``RandomSampler`` (nanoGPT's layout, read in a shuffled order).

    ../.venv-vision/bin/python loader_throughput.py --out DIR/loader.json      # ~2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler, get_worker_info

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORDS = ("the quick brown fox jumps over a lazy dog while elastic runner trains its models on many machines that "
         "come and go").split()


def write_corpus(root: Path, shards: int, docs: int, tokens: int) -> None:
    rng = random.Random(0)
    (root / "web").mkdir(parents=True)
    (root / "tok").mkdir(parents=True)
    for k in range(shards):
        with open(root / "web" / f"part-{k:03d}.jsonl", "w") as fh:
            for _ in range(docs):
                fh.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 400)))}) + "\n")
        rng_np = np.random.default_rng(k)
        rng_np.integers(0, 50_000, tokens, dtype=np.uint16).tofile(root / "tok" / f"shard-{k:03d}.bin")


class PlainJsonl(IterableDataset):
    """Each worker reads its share of the files in order, tokenizes (UTF-8 bytes) and packs windows."""

    def __init__(self, files: list[str], block: int) -> None:
        self.files, self.block = files, block

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        info = get_worker_info()
        mine = self.files[info.id::info.num_workers] if info else self.files
        buffer: list[int] = []
        for name in mine:
            with open(name, "rb") as fh:
                for line in fh:
                    buffer.extend(json.loads(line)["text"].encode())
                    buffer.append(256)
                    while len(buffer) >= self.block + 1:
                        window = torch.tensor(buffer[:self.block + 1], dtype=torch.int64)
                        del buffer[:self.block]
                        yield window[:-1], window[1:]


class PlainTokens(Dataset):
    def __init__(self, files: list[str], block: int) -> None:
        self.files, self.block = files, block
        self.sizes = [Path(f).stat().st_size // 2 for f in files]
        self.windows = [(n - 1) // block for n in self.sizes]
        self.starts = np.concatenate([[0], np.cumsum(self.windows)])
        self.maps: dict[int, Any] = {}

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = int(np.searchsorted(self.starts, i, side="right") - 1)
        if k not in self.maps:
            self.maps[k] = np.memmap(self.files[k], dtype=np.uint16, mode="r")
        w = i - int(self.starts[k])
        window = torch.from_numpy(self.maps[k][w * self.block:w * self.block + self.block + 1].astype(np.int64))
        return window[:-1], window[1:]


def rate(loader: Any, batches: int, block: int, batch: int) -> float:
    it = iter(loader)
    next(it)  # the workers' start is not the steady state
    start = time.perf_counter()
    for _ in range(batches):
        next(it)
    return batches * batch * block / (time.perf_counter() - start)


def ours(root: Path, kind: str, block: int, batch: int, workers: int) -> DataLoader:
    from elastic_runner.config import load_config
    from elastic_runner.data.corpus import mixture_sampler, open_corpus

    source = ({"path": str(root / "web" / "*.jsonl")} if kind == "jsonl" else
              {"path": str(root / "tok" / "*.bin"), "format": "tokens"})
    cfg = load_config(None, ["train.max_steps=1", f"data.sources=[{json.dumps(source)}]",
                             f"data.pack={{block_size: {block}}}"])
    corpus = open_corpus(cfg.data)
    sampler = mixture_sampler(corpus.dataset, batch, seed=0, shuffle=True, rank=0, world_size=1)
    plans = (plan.indices for plan in sampler.plans())
    return DataLoader(corpus.dataset, batch_sampler=plans, num_workers=workers, persistent_workers=False)


def plain(root: Path, kind: str, block: int, batch: int, workers: int) -> DataLoader:
    if kind == "jsonl":
        return DataLoader(PlainJsonl(sorted(map(str, (root / "web").glob("*.jsonl"))), block), batch_size=batch,
                          num_workers=workers)
    data = PlainTokens(sorted(map(str, (root / "tok").glob("*.bin"))), block)
    return DataLoader(data, batch_size=batch, sampler=RandomSampler(data, generator=torch.Generator().manual_seed(0)),
                      num_workers=workers)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    from common import write_json

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_corpus(root, shards=8, docs=1500, tokens=2_000_000)
        ours(root, "jsonl", args.block_size, args.batch, 0)  # the shard index, built once before the timing
        results: dict[str, Any] = {}
        for kind in ("jsonl", "tokens"):
            pairs = []
            for _ in range(args.repeats):
                a = rate(ours(root, kind, args.block_size, args.batch, args.workers), args.batches, args.block_size,
                         args.batch)
                b = rate(plain(root, kind, args.block_size, args.batch, args.workers), args.batches,
                         args.block_size, args.batch)
                pairs.append((a, b))
            ratios = [a / b for a, b in pairs]
            results[kind] = {"elastic_runner_tokens_per_s": [round(a) for a, _ in pairs],
                             "plain_tokens_per_s": [round(b) for _, b in pairs],
                             "ratio_median": round(statistics.median(ratios), 3),
                             "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)]}
            print(f"{kind}: elastic_runner {statistics.median(a for a, _ in pairs):,.0f} tokens/s, plain "
                  f"{statistics.median(b for _, b in pairs):,.0f}, ratio {results[kind]['ratio_median']} "
                  f"({results[kind]['ratio_range'][0]}-{results[kind]['ratio_range'][1]})", flush=True)
    write_json(args.out, {"benchmark": "loader_throughput", "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
