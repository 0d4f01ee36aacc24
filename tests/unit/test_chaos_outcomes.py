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


def scenario(tmp_path, **options: Any):  # noqa: ANN001, ANN201
    from elastic_runner.chaos.scenario import Scenario

    config = tmp_path / "c.yaml"
    config.write_text("{}\n")
    return Scenario(config=str(config), run_dir=str(tmp_path / "run"), **options)


def test_faults_can_be_placed_by_step_so_a_scenario_is_the_same_experiment_on_any_machine(tmp_path) -> None:  # noqa: ANN001
    import pytest

    from elastic_runner.chaos.scenario import ScenarioError, parse_fault_list

    fixed = parse_fault_list("step:200:kill-worker,step:450:join")
    assert [(f.step, f.type) for f in fixed] == [(200, "kill-worker"), (450, "join")]
    with pytest.raises(ScenarioError, match="write step:STEP:TYPE"):
        parse_fault_list("step:soon:kill-worker")
    with pytest.raises(ScenarioError, match="either by time .* or by step"):
        scenario(tmp_path, faults=fixed + parse_fault_list("10:hang")).validate()

    drawn = scenario(tmp_path, random_types=["kill-worker", "hang"], every_steps=(100, 300), count=5, seed=3)
    drawn.validate()
    plan = drawn.schedule()
    assert len(plan) == 5 and all(f.step is not None and f.drawn for f in plan)
    gaps = [b.step - a.step for a, b in zip([None, *plan][1:], plan[1:])]  # type: ignore[operator]
    assert plan[0].step >= 100 and all(100 <= g <= 300 for g in gaps)
    assert plan == drawn.schedule(), "seeded: the same plan every time"
    with pytest.raises(ScenarioError, match="need --count"):
        scenario(tmp_path, random_types=["hang"], every_steps=(100, 300)).validate()


def test_count_asks_for_exactly_n_random_faults_whatever_the_duration(tmp_path) -> None:  # noqa: ANN001
    timed = scenario(tmp_path, random_types=["kill-worker"], every=(5.0, 5.0), count=30, duration=10.0)
    timed.validate()
    assert len(timed.schedule()) == 30
