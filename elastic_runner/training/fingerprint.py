"""Silent corruption told from bitwise replicas: a fingerprint of each replica's state, compared across ranks.

With ``dist.gradient_sync: ordered`` every replica of a ddp model holds bitwise the same parameters and optimizer
state after every step (tests/elastic/test_bitwise.py), so a replica that differs *is* a corrupted one: a flipped
bit in a device's memory, a miscomputing GPU. Every ``recovery.fingerprint_every_steps`` (at a logging step) each
rank sums its parameters and optimizer state viewed as integers on its device — a single flipped bit changes that
sum by ± a power of two, never by a multiple of 2**64, so it is always seen — and the sums ride in the all-reduce
that already adds the logged loss up (:meth:`~elastic_runner.training.bookkeeping.StepBooks.report_progress`): no
collective of its own, no host read in any other step. The ranks whose sum differs from the majority's are the
suspects; with no majority (two replicas that differ) the job cannot tell which is wrong and says so. Under hsdp
each rank sums its shards (a DTensor's local slice) and is compared with the ranks holding the same shard on the other
nodes: one all-reduce across the nodes gives each copy of a shard the same gradient, so the copies stay bitwise equal;
fsdp has no copies to compare.

What the job does then (:class:`ReplicasDiverged`) is the loop's: it rolls back to the newest state a check vouched
for (:meth:`~elastic_runner.training.checkpointer.Checkpointer.discard_after`).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch
from torch import nn

#: What a check may cost, as a share of step time, when ``recovery.fingerprint_every_steps`` is auto.
AUTO_SHARE = 0.01
#: Floats each rank puts in the logging all-reduce: its sum's low and high 32 bits, its node, the last check's cost
#: (s) and its own step time (s) — every rank computes the same interval from the same sums.
SLOTS = 5
_LOW = 0xFFFFFFFF


class ReplicasDiverged(RuntimeError):
    """Replicas that must be bitwise identical differ: the job rolls back (a restart from the newest state a check
    vouched for)."""


class TooManyRollbacks(RuntimeError):
    """More than ``recovery.max_rollbacks`` rollbacks in ``recovery.rollback_window_seconds``: a node that keeps
    corrupting its replica (or a fault no rollback cures) stops the job (exit status 3)."""


class RollbackImpossible(TooManyRollbacks):
    """A snapshot no check vouched for could not be moved aside: a restart would resume from it, so the job stops
    (exit status 3) and says which one to move."""


def replica_tensors(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """What every replica holds alike, in one order on every rank: the parameters by name, then the optimizer's
    state tensors by parameter and key. Buffers are left out: a BatchNorm's running statistics are each rank's
    own until they are synchronised at a snapshot."""
    tensors = [p.detach() for _, p in sorted(model.named_parameters(), key=lambda item: item[0])]
    if optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                for key in sorted(optimizer.state.get(p, {})):
                    value = optimizer.state[p][key]
                    if isinstance(value, torch.Tensor):
                        tensors.append(value.detach())
    return tensors


def fingerprint(tensors: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """An int64 on ``device``: the sum over tensors of (their bits summed as integers, :func:`_bits_sum`) x (an odd
    weight of their place), wrapping at 2**64. Changing one bit of one tensor changes it (an odd multiple of a power of two below
    2**64 is never 0 modulo 2**64); moving a value between tensors changes it too. Queued on the device: nothing
    waits for it here."""
    total = torch.zeros((), dtype=torch.int64, device=device)
    for place, tensor in enumerate(tensors):
        if tensor.numel() == 0:
            continue
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += _bits_sum(local).to(device, non_blocking=True) * (2 * place + 1)
    return total


def _bits_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes summed as int64 words (a short tail as bytes), wrapping: any one flipped bit changes it.
    Words, not elements: a CPU sums int64s 15x faster than it sums int32s into an int64."""
    data = tensor.reshape(-1).view(torch.uint8)
    whole = data.numel() // 8 * 8
    try:
        words = data[:whole].view(torch.int64).sum()
    except RuntimeError:  # not 8-byte aligned in its storage: a copy is, and sums to what aligned bytes sum to
        return _bits_sum(tensor.clone())
    return words + data[whole:].to(torch.int64).sum() if whole < data.numel() else words


def split(value: torch.Tensor) -> torch.Tensor:
    """An int64 as two float64s (its low and high 32 bits, each exact in a float64), on its device."""
    return torch.stack([value & _LOW, (value >> 32) & _LOW]).to(torch.float64)


def join(low: float, high: float) -> int:
    return (int(high) << 32) | int(low)


