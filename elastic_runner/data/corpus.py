"""``data.sources`` built into what training needs: one map-style dataset over every source, and its sampler.

The sources are opened (:mod:`.shards`: listed, their shard index read or built), the tokenizer loaded
(:mod:`.packing`), and together they are a :class:`~.mixture.MixtureDataset` of global ids with a
:class:`~.mixture.MixtureSampler` over it: exact proportions, each source exactly once per its own epoch, at any
world size and DataLoader worker count (the loader reads the ids the sampler hands it, nothing else). A language
model learns its vocabulary from the tokenizer and its window from ``data.pack.block_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import DataConfig
from ..config.sources import parse_pack, parse_sources
from .mixture import MixtureDataset, MixtureSampler
from .packing import load_tokenizer
from .shards import open_source


@dataclass
class Corpus:
    """``data.sources`` opened: the dataset of every source's samples, and what a model learns of it."""

    dataset: MixtureDataset
    description: str
    vocab_size: int | None  #: the tokenizer's, when the sources are packed
    block_size: int | None


def open_corpus(cfg: DataConfig) -> Corpus:
    specs = parse_sources(cfg.sources)
    pack = parse_pack(cfg.pack)
    tokenizer = load_tokenizer(cfg.tokenizer) if pack is not None else None
    sources = [open_source(spec, pack, tokenizer) for spec in specs]
    parts = ", ".join(f"{s.spec.label} ({len(s.shards)} shard{'s' if len(s.shards) != 1 else ''}, {len(s):,} "
                      f"{'windows' if pack else 'items'}, weight {s.spec.weight:g})" for s in sources)
    vocabularies = [s.vocab_size for s in sources if s.vocab_size is not None]
    return Corpus(MixtureDataset(sources), f"{len(sources)} source{'s' if len(sources) != 1 else ''}: {parts}",
                  max(vocabularies) if vocabularies else None, pack.block_size if pack else None)


def mixture_sampler(dataset: MixtureDataset, global_batch: int, *, seed: int, shuffle: bool, rank: int,
                    world_size: int) -> MixtureSampler:
    sources = dataset.sources
    return MixtureSampler([len(s) for s in sources], [s.spec.weight for s in sources], global_batch, seed=seed,
                          shuffle=shuffle, rank=rank, world_size=world_size, labels=[s.spec.label for s in sources],
                          identities=[s.identity() for s in sources])
