"""Several sources mixed by weight into every global batch, each exactly once per its own epoch, at any world size.

:class:`MixtureSampler` has :class:`~.sampler.ElasticSampler`'s interface over one index space: source ``s``'s
sample ``i`` is the global id ``base[s] + i`` (:class:`MixtureDataset` reads it back). Its position is how many
samples the job has taken from each source, ``taken[s]``: source ``s`` is in its epoch ``taken[s] // N[s]``, at
position ``taken[s] % N[s]`` of that epoch's order (a seeded permutation of its ``N[s]`` samples, a function of
the position: :mod:`.order`). Sources run their epochs independently: a step may end one epoch of a source and begin
its next.

**Exact proportions.** The ``G`` slots of each global batch are given out one at a time by Balinski and Young's quota
method: slot number ``t`` of the run (counted over all steps) goes to the source with the largest ``w[s] /
(taken[s] + 1)`` among those still below their share ``w[s] * t`` — so after any number of slots ``t`` every source
has had ``floor(w[s] t)`` or ``ceil(w[s] t)`` of them, within one of its exact share (the method's theorem: it
stays within quota), and each global batch holds each source's share rounded, the error carried on. The weights are
exact fractions of the configured ones, and the assignment a pure function of ``taken``, so a resumed or resharded
job gives out the same slots.

**Any world size.** A step's window is its ``G`` global ids in slot order, each source's continuing where it stopped;
rank ``r`` of ``W`` takes ``window[r::W]``, as for one dataset. The window does not depend on ``W``: the union of the
ranks' first ``k`` steps is the next ``k G`` slots, whatever ``W`` was before.

The snapshot keeps ``taken``, the sources' sizes and what their shards were (names, sizes, checksums): a resume whose
sources changed is refused and names the shard.
"""

from __future__ import annotations

import hashlib
import json
from bisect import bisect_right
from dataclasses import dataclass
from fractions import Fraction
from math import lcm
from typing import Any, Iterator, Sequence

import numpy as np

from ..config import ConfigError
from .order import FeistelOrder, round_keys
from ..printable import printable
from .sampler import StepPlan
from .sources import BadItem


def exact_weights(weights: Sequence[float]) -> tuple[list[int], int]:
    """The weights as integers ``W[s]`` of a common denominator ``Q`` (``W[s] / Q`` sum to 1), exactly: the
    weight written ``0.3`` is 3/10, not the nearest binary float."""
    fractions = [Fraction(str(w)) for w in weights]
    total = sum(fractions)
    shares = [f / total for f in fractions]
    denominator = lcm(*(s.denominator for s in shares))
    return [int(s * denominator) for s in shares], denominator


def quota_slots(taken: Sequence[int], weights: Sequence[int], denominator: int, count: int) -> list[int]:
    """The sources of the next ``count`` slots, given ``taken`` so far (the quota method; see the module)."""
    if len(weights) == 1:
        return [0] * count
    taken = list(taken)
    t = sum(taken)
    # below[s] = W[s] t - Q taken[s]: how far source s is below its share (times Q) once slot t is given out;
    # it may take slot t while that is positive (its upper quota), the largest W[s] / (taken[s] + 1) of those.
    below = [w * (t + 1) - denominator * n for w, n in zip(weights, taken)]
    sources = range(len(weights))
    out = []
    for _ in range(count):
        best = -1
        for s in sources:
            if below[s] > 0 and (best < 0 or weights[s] * (taken[best] + 1) > weights[best] * (taken[s] + 1)):
                best = s
        taken[best] += 1
        below[best] -= denominator
        out.append(best)
        for s in sources:
            below[s] += weights[s]
    return out


def source_seed(seed: int, position: int) -> int:
    """Source ``position``'s order seed: its own stream of ``run.seed``'s, so that sources never share an order."""
    return round_keys(seed, position, rounds=1)[0] & ((1 << 63) - 1)


@dataclass(frozen=True)
class Segment:
    """What one step takes from one source in one of its epochs: positions ``[start, start + count)``."""

    source: int
    epoch: int
    start: int
    count: int


