"""From the sampler's index lists to batches on the training device.

The loop never iterates a dataset directly: the elastic sampler says which indices each rank
consumes in each micro-step, and a :class:`BatchSource` fetches exactly those — one indexing
operation for data held as two tensors (:class:`TensorSource`), a DataLoader whose batch sampler
is our index lists otherwise (:class:`LoaderSource`, with worker processes if configured).

Items may be any nesting of tensors, numbers, tuples, lists, dicts, namedtuples and dataclasses.
They are collated with torch's ``default_collate`` (extended to dataclasses, field by field)
unless ``data.collate`` names a function, and
the whole batch is moved to the device recursively (``non_blocking``; pinned memory on a GPU). A
batch that cannot be collated is explained by the dataset indices and structures of the two items
that differ, and raised in the training process as a :class:`~elastic_runner.config.ConfigError`
(not as a DataLoader worker's traceback).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable, Iterable, Iterator, Protocol, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from ..config import ConfigError
from ..worker.lifecycle import LoaderWorkersDieWithTrainer

Collate = Callable[[list[Any]], Any]


class BatchSource(Protocol):
    def batches(self, index_lists: Iterable[list[int]], epoch: int = 0) -> Iterator[Any]:
        """One collated batch on the device per index list, in order (``epoch``: for per-sample seeding)."""


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor inside it on ``device`` (any nesting)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        moved = {k: to_device(v, device) for k, v in batch.items()}
        if type(batch) is dict:
            return moved
        try:
            return type(batch)(moved)  # OrderedDict, a tokenizer's BatchEncoding...
        except Exception:  # noqa: BLE001 - a mapping type that cannot be rebuilt from a dict
            return moved
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(batch, **{f.name: to_device(getattr(batch, f.name), device)
                                             for f in dataclasses.fields(batch) if f.init})
    return batch


# -- collation with errors that say which items differ -----------------------------------------------------


def collate_any(items: list[Any]) -> Any:
    """torch's ``default_collate``, also through dataclasses (field by field, same class)."""
    first = items[0]
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        fields = [f.name for f in dataclasses.fields(first) if f.init]
        return type(first)(**{name: collate_any([getattr(item, name) for item in items]) for name in fields})
    if isinstance(first, Mapping) and any(_has_dataclass(v) for v in first.values()):
        return {key: collate_any([item[key] for item in items]) for key in first}
    if isinstance(first, (list, tuple)) and not hasattr(first, "_fields") and any(_has_dataclass(v) for v in first):
        if any(len(item) != len(first) for item in items):
            raise RuntimeError("each element in list of batch should be of equal size")
        return type(first)(collate_any(list(column)) for column in zip(*items))
    return default_collate(items)


