"""Test-only components, injected through config (``--set data.sampler=tests.broken_components:NAME``):
deliberately broken ones prove the checkers can fail; a paced one makes a job last long enough for a
fault, however fast the machine trains."""

from __future__ import annotations

import time

from elastic_runner.data.sampler import ElasticSampler, StepPlan


class RepeatingSampler(ElasticSampler):
    """Like the elastic sampler, but rank 0 sees its first sample twice in every 7th step."""

    def plan_at(self, epoch: int, start: int) -> StepPlan | None:
        plan = super().plan_at(epoch, start)
        if plan is None or self.rank != 0 or (start // self.global_batch) % 7 != 3 or len(plan.indices) < 2:
            return plan
        indices = [plan.indices[0]] + plan.indices[:-1]
        return StepPlan(epoch=plan.epoch, start=plan.start, global_count=plan.global_count, indices=indices)


class PacedSampler(ElasticSampler):
    """The elastic sampler, taking at least 40 ms per step: 350 steps last 14 s or more, so a test
    can break something outside the workers (etcd) for seconds and see training go on through it."""

    def advance(self, plan: StepPlan) -> None:
        time.sleep(0.04)
        super().advance(plan)