class MixtureSampler:
    """The mixture's order and position (see the module docstring); :class:`~.sampler.ElasticSampler`'s
    interface."""

    def __init__(self, sizes: Sequence[int], weights: Sequence[float], global_batch: int, *, seed: int = 0,
                 shuffle: bool = True, rank: int = 0, world_size: int = 1, labels: Sequence[str] = (),
                 identities: Sequence[Any] = ()) -> None:
        if not sizes or any(n <= 0 for n in sizes):
            empty = next((i for i, n in enumerate(sizes) if n <= 0), 0)
            raise ValueError(f"source {labels[empty] if labels else empty} has no sample (too little data for one "
                             "window?)")
        if global_batch <= 0:
            raise ValueError(f"global batch must be positive, got {global_batch}")
        self.sizes = [int(n) for n in sizes]
        self.bases = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.num_samples = int(self.bases[-1])
        self.weights, self.denominator = exact_weights(weights)
        self.global_batch = global_batch
        self.seed, self.shuffle = seed, shuffle
        self.labels = list(labels) or [str(i) for i in range(len(sizes))]
        self.identities = [_digest(identity) for identity in identities] or [""] * len(sizes)
        self._identity_records = list(identities)
        self.taken = [0] * len(sizes)
        self.order_kind = "feistel"
        self._orders: dict[tuple[int, int], FeistelOrder] = {}
        self.rank, self.world_size = 0, 1
        self.reshard(rank, world_size)

    # -- what ElasticSampler's callers read ---------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The first source's epoch (a mixture's sources each run their own: the audit and report say all)."""
        return self.taken[0] // self.sizes[0]

    @property
    def consumed(self) -> int:
        """Samples taken from every source so far (the steps' windows, end to end)."""
        return sum(self.taken)

    def reshard(self, rank: int, world_size: int) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of size {world_size}")
        if world_size > self.global_batch:
            raise ValueError(f"world size {world_size} exceeds the global batch {self.global_batch}: some ranks "
                             "would get no samples")
        self.rank, self.world_size = rank, world_size

    def steps_per_epoch(self) -> int:
        return self.sizes[0] // self.global_batch  # (train.epochs only with one source: see steps_for_epochs)

    def steps_left_in_epoch(self) -> int:
        return (self.sizes[0] - self.taken[0] % self.sizes[0]) // self.global_batch

    def steps_for_epochs(self, epochs: int) -> int:
        """Steps from here to ``epochs`` epochs of the (single) source: its samples end to end, the last partial
        step left out."""
        return max(0, (epochs * self.sizes[0] - self.consumed) // self.global_batch)

    def epoch_done(self) -> bool:
        return False  # the sources run their epochs inside the steps

    def next_epoch(self) -> None:
        raise RuntimeError("a mixture's sources begin their epochs themselves")

    # -- the steps ---------------------------------------------------------------------------------------------

    def order(self, source: int, epoch: int) -> FeistelOrder:
        key = (source, epoch)
        order = self._orders.get(key)
        if order is None:
            if len(self._orders) > 4 * len(self.sizes):
                self._orders.clear()
            order = self._orders[key] = FeistelOrder(self.sizes[source], source_seed(self.seed, source), epoch,
                                                     self.shuffle)
        return order

    def window(self, taken: Sequence[int]) -> tuple[list[int], list[Segment]]:
        """The global ids of the step after ``taken``, in slot order, and what it takes from each source."""
        slots = quota_slots(taken, self.weights, self.denominator, self.global_batch)
        counts = np.bincount(slots, minlength=len(self.sizes)).tolist()
        ids: list[list[int]] = []
        segments: list[Segment] = []
        for s, count in enumerate(counts):
            picked: list[int] = []
            at = taken[s]
            while len(picked) < count:
                epoch, position = divmod(at, self.sizes[s])
                n = min(count - len(picked), self.sizes[s] - position)
                picked += self.order(s, epoch).slice(position, n)
                segments.append(Segment(s, epoch, position, n))
                at += n
            ids.append([int(self.bases[s]) + i for i in picked])
        nexts = [0] * len(self.sizes)
        window = []
        for s in slots:
            window.append(ids[s][nexts[s]])
            nexts[s] += 1
        return window, segments

    def plan_after(self, taken: Sequence[int]) -> StepPlan:
        window, segments = self.window(taken)
        return StepPlan(epoch=0, start=sum(taken), global_count=self.global_batch,
                        indices=window[self.rank::self.world_size],
                        segments=tuple((g.source, g.epoch, g.start, g.count) for g in segments))

    def plans(self) -> Iterator[StepPlan]:
        taken = list(self.taken)
        while True:
            plan = self.plan_after(taken)
            yield plan
            for source, _, _, count in plan.segments:
                taken[source] += count

    def advance(self, plan: StepPlan) -> None:
        if plan.start != self.consumed:
            raise RuntimeError(f"step plan (start {plan.start}) does not continue the mixture ({self.consumed} "
                               "taken)")
        for source, _, _, count in plan.segments:
            self.taken[source] += count

    # -- state -------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "mixture", "taken": list(self.taken), "sizes": list(self.sizes), "labels": self.labels,
                "weights": [f"{w}/{self.denominator}" for w in self.weights], "seed": self.seed,
                "shuffle": self.shuffle, "order": self.order_kind, "sources": self._identity_records,
                "epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "mixture":
            raise ValueError("the snapshot's sampler is one dataset's, not a mixture of data.sources")
        for s, recorded in enumerate(state.get("sources") or []):
            if s < len(self.identities) and self.identities[s] and _digest(recorded) != self.identities[s]:
                raise ValueError(f"source {self.labels[s]!r}: {_first_difference(recorded, self._identity_records[s])}")
        if list(state["sizes"]) != self.sizes or len(state["taken"]) != len(self.sizes):
            changed = next((i for i, (a, b) in enumerate(zip(state["sizes"], self.sizes)) if a != b), None)
            raise ValueError(f"source {self.labels[changed]!r} had {printable(state['sizes'][changed], 40)} samples, it has "
                             f"{self.sizes[changed]} now" if changed is not None else
                             f"the run had {len(state['sizes'])} sources, the config gives {len(self.sizes)}")
        self.taken = [int(n) for n in state["taken"]]


def _digest(identity: Any) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]


