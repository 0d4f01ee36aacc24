"""What became of each injected fault: recovered by a new attempt, absorbed by the running one, or
landed as the job finished (and never waited for as a recovery that cannot come)."""

from __future__ import annotations

from typing import Any

from elastic_runner.chaos.verify import Injected, attribute_recoveries


def attempt(generation: int, start: float, world: int, steps_until: float, *, finished: bool = False) -> list[dict[str, Any]]:
    """Rank 0's events of one attempt: started at ``start``, stepping every second until ``steps_until``."""
    base = {"generation": generation, "rank": 0}
    out = [base | {"time": start, "kind": "start", "world_size": world},
           base | {"time": start, "kind": "world", "world_size": world, "step": 0},
           base | {"time": start + 0.5, "kind": "first_step", "step": 1}]
    t = start + 1.0
    while t <= steps_until:
        out.append(base | {"time": t, "kind": "progress", "step": int(t * 10), "loss": 1.0})
        t += 1.0
    if finished:
        out.append(base | {"time": steps_until + 0.1, "kind": "end", "status": "finished", "step": 999})
    return out


def fault(kind: str, at: float) -> Injected:
    return Injected(type=kind, at=at, offset=at, description=kind)


def test_a_fault_followed_by_a_new_attempt_is_a_recovery() -> None:
    faults = [fault("kill-worker", 10.0)]
    attribute_recoveries(faults, attempt(1, 0.0, 2, 10.0) + attempt(2, 10.6, 2, 30.0, finished=True))
    assert faults[0].outcome == "recovered" and faults[0].generation == 2 and faults[0].recovery_s == 1.1


def test_a_hang_nobody_noticed_is_absorbed_once_the_attempt_steps_past_it() -> None:
    """Before: a hang at world size 1 (no peer to notice) was waited on for 120 s as a recovery."""
    faults = [fault("hang", 10.0)]
    attribute_recoveries(faults, attempt(1, 0.0, 1, 12.0), hang_seconds=1.0)
    assert faults[0].outcome is None, "not decided while the hang may still be noticed"
    attribute_recoveries(faults, attempt(1, 0.0, 1, 16.0), hang_seconds=1.0)
    assert faults[0].outcome == "absorbed" and not faults[0].interrupted


def test_a_fault_that_lands_as_the_job_finishes_is_recorded_as_such() -> None:
    faults = [fault("kill-worker", 19.9)]
    attribute_recoveries(faults, attempt(1, 0.0, 2, 20.0, finished=True))
    assert faults[0].outcome == "job ended" and faults[0].recovery_s is None
