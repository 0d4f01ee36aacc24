"""How an attempt ends decides what it leaves for the next: a state after a non-finite step is never left."""

from __future__ import annotations

import math

from elastic_runner.training.gradients import NonFiniteGradient, NonFiniteRollback
from elastic_runner.worker.ending import ending_for
from elastic_runner.lifecycle import EXIT_DIVERGED


def test_a_diverged_attempt_keeps_nothing_and_a_stop_then_saves_no_snapshot() -> None:
    """A stop or park read the non-finite step on one rank (stop_here): with state kept, the stop would write the
    diverged state as its snapshot and the next start would resume from it."""
    for stop_requested in (False, True):
        ending = ending_for(NonFiniteGradient(12, [1], math.nan), stop_requested)
        assert (ending.exit_code, ending.keeps_state, ending.status) == (EXIT_DIVERGED, False, "failed")


def test_a_non_finite_rollback_keeps_nothing_and_is_said_once_for_the_job() -> None:
    ending = ending_for(NonFiniteRollback(12, [1], "step 12: ..."), False)
    assert (ending.status, ending.keeps_state, ending.said_by) == ("rolled_back", False, "job")


def test_a_process_whose_device_is_unusable_exits_failed_with_one_line() -> None:
    from elastic_runner.recovery.states import DeviceUnusable

    ending = ending_for(DeviceUnusable("rank 1: the device is unusable (...)"), False)
    assert (ending.status, ending.exit_code, ending.say) == ("failed", 1, True)
