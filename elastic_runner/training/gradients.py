"""From the gradients of one step's backward passes to the update: exact mean, clipping, finiteness.

The gradient sync (:mod:`.parallel`) sums the gradients over the W ranks (torch's DDP, if chosen,
averages them: the factor ``A`` below is W for DDP and 1 for a sum). Each rank backpropagates
``sum(losses) * A / global_count`` for per-sample losses, so the synchronised gradient is the mean
over the global batch. A weighted loss ``(losses, weights)`` cannot be normalised before its weights
are known on every rank: each rank backpropagates ``sum(weights * losses) * A``, and once the
gradients are synchronised one all-reduce of the weight sum gives the global weight, by which the
gradient is divided. Either way the gradient is the exact (weighted) mean over the global batch,
whatever the world size and however a rank's share is split into micro-batches.

Which of the two a loss is, every rank learns in the first step of an attempt (one all-reduce, so
that a rank whose micro-batches were all empty learns it too); after that a per-sample loss costs
no collective and a weighted one one scalar all-reduce per step.

Then the gradient is clipped (``optim.grad_clip_norm``) and checked: a non-finite gradient (a NaN
or inf loss on any rank reaches every rank through the gradient sum, so all ranks agree without
another collective) stops the run (:class:`NonFiniteGradient`) or, with
``train.on_nonfinite: skip``, skips the update on every rank. With fp16 the gradient scaler skips
such steps itself.

**No host synchronisation in a step** (issue 49): on a GPU every read of a device value into the host —
``bool(tensor)``, ``.item()``, a weight sum as a Python float — drains the stream and stalls the next
kernels. So the weight sum is all-reduced as a device tensor and divided out on the device, and the
finiteness of the gradient is noted on the device (the first non-finite step, and this rank's loss there)
and read by :meth:`StepGradients.check` only where the loop reads the device anyway: at logging steps,
before any snapshot or node-memory capture, at a stop and at the end. With ``stop`` (the default) the
run still stops at the step that diverged, naming it and the ranks whose loss was not finite, and no
snapshot is taken of a state after it. ``skip`` must decide before the update: an optimizer that skips
on the device (torch's fused Adam, AdamW and SGD take a ``found_inf`` flag) costs no sync; any other
reads the flag at every step. The first step of an attempt reads once which form the loss has.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..snapshot.shards import is_dtensor
from ..workload.tasks import LossOutputError


class NonFiniteGradient(RuntimeError):
    """The gradient of a step is NaN or inf; ``ranks``: those whose own loss was not finite."""

    def __init__(self, step: int, ranks: list[int], value: float) -> None:
        self.step, self.ranks, self.value = step, ranks, value
        who = f"the loss of rank {', '.join(map(str, ranks))} was {value}" if ranks else "the gradient overflowed"
        super().__init__(
            f"step {step}: {who}; stopping (exit status 3, not restarted). The snapshots stay as they were; "
            "resume from the newest with a lower optim.lr or optim.grad_clip_norm, or set "
            "train.on_nonfinite: skip to skip such steps")


class NonFiniteRollback(Exception):
    """``train.on_nonfinite: rollback``: the gradient of ``step`` was not finite; every rank leaves the attempt and
    its process runs the next one, resumed from the newest snapshot (before ``step``) with ``step`` skipped."""

    def __init__(self, step: int, ranks: list[int], line: str) -> None:
        self.step, self.ranks = step, ranks
        super().__init__(line)


class StepGradients:
    def __init__(self, dist: Any, model: nn.Module, clip_norm: float | None, on_nonfinite: str, scaler: Any,
                 averages_over: int = 1) -> None:
        self.dist = dist
        self.averages_over = averages_over  #: what the gradient sync divides by (DDP: the world size)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.clip_norm = clip_norm
        self.on_nonfinite = on_nonfinite
        self.scaler = scaler
        #: Whether the loss is weighted; None until the first step of this attempt tells.
        self.weighted: bool | None = None
        #: FSDP/HSDP: the gradients are DTensors, each rank holding a shard (:mod:`.sharding`).
        self.sharded = any(is_dtensor(p) for p in self.params)
        device = self.params[0].device if self.params else torch.device("cpu")
        #: ``stop``: the first step whose gradient was not finite (-1: none), and this rank's loss there (device).
        self._first_bad = torch.full((), -1, dtype=torch.int64, device=device)
        self._bad_loss = torch.zeros((), dtype=torch.float64, device=device)
        #: ``skip`` with a fused optimizer: steps skipped on the device (read at logging steps).
        self.skipped = torch.zeros((), dtype=torch.int64, device=device)
        self._skipped_seen = 0
        #: Until a logging step reads it: how many ranks returned weighted and unweighted losses (device sums).
        self._form: torch.Tensor | None = None
        #: ``skip`` read on the host: (step, ranks whose loss was not finite) of each skipped step, to be said.
        self.skipped_steps: list[tuple[int, list[int]]] = []

    def loss_for_backward(self, losses: torch.Tensor, weights: torch.Tensor | None, global_count: int,
                          where: str) -> torch.Tensor:
        form = weights is not None
        if self.weighted is not None and form != self.weighted:
            raise LossOutputError(where, "returned " + ("(losses, weights)" if form else "losses without weights")
                                  + " after returning " + ("(losses, weights)" if self.weighted else "losses only"),
                                  "Return the same form for every batch")
        factor = self.averages_over
        if weights is None:
            return losses.sum() * (factor / global_count)
        return (losses * weights.detach()).sum() * factor

    def finish(self, step: int, weighted_here: bool | None, step_loss: torch.Tensor,
               optimizer: torch.optim.Optimizer) -> bool:
        """After the backward passes: normalise, clip, check. True when the update may be applied (see the module
        docstring for what is decided on the device and what on the host).

        ``weighted_here``: the form of this rank's losses this step (None: it had no sample);
        ``step_loss``: this rank's (weighted) loss sum and its weight (or sample count), on the device."""
        # Sharded without clipping: each rank sees only its slice of the gradient, so whether it is finite is one
        # number summed over the ranks, sent with the weight sum where there is one (a NaN loss on any rank
        # reaches every slice through the sum; an overflow may reach one slice only).
        local_bad = self._slice_not_finite() if self.sharded and self.clip_norm is None else None
        bad_ranks: torch.Tensor | None = None
        if self.weighted is None or self.weighted or local_bad is not None:
            # One small all-reduce on the device: the weight sum, which form each rank's loss had (until a logging
            # step has read it: see check), and how many ranks' gradient slices were not finite.
            zero = torch.zeros((), dtype=torch.float64, device=step_loss.device)
            sums = torch.stack([step_loss[1].to(torch.float64) if weighted_here else zero,
                                zero + (1.0 if weighted_here else 0.0), zero + (1.0 if weighted_here is False else 0.0),
                                local_bad.to(torch.float64).to(step_loss.device) if local_bad is not None else zero])
            self.dist.all_reduce_sum(sums)
            if self.weighted is None:
                self._form = sums[1:3]
                self._divide(torch.where(sums[1] > 0, sums[0], 0.0))  # an unweighted loss is left as it is
            elif self.weighted:
                self._divide(sums[0])
            bad_ranks = sums[3]
        if self.scaler is not None and self.clip_norm is not None:
            self.scaler.unscale_(optimizer)
        if local_bad is not None:
            assert bad_ranks is not None
            norm = torch.where(bad_ranks.to(step_loss.device) > 0, math.nan, 0.0)
        elif self.sharded:  # DTensor gradients: the norm over every rank's slice (one collective), as a plain number
            from .sharding import global_norm

            norm = global_norm([p.grad for p in self.params if p.grad is not None])
            if self.clip_norm is not None:
                nn.utils.clip_grads_with_norm_(self.params, self.clip_norm, norm)
        elif self.clip_norm is not None:
            norm = nn.utils.clip_grad_norm_(self.params, self.clip_norm)
        elif self.scaler is None:
            grads = [p.grad for p in self.params if p.grad is not None]
            norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))) if grads else torch.zeros(())
        if self.scaler is not None:
            return True  # fp16: the gradient scaler skips the step itself
        finite = torch.isfinite(norm)
        if self.on_nonfinite in ("stop", "rollback"):  # (rollback: the loop rolls back where stop would stop)
            self._note(step, finite, step_loss[0])
            return True
        if getattr(optimizer, "_step_supports_amp_scaling", False) and getattr(optimizer, "defaults", {}).get("fused"):
            optimizer.found_inf = (~finite).to(torch.float32)  # type: ignore[attr-defined]  # skipped on the device
            self.skipped = self.skipped + (~finite).to(torch.int64)
            return True
        if bool(finite):  # skip, with an optimizer that cannot skip on the device: read here, every step
            return True
        losses = self.dist.all_gather_object(float(step_loss[0]))
        optimizer.zero_grad(set_to_none=True)
        self.skipped_steps.append((step, [r for r, value in enumerate(losses) if not math.isfinite(value)]))
        return False

    def _divide(self, total: torch.Tensor) -> None:
        """Every gradient divided by the global weight ``total`` (on the device; a total of 0: left as it is)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return
        local = [g.to_local() for g in grads] if self.sharded else grads
        scale = torch.where(total > 0, 1.0 / total.clamp(min=1e-300), 1.0).to(local[0].device, local[0].dtype)
        torch._foreach_mul_(local, scale)

    def _note(self, step: int, finite: torch.Tensor, loss: torch.Tensor) -> None:
        """Remember, on the device, the first step whose gradient was not finite, and this rank's loss there."""
        first_now = (~finite) & (self._first_bad < 0)
        self._first_bad = torch.where(first_now, step, self._first_bad)
        self._bad_loss = torch.where(first_now, loss.to(torch.float64), self._bad_loss)

    def check(self) -> None:
        """Read what :meth:`finish` noted and stop the run at the step that diverged, naming the ranks whose own loss
        was not finite there: a host sync and, once diverged, a collective — call it at the same steps on every rank
        (the logging steps), where the loop reads the device anyway."""
        if self.weighted is None and self._form is not None:  # which form the loss has, from the first steps' sums
            weighted, unweighted = self._form.tolist()
            if weighted and unweighted:
                raise LossOutputError("model.loss", "returns (losses, weights) on some ranks and losses alone on "
                                      "others", "Return the same form on every rank")
            self.weighted = bool(weighted) if weighted or unweighted else None
        first = int(self._first_bad)
        if first < 0:
            return
        losses = self.dist.all_gather_object(float(self._bad_loss))
        bad = [r for r, value in enumerate(losses) if not math.isfinite(value)]
        raise NonFiniteGradient(first, bad, losses[bad[0]] if bad else float("nan"))

    def newly_skipped(self) -> int:
        """Steps skipped on the device (``skip`` with a fused optimizer) since the last call: read at logging steps."""
        total = int(self.skipped)
        new, self._skipped_seen = total - self._skipped_seen, total
        return new

    def first_nonfinite(self) -> int | None:
        """The first step of this attempt whose gradient was not finite, or None (a host sync: not for a step)."""
        first = int(self._first_bad)
        return first if first >= 0 else None

    def diverged(self) -> bool:
        """Whether a step of this attempt had a non-finite gradient (a host sync, no collective: for a capture that
        one rank decides alone, which must never keep a diverged state)."""
        return int(self._first_bad) >= 0

    def stop_here(self) -> None:
        """Stop at the step that diverged with what this rank knows (a stop or a park that one rank decides)."""
        mine = float(self._bad_loss)
        raise NonFiniteGradient(int(self._first_bad), [] if math.isfinite(mine) else [self.dist.rank], mine)

    def _slice_not_finite(self) -> torch.Tensor:
        """1.0 if this rank's slice of the gradient holds a NaN or inf, else 0.0 (on the device; no collective)."""
        grads = [p.grad.to_local() for p in self.params if p.grad is not None]
        if not grads:
            return torch.zeros(())
        return (~torch.isfinite(torch.stack(torch._foreach_norm(grads))).all()).to(torch.float64)
