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
import logging
from collections.abc import Mapping
from typing import Any, Callable, Iterable, Iterator, Protocol, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from ..config import ConfigError
from ..lifecycle import LoaderWorkersDieWithTrainer

Collate = Callable[[list[Any]], Any]

log = logging.getLogger("elastic_runner.train")


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
    """What a dataset returns for an item it cannot produce (an image that does not decode, a shard that changed):
    the batch that holds it is refused by name, also from a DataLoader worker."""

    def __init__(self, path: str, error: str, refusal: tuple[str, str, str] | None = None) -> None:
        self.path, self.error = path, error
        self.refusal = refusal  #: (key, problem, fix) where the dataset said it itself

    @classmethod
    def refusing(cls, exc: ConfigError) -> "BadItem":
        return cls("", exc.problem, (exc.key, exc.problem, exc.fix))


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
        if bad is not None and bad[1].refusal is not None:
            return BadBatch(*bad[1].refusal)
        if bad is not None:
            return BadBatch("data.path", f"dataset item {bad[0]}: {bad[1].path} cannot be decoded ({bad[1].error})",
                            "Replace or remove the file, or set data.bad_images: skip to leave undecodable files out")
        try:
            return self.collate([item for _, item in indexed])
        except Exception as exc:  # noqa: BLE001 - explained, then raised in the training process
            return explain(indexed, exc, self.custom)


class Indexed(Dataset[tuple[int, Any]]):
    """A dataset whose items carry their index, so that a collate error can name them.

    A key may be ``(epoch, index)``: a DataLoader worker that lives through several epochs holds the copy of the
    dataset it started with, so the epoch comes with the index and the dataset's ``set_epoch`` (if it has one) is
    called in the worker when it changes."""

    def __init__(self, dataset: Dataset[Any]) -> None:
        self.dataset = dataset
        self.epoch: int | None = None

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[int, Any]:
        if isinstance(key, tuple):
            epoch, index = key
            self.set_epoch(epoch)
        else:
            index = key
        return index, self.dataset[index]

    def set_epoch(self, epoch: int) -> None:
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if callable(set_epoch) and epoch != self.epoch:
            set_epoch(epoch)
        self.epoch = epoch


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
    """Any map-style dataset: a DataLoader whose batch sampler is our index lists.

    Its worker processes start at each :meth:`batches` and end with it; with ``keep_workers`` they live from the first
    call to :meth:`close`, through every epoch and — the source kept by its process (:class:`KeptLoaders`) — through
    every in-process recovery: an iteration abandoned mid-way (the step in flight when a peer failed) leaves its
    prefetched batches behind, and torch's persistent workers drop them at the next one. A kept loader whose worker
    died meanwhile is started anew at the next call; one that dies during an iteration fails the step, as it would
    without keeping."""

    def __init__(self, dataset: Dataset[Any], device: torch.device, num_workers: int, seed: int,
                 collate: Collate | None = None, worker_init: Callable[[int], None] | None = None,
                 keep_workers: bool = False) -> None:
        self.dataset = Indexed(dataset)
        self.device = device
        self.num_workers = num_workers
        self.seed = seed
        self.collate = IndexedCollate(collate)
        self.worker_init = worker_init
        self.keep_workers = keep_workers and num_workers > 0
        self._feed = _Feed()
        self._kept: DataLoader[Any] | None = None
        #: Loaders started anew because a kept worker had died (for the log and tests).
        self.restarts = 0

    def batches(self, index_lists: Iterable[list[int]], epoch: int = 0) -> Iterator[Any]:
        self.dataset.set_epoch(epoch)  # here before the workers start (they copy the dataset as it is now)
        if self.keep_workers:
            self._feed.index_lists = ([(epoch, i) for i in indices] for indices in index_lists)
            loader = self._kept_loader()
        else:
            loader = self._loader(_Feed(index_lists), persistent=False)
        for batch in loader:
            if isinstance(batch, BadBatch):
                raise batch.error()
            yield to_device(batch, self.device)

    def _loader(self, feed: _Feed, persistent: bool) -> DataLoader[Any]:
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(
            self.dataset, batch_sampler=feed, num_workers=self.num_workers, collate_fn=self.collate,
            pin_memory=self.device.type == "cuda", generator=generator, persistent_workers=persistent,
            worker_init_fn=LoaderWorkersDieWithTrainer(self.worker_init),
        )

    def _kept_loader(self) -> DataLoader[Any]:
        if self._kept is not None and not self.workers_alive():
            log.warning("a DataLoader worker of this process died: its loader starts anew")
            self.close()
            self.restarts += 1
        if self._kept is None:
            self._kept = self._loader(self._feed, persistent=True)
        return self._kept

    def _workers(self) -> list[Any]:
        """The kept loader's worker processes (none before its first batch, or without keeping)."""
        return getattr(getattr(self._kept, "_iterator", None), "_workers", None) or []

    def worker_pids(self) -> list[int]:
        return [w.pid for w in self._workers()]

    def workers_alive(self) -> bool:
        return all(w.is_alive() for w in self._workers())

    def close(self) -> None:
        """End the kept workers now (the loader's own clean-up would wait for the collector)."""
        loader, self._kept = self._kept, None
        iterator = getattr(loader, "_iterator", None)
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if callable(shutdown):
            shutdown()


class _Feed:
    """The batch sampler: the index lists of the current iteration (a kept DataLoader iterates it once per call)."""

    def __init__(self, index_lists: Iterable[list[Any]] = ()) -> None:
        self.index_lists = index_lists

    def __iter__(self) -> Iterator[list[Any]]:
        return iter(self.index_lists)


class KeptLoaders:
    """The loaders a worker process keeps from one attempt to the next (in-process recovery), one per role (train,
    test): the same dataset object — the workload the next attempt trains again — gets the same loader and its
    workers; another dataset (a workload built anew) ends the old loader's."""

    def __init__(self) -> None:
        self._by_role: dict[str, LoaderSource] = {}

    def source(self, role: str, dataset: Dataset[Any], make: Callable[[], LoaderSource]) -> LoaderSource:
        kept = self._by_role.get(role)
        if kept is not None and kept.dataset.dataset is dataset:
            return kept
        if kept is not None:
            kept.close()
        self._by_role[role] = made = make()
        return made

    def close(self) -> None:
        for source in self._by_role.values():
            source.close()
        self._by_role.clear()


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
