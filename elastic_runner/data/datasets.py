"""Datasets from config: the shipped digits, synthetic data, token files, images, and import paths.

Built in:
- ``digits``: the UCI optical-recognition digits (1,797 8x8 images, CC BY 4.0),
  shipped inside the package, so the quickstart needs no download.
- ``synthetic``: deterministic Gaussian class clusters of any size and shape,
  for benchmarks.
- ``tokens``: memory-mapped token files for language models (:mod:`elastic_runner.data.tokens`).
- ``image_folder``, ``cifar10`` (from a local directory) and ``fake_images``, with
  augmentation that resumes bitwise: :mod:`elastic_runner.data.images`.
- ``package.module:callable``: the user's own; items may be any nesting of
  tensors, numbers, tuples, lists, dicts and dataclasses.

How index lists become batches on the device: :mod:`elastic_runner.data.sources`.
"""

from __future__ import annotations

import functools
import gzip
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

import torch
from torch.utils.data import Dataset

from ..config import ConfigError, DataConfig
from ..config.imports import call, resolve

#: The digits split does not depend on run.seed: every run evaluates on the same images.
DIGITS_SPLIT_SEED = 20240917


@dataclass
class DatasetBundle:
    train: Dataset[Any]
    test: Dataset[Any] | None
    input_shape: tuple[int, ...] | None  #: shape of one input of (input, target) items, if they are
    num_classes: int | None  #: what the dataset tells (a built-in classifier needs it)
    description: str
    vocab_size: int | None = None  #: token datasets
    block_size: int | None = None  #: token datasets: tokens per window
    language_model: bool = False

    @property
    def num_train(self) -> int:
        return len(self.train)  # type: ignore[arg-type]


class TensorPairDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Inputs and labels held as two tensors; batches are one indexing op."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if len(x) != len(y):
            raise ValueError(f"inputs ({len(x)}) and labels ({len(y)}) differ in length")
        self.x = x
        self.y = y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


# --------------------------------------------------------------------------- builders


def _split(x: torch.Tensor, y: torch.Tensor, test_fraction: float, seed: int) -> tuple[TensorPairDataset, TensorPairDataset]:
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(x), generator=g)
    n_test = max(1, int(round(len(x) * test_fraction)))
    test_idx, train_idx = order[:n_test].sort().values, order[n_test:].sort().values
    return TensorPairDataset(x[train_idx], y[train_idx]), TensorPairDataset(x[test_idx], y[test_idx])


@functools.lru_cache(maxsize=1)
def load_digits_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """The shipped digits as (N,1,8,8) floats in [0,1] and labels (cached; do not modify)."""
    raw = resources.files("elastic_runner").joinpath("_data/digits.csv.gz").read_bytes()
    rows = [line.split(",") for line in gzip.decompress(raw).decode().splitlines() if line]
    values = torch.tensor([[float(v) for v in row] for row in rows])
    x = (values[:, :64] / 16.0).reshape(-1, 1, 8, 8).contiguous()
    y = values[:, 64].long()
    return x, y


def _digits(cfg: DataConfig) -> DatasetBundle:
    if cfg.params:
        raise ConfigError("data.params", f"digits takes no parameters, got {sorted(cfg.params)}", "Remove data.params")
    x, y = load_digits_tensors()
    train, test = _split(x, y, cfg.test_fraction, DIGITS_SPLIT_SEED)
    return DatasetBundle(train, test, (1, 8, 8), 10, f"digits ({len(train)} train / {len(test)} test)")


SYNTHETIC_DEFAULTS: dict[str, Any] = {
    "size": 4096, "test_size": 512, "shape": [1, 8, 8], "num_classes": 10, "noise": 1.0, "seed": 0,
}


def make_synthetic(size: int = 4096, test_size: int = 512, shape: Sequence[int] = (1, 8, 8),
                   num_classes: int = 10, noise: float = 1.0, seed: int = 0) -> tuple[TensorPairDataset, TensorPairDataset]:
    """Gaussian clusters around one random prototype per class: learnable, fixed by seed."""
    g = torch.Generator().manual_seed(seed)
    shape = tuple(int(s) for s in shape)
    prototypes = torch.randn((num_classes, *shape), generator=g)
    total = size + test_size
    y = torch.randint(num_classes, (total,), generator=g)
    x = prototypes[y] + noise * torch.randn((total, *shape), generator=g)
    return TensorPairDataset(x[:size], y[:size]), TensorPairDataset(x[size:], y[size:])


