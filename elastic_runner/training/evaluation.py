"""Evaluation over the whole test set: each rank a shard, the task's sums gathered, the metrics computed once."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from ..data.sources import BatchSource, shard

if TYPE_CHECKING:
    from ..observe.metrics import Metrics
    from ..dist import Dist
    from ..workload.tasks import Task


class Evaluator:
    def __init__(self, dist: Dist, wrapped: torch.nn.Module, model: torch.nn.Module, task: Task,
                 source: BatchSource | None, size: int, batch_size: int, metrics: Metrics,
                 lockstep: Callable[[torch.nn.Module], Any] | None = None) -> None:
        self.dist, self.wrapped, self.model, self.task = dist, wrapped, model, task
        self.source, self.size = source, size
        self.batch_size, self.metrics = batch_size, metrics
        #: A sharded model: every forward is a collective, so a rank with fewer batches than its peers runs this
        #: stand-in (results discarded) until all ranks have run as many forwards.
        self.lockstep = lockstep

    def evaluate(self, autocast: Callable[[], Any]) -> dict[str, float]:
        """``{eval_<metric>: value, eval_samples: n}``; empty without a test set. A collective."""
        if self.source is None or self.size == 0:
            return {}
        self.wrapped.eval()  # the wrapper and the model: the next step switches both back
        indices = list(shard(self.size, self.dist.rank, self.dist.world_size))
        chunks = [indices[i:i + self.batch_size] for i in range(0, len(indices), self.batch_size)]
        sums: dict[str, float] = {}
        with torch.no_grad(), autocast():
            for chunk, data in zip(chunks, self.source.batches(chunks)):
                for key, value in self.task.eval_sums(self.model, data, len(chunk)).items():
                    sums[key] = sums.get(key, 0.0) + value
            if self.lockstep is not None:
                most = max(-(-len(shard(self.size, r, self.dist.world_size)) // self.batch_size)
                           for r in range(self.dist.world_size))
                for _ in range(most - len(chunks)):
                    self.lockstep(self.model)
        totals: dict[str, float] = {}
        samples = 0.0
        for rank_sums, count in self.dist.all_gather_object((sums, len(indices))):
            samples += count
            for key, value in rank_sums.items():
                totals[key] = totals.get(key, 0.0) + value
        metrics = self.task.finalize(totals, samples)
        self.metrics.set_eval(metrics)
        return {f"eval_{k}": v for k, v in metrics.items()} | {"eval_samples": int(samples)}
