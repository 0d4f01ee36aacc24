"""Deliberately broken components, injected through config to prove the checkers can fail."""

from __future__ import annotations

from elastic_runner.sampler import ElasticSampler, StepPlan


class RepeatingSampler(ElasticSampler):
    """Like the elastic sampler, but rank 0 sees its first sample twice in every 7th step."""

    def plan_at(self, epoch: int, start: int) -> StepPlan | None:
        plan = super().plan_at(epoch, start)
        if plan is None or self.rank != 0 or (start // self.global_batch) % 7 != 3 or len(plan.indices) < 2:
            return plan
        indices = [plan.indices[0]] + plan.indices[:-1]
        return StepPlan(epoch=plan.epoch, start=plan.start, global_count=plan.global_count, indices=indices)
