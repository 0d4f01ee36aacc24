"""ElasticSampler: every sample of an epoch exactly once, across any restarts.

One order of the dataset per epoch, a pure function of (seed, epoch) computed per position (see
:mod:`~elastic_runner.data.order`): nothing of the dataset's size is held, so a corpus of 10^9 samples
costs what 10^3 do. The job's position in the order (``consumed``) is part of the snapshot. Optimizer step
k of an epoch uses the window ``order[start : start + G]``, where G is the global batch; rank r of a world
of W ranks takes ``window[r::W]``. Hence the union over ranks of one step is exactly the next G samples of
the order, whatever W is, and after a restart with a new W the job simply continues at ``consumed``:
nothing is skipped, nothing repeats.

The order (``order=``, recorded in the state) is ``"feistel"`` by default: a seeded Feistel network over
the smallest even-bit domain that holds the dataset, cycle-walked into ``range(N)``. It is a true
permutation, so every sample of an epoch comes exactly once; its spread is pseudo-random, not
cryptographic. ``"randperm"`` is the order of runs before it (``torch.randperm``, materialised: O(N)
memory): a state without an order kind was written by such a run and resumes in it, so an old snapshot
continues the epoch it was in, sample for sample.

This is *not* torch's ``ElasticDistributedSampler(start_index)``, which skips
dataset ids below ``start_index`` (not the consumed samples of a shuffled order).

The last, incomplete window of an epoch follows ``partial_batch``: ``drop``
skips those samples for this epoch (each epoch's order differs, so
different samples are dropped), ``partial`` runs one smaller step. Samples are
never padded with repeats.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from ..printable import printable
from .order import DEFAULT_ORDER, LEGACY_ORDER, EpochOrder, check_order_kind, epoch_order
from .order import epoch_permutation as epoch_permutation  # the legacy order's array, re-exported


@dataclass(frozen=True)
class StepPlan:
    """What one rank consumes in one optimizer step."""

    epoch: int
    start: int  #: position of the step's window in the epoch's order
    global_count: int  #: samples in the whole step, all ranks together
    indices: list[int]  #: dataset indices this rank consumes
    #: A mixture's step (:mod:`.mixture`): (source, its epoch, position, count) of each part of the window.
    segments: tuple[tuple[int, int, int, int], ...] = ()

    @property
    def end(self) -> int:
        return self.start + self.global_count


class ElasticSampler:
    def __init__(self, num_samples: int, global_batch: int, *, seed: int = 0, shuffle: bool = True,
                 partial_batch: str = "drop", rank: int = 0, world_size: int = 1,
                 order: str = DEFAULT_ORDER) -> None:
        if num_samples <= 0:
            raise ValueError("the dataset is empty")
        if global_batch <= 0:
            raise ValueError(f"global batch must be positive, got {global_batch}")
        if partial_batch not in ("drop", "partial"):
            raise ValueError(f"partial_batch must be 'drop' or 'partial', got {partial_batch!r}")
        if partial_batch == "drop" and global_batch > num_samples:
            raise ValueError(
                f"the global batch ({global_batch}) is larger than the dataset ({num_samples}); "
                "with data.partial_batch: drop no step would ever run"
            )
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.seed = seed
        self.shuffle = shuffle
        self.partial_batch = partial_batch
        #: The kind of order (a key of ORDERS); a loaded state's kind replaces it.
        self.order_kind = check_order_kind(order, "order")
        self.epoch = 0
        self.consumed = 0
        self.rank = 0
        self.world_size = 1
        self._order: EpochOrder | None = None  #: the order of one epoch, rebuilt when the epoch or kind changes
        self.reshard(rank, world_size)

    # -- placement ------------------------------------------------------------------

    def reshard(self, rank: int, world_size: int) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of size {world_size}")
        if world_size > self.global_batch:
            raise ValueError(
                f"world size {world_size} exceeds the global batch {self.global_batch}: some ranks would get no samples"
            )
        self.rank = rank
        self.world_size = world_size

    # -- order ------------------------------------------------------------------------

    def order_at(self, epoch: int) -> EpochOrder:
        """The order of ``epoch`` (feistel: O(1) to build; randperm: the whole epoch, materialised)."""
        order = self._order
        if order is None or order.epoch != epoch or order.kind != self.order_kind:
            order = self._order = epoch_order(self.order_kind, self.num_samples, self.seed, epoch, self.shuffle)
        return order

    def steps_per_epoch(self) -> int:
        full, rest = divmod(self.num_samples, self.global_batch)
        return full + (1 if rest and self.partial_batch == "partial" else 0)

    def steps_left_in_epoch(self) -> int:
        """Steps still to run in the current epoch at the current global batch."""
        remaining = self.num_samples - self.consumed
        full, rest = divmod(max(0, remaining), self.global_batch)
        return full + (1 if rest and self.partial_batch == "partial" else 0)

    def plan_at(self, epoch: int, start: int) -> StepPlan | None:
        """The step whose window starts at ``start``; None when the epoch is done."""
        remaining = self.num_samples - start
        if remaining <= 0 or (remaining < self.global_batch and self.partial_batch == "drop"):
            return None
        count = min(self.global_batch, remaining)
        window = self.order_at(epoch).slice(start, count)
        return StepPlan(epoch=epoch, start=start, global_count=count, indices=window[self.rank::self.world_size])

    def plans(self) -> Iterator[StepPlan]:
        """The remaining steps of the current epoch, without advancing."""
        start = self.consumed
        while (plan := self.plan_at(self.epoch, start)) is not None:
            yield plan
            start = plan.end

    def epoch_done(self) -> bool:
        return self.plan_at(self.epoch, self.consumed) is None

    # -- progress ---------------------------------------------------------------------

    def advance(self, plan: StepPlan) -> None:
        if plan.epoch != self.epoch or plan.start != self.consumed:
            raise RuntimeError(
                f"step plan (epoch {plan.epoch}, start {plan.start}) does not continue the sampler "
                f"(epoch {self.epoch}, consumed {self.consumed})"
            )
        self.consumed = plan.end

    def next_epoch(self) -> None:
        self.epoch += 1
        self.consumed = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch, "consumed": self.consumed, "seed": self.seed,
            "num_samples": self.num_samples, "shuffle": self.shuffle, "order": self.order_kind,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_samples"] != self.num_samples:
            raise ValueError(
                f"the snapshot's dataset had {printable(state['num_samples'], 40)} samples, this one has {self.num_samples}"
            )
        # A state without an order kind predates them: its run used the randperm order, and continues in it.
        kind = check_order_kind(state.get("order", LEGACY_ORDER), "the snapshot's sampler order")
        self.order_kind = kind
        self.epoch = int(state["epoch"])
        self.consumed = int(state["consumed"])
