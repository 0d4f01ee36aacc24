"""What is trained: datasets, model, task (loss and metrics), optimizer and schedule factories.

A :class:`Workload` comes from a config (:func:`from_config`: built-in names and import paths) or
from a user's own script (:func:`elastic_runner.api.fit`: Python objects). The training attempt
does not care which. :func:`check` runs once per attempt before anything is written to the run
directory: it collates the first items and calls the loss on them, so that a dataset whose items
do not collate or a loss that does not return per-sample values stops the run with one line and
exit status 2, with nothing in ``run.dir`` changed.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import Dataset

from ..config import BatchConfig, Config, ConfigError
from ..config.imports import resolve
from ..data.datasets import DatasetBundle, build_datasets
from ..data.layout import split_even
from ..data.sources import Collate, collate_items, to_device
from .models import build_model
from .optim import build_optimizer, build_schedule
from .tasks import Task, build_task

OptimizerFactory = Callable[[Iterable[nn.Parameter], float], torch.optim.Optimizer]
ScheduleFactory = Callable[[torch.optim.Optimizer, int], LRScheduler]


@dataclass
class Workload:
    train: Dataset[Any]
    test: Dataset[Any] | None
    model: nn.Module
    task: Task
    make_optimizer: OptimizerFactory  #: (parameters, lr_scale) -> optimizer
    make_schedule: ScheduleFactory  #: (optimizer, total_steps) -> LR scheduler
    description: str
    collate: Collate | None = None
    #: How the model is rebuilt without the data (see elastic_runner.api.load_model).
    model_build: dict[str, Any] = field(default_factory=dict)
    #: Fingerprint parts for objects no config describes (a script's own model and data).
    identity: dict[str, Any] = field(default_factory=dict)
    #: The script's own ``torch.compile`` wrapper of ``model`` (``model`` is then the plain module inside it).
    compiled: nn.Module | None = None

    @property
    def num_train(self) -> int:
        return len(self.train)  # type: ignore[arg-type]


def from_config(cfg: Config) -> Workload:
    """Built-in names and import paths of ``cfg``; the model is built with ``run.seed``."""
    bundle = build_datasets(cfg.data, seed=cfg.run.seed)
    collate = resolve(cfg.data.collate, "data.collate") if cfg.data.collate else None
    build = model_build_args(bundle)
    torch.manual_seed(cfg.run.seed)  # identical initial weights on every rank and every attempt
    model = build_model(cfg.model, **build)
    if cfg.model.sync_batchnorm:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    task = build_task(cfg.model, cfg.eval, language_model=bundle.language_model or cfg.model.name == "gpt")
    return Workload(
        train=bundle.train, test=bundle.test, model=model, task=task,
        make_optimizer=lambda params, lr_scale: build_optimizer(cfg.optim, params, lr_scale),
        make_schedule=lambda optimizer, total: build_schedule(cfg.schedule, optimizer, total),
        description=bundle.description, collate=collate, model_build=build)


def model_build_args(bundle: DatasetBundle) -> dict[str, Any]:
    """What a built-in model needs to know from the data (saved in snapshots for load_model)."""
    return {"input_shape": list(bundle.input_shape) if bundle.input_shape is not None else None,
            "num_classes": bundle.num_classes, "vocab_size": bundle.vocab_size, "block_size": bundle.block_size}


def identity_of(model: nn.Module, train: Any, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Fingerprint parts of a script's own objects: model class and parameter shapes, dataset size."""
    shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
    digest = hashlib.sha256(json.dumps(shapes, sort_keys=True).encode()).hexdigest()[:16]
    out: dict[str, Any] = {"model": f"{type(model).__module__}.{type(model).__qualname__}:{digest}",
                           "data": f"{type(train).__qualname__}:{len(train)}"}
    if optimizer is not None:
        out["optim"] = type(optimizer).__qualname__
    return out


def check(workload: Workload, device: torch.device, micro_size: int) -> None:
    """Collate the first items and call the loss on them (no gradient, the model in eval mode, so
    that nothing — BatchNorm statistics, random generators — changes); a ConfigError if wrong."""
    n = max(1, min(micro_size, 2, workload.num_train))
    batch = to_device(collate_items(workload.train, list(range(n)), workload.collate), device)
    model = workload.model
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            workload.task.compute_loss(model, batch, n)
    except ConfigError:
        raise
    except Exception as exc:  # the user's model or loss failed on a real batch: say where
        first = (str(exc).splitlines() or [""])[0][:300]
        raise ConfigError(workload.task.where, f"failed on a batch of dataset items 0..{n - 1} "
                          f"({type(exc).__name__}: {first})",
                          "Check that the loss function matches the items the dataset returns (and data.collate)") from exc
    finally:
        model.train(was_training)


def check_batchnorm(model: nn.Module, device: torch.device, batch: BatchConfig, largest: int, current: int,
                    num_train: int, partial: bool) -> None:
    """A model with BatchNorm in training mode needs >= 2 samples per rank and micro-step (BatchNorm
    refuses one), at every world size this job may reach; SyncBatchNorm needs CUDA."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if any(isinstance(m, nn.SyncBatchNorm) for m in norms) and device.type != "cuda":
        raise ConfigError("model.sync_batchnorm", f"needs CUDA devices (torch's SyncBatchNorm refuses {device.type} "
                          "tensors)", "Set model.sync_batchnorm: false on CPUs")
    if not norms or not model.training or any(isinstance(m, nn.SyncBatchNorm) for m in norms):
        return
    for world in sorted({current, largest}):
        global_size = batch.global_size if batch.global_size is not None else (batch.per_rank_size or 1) * world
        if smallest_micro_batch(global_size, world, batch.micro_size) == 1:
            raise ConfigError(
                "batch.global_size", f"at world size {world} (the most this job may reach is {largest}: --nnodes MAX x "
                f"workers per node) some rank gets 1 sample in a micro-step of the global batch of {global_size}, "
                "and the model's BatchNorm layers need at least 2 in training mode",
                f"Raise batch.global_size to at least {2 * world}, lower the largest --nnodes, raise or drop "
                "batch.micro_size, or set model.sync_batchnorm: true (GPUs)")
        rest = num_train % global_size
        if partial and rest and smallest_micro_batch(rest, world, batch.micro_size) == 1:
            raise ConfigError(
                "data.partial_batch", f"the last step of an epoch holds {rest} samples (the dataset's {num_train} "
                f"modulo the global batch of {global_size}): at world size {world} some rank gets 1, and the model's "
                "BatchNorm layers need at least 2 in training mode",
                "Set data.partial_batch: drop (those samples wait for the next epoch's order)")


def smallest_micro_batch(count: int, world: int, micro_size: int | None) -> int:
    """The fewest samples (> 0) any rank runs through the model at once when ``count`` samples of a
    step are shared by ``world`` ranks (as elastic_runner.data.layout lays them out); 0 if none gets any."""
    shares = [count // world + (1 if r < count % world else 0) for r in range(world)]
    accumulation = math.ceil(max(shares) / (micro_size or max(shares) or 1)) or 1
    sizes = [len(part) for share in shares for part in split_even(range(share), accumulation) if len(part)]
    return min(sizes, default=0)