def _first_difference(before: list[dict[str, Any]], now: list[dict[str, Any]]) -> str:
    """Which shard of a source differs between the run's start and now."""
    old = {s["name"]: s for s in before}
    new = {s["name"]: s for s in now}
    for name in sorted(set(old) | set(new)):
        if name not in new:
            return f"its shard {printable(name)} is gone"  # (the start's names are the snapshot's: anyone's)
        if name not in old:
            return f"{printable(name)} is a shard it did not have"
        if old[name] != new[name]:
            diff = [f"{k} {printable(old[name].get(k), 80)} → {new[name].get(k)}" for k in ("size", "tokens", "check")
                    if old[name].get(k) != new[name].get(k)]
            return f"its shard {printable(name)} changed since the run started ({', '.join(diff)})"
    return "its shards changed since the run started"


class MixtureDataset:
    """The sources as one map-style dataset of global ids (the mixture's index space)."""

    def __init__(self, sources: Sequence[Any]) -> None:
        self.sources = list(sources)
        self.bases = [0]  # a list: bisect on a handful of ints is faster than numpy's per-call set-up
        for source in self.sources:
            self.bases.append(self.bases[-1] + len(source))

    def __len__(self) -> int:
        return self.bases[-1]

    def locate(self, gid: int) -> tuple[int, int]:
        """(source, its sample) of global id ``gid``."""
        s = bisect_right(self.bases, gid) - 1
        return s, gid - self.bases[s]

    def __getitem__(self, gid: int) -> Any:
        s, i = self.locate(gid)
        try:
            return self.sources[s][i]
        except ConfigError as exc:  # data that is not what it was: one line in the training process, exit 2
            return BadItem.refusing(exc)
        except (PermissionError, FileNotFoundError, IsADirectoryError) as exc:  # a local shard gone or locked
            source = self.sources[s]
            return BadItem.refusing(ConfigError(f"{source.spec.key}.path", f"cannot read a shard of {source.spec.label} "
                                                f"({exc.strerror or exc}: {exc.filename or ''})",
                                                "Restore the shard: a run cannot resume exactly without its data"))
