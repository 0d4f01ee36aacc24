"""What a resumed state adapts to this attempt: the run's planned length, the schedule, the learning rate.

A snapshot was written by an attempt with its own world size and perhaps an older config. The
number of steps left follows the sampler's position and the *current* global batch; a built-in
schedule follows the current ``schedule`` section; with ``batch.scale_lr: linear`` the restored
learning rates are rescaled from the old world size to this one.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..config import Config
from ..workload.optim import ScheduleFactor


def planned_total_steps(cfg: Config, sampler: Any, done: int) -> int:
    """The step the run ends at, from where it stands now: ``done`` steps taken, the
    sampler's position, and the *current* global batch (with batch.per_rank_size it
    changes with the world size, so a fixed epochs * steps_per_epoch would be wrong)."""
    limits = []
    if cfg.train.max_steps is not None:
        limits.append(cfg.train.max_steps)
    if cfg.train.epochs is not None and hasattr(sampler, "steps_for_epochs"):  # one of data.sources, end to end
        limits.append(done + sampler.steps_for_epochs(cfg.train.epochs))
    elif cfg.train.epochs is not None:
        if sampler.epoch >= cfg.train.epochs:
            limits.append(done)
        else:
            later_epochs = cfg.train.epochs - sampler.epoch - 1
            limits.append(done + sampler.steps_left_in_epoch() + later_epochs * sampler.steps_per_epoch())
    return max(done, min(limits)) if limits else math.inf  # type: ignore[return-value]


def refresh_schedule(scheduler: Any, cfg: Any, total_steps: int) -> None:
    """A restored built-in schedule follows the current config (e.g. a longer train.max_steps).

    LambdaLR restores its factor's fields from the snapshot; the run length and
    warm-up of *this* configuration are what the remaining steps must follow.
    """
    for factor in getattr(scheduler, "lr_lambdas", []):
        if isinstance(factor, ScheduleFactor):
            factor.total_steps = max(1, total_steps)
            factor.warmup_steps = cfg.warmup_steps
            factor.step_size = cfg.step_size
            factor.gamma = cfg.gamma
            factor.min_lr_ratio = cfg.min_lr_ratio


def rescale_lr(optimizer: torch.optim.Optimizer, scheduler: Any, old: float, new: float) -> None:
    """batch.scale_lr: linear — the restored rates were scaled for the old world size."""
    if not old or old == new:
        return
    ratio = new / old
    for group in optimizer.param_groups:
        group["lr"] *= ratio
        if "initial_lr" in group:
            group["initial_lr"] *= ratio
    if hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = [lr * ratio for lr in scheduler.base_lrs]
