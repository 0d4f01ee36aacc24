"""The step lock and the node-memory keeper: only whole steps are kept, and a resumed state is not kept again."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_runner.observe.events import NullEventLog
from elastic_runner.snapshot.memory import MemoryTier
from elastic_runner.training.boundary import Keeper, StateGuard
from elastic_runner.training.state import TrainState

from ..support import capture


def test_a_half_applied_step_is_never_kept(tmp_path: Path) -> None:
    guard, state = StateGuard(), TrainState(step=5)
    tier = MemoryTier(tmp_path / "mem", generation=1, run_uid="run-a")
    keeper = Keeper(tier, capture(5), guard, state, NullEventLog())
    with pytest.raises(RuntimeError):
        with guard.mutating():
            raise RuntimeError("out of memory inside optimizer.step")
    assert not keeper.keep("failure") and tier.newest(0) is None
    with guard.mutating():
        pass  # a complete step clears the mark
    assert keeper.keep("failure") and tier.newest(0).step == 5


def test_the_resumed_state_is_not_kept_again_under_a_new_generation(tmp_path: Path) -> None:
    state = TrainState(step=7)
    keeper = Keeper(MemoryTier(tmp_path / "mem", 2, "run-a"), capture(7), StateGuard(), state, NullEventLog())
    keeper.resumed_step = 7
    assert not keeper.keep("failure")


def test_a_state_from_a_non_finite_step_on_is_never_kept_before_any_check_read_it(tmp_path: Path) -> None:
    """The non-finite gradient of step 4 is noted on the device and read at the next logging step; a failure, a
    lost peer or a park at step 5 in between must not keep the diverged state (a resume would start from it)."""
    state = TrainState(step=5)
    tier = MemoryTier(tmp_path / "mem", generation=1, run_uid="run-a")
    keeper = Keeper(tier, capture(5), StateGuard(), state, NullEventLog())
    first_bad: list[int | None] = [4]
    keeper.diverged_at = lambda: first_bad[0]
    assert not keeper.keep("peer lost") and tier.newest(0) is None
    first_bad[0] = 6  # the gradient went bad after the state to keep: it is a good one
    assert keeper.keep("failure") and tier.newest(0).step == 5