def _synthetic(cfg: DataConfig) -> DatasetBundle:
    unknown = set(cfg.params) - set(SYNTHETIC_DEFAULTS)
    if unknown:
        raise ConfigError(
            "data.params", f"unknown synthetic parameter(s) {sorted(unknown)}",
            f"Valid parameters: {', '.join(SYNTHETIC_DEFAULTS)}",
        )
    p = SYNTHETIC_DEFAULTS | cfg.params
    for key in ("size", "test_size", "num_classes"):
        if not isinstance(p[key], int) or p[key] <= 0:
            raise ConfigError(f"data.params.{key}", f"got {p[key]!r}, must be a positive integer", f"Set data.params.{key} to e.g. {SYNTHETIC_DEFAULTS[key]}")
    if not isinstance(p["shape"], (list, tuple)) or not p["shape"] or not all(isinstance(s, int) and s > 0 for s in p["shape"]):
        raise ConfigError("data.params.shape", f"got {p['shape']!r}, must be a list of positive integers", "Set it to e.g. [3, 32, 32] or [64]")
    train, test = make_synthetic(**p)
    return DatasetBundle(train, test, tuple(p["shape"]), p["num_classes"], f"synthetic ({p['size']} x {tuple(p['shape'])})")


def _images(kind: str) -> Any:
    """image_folder, cifar10, fake_images (elastic_runner.data.images; torchvision imported only when needed)."""
    def build(cfg: DataConfig, seed: int) -> DatasetBundle:
        from . import images

        train, test, shape, classes, description = getattr(images, kind)(cfg, seed)
        return DatasetBundle(train, test, shape, classes, description)
    return build


def _infer_num_classes(ds: Any) -> int | None:
    for attr in ("num_classes",):
        if isinstance(getattr(ds, attr, None), int):
            return getattr(ds, attr)
    classes = getattr(ds, "classes", None)
    if classes is not None:
        return len(classes)
    if isinstance(ds, TensorPairDataset):
        return int(ds.y.max()) + 1
    return None


def _user_dataset(cfg: DataConfig) -> DatasetBundle:
    factory = resolve(cfg.name, "data.name")
    result = call(factory, dict(cfg.params), "data.params", cfg.name)
    train, test = (result if isinstance(result, tuple) and len(result) == 2 else (result, None))
    if not hasattr(train, "__len__") or not hasattr(train, "__getitem__"):
        raise ConfigError("data.name", f"{cfg.name} returned {type(train).__name__}, not a map-style dataset", "Return a torch Dataset with __len__ and __getitem__ (or a (train, test) pair)")
    if len(train) == 0:
        raise ConfigError("data.name", f"{cfg.name} returned an empty dataset", "Check the dataset's source")
    return bundle_of(train, test, f"{cfg.name} ({len(train)} samples)")


def bundle_of(train: Any, test: Any, description: str) -> DatasetBundle:
    """What can be told about a dataset of any items: the input shape of (input, target) items
    with a tensor input, the number of classes if the dataset says."""
    first = train[0]
    shape = None
    if isinstance(first, (tuple, list)) and len(first) == 2 and isinstance(first[0], torch.Tensor):
        shape = tuple(first[0].shape)
    return DatasetBundle(train, test, shape, _infer_num_classes(train), description)


def _tokens(cfg: DataConfig) -> DatasetBundle:
    from .tokens import prepare_once, token_datasets

    unknown = set(cfg.params) - {"block_size", "text"}
    if unknown:
        raise ConfigError("data.params", f"unknown tokens parameter(s) {sorted(unknown)}",
                          "Valid parameters: block_size, text")
    block_size = cfg.params.get("block_size", 128)
    directory = Path(cfg.path or "")
    if "text" in cfg.params:
        prepare_once(cfg.params["text"], directory)  # the first worker to get here writes it; the rest reuse it
    train, val, meta = token_datasets(directory, block_size)
    return DatasetBundle(train, val, None, None, f"tokens {cfg.path} ({train.tokens:,} train tokens, "
                         f"{len(train):,} windows of {block_size}; vocabulary {meta['vocab_size']})",
                         vocab_size=meta["vocab_size"], block_size=block_size, language_model=True)


def build_datasets(cfg: DataConfig, seed: int = 0) -> DatasetBundle:
    """The configured datasets; ``seed`` (run.seed) seeds their augmentation."""
    if cfg.sources is not None:
        from .corpus import open_corpus

        corpus = open_corpus(cfg)
        return DatasetBundle(corpus.dataset, None, None, None, corpus.description, vocab_size=corpus.vocab_size,
                             block_size=corpus.block_size, language_model=corpus.block_size is not None)
    builders = {"digits": _digits, "synthetic": _synthetic, "tokens": _tokens}
    if cfg.name in builders:
        return builders[cfg.name](cfg)
    if cfg.name in ("image_folder", "cifar10", "fake_images"):
        return _images(cfg.name)(cfg, seed)
    return _user_dataset(cfg)
