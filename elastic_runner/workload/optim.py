"""Optimizers and learning-rate schedules from config (built-in or import path)."""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from ..config import ConfigError, OptimConfig, ScheduleConfig
from ..config.imports import call, resolve


def build_optimizer(cfg: OptimConfig, params: Iterable[torch.nn.Parameter], lr_scale: float = 1.0) -> torch.optim.Optimizer:
    lr = cfg.lr * lr_scale
    extra: dict[str, Any] = dict(cfg.params)
    params = list(params)
    if cfg.name in ("sgd", "adamw") and not {"foreach", "fused"} & extra.keys() and any(map(_sharded, params)):
        # torch picks the per-tensor loop for sharded parameters (its multi-tensor kernels are chosen for plain
        # tensors only): one Python-level update per parameter, each op dispatched through DTensor — on a GPU the
        # step then waits for the CPU. torchtitan asks for foreach too; optim.params may still say otherwise.
        extra["foreach"] = True
    if cfg.name == "sgd":
        return call(torch.optim.SGD, {"lr": lr, "momentum": cfg.momentum, "weight_decay": cfg.weight_decay} | extra,
                    "optim.params", "sgd", params)
    if cfg.name == "adamw":
        return call(torch.optim.AdamW, {"lr": lr, "weight_decay": cfg.weight_decay} | extra, "optim.params", "adamw", params)
    factory = resolve(cfg.name, "optim.name")
    optimizer = call(factory, {"lr": lr} | extra, "optim.params", cfg.name, params)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError("optim.name", f"{cfg.name} returned {type(optimizer).__name__}, not a torch.optim.Optimizer", "Point optim.name at an Optimizer class")
    return optimizer


def _sharded(param: Any) -> bool:
    """A parameter sharded by FSDP2 (a DTensor; told apart without importing torch.distributed, which the model side
    does not import)."""
    return type(param).__name__ == "DTensor" and hasattr(param, "device_mesh")


class ScheduleFactor:
    """LR multiplier per step. A class (not a lambda) so LambdaLR can save it."""

    def __init__(self, kind: str, total_steps: int, warmup_steps: int, step_size: int, gamma: float, min_lr_ratio: float) -> None:
        self.kind = kind
        self.total_steps = max(1, total_steps)
        self.warmup_steps = warmup_steps
        self.step_size = step_size
        self.gamma = gamma
        self.min_lr_ratio = min_lr_ratio

    def __call__(self, step: int) -> float:
        # LambdaLR calls with the number of scheduler steps taken so far; the
        # rate of optimizer step k (counted from 1) is factor(k - 1).
        if self.warmup_steps and step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return 1.0
        if self.kind == "step":
            return self.gamma ** (step // self.step_size)
        # cosine from the end of warm-up to total_steps
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_schedule(cfg: ScheduleConfig, optimizer: torch.optim.Optimizer, total_steps: int) -> LRScheduler:
    if cfg.name in ("constant", "step", "cosine"):
        factor = ScheduleFactor(cfg.name, total_steps, cfg.warmup_steps, cfg.step_size, cfg.gamma, cfg.min_lr_ratio)
        return LambdaLR(optimizer, factor)
    factory = resolve(cfg.name, "schedule.name")
    schedule = call(factory, dict(cfg.params), "schedule.params", cfg.name, optimizer, total_steps)
    if not isinstance(schedule, LRScheduler):
        raise ConfigError("schedule.name", f"{cfg.name} returned {type(schedule).__name__}, not an LRScheduler", "Return a torch.optim.lr_scheduler.LRScheduler")
    return schedule