def _has_dataclass(obj: Any) -> bool:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return True
    if isinstance(obj, Mapping):
        return any(_has_dataclass(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_dataclass(v) for v in obj)
    return False



class BadItem:
    """What a dataset returns for an item it cannot produce (an image that does not decode): the batch
    that holds it is refused by name, also from a DataLoader worker."""

    def __init__(self, path: str, error: str) -> None:
        self.path, self.error = path, error


@dataclasses.dataclass
class BadBatch:
    """What a collate that failed returns (also from a DataLoader worker): the explanation."""

    key: str
    problem: str
    fix: str

    def error(self) -> ConfigError:
        return ConfigError(self.key, self.problem, self.fix)


def structure(obj: Any) -> Any:
    """The nesting of an item without shapes or values: what must be equal to collate items."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", obj.dim(), str(obj.dtype))
    if isinstance(obj, dict):
        return ("dict", tuple(sorted((str(k), structure(v)) for k, v in obj.items())))
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, tuple(structure(v) for v in obj))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return (type(obj).__name__, tuple(structure(getattr(obj, f.name)) for f in dataclasses.fields(obj)))
    return type(obj).__name__


def _shapes(obj: Any, path: str = "") -> dict[str, tuple[int, ...]]:
    if isinstance(obj, torch.Tensor):
        return {path or "item": tuple(obj.shape)}
    out: dict[str, tuple[int, ...]] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out |= _shapes(v, f"{path}[{k!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out |= _shapes(v, f"{path}[{i}]")
    return out


def explain(indexed: Sequence[tuple[int, Any]], exc: BaseException, custom: bool) -> BadBatch:
    """Why ``indexed`` (dataset index, item) pairs did not collate."""
    key = "data.collate" if custom else "data.name"
    first_index, first = indexed[0]
    for index, item in indexed[1:]:
        if structure(item) != structure(first):
            return BadBatch(key, f"dataset items {first_index} and {index} have different structures: "
                            f"{describe(first)} vs {describe(item)}",
                            "Make every item the same nesting of tensors, numbers, tuples, lists and dicts")
    for index, item in indexed[1:]:
        a, b = _shapes(first), _shapes(item)
        for path, shape in a.items():
            if b.get(path, shape) != shape:
                return BadBatch(key, f"dataset items {first_index} and {index} hold tensors of different shapes at "
                                f"{path}: {list(shape)} vs {list(b[path])}",
                                "Pad them to one length in a collate function: data.collate: 'package.module:fn'"
                                if not custom else "Make your collate function pad them to one length")
    first_line = (str(exc).splitlines() or [""])[0][:300]
    return BadBatch(key, f"collating dataset items {[i for i, _ in indexed[:8]]} failed "
                    f"({type(exc).__name__}: {first_line}); the first item is {describe(first)}",
                    "Return tensors, numbers, tuples, lists or dicts from the dataset, or give data.collate")


class IndexedCollate:
    """Collates (index, item) pairs (see :class:`Indexed`); a failure becomes a :class:`BadBatch`."""

    def __init__(self, collate: Collate | None) -> None:
        self.collate = collate or collate_any
        self.custom = collate is not None

    def __call__(self, indexed: list[tuple[int, Any]]) -> Any:
        bad = next(((i, item) for i, item in indexed if isinstance(item, BadItem)), None)
        if bad is not None:
            return BadBatch("data.path", f"dataset item {bad[0]}: {bad[1].path} cannot be decoded ({bad[1].error})",
                            "Replace or remove the file, or set data.bad_images: skip to leave undecodable files out")
        try:
            return self.collate([item for _, item in indexed])
        except Exception as exc:  # noqa: BLE001 - explained, then raised in the training process
            return explain(indexed, exc, self.custom)


class Indexed(Dataset[tuple[int, Any]]):
    """A dataset whose items carry their index, so that a collate error can name them."""

    def __init__(self, dataset: Dataset[Any]) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> tuple[int, Any]:
        return index, self.dataset[index]


def collate_items(dataset: Dataset[Any], indices: Sequence[int], collate: Collate | None) -> Any:
    """Collate ``dataset[i] for i in indices`` in this process (a start-up check, evaluation)."""
    batch = IndexedCollate(collate)([(i, dataset[i]) for i in indices])
    if isinstance(batch, BadBatch):
        raise batch.error()
    return batch


# -- sources ----------------------------------------------------------------------------------------------------


class TensorSource:
    """In-memory (input, target) tensors: a batch is one indexing operation, no worker processes."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> None:
        # Keep the data on the training device when it is small: no per-step copies.
        self.on_device = device.type == "cuda" and x.numel() * x.element_size() < (1 << 30)
        self.x = x.to(device) if self.on_device else x
        self.y = y.to(device) if self.on_device else y
        self.device = device

    def batches(self, index_lists: Iterable[list[int]], epoch: int = 0) -> Iterator[Any]:
        for indices in index_lists:
            idx = torch.as_tensor(indices, dtype=torch.long, device=self.x.device)
            x, y = self.x.index_select(0, idx), self.y.index_select(0, idx)
            if not self.on_device:
                x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            yield [x, y]  # what default_collate makes of (input, target) items


class LoaderSource:
    """Any map-style dataset: a DataLoader whose batch sampler is our index lists."""

    def __init__(self, dataset: Dataset[Any], device: torch.device, num_workers: int, seed: int,
                 collate: Collate | None = None, worker_init: Callable[[int], None] | None = None) -> None:
        self.dataset = Indexed(dataset)
        self.device = device
        self.num_workers = num_workers
        self.seed = seed
        self.collate = IndexedCollate(collate)
        self.worker_init = worker_init

    def batches(self, index_lists: Iterable[list[int]], epoch: int = 0) -> Iterator[Any]:
        set_epoch = getattr(self.dataset.dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)  # before the workers start: they copy the dataset as it is now
        generator = torch.Generator().manual_seed(self.seed)
        loader = DataLoader(
            self.dataset, batch_sampler=_Once(index_lists), num_workers=self.num_workers, collate_fn=self.collate,
            pin_memory=self.device.type == "cuda", generator=generator, persistent_workers=False,
            worker_init_fn=LoaderWorkersDieWithTrainer(self.worker_init),
        )
        for batch in loader:
            if isinstance(batch, BadBatch):
                raise batch.error()
            yield to_device(batch, self.device)


class _Once:
    """A batch sampler over a one-shot iterable (DataLoader only iterates it once)."""

    def __init__(self, index_lists: Iterable[list[int]]) -> None:
        self.index_lists = index_lists

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.index_lists)


def shard(n: int, rank: int, world: int) -> range:
    """Evaluation shard of rank r: every world-th index, so shards cover [0, n) once."""
    return range(rank, n, world)


def describe(obj: Any, depth: int = 0) -> str:
    """A short structural description of a batch or an item: ``{input_ids: Tensor[12] int64, ...}``."""
    if isinstance(obj, torch.Tensor):
        return f"Tensor{list(obj.shape)} {str(obj.dtype).removeprefix('torch.')}"
    if depth > 3:
        return "..."
    if isinstance(obj, dict):
        return "{" + ", ".join(f"{k}: {describe(v, depth + 1)}" for k, v in list(obj.items())[:8]) + "}"
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return f"{type(obj).__name__}(" + ", ".join(f"{k}={describe(getattr(obj, k), depth + 1)}" for k in obj._fields) + ")"
    if isinstance(obj, (list, tuple)):
        inner = ", ".join(describe(v, depth + 1) for v in obj[:8])
        return f"({inner})" if isinstance(obj, tuple) else f"[{inner}]"
    if hasattr(obj, "__dataclass_fields__"):
        return f"{type(obj).__name__}(" + ", ".join(
            f"{k}={describe(getattr(obj, k), depth + 1)}" for k in obj.__dataclass_fields__) + ")"
    return type(obj).__name__
