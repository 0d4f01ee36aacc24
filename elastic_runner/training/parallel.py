"""How the model is replicated over the ranks and how its gradients are summed: the same arithmetic every step.

:class:`OrderedGradientSync` (``dist.gradient_sync: ordered``, the default) sums the gradients over the
ranks in a layout fixed by the model alone: buckets of parameters in reverse registration order (the
gradients of the last layers are ready first), each bucket cut at :data:`BUCKET_BYTES` and kept to one
dtype and device, always reduced in the same order with the same sizes. A bucket is sent as soon as the
backward pass has produced all of its gradients (overlapping communication with the rest of the
backward pass) but never before the buckets ahead of it, so every rank issues the same collectives in
the same order. gloo's and NCCL's ring sums each element in an order that depends only on the world
size and where the element sits in its buffer — so a process that resumes a run does exactly the
additions of the process that stopped, at every world size. torch's ``DistributedDataParallel`` does
not: a new wrapper's first iteration runs an initial bucket layout of its own before it rebuilds its
buckets in gradient-ready order, and every resume starts with a new wrapper (below three ranks a sum
of two is the same in either order, which is why that went unseen).

The sum is a SUM (never gloo's AVG, pytorch#162338): the loss each rank backpropagates is already
scaled so that the sum is the exact mean over the global batch (:mod:`.gradients`). A rank without a
sample in the last micro-step joins with the gradients it has (or zeros); a parameter that took no part
in a step reduces zeros, as on every other rank.

``dist.gradient_sync: ddp`` keeps torch's DDP (:class:`TorchDDPSync`), for comparison and for models
that rely on a DDP feature; it is exact in distribution but bitwise on resume only below three ranks.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterator, Protocol

import torch
import torch.distributed as tdist
from torch import nn

from ..dist import broadcast_coalesced

#: The largest bucket, in bytes (DDP's default bucket cap, 25 MiB), and the first one's (DDP's: 1 MiB, so that
#: communication starts early in the backward pass).
BUCKET_BYTES = 25 << 20
FIRST_BUCKET_BYTES = 1 << 20


class GradientSync(Protocol):
    """What a step needs from the replication: the module the loss calls, and the gradient sum."""

    module: nn.Module  #: what the task's loss calls (the model, or DDP's wrapper)
    #: The factor by which the sync divides the summed gradients (DDP averages over the world: W; a sum: 1).
    averages_over: int

    def begin_step(self) -> None: ...
    def no_sync(self) -> contextlib.AbstractContextManager[None]: ...
    def empty_micro_step(self) -> None: ...
    def finish(self) -> None: ...
    def close(self) -> None: ...


class _Bucket:
    """Consecutive parameters whose gradients live in one flat buffer (each ``.grad`` a view of it during a step,
    so the backward pass accumulates into it and nothing is copied to send or to read the sum)."""

    def __init__(self, index: int, params: list[nn.Parameter]) -> None:
        self.index = index
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.buffer = torch.zeros(self.numel, dtype=params[0].dtype, device=params[0].device)
        self.views: list[torch.Tensor] = []
        offset = 0
        for p in params:
            self.views.append(self.buffer[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.ready = 0
        self.work: Any = None


class OrderedGradientSync:
    """Sums the gradients of ``model`` over the process group in a fixed bucket layout; see the module docstring.

    Built once per attempt, after the model's parameters and buffers are the job's (it broadcasts rank 0's,
    as DDP does). :meth:`no_sync` around the micro-steps before the last; :meth:`finish` after the last
    backward pass: then every ``.grad`` is the sum over the ranks.
    """

    averages_over = 1

    def __init__(self, model: nn.Module, *, bucket_bytes: int = BUCKET_BYTES,
                 first_bucket_bytes: int = FIRST_BUCKET_BYTES, group: Any = None, forward: nn.Module | None = None) -> None:
        self.module = forward if forward is not None else model
        self.group = group
        self.world = tdist.get_world_size(group)
        seen: set[int] = set()
        params = []
        for p in model.parameters():
            if p.requires_grad and id(p) not in seen:  # a shared (tied) parameter is summed once
                seen.add(id(p))
                params.append(p)
        self.buckets = _layout(list(reversed(params)), bucket_bytes, first_bucket_bytes)
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._sync = True
        self._next = 0  #: the first bucket not yet sent in this backward pass
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in params]
        _broadcast_state(model, group)

    def begin_step(self) -> None:
        """Before a step's first backward pass: every gradient a zeroed view of its bucket (the optimizer sets
        them to None after each update), so the backward passes accumulate straight into what is sent."""
        if self.world == 1:
            return
        for bucket in self.buckets:
            bucket.buffer.zero_()
            for p, view in zip(bucket.params, bucket.views):
                if p.grad is not None and not _is(p.grad, view):
                    view.copy_(p.grad)  # a gradient left from before (a user's loop that does not set it to None)
                p.grad = view

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes in here accumulate locally (the micro-steps before a step's last)."""
        before, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = before

    def empty_micro_step(self) -> None:
        """No sample for this rank in this micro-step: nothing to run; :meth:`finish` sends what it has."""

    def finish(self) -> None:
        """After the step's last backward pass: send what is left (in order), wait, write the sums back."""
        if self.world > 1:
            self._send_ready(force=True)
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
                bucket.work = None
            bucket.ready = 0
        self._next = 0

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    # -- while the backward pass runs -------------------------------------------------------------------------

    def _grad_ready(self, param: torch.Tensor) -> None:
        if not self._sync or self.world == 1:
            return
        bucket = self._bucket_of[id(param)]
        bucket.ready += 1
        if bucket.ready == len(bucket.params) and bucket.index == self._next:
            self._send_ready(force=False)

    def _send_ready(self, force: bool) -> None:
        """Send buckets in index order: each one complete (or, with ``force``, as it is) and none out of turn."""
        while self._next < len(self.buckets):
            bucket = self.buckets[self._next]
            if not force and bucket.ready < len(bucket.params):
                return
            _gather(bucket)
            bucket.work = tdist.all_reduce(bucket.buffer, op=tdist.ReduceOp.SUM, group=self.group, async_op=True)
            self._next += 1


