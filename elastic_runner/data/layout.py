"""How one optimizer step is split over ranks and micro-batches.

``batch.global_size`` is the optimisation contract. At world size W each rank
takes its share of the step's window (sizes differ by at most one when W does
not divide the global batch), splits it into ``accumulation`` micro-batches of
at most ``batch.micro_size`` samples, and scales its summed per-sample loss by
``1 / global_count``. The gradients are summed over the W ranks, so the applied
gradient is exactly the mean over the global batch, independent of W and of
how the share was split (DeepSpeed-elasticity's idea, without its restriction
to world sizes that divide the batch; :mod:`elastic_runner.training.gradients`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Sequence, TypeVar

from ..config import BatchConfig, ConfigError

T = TypeVar("T")


@dataclass(frozen=True)
class BatchLayout:
    world_size: int
    global_size: int
    micro_size: int  #: largest micro-batch any rank runs
    accumulation: int  #: micro-steps per optimizer step (equal on all ranks)
    shares: tuple[int, ...]  #: samples per rank in a full step
    lr_scale: float = 1.0

    @property
    def even(self) -> bool:
        return len(set(self.shares)) == 1

    def describe(self) -> str:
        share = str(self.shares[0]) if self.even else f"{min(self.shares)}-{max(self.shares)}"
        return (
            f"world_size={self.world_size} global_batch={self.global_size} per_rank={share} "
            f"micro_batch={self.micro_size} accumulation={self.accumulation}"
        )


def valid_world_sizes(global_size: int, limit: int = 64) -> list[int]:
    return [w for w in range(1, min(global_size, limit) + 1) if global_size % w == 0]


def layout_for(cfg: BatchConfig, world_size: int) -> BatchLayout:
    if cfg.global_size is not None:
        global_size = cfg.global_size
        if world_size > global_size:
            raise ConfigError(
                "batch.global_size", f"{global_size} is smaller than the world size {world_size}",
                f"Use at most {global_size} ranks or raise batch.global_size",
            )
        if global_size % world_size and cfg.uneven == "refuse":
            raise ConfigError(
                "batch.global_size", f"{global_size} is not divisible by the world size {world_size} and batch.uneven is 'refuse'",
                f"Run with a world size in {valid_world_sizes(global_size)}, or set batch.uneven: weighted",
            )
        lr_scale = 1.0
    else:
        assert cfg.per_rank_size is not None
        global_size = cfg.per_rank_size * world_size
        lr_scale = float(world_size) if cfg.scale_lr == "linear" else 1.0
    base, extra = divmod(global_size, world_size)
    shares = tuple(base + (1 if r < extra else 0) for r in range(world_size))
    largest = max(shares)
    micro_limit = cfg.micro_size or largest
    accumulation = math.ceil(largest / micro_limit)
    micro_size = math.ceil(largest / accumulation)
    return BatchLayout(world_size, global_size, micro_size, accumulation, shares, lr_scale)


def split_even(items: Sequence[T], parts: int) -> Iterator[Sequence[T]]:
    """``parts`` contiguous chunks whose sizes differ by at most one (some may be empty)."""
    base, extra = divmod(len(items), parts)
    start = 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        yield items[start:start + size]
        start += size
