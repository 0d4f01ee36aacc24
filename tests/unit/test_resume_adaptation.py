"""What a resumed state adapts to: the run length follows the current global batch, the schedule the new run length and learning-rate scale."""

from __future__ import annotations

import pytest
import torch

from elastic_runner.config import BatchConfig, Config, ScheduleConfig, TrainConfig
from elastic_runner.data.sampler import ElasticSampler
from elastic_runner.training.adapt import planned_total_steps, refresh_schedule, rescale_lr
from elastic_runner.workload.optim import build_schedule


def test_run_length_follows_the_current_global_batch() -> None:
    cfg = Config(train=TrainConfig(epochs=10), batch=BatchConfig(global_size=None, per_rank_size=8))
    s2 = ElasticSampler(1000, 16)  # world size 2: 16 per step
    assert planned_total_steps(cfg, s2, 0) == 10 * 62
    s2.epoch, s2.consumed = 3, 496
    s4 = ElasticSampler(1000, 32)  # scaled up to world size 4 at step 217 (3 epochs + 31 steps)
    s4.load_state_dict(s2.state_dict())
    assert planned_total_steps(cfg, s4, 217) == 217 + (1000 - 496) // 32 + 6 * 31
    cfg.train.max_steps = 300
    assert planned_total_steps(cfg, s4, 217) == 300


def test_a_restored_schedule_follows_the_new_run_length_and_lr_scale() -> None:
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=0.2)
    sched = build_schedule(ScheduleConfig(name="cosine"), opt, total_steps=100)
    for _ in range(50):
        opt.step()
        sched.step()
    saved = sched.state_dict(), opt.state_dict()
    opt2 = torch.optim.SGD([param], lr=0.2)
    sched2 = build_schedule(ScheduleConfig(name="cosine"), opt2, total_steps=100)
    opt2.load_state_dict(saved[1])
    sched2.load_state_dict(saved[0])
    assert sched2.lr_lambdas[0].total_steps == 100  # what LambdaLR restores
    refresh_schedule(sched2, ScheduleConfig(name="cosine"), 200)
    assert sched2.lr_lambdas[0].total_steps == 200
    rescale_lr(opt2, sched2, old=2.0, new=4.0)
    assert sched2.base_lrs == [pytest.approx(0.4)]
