"""Evaluation over the whole test set: each rank a shard, the task's sums gathered, the metrics computed once."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from ..data.sources import BatchSource, shard

if TYPE_CHECKING:
    from ..observe.metrics import Metrics
    from ..worker.dist import Dist
    from ..workload.tasks import Task


class Evaluator:
    def __init__(self, dist: Dist, wrapped: torch.nn.Module, model: torch.nn.Module, task: Task,
                 source: BatchSource | None, size: int, batch_size: int, metrics: Metrics) -> None:
        self.dist, self.wrapped, self.model, self.task = dist, wrapped, model, task
        self.source, self.size = source, size
        self.batch_size, self.metrics = batch_size, metrics

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
        totals: dict[str, float] = {}
        samples = 0.0
        for rank_sums, count in self.dist.all_gather_object((sums, len(indices))):
            samples += count
            for key, value in rank_sums.items():
                totals[key] = totals.get(key, 0.0) + value
        metrics = self.task.finalize(totals, samples)
        self.metrics.set_eval(metrics)
        return {f"eval_{k}": v for k, v in metrics.items()} | {"eval_samples": int(samples)}