@dataclass(frozen=True)
class Verdict:
    step: int
    #: The ranks whose state differs from the majority's (empty: all agree, or no majority to tell them by).
    suspects: list[int] = field(default_factory=list)
    #: Whether every rank's fingerprint was the same.
    agreed: bool = True
    #: The nodes of the suspects (their group ranks), in the same order.
    nodes: list[int] = field(default_factory=list)

    @property
    def undecided(self) -> bool:
        """The replicas differ and no majority says which is right (e.g. two replicas): all are suspect."""
        return not self.agreed and not self.suspects


def compare(step: int, values: Sequence[int], nodes: Sequence[int], shards: int = 1) -> Verdict:
    """The ranks whose fingerprint differs from more than half of those of the ranks that hold the same: with
    ``shards`` > 1 (hsdp: a node's ranks each hold one shard, rank r the shard r % shards) rank r is compared with the
    ranks of its shard on the other nodes. One shard whose copies differ with no majority among them makes every
    rank suspect (undecided), whatever the other shards say: the job cannot tell which copy to keep."""
    suspects: list[int] = []
    agreed = True
    for shard in range(shards):
        ranks = list(range(shard, len(values), shards))
        counts = Counter(values[r] for r in ranks)
        if len(counts) <= 1:
            continue
        agreed = False
        common, n = counts.most_common(1)[0]
        if 2 * n <= len(ranks):
            return Verdict(step, agreed=False)
        suspects += [r for r in ranks if values[r] != common]
    if agreed:
        return Verdict(step)
    suspects.sort()
    return Verdict(step, suspects, agreed=False, nodes=[int(nodes[r]) for r in suspects])


class FingerprintCheck:
    """When a check is due, and its cost. ``every``: steps between checks, or ``"auto"``: as often as keeps a
    check at or below :data:`AUTO_SHARE` of step time (measured: the first check runs at the first logging step);
    a check runs at a logging step (``logging_every``) and at the last step, so that the final state is vouched
    for. Every rank decides alike: from the step and from the sums every rank received."""

    def __init__(self, every: int | str, logging_every: int, start_step: int, device: torch.device,
                 shards: int = 1) -> None:
        self.auto = every == "auto"
        #: hsdp: the ranks of a node each hold one shard (:func:`compare`); 1: every rank holds the whole state.
        self.shards = shards
        self.logging_every = logging_every
        self.every = logging_every if self.auto else int(every)
        #: The newest step whose check agreed: states from there back are vouched for (at first, the state this
        #: attempt started from: every rank loaded the same bytes).
        self.verified_step = start_step
        self._last = start_step
        self.device = device
        self._cuda = device.type == "cuda"
        self._timing: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        self._cost_s = 0.0

    def due(self, step: int, last: bool) -> bool:
        return last or step - self._last >= self.every

    def compute(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> torch.Tensor:
        """This rank's fingerprint (on its device; read by the logging all-reduce), timed without a host wait."""
        started = time.perf_counter()
        if self._cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        value = fingerprint(replica_tensors(model, optimizer), self.device)
        if self._cuda:
            end.record()
            self._timing = (begin, end)
        else:
            self._cost_s = time.perf_counter() - started
        return value

    def slots(self, value: torch.Tensor, node: int, step_s: float) -> torch.Tensor:
        """This rank's :data:`SLOTS` floats, on its device."""
        extra = torch.tensor([float(node), self._measured_cost(), step_s], dtype=torch.float64)
        return torch.cat([split(value), extra.to(value.device)])

    def _measured_cost(self) -> float:
        if self._timing is not None and self._timing[1].query():  # the previous check's, complete by now
            self._cost_s = self._timing[0].elapsed_time(self._timing[1]) / 1000.0
            self._timing = None
        return self._cost_s

    def judge(self, step: int, summed: Sequence[float]) -> Verdict:
        """The verdict from every rank's slots (``summed``: the all-reduced blocks, :data:`SLOTS` per rank)."""
        world = len(summed) // SLOTS
        values = [join(summed[SLOTS * r], summed[SLOTS * r + 1]) for r in range(world)]
        verdict = compare(step, values, [summed[SLOTS * r + 2] for r in range(world)], self.shards)
        self._last = step
        if verdict.agreed:
            self.verified_step = step
        if self.auto:
            cost = max(summed[SLOTS * r + 3] for r in range(world))
            step_s = sorted(summed[SLOTS * r + 4] for r in range(world))[(world - 1) // 2]
            if cost > 0 and step_s > 0:
                steps = math.ceil(cost / (AUTO_SHARE * step_s))
                self.every = self.logging_every * max(1, math.ceil(steps / self.logging_every))
        return verdict