class TorchDDPSync:
    """torch's ``DistributedDataParallel`` (``dist.gradient_sync: ddp``): it averages over the world."""

    def __init__(self, model: nn.Module, device: torch.device, forward: nn.Module | None = None) -> None:
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [device.index] if device.type == "cuda" else None
        # Buffers are not broadcast before every forward (DDP's default): the loop makes every rank take
        # rank 0's buffers once per step, at the step boundary (Checkpointer.sync_buffers). torch 2.13 renamed
        # the switch (broadcast_buffers is deprecated there; older torch lacks the new name).
        accepted = inspect.signature(DistributedDataParallel.__init__).parameters
        no_forward_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in accepted else {"broadcast_buffers": False}
        self.module = DistributedDataParallel(Replica(model, forward), device_ids=device_ids, **no_forward_sync)
        self.averages_over = tdist.get_world_size()

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return self.module.no_sync()  # type: ignore[operator,no-any-return]

    def empty_micro_step(self) -> None:
        """Join DDP's all-reduce with zero gradients, without running the model (see :class:`Replica`)."""
        self.module(EMPTY).backward()

    def begin_step(self) -> None:
        """DDP keeps its own buckets."""

    def finish(self) -> None:
        """DDP has averaged the gradients during the last backward pass."""

    def close(self) -> None:
        pass


def replicate(model: nn.Module, device: torch.device, how: str = "ordered",
              forward: nn.Module | None = None) -> OrderedGradientSync | TorchDDPSync:
    """The model replicated on every rank (rank 0's parameters and buffers), with its gradient sync. ``forward``:
    what the loss calls instead of ``model`` (its compiled wrapper, :mod:`.compiling`); the gradients are
    ``model``'s all the same."""
    if how == "ddp":
        return TorchDDPSync(model, device, forward)
    return OrderedGradientSync(model, forward=forward)


# -- the fixed layout ------------------------------------------------------------------------------------------


def _layout(params: list[nn.Parameter], bucket_bytes: int, first_bucket_bytes: int | None = None) -> list[_Bucket]:
    """Consecutive runs of ``params`` of one dtype and device, cut at ``first_bucket_bytes`` for the first bucket
    and ``bucket_bytes`` after it (a larger parameter is a bucket of its own)."""
    buckets: list[_Bucket] = []
    current: list[nn.Parameter] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        cap = first_bucket_bytes if first_bucket_bytes is not None and not buckets else bucket_bytes
        if current and (size + nbytes > cap or (p.dtype, p.device) != (current[0].dtype, current[0].device)):
            buckets.append(_Bucket(len(buckets), current))
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(_Bucket(len(buckets), current))
    return buckets


def _gather(bucket: _Bucket) -> None:
    """Every gradient of the bucket in its buffer: a parameter without a gradient this step sends zeros, one whose
    gradient autograd replaced (not our view) is copied in; afterwards each ``.grad`` is its view of the sum."""
    for p, view in zip(bucket.params, bucket.views):
        if p.grad is None:
            view.zero_()
        elif not _is(p.grad, view):
            view.copy_(p.grad)
        p.grad = view


def _is(grad: torch.Tensor, view: torch.Tensor) -> bool:
    """``grad`` is ``view`` (the same memory and shape), not a tensor autograd put in its place."""
    return grad.data_ptr() == view.data_ptr() and grad.shape == view.shape and grad.stride() == view.stride()


def _broadcast_state(model: nn.Module, group: Any) -> None:
    """Every rank takes rank 0's parameters and buffers (as DDP's constructor does)."""
    if tdist.get_world_size(group) > 1:
        src = tdist.get_global_rank(group, 0) if group is not None else 0
        broadcast_coalesced(list(model.parameters()) + list(model.buffers()), src, group)


#: The input of a micro-step in which this rank has no sample: ``ddp(EMPTY)`` is a zero loss.
EMPTY = object()


class Replica(torch.nn.Module):
    """The module DDP wraps: the model, or a zero loss over its parameters for :data:`EMPTY`.

    A rank without samples in a micro-step must still join DDP's gradient all-reduce, with zero
    gradients and without running the model: a user's model or loss need not handle an empty
    batch, and BatchNorm refuses one in training mode. The zero loss reaches every parameter, so
    DDP's hooks fire exactly as after a real forward. Attribute lookups the model answers (a loss
    function reading ``model.module.config``) are passed through.
    """

    def __init__(self, model: torch.nn.Module, forward: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.model = model
        # Not a submodule: the compiled wrapper holds the same parameters under other names.
        self.__dict__["_forward"] = forward if forward is not None else model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and args[0] is EMPTY and not kwargs:
            return sum(p.sum() for p in self.model.parameters() if p.requires_grad) * 0.0
        return self.__dict__["_forward"](*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("model"), name)
