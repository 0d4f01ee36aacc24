"""How the model is replicated over the ranks and how its gradients are synchronised (DDP).

:func:`wrap` puts the model in ``DistributedDataParallel`` (also at world size 1: one code path);
:class:`Replica` is the module it wraps, so that a rank without a sample in a micro-step still
joins the gradient all-reduce (:data:`EMPTY`). The model itself never imports ``torch.distributed``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch


def wrap(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """DDP around the model (also at world size 1: one code path).

    Buffers are not broadcast before every forward (DDP's default): the loop makes every rank
    take rank 0's buffers once per step, at the step boundary (Checkpointer.sync_buffers), so
    that the state a survivor keeps is the job's. The gradient is the same either way (a
    training-mode forward normalises by the batch's own statistics). ``ddp(EMPTY)`` joins the
    gradient sync of a micro-step in which this rank has no sample (see :class:`Replica`).
    """
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [device.index] if device.type == "cuda" else None
    # torch 2.13 renamed the switch (broadcast_buffers is deprecated there; older torch lacks the new name).
    accepted = inspect.signature(DistributedDataParallel.__init__).parameters
    no_forward_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in accepted else {"broadcast_buffers": False}
    return DistributedDataParallel(Replica(model), device_ids=device_ids, **no_forward_sync)


#: The input of a micro-step in which this rank has no sample: ``ddp(EMPTY)`` is a zero loss.
EMPTY = object()


class Replica(torch.nn.Module):
    """The module DDP wraps: the model, or a zero loss over its parameters for :data:`EMPTY`.

    A rank without samples in a micro-step must still join the gradient all-reduce, with zero
    gradients and without running the model: a user's model or loss need not handle an empty
    batch, and BatchNorm refuses one in training mode. The zero loss reaches every parameter, so
    DDP's hooks fire exactly as after a real forward. Attribute lookups the model answers (a loss
    function reading ``model.module.config``) are passed through.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and args[0] is EMPTY and not kwargs:
            return sum(p.sum() for p in self.model.parameters() if p.requires_grad) * 0.0
        return self.model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("model"), name)
