"""Test-only components, injected through config (``--set data.sampler=tests.broken_components:NAME``):
deliberately broken ones prove the checkers can fail; a paced one makes a job last long enough for a
fault, however fast the machine trains (a chaos run's reference unpaced); a slow one makes one rank a straggler."""

from __future__ import annotations

import os
import time

import torch

from elastic_runner.data.sampler import ElasticSampler, StepPlan
from elastic_runner.training import injected_faults
from elastic_runner.workload.models import SmallCNN


class RepeatingSampler(ElasticSampler):
    """Like the elastic sampler, but rank 0 sees its first sample twice in every 7th step."""

    def plan_at(self, epoch: int, start: int) -> StepPlan | None:
        plan = super().plan_at(epoch, start)
        if plan is None or self.rank != 0 or (start // self.global_batch) % 7 != 3 or len(plan.indices) < 2:
            return plan
        indices = [plan.indices[0]] + plan.indices[:-1]
        return StepPlan(epoch=plan.epoch, start=plan.start, global_count=plan.global_count, indices=indices)


#: A paced sampler's least time a step.
PACE_S = 0.04


class PacedSampler(ElasticSampler):
    """The elastic sampler, taking at least 40 ms per step: 350 steps last 14 s or more, so a test
    can break something outside the workers (etcd) for seconds and see training go on through it."""

    def advance(self, plan: StepPlan) -> None:
        time.sleep(PACE_S)
        super().advance(plan)


class FaultPacedSampler(ElasticSampler):
    """Paced as :class:`PacedSampler` in a run the chaos tool injects faults into (its hooks are on), and not in the
    fault-free reference run it compares that run with: a reference needs no time for a fault to land in, and the
    pace changes nothing the comparison sees (which samples, in which steps)."""

    def advance(self, plan: StepPlan) -> None:
        if os.environ.get(injected_faults.ENV) == "1":
            time.sleep(PACE_S)
        super().advance(plan)


class _SlowOnOneRank(torch.nn.Module):
    """A small digits classifier whose forward on one rank takes ``delay_s`` more while ``while_file`` exists: a
    rank on a slow device, for as long as the test keeps the file."""

    def __init__(self, rank: int, while_file: str, delay_s: float) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, 10))
        self.slow = int(os.environ.get("RANK", "0")) == rank
        self.while_file, self.delay_s = while_file, delay_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.slow and self.training and os.path.exists(self.while_file):
            time.sleep(self.delay_s)
        return self.net(x)


def slow_on_one_rank(rank: int = 1, while_file: str = "", delay_s: float = 0.03) -> torch.nn.Module:
    """``model.name: tests.broken_components:slow_on_one_rank``."""
    return _SlowOnOneRank(rank, while_file, delay_s)


class _CorruptsOneRank(torch.nn.Module):
    """A small digits classifier whose replica on one rank gets one bit of a weight flipped (a device's silent
    corruption) at its ``at_forward``-th training forward in a process: once in the run while ``once_file`` does
    not exist yet (the model creates it), or in every process that gets there when ``once_file`` is empty."""

    def __init__(self, rank: int, at_forward: int, once_file: str) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, 10))
        self.bad = int(os.environ.get("RANK", "0")) == rank
        self.at_forward, self.once_file, self.forwards = at_forward, once_file, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bad and self.training:
            self.forwards += 1
            if self.forwards == self.at_forward and not (self.once_file and os.path.exists(self.once_file)):
                if self.once_file:
                    open(self.once_file, "w").close()
                with torch.no_grad():  # a mantissa bit: the loss stays finite, only the replicas differ
                    self.net[1].weight.view(-1).view(torch.int32)[5] ^= 1 << 12
        return self.net(x)


def corrupts_one_rank(rank: int = 1, at_forward: int = 50, once_file: str = "") -> torch.nn.Module:
    """``model.name: tests.broken_components:corrupts_one_rank``."""
    return _CorruptsOneRank(rank, at_forward, once_file)


class _FailsOnItsDevice(SmallCNN):
    """configs/quickstart.yaml's cnn (the same parameters, initialised alike) whose ``at_forward``-th training forward on
    ``rank`` raises what NCCL raises after a sticky CUDA error (an illegal memory access), once in the run (``once_file``
    records it): the device of that process is to be taken as unusable, though the error reads like NCCL's."""

    def __init__(self, num_classes: int, channels: int, hidden: int, rank: int, at_forward: int, once_file: str) -> None:
        super().__init__((1, 8, 8), num_classes, channels=channels, hidden=hidden)
        self.bad = int(os.environ.get("RANK", "0")) == rank
        self.at_forward, self.once_file, self.forwards = at_forward, once_file, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bad and self.training:
            self.forwards += 1
            if self.forwards == self.at_forward and not os.path.exists(self.once_file):
                open(self.once_file, "w").close()
                raise RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error (run with "
                                   "NCCL_DEBUG=INFO for details), NCCL version 2.28.9\nncclUnhandledCudaError: Call to "
                                   "CUDA function failed.\nLast error:\nCuda failure 'an illegal memory access was "
                                   "encountered'")
        return super().forward(x)


def fails_on_its_device_once(num_classes: int, channels: int = 16, hidden: int = 64, rank: int = 1,
                             at_forward: int = 130, once_file: str = "") -> torch.nn.Module:
    """``model.name: tests.broken_components:fails_on_its_device_once``."""
    return _FailsOnItsDevice(num_classes, channels, hidden, rank, at_forward, once_file)


def built_while_no_gate(num_classes: int, channels: int = 16, hidden: int = 64, gate_file: str = "",
                        most_s: float = 60.0) -> torch.nn.Module:
    """``model.name: tests.broken_components:built_while_no_gate``: configs/quickstart.yaml's cnn (the same parameters,
    initialised alike), whose construction waits while ``gate_file`` exists (at most ``most_s``): a process building
    the workload (a worker's start, a standby's warm-up) stays in that moment for as long as the test holds the
    gate."""
    deadline = time.monotonic() + most_s
    while gate_file and os.path.exists(gate_file) and time.monotonic() < deadline:
        time.sleep(0.02)
    return SmallCNN((1, 8, 8), num_classes, channels=channels, hidden=hidden)


def digits_with_poisoned_samples(poisoned: list[int] | None = None) -> tuple[torch.utils.data.Dataset,
                                                                               torch.utils.data.Dataset]:
    """``data.name: tests.broken_components:digits_with_poisoned_samples``: the shipped digits (train / test split as
    ``data.name: digits``) with the inputs of the training samples ``poisoned`` all NaN: the loss of whichever rank
    draws one is NaN, in every attempt that trains on it (a corrupt record in a corpus)."""
    from elastic_runner.data.datasets import DIGITS_SPLIT_SEED, TensorPairDataset, _split, load_digits_tensors

    x, y = load_digits_tensors()
    train, test = _split(x, y, 0.2, DIGITS_SPLIT_SEED)
    bad_x = train.x.clone()
    for index in poisoned or []:
        bad_x[index] = float("nan")
    return TensorPairDataset(bad_x, train.y), test
