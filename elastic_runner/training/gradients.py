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
        """After the backward passes: normalise, clip, check. True when the update may be applied.

        ``weighted_here``: the form of this rank's losses this step (None: it had no sample);
        ``step_loss``: this rank's (weighted) loss sum and its weight (or sample count)."""
        # Sharded without clipping: each rank sees only its slice of the gradient, so whether it is finite is one
        # number summed over the ranks, sent with the weight sum where there is one (a NaN loss on any rank
        # reaches every slice through the sum; an overflow may reach one slice only).
        local_bad = self._slice_not_finite() if self.sharded and self.clip_norm is None else None
        bad_ranks = 0.0
        if self.weighted is None or self.weighted:
            total, bad_ranks = self._global_weight(weighted_here, float(step_loss[1]) if weighted_here else 0.0,
                                                   local_bad or 0.0)
            if self.weighted and total > 0:
                grads = [p.grad for p in self.params if p.grad is not None]
                torch._foreach_mul_([g.to_local() for g in grads] if self.sharded else grads, 1.0 / total)
        elif local_bad is not None:
            bad_ranks = self.dist.sum_floats([local_bad])[0]
        if self.scaler is not None and self.clip_norm is not None:
            self.scaler.unscale_(optimizer)
        if local_bad is not None:
            norm = torch.tensor(math.nan if bad_ranks else 0.0)
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
        if self.scaler is not None or bool(torch.isfinite(norm)):
            return True
        # Every rank sees the same non-finite gradient (the sync summed it): all take this path.
        losses = self.dist.all_gather_object(float(step_loss[0]))
        bad = [r for r, value in enumerate(losses) if not math.isfinite(value)]
        if self.on_nonfinite == "stop":
            raise NonFiniteGradient(step, bad, losses[bad[0]] if bad else float("nan"))
        optimizer.zero_grad(set_to_none=True)
        return False

    def _slice_not_finite(self) -> float:
        """1.0 if this rank's slice of the gradient holds a NaN or inf (no collective), else 0.0."""
        grads = [p.grad.to_local() for p in self.params if p.grad is not None]
        if not grads:
            return 0.0
        return 0.0 if bool(torch.isfinite(torch.stack(torch._foreach_norm(grads))).all()) else 1.0

    def _global_weight(self, weighted_here: bool | None, local_weight: float, also: float = 0.0) -> tuple[float, float]:
        """The weight summed over the ranks, and ``also`` summed with it (in the same collective)."""
        if self.weighted is None:
            flags = self.dist.sum_floats([1.0 if weighted_here else 0.0, 1.0 if weighted_here is False else 0.0,
                                          local_weight, also])
            if flags[0] and flags[1]:
                raise LossOutputError("model.loss", "returns (losses, weights) on some ranks and losses alone on others",
                                      "Return the same form on every rank")
            self.weighted = bool(flags[0])
            return flags[2], flags[3]
        total, summed = self.dist.sum_floats([local_weight, also])
        return total, summed
