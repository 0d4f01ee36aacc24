"""One optimizer step's mathematics: forward, loss, backward, gradient sync, update.

:meth:`TrainStep.compute` runs the micro-batches of this rank's share (the task's loss on each
batch as collated, gradient sync on the last one only) and turns the gradients into the exact mean
over the global batch (:mod:`.gradients`); :meth:`TrainStep.update` applies them. The loop calls
the two around the step lock; what is recorded about a step (audit, metrics, goodput) is not here.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from ..data.layout import BatchLayout, split_even
from ..data.sampler import StepPlan
from ..workload.tasks import Task
from . import injected_faults
from .gradients import StepGradients
from .parallel import GradientSync
from .parts import TrainingParts
from .rng import seed_step, step_seed
from .step_clock import StepClock

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class StepResult:
    loss: torch.Tensor  #: float64 (this rank's (weighted) loss sum, its weight or sample count)
    apply: bool  #: False: a non-finite gradient that ``train.on_nonfinite: skip`` skips
    data_wait_s: float  #: time spent waiting for batches


class TrainStep:
    """The arithmetic of a step on one rank; every rank runs the same collectives in the same order."""

    def __init__(self, parts: TrainingParts, sync: GradientSync, task: Task, layout: BatchLayout,
                 gradients: StepGradients, *, seed: int, rank: int, device: torch.device, precision: str,
                 timed: bool = True) -> None:
        self.parts, self.sync, self.task, self.layout, self.gradients = parts, sync, task, layout, gradients
        self.seed, self.rank, self.device = seed, rank, device
        self.autocast_dtype = AUTOCAST.get(precision)
        self._training = False
        self.clock = StepClock(device, timed)  #: this rank's local time per step (recovery.straggler_ratio)
        self.poisoned = False  #: the next micro-batch's loss is made NaN (the chaos tool's nan-batch only)
        #: Each step's compute is stretched to this many times its length (the chaos tool's slow-node only: 1 else).
        self.slowed_by = 1.0

    def compute(self, step: int, plan: StepPlan, batches: Iterator[Any]) -> StepResult:
        """Forward and backward over this rank's micro-batches, the gradient sync after the last one; the
        gradient is then the mean over the global batch."""
        self.clock.begin()
        if self.slowed_by > 1.0 and self.device.type == "cuda":  # (the chaos tool's slow-node only: see stretch)
            torch.cuda.current_stream(self.device).synchronize()
        began = time.perf_counter()
        seed_step(step_seed(self.seed, step, self.rank), self.device)  # dropout, augmentation: as uninterrupted
        if not self._training:  # (a walk over every module: only after an evaluation switched it off)
            self.sync.module.train()
            self._training = True
        self.sync.begin_step()
        micro_lists = list(split_even(plan.indices, self.layout.accumulation))
        loss = torch.zeros(2, dtype=torch.float64, device=self.device)
        weighted, data_wait = None, 0.0
        for i, micro in enumerate(micro_lists):
            last = i == len(micro_lists) - 1
            with contextlib.nullcontext() if last else self.sync.no_sync():
                if micro:
                    t0 = time.perf_counter()
                    batch = next(batches)
                    data_wait += time.perf_counter() - t0
                    with self.autocast():
                        losses, weights = self.task.compute_loss(self.sync.module, batch, len(micro))
                        if self.poisoned:  # the chaos tool's nan-batch (training.injected_faults): this step only
                            losses, self.poisoned = losses * float("nan"), False
                        scaled = self.gradients.loss_for_backward(losses, weights, plan.global_count, self.task.where)
                    weighted = weights is not None
                    _add_loss_sums(loss, losses, weights, len(micro))
                    self.backward(scaled)
                else:
                    self.sync.empty_micro_step()  # no sample for this rank here: it joins the sync all the same
        if self.slowed_by > 1.0:
            self.stretch(began)
        self.clock.waiting()  # from here to the update: the other ranks' time, not this rank's
        self.sync.finish()  # every gradient is now the sum over the ranks
        apply = self.gradients.finish(step, weighted, loss, self.parts.optimizer)
        return StepResult(loss, apply, data_wait)

    def skip(self, plan: StepPlan, batches: Iterator[Any]) -> StepResult:
        """A step skipped by rule (every rank skips it alike: no collective): this rank's micro-batches taken from
        ``batches`` so that the next step gets its own, nothing computed, nothing to apply. Not timed (the straggler
        clock drops a step without its first marks)."""
        t0 = time.perf_counter()
        for micro in split_even(plan.indices, self.layout.accumulation):
            if micro:
                next(batches)
        loss = torch.zeros(2, dtype=torch.float64, device=self.device)
        return StepResult(loss, False, time.perf_counter() - t0)

    def stretch(self, began: float) -> None:
        """The chaos tool's slow device: this step's compute so far, from ``began`` (a host time), made
        :attr:`slowed_by` times as long, before the gradient sync's wait (:func:`injected_faults.stretch`). On a GPU
        the host waited for the previous work at the step's start and waits for the step's kernels here (only while
        slowed: the step is to be slow), so that the time stretched is the device's; the idle device then shows the
        stretch between the clock's events as a slow GPU would."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        injected_faults.stretch(began, self.slowed_by)

    def backward(self, loss: torch.Tensor) -> None:
        scaler = self.parts.scaler
        (scaler.scale(loss) if scaler is not None else loss).backward()

    def update(self, result: StepResult) -> None:
        """Apply the gradient (unless skipped) and advance the schedule; the caller holds the step lock."""
        parts = self.parts
        self.clock.updating()
        if result.apply and parts.scaler is not None:
            parts.scaler.step(parts.optimizer)
            parts.scaler.update()
        elif result.apply:
            parts.optimizer.step()
        parts.scheduler.step()
        parts.optimizer.zero_grad(set_to_none=True)
        self.clock.end()

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def evaluating(self) -> None:
        """An evaluation switched the model to eval mode: the next step switches it back."""
        self._training = False


def _add_loss_sums(into: torch.Tensor, losses: torch.Tensor, weights: torch.Tensor | None, count: int) -> None:
    """Add one micro-batch's (loss sum, weight) to ``into``, for the logged loss: weighted by the task's weights if
    any (in place: no tensor is made per micro-batch)."""
    detached = losses.detach().double()
    if weights is None:
        into[0] += detached.sum()
        into[1] += count
    else:
        w = weights.detach().double()
        into[0] += (detached * w).sum()
        into[1] += w.sum()
