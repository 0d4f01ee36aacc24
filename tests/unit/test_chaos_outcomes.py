"""What became of each injected fault: recovered by a new attempt, absorbed by the running one, or
landed as the job finished (and never waited for as a recovery that cannot come)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from elastic_runner.chaos.verdict import _corruption_check, _nonfinite_check, _spare_check, _stragglers_check
from elastic_runner.chaos.verify import History, Injected, attribute_recoveries, newest_snapshot_violations


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


@pytest.mark.parametrize("kind", ["restart-etcd", "fill-disk"])
def test_a_fault_the_job_rides_out_is_not_credited_with_a_join_that_followed_it(kind: str) -> None:
    faults = [fault(kind, 10.0)]
    # Training stopped at 10.5 and a larger world started at 11: a node joined (the fault did not stop anyone;
    # seen in the 1,000-fault soak: a supervisor's replacement joining just after a full volume).
    attribute_recoveries(faults, attempt(1, 0.0, 2, 10.5) + attempt(2, 11.0, 3, 30.0, finished=True))
    assert faults[0].outcome == "absorbed" and not faults[0].interrupted
    same_size = [fault(kind, 10.0)]
    attribute_recoveries(same_size, attempt(1, 0.0, 2, 10.5) + attempt(2, 11.0, 2, 30.0, finished=True))
    assert same_size[0].outcome == "recovered", "a new attempt at the same size right after it: the fault's doing"


@pytest.mark.parametrize("kind,found_by", [("nan-batch", "nonfinite_rollback"), ("corrupt-param", "replica_mismatch")])
def test_a_fault_found_at_a_later_check_and_rolled_back_is_a_recovery_however_long_its_attempt_stepped_first(
        kind: str, found_by: str) -> None:
    """Seen in the 1,000-fault soak: a NaN requested just as a join's attempt began struck that attempt's first step,
    and the logging step that found it came more than 2 s after the request; its attempt had stepped past the 2 s
    after which a step proves a fault absorbed, so the rollback's new attempt went uncredited."""
    faults = [fault(kind, 10.0)]
    rolled = {"generation": 1, "rank": 0, "time": 13.6, "kind": found_by, "step": 136, "status": "rolled_back"}
    attribute_recoveries(faults, attempt(1, 0.0, 2, 13.5) + [rolled] + attempt(2, 13.7, 2, 30.0, finished=True))
    assert faults[0].outcome == "recovered" and faults[0].generation == 2 and faults[0].recovery_s == 4.2
    unfound = [fault(kind, 10.0)]  # (on_nonfinite: skip) the attempt steps on: absorbed, as before
    attribute_recoveries(unfound, attempt(1, 0.0, 2, 30.0, finished=True))
    assert unfound[0].outcome == "absorbed"


def test_a_live_run_is_judged_from_its_new_events_only_with_the_same_outcome() -> None:
    events = attempt(1, 0.0, 2, 10.0) + attempt(2, 10.6, 2, 30.0, finished=True)
    history = History()
    for i in range(0, len(events), 3):  # as a watcher reads them: a few at a time
        history.add(events[i:i + 3])
    live, once = [fault("kill-worker", 10.0)], [fault("kill-worker", 10.0)]
    attribute_recoveries(live, history)
    attribute_recoveries(once, events)
    assert live == once and live[0].outcome == "recovered"


def state(kind: str, generation: int, step: int, t: float, name: str = "") -> dict[str, Any]:
    return {"time": t, "kind": kind, "generation": generation, "rank": 0, "step": step, "snapshot": name or f"s{step}"}


def resumed(generation: int, t: float, step: int) -> list[dict[str, Any]]:
    return [{"time": t, "kind": "start", "generation": generation, "rank": 0, "world_size": 2},
            {"time": t + 0.1, "kind": "resume", "generation": generation, "rank": 0, "step": step}]


def test_a_resume_older_than_a_snapshot_that_existed_is_a_violation() -> None:
    events = [state("snapshot_saved", 1, 200, 1.0), state("snapshot_saved", 1, 250, 2.0), *resumed(2, 3.0, 200)]
    (problem,) = newest_snapshot_violations(events)
    assert "generation 2 resumed at step 200 but s250" in problem
    rejected = events + [{"time": 2.5, "kind": "snapshot_rejected", "snapshot": "s250", "generation": 1, "rank": 0}]
    assert newest_snapshot_violations(rejected) == [], "a damaged snapshot the loader rejected is no candidate"
    rolled_back = events + [{"time": 2.5, "kind": "replica_mismatch", "generation": 1, "rank": 0, "step": 260,
                             "verified_step": 240, "suspects": [1], "status": "rolled_back", "moved_aside": ["s250"]}]
    assert newest_snapshot_violations(rolled_back) == [], "a snapshot a rollback moved aside is no candidate"


def test_survivors_memory_counts_for_the_next_attempt_only() -> None:
    kept = [state("snapshot_saved", 1, 200, 1.0), state("kept_in_memory", 1, 257, 2.0)]
    # The next attempt must take the survivors' newer state...
    assert newest_snapshot_violations(kept + resumed(2, 3.0, 200))
    # ...and once it has (and then died with every copy, as corrupt-snapshot makes it), the disk is all there is.
    stepped = [{"time": 3.5, "kind": "first_step", "generation": 2, "rank": 0, "step": 258}]
    later = kept + resumed(2, 3.0, 257) + stepped + resumed(3, 9.0, 200)
    assert newest_snapshot_violations(later) == []
    # An attempt that died before its first step took nothing over: the survivors' copy still counts.
    assert newest_snapshot_violations(kept + resumed(2, 3.0, 257) + resumed(3, 9.0, 200))


def on_node(events: list[dict[str, Any]], agent: str) -> list[dict[str, Any]]:
    return [e | {"agent": agent} if e["kind"] == "start" else e for e in events]


def test_memory_kept_on_a_node_that_is_not_in_the_next_attempt_is_no_candidate() -> None:
    """Node memory is the node's: a survivor that parked for a joining node and then lost its node (kill-agent)
    took its copy with it, and the joiner, alone, can only resume from the disk (the 2026-12-06 soak's false
    alarm: generation 624 resumed step 160,224 from disk while the lost node had kept step 160,391)."""
    kept = [state("snapshot_saved", 1, 200, 1.0), *on_node(resumed(1, 0.0, 100), "node-a"),
            state("kept_in_memory", 1, 257, 2.0)]
    assert newest_snapshot_violations(kept + on_node(resumed(2, 3.0, 200), "node-a")), "its own node still holds it"
    assert newest_snapshot_violations(kept + on_node(resumed(2, 3.0, 200), "node-b")) == []
    assert newest_snapshot_violations(kept + resumed(2, 3.0, 200)), "nodes unknown: the copy counts"


def test_memory_a_fault_wiped_is_no_candidate() -> None:
    """corrupt-snapshot SIGKILLs every worker, then deletes every node's memory: a worker that kept its state in
    the moment between the kills left a record, not a copy (the 1,000-fault soak's 11 false alarms)."""
    events = [state("snapshot_saved", 1, 200, 1.0), state("kept_in_memory", 1, 257, 5.02), *resumed(2, 7.0, 200)]
    assert newest_snapshot_violations(events), "without the wipe: the kept step was there"
    assert newest_snapshot_violations(events, wiped_at=[5.0]) == []
    assert newest_snapshot_violations(events, wiped_at=[8.0]), "a wipe after the resume changes nothing"


def test_memory_kept_before_an_attempt_that_a_wipe_then_ended_is_no_candidate_for_the_one_after() -> None:
    """In process, the next attempt starts within a fraction of a second of the park that kept the step: a wipe
    that lands in that attempt's resume takes the copy with it (seen in a 60-fault soak)."""
    events = [state("snapshot_saved", 1, 200, 1.0), state("kept_in_memory", 1, 257, 4.8), *resumed(2, 4.95, 257),
              *resumed(3, 6.0, 200)]
    assert newest_snapshot_violations(events), "without the wipe: the kept step was there for generation 3"
    assert newest_snapshot_violations(events, wiped_at=[5.0]) == []


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
    # Each one so many steps after the previous injection (not a fixed plan the job could run ahead of).
    assert len(plan) == 5 and all(f.step is None and f.drawn for f in plan)
    assert all(100 <= f.after_steps <= 300 for f in plan)  # type: ignore[operator]
    assert plan[2].when == f"{plan[2].after_steps} steps after the previous fault"
    assert plan == drawn.schedule(), "seeded: the same plan every time"
    with pytest.raises(ScenarioError, match="need --count"):
        scenario(tmp_path, random_types=["hang"], every_steps=(100, 300)).validate()


def test_count_asks_for_exactly_n_random_faults_whatever_the_duration(tmp_path) -> None:  # noqa: ANN001
    timed = scenario(tmp_path, random_types=["kill-worker"], every=(5.0, 5.0), count=30, duration=10.0)
    timed.validate()
    assert len(timed.schedule()) == 30


def test_a_scenario_file_sets_the_job_and_its_faults_and_the_command_line_overrides_it(tmp_path) -> None:  # noqa: ANN001
    import argparse

    import pytest

    from elastic_runner.chaos import add_parser, build_scenario
    from elastic_runner.chaos.scenario import ScenarioError

    config = tmp_path / "c.yaml"
    config.write_text("{}\n")
    path = tmp_path / "scenario.yaml"
    path.write_text(f"config: {config}\nrun_dir: {tmp_path / 'a'}\nnnodes: '1:2'\nagents: 2\nduration: 8\n"
                    "faults: [{at: 2, type: kill-node}]\n"
                    "random: {types: [kill-worker, hang], every: [3, 4], seed: 7}\noverrides: ['train.epochs=40']\n")
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["chaos", "--scenario", str(path), "--run-dir", str(tmp_path / "b"), "--set", "x.y=1"])
    s = build_scenario(args)
    s.validate()
    assert s.run_dir == str(tmp_path / "b") and s.nnodes == "1:2" and s.overrides == ["train.epochs=40", "x.y=1"]
    assert s.random_types == ["kill-worker", "hang"] and s.every == (3, 4) and s.seed == 7
    plan = s.schedule()
    assert plan[0].type == "kill-node" or plan[0].at <= 2, plan
    assert "kill-node" in [f.type for f in plan] and all(f.at < 8 for f in plan if f.drawn)
    path.write_text(f"config: {config}\nrun_dir: x\nfaults_at: 3\n")
    with pytest.raises(ScenarioError, match=r"unknown option\(s\) \['faults_at'\]"):
        build_scenario(parser.parse_args(["chaos", "--scenario", str(path)]))


def test_only_generations_that_stepped_count_for_a_bitwise_comparison() -> None:
    from elastic_runner.chaos.runner import stepping_world_sizes

    history = [
        {"kind": "world", "generation": 1, "world_size": 4}, {"kind": "first_step", "generation": 1},
        {"kind": "world", "generation": 2, "world_size": 2},  # a node lost, replaced before this round stepped
        {"kind": "world", "generation": 3, "world_size": 4}, {"kind": "progress", "generation": 3},
    ]
    assert stepping_world_sizes(history) == {4}
    assert stepping_world_sizes(history + [{"kind": "first_step", "generation": 2}]) == {2, 4}


def test_bitwise_needs_the_reference_at_the_jobs_own_size(tmp_path: Path) -> None:
    from elastic_runner.chaos.scenario import Scenario, ScenarioError

    config = tmp_path / "c.yaml"
    config.write_text("train: {epochs: 1}\n")
    scenario = Scenario(config=str(config), run_dir=str(tmp_path / "run"), nnodes="1:3", agents=2, reference=True,
                        bitwise=True, reference_agents=3, random_types=["kill-worker"])
    with pytest.raises(ScenarioError, match="reference_agents=3 differs from agents=2"):
        scenario.validate()


def test_records_lost_must_belong_to_a_generation_a_lost_node_ended() -> None:
    from elastic_runner.chaos.verdict import verify
    from elastic_runner.observe.audit import AuditReport

    events = attempt(1, 0.0, 3, 10.0) + attempt(2, 10.6, 2, 20.0) + attempt(3, 20.6, 2, 30.0, finished=True)
    for e in events:
        if e["kind"] == "world":
            e |= {"global_batch": 6, "micro_batch": 6 // e["world_size"], "accumulation": 1}
    lost = [{"generation": 1, "ranks": [2], "first_step": 90, "last_step": 99}]
    audit = AuditReport(finished=True, final_step=300, records_lost=lost)
    checks = verify(audit=audit, events=events, faults=[fault("kill-node", 10.0), fault("kill-worker", 20.0)],
                    leftover=[], finished=True, reference=None).checks
    assert checks["records lost only with a lost node"][0], checks
    # The same records missing in generation 2, which only a worker kill ended: not explained by any lost node.
    audit.records_lost = [dict(lost[0], generation=2)]
    checks = verify(audit=audit, events=events, faults=[fault("kill-node", 10.0), fault("kill-worker", 20.0)],
                    leftover=[], finished=True, reference=None).checks
    ok, detail = checks["records lost only with a lost node"]
    assert not ok and "generation(s) [2]" in detail


def flipped(pid: int, rank: int, step: int, at: float, generation: int = 1) -> dict[str, Any]:
    return {"time": at, "kind": "chaos_corrupted", "pid": pid, "rank": rank, "step": step, "generation": generation,
            "interval_steps": 25}


def found(step: int, at: float, suspects: list[int], generation: int = 1) -> dict[str, Any]:
    return {"time": at, "kind": "replica_mismatch", "rank": 0, "step": step, "generation": generation,
            "verified_step": step - 25, "suspects": suspects, "status": "rolled_back", "interval_steps": 25}


def corrupt_param(at: float, pid: int) -> Injected:
    injected = fault("corrupt-param", at)
    injected.targets = [pid]
    return injected


def test_a_flipped_bit_must_be_found_at_the_next_check_naming_its_rank_or_nobody() -> None:
    events = attempt(1, 0.0, 3, 9.0) + attempt(2, 10.0, 3, 12.0, finished=True)
    ok, detail = _corruption_check(events + [flipped(77, 2, 110, 4.0), found(125, 5.0, [2])],
                                   [corrupt_param(3.9, 77)])
    assert ok and detail.startswith("1 of 1 flipped bit(s) found"), detail
    pair = attempt(1, 0.0, 2, 9.0) + attempt(2, 10.0, 2, 12.0, finished=True)
    assert _corruption_check(pair + [flipped(77, 1, 110, 4.0), found(125, 5.0, [])], [corrupt_param(3.9, 77)])[0], \
        "two replicas: nobody can be named"
    ok, detail = _corruption_check(events + [flipped(77, 2, 110, 4.0), found(125, 5.0, [])], [corrupt_param(3.9, 77)])
    assert not ok and "naming nobody among 3 copies" in detail, "three replicas and one flip: a majority names it"
    hsdp = attempt(1, 0.0, 4, 9.0) + attempt(2, 10.0, 4, 12.0, finished=True)
    assert _corruption_check(hsdp + [flipped(77, 3, 110, 4.0), found(125, 5.0, []) | {"copies": 2}],
                             [corrupt_param(3.9, 77)])[0], "hsdp on two nodes: each shard has two copies"
    ok, detail = _corruption_check(events + [flipped(77, 2, 110, 4.0), found(125, 5.0, [0])], [corrupt_param(3.9, 77)])
    assert not ok and "naming [0]" in detail, "the wrong rank named"
    ok, detail = _corruption_check(events + [flipped(77, 2, 10, 4.0), found(75, 5.0, [2])], [corrupt_param(3.9, 77)])
    assert not ok and "found at step 75 (the last agreeing check: step 50)" in detail, "a check after it agreed"
    ok, detail = _corruption_check(events + [flipped(77, 2, 20, 0.5)], [corrupt_param(0.4, 77)])
    assert not ok and "never found (its attempt went on to step 90)" in detail


def test_a_flip_whose_attempt_ended_before_its_check_or_that_never_happened_is_excused() -> None:
    events = attempt(1, 0.0, 3, 9.0) + attempt(2, 10.0, 3, 12.0, finished=True)
    ok, detail = _corruption_check(events + [flipped(77, 2, 89, 8.9)], [corrupt_param(8.8, 77)])
    assert ok and "1 ended first by another fault" in detail, detail
    gone = corrupt_param(8.8, 77)
    gone.generation = 2  # a new attempt followed: its worker was gone before its next step boundary
    ok, detail = _corruption_check(events, [gone])
    assert ok and detail.startswith("0 of 1"), detail
    ok, detail = _corruption_check(events, [corrupt_param(5.0, 77)])
    assert not ok and "never flipped its bit" in detail, "a request nobody carried out, in a running attempt"


def poisoned(pid: int, rank: int, step: int, at: float, generation: int = 1) -> dict[str, Any]:
    return {"time": at, "kind": "chaos_nan", "pid": pid, "rank": rank, "step": step, "generation": generation,
            "interval_steps": 10}


def rolled_back(step: int, at: float, generation: int = 1, status: str = "rolled_back") -> dict[str, Any]:
    return {"time": at, "kind": "nonfinite_rollback", "rank": 0, "step": step, "generation": generation,
            "ranks": [1], "status": status}


def nan_batch(at: float, pid: int) -> Injected:
    injected = fault("nan-batch", at)
    injected.targets = [pid]
    return injected


def test_a_nan_batch_must_be_rolled_back_at_the_next_logging_step_of_its_attempt() -> None:
    events = attempt(1, 0.0, 2, 9.0) + attempt(2, 10.0, 2, 12.0, finished=True)
    ok, detail = _nonfinite_check(events + [poisoned(77, 1, 41, 4.0), rolled_back(41, 5.0)], [nan_batch(3.9, 77)],
                                  [41])
    assert ok and detail.startswith("1 of 1 NaN batch(es) rolled back") and "[41]" in detail, detail
    ok, detail = _nonfinite_check(events + [poisoned(77, 1, 41, 4.0)], [nan_batch(3.9, 77)], [])
    assert not ok and "never rolled back (its attempt went on to step 90)" in detail, detail
    ok, detail = _nonfinite_check(events + [poisoned(77, 1, 41, 4.0), rolled_back(41, 5.0, status="stopped")],
                                  [nan_batch(3.9, 77)], [])
    assert not ok and "stopped the job" in detail, detail
    ok, detail = _nonfinite_check(events + [poisoned(77, 1, 41, 4.0), rolled_back(41, 5.0, generation=2)],
                                  [nan_batch(3.9, 77)], [])
    assert not ok, "a rollback of another attempt is not this NaN's"
    ok, detail = _nonfinite_check(events + [poisoned(77, 1, 88, 8.9)], [nan_batch(8.8, 77)], [])
    assert ok and "1 ended first by another fault" in detail, "its attempt ended before the logging step"
    ok, detail = _nonfinite_check(events, [nan_batch(5.0, 77)], [])
    assert not ok and "never made its loss NaN" in detail, "a request nobody carried out, in a running attempt"


def _spare_seated(pid: int, at: float, world: int, waited_beside: int, per_node: int = 1) -> list[dict[str, Any]]:
    source = f"agent-vm-{pid}"
    return [{"time": at - 3.0, "kind": "agent_spare_waiting", "source": source, "max_nodes": waited_beside,
             "local_world_size": per_node},
            {"time": at + 0.5, "kind": "agent_rendezvous", "source": source, "world_size": world, "spare_s": 3.5}]


def _takeover(at: float, pid: int, world: int, generation: int) -> Injected:
    return Injected(type="spare-takeover", at=at, offset=at, description="spare-takeover", generation=generation,
                    world_size=world, targets=[pid])


def test_a_spare_takeover_must_keep_the_world_of_the_full_round_the_spare_waited_beside() -> None:
    history = attempt(1, 0.0, 3, 9.0) + attempt(2, 10.0, 3, 12.0, finished=True)
    ok, detail = _spare_check(history + _spare_seated(77, 9.5, 3, 3), [_takeover(9.5, 77, 3, 2)])
    assert ok and detail.startswith("1 of 1"), detail
    shrunk = attempt(1, 0.0, 3, 9.0) + attempt(2, 10.0, 2, 12.0, finished=True)
    ok, detail = _spare_check(shrunk + _spare_seated(77, 9.5, 2, 3), [_takeover(9.5, 77, 2, 2)])
    assert not ok and "world size 3 before, 2 after" in detail, detail
    ok, detail = _spare_check(history, [_takeover(9.5, 77, 3, 2)])
    assert not ok and "was not seated" in detail, "a recovery at the right size that the spare took no part in"
    # The soak: a replacement sealed a round of 3 a moment before the loss, while the attempt training was of 2; the
    # spare then waited beside that full round, and the recovery is at 3.
    filling = attempt(1, 0.0, 2, 9.0) + attempt(2, 10.0, 3, 12.0, finished=True)
    assert _spare_check(filling + _spare_seated(77, 9.5, 3, 3), [_takeover(9.5, 77, 3, 2)])[0]
    # Two processes per node: a full round of 2 nodes is a world of 4 ranks.
    pairs = attempt(1, 0.0, 4, 9.0) + attempt(2, 10.0, 4, 12.0, finished=True)
    ok, detail = _spare_check(pairs + _spare_seated(77, 9.5, 4, 2, per_node=2), [_takeover(9.5, 77, 4, 2)])
    assert ok, detail


def _slow(at: float, pid: int = 7) -> Injected:
    return Injected(type="slow-node", at=at, offset=at, description="slow", lasts_s=10.0, targets=[pid],
                    outcome="absorbed")


def _with_pid(events: list[dict[str, Any]], pid: int) -> list[dict[str, Any]]:
    return [e | {"pid": pid} if e["kind"] == "start" else e for e in events]


def test_a_slow_node_must_be_named_unless_another_faults_recovery_left_too_few_windows_to_name_it() -> None:
    """A new attempt starts every rank's count again. The soak's 8 such misses of 18: a join, a NaN rollback or a lost
    node's recovery in the middle of the 10 s, the last attempt stepping for 3 s or less of it."""
    named = {"time": 16.0, "kind": "straggler", "status": "named", "pid": 7, "rank": 1, "generation": 1}
    ridden_out = attempt(1, 0.0, 3, 40.0)
    assert _stragglers_check(_with_pid(ridden_out, 7) + [named], [_slow(10.0)], set())[0]
    ok, detail = _stragglers_check(_with_pid(ridden_out, 7), [_slow(10.0)], set())
    assert not ok and "the slow node at 10.0 s (pids [7]) was not named within 15 s" in detail
    # A recovery at 17.5 s: the new attempt's windows end at 18.5 and 19.5 s while the node is slow — too few.
    cut = _with_pid(attempt(1, 0.0, 3, 17.0), 7) + _with_pid(attempt(2, 17.5, 3, 40.0), 7)
    ok, detail = _stragglers_check(cut, [_slow(10.0)], set())
    assert ok and "1 cut short by another fault's recovery" in detail, detail
    # A recovery at 11 s: its windows end at 12 ... 19 s: enough to name it, and it was not.
    early = _with_pid(attempt(1, 0.0, 3, 11.0), 7) + _with_pid(attempt(2, 11.0, 3, 40.0), 7)
    assert not _stragglers_check(early, [_slow(10.0)], set())[0]
    # The throttled worker replaced by a new process (never throttled) at 11 s: nothing slow was left to name.
    replaced = _with_pid(attempt(1, 0.0, 3, 11.0), 7) + _with_pid(attempt(2, 11.0, 3, 40.0), 8)
    assert _stragglers_check(replaced, [_slow(10.0)], set())[0]


def test_a_node_slowed_again_while_it_is_still_named_from_the_last_time_counts_as_named() -> None:
    """The soak of 2026-12-06 throttled pid 5606 twice 12.4 s apart: named 8.2 s before the second throttle began and
    cleared 12 s after it, it was never named inside the second one — a named worker is not named again until it is
    cleared. A naming that was cleared before the second throttle, or another worker's naming, counts for nothing."""
    history = _with_pid(attempt(1, 0.0, 3, 40.0), 7)
    first = {"time": 1.8, "kind": "straggler", "status": "named", "pid": 7, "rank": 1}
    cleared = {"time": 22.0, "kind": "straggler", "status": "cleared", "pid": 7, "rank": 1}
    assert _stragglers_check(history + [first, cleared], [_slow(10.0)], set())[0]
    early_clear = cleared | {"time": 9.0}
    ok, detail = _stragglers_check(history + [first, early_clear], [_slow(10.0)], set())
    assert not ok and "was not named" in detail, detail
    other = first | {"pid": 8}
    ok, detail = _stragglers_check(history + [other, cleared], [_slow(10.0)], {8})
    assert not ok and "the slow node at 10.0 s (pids [7]) was not named" in detail, detail


def test_a_slow_node_not_named_is_reported_with_how_near_its_workers_came_to_the_straggler_ratio() -> None:
    """The thousand-fault soak of 2026-12-04 missed 5 slow nodes and could not say why; each logging window now
    carries every rank's ratio (``local_ratios``) and its seconds above the straggler ratio (``slow_s``)."""
    windows = _with_pid(attempt(1, 0.0, 2, 40.0), 7)
    ratios = {11.0: 1.4, 12.0: 2.1, 13.0: 1.9}
    measured = [e | {"local_ratios": [ratios.get(e["time"], 1.0), 1.0], "slow_s": [0.0, 0.0] if e["time"] != 12.0
                     else [0.9, 0.0]} if e["kind"] == "progress" else e for e in windows]
    ok, detail = _stragglers_check(measured, [_slow(10.0)], set())
    assert not ok and ("was not named within 15 s (over 16 logging window(s) its local time was 1.00-2.10x the median "
                       "rank's (median 1.00x), at most 0.9 s at or above the straggler ratio)") in detail, detail
    ok, detail = _stragglers_check(windows, [_slow(10.0)], set())
    assert not ok and "(no logging window of rank 0 recorded its workers' ratios then)" in detail, detail


def test_a_worker_never_slowed_that_is_named_fails_the_check_unless_a_starved_agent_was_starting_on_its_machine() -> None:
    """The 300-fault soak of 2026-12-04: rank 1, never throttled, was named at 3.9x its peers over 1.6 s while the
    chaos tool's spare agent started on the same 2-core machine, in 9.8 s against a median of 3.5 s. Named rightly —
    a noisy neighbour — but no fault the soak injected: excused, and counted in the detail. A start-up of the usual
    length, on another machine, or outside the straggler window before the naming excuses nothing."""
    history = _with_pid(attempt(1, 0.0, 3, 40.0), 7)
    throttled = {"time": 16.0, "kind": "straggler", "status": "named", "pid": 7, "rank": 1, "host": "a"}
    bystander = {"time": 30.0, "kind": "straggler", "status": "named", "pid": 9, "rank": 2, "host": "a",
                 "seconds": 1.6, "window_s": 3.0, "step": 8600}

    def started(host: str, begin: float, took: float) -> dict[str, Any]:
        return {"time": begin + took + 0.5, "kind": "agent_rendezvous", "host": host, "seconds": 0.5,
                "startup_s": took}

    usual = [started("a", at, 3.5) for at in (1.0, 5.0, 9.0)]  # the run's median start-up: 3.5 s

    def judged(*extra: dict[str, Any], named: dict[str, Any] = bystander) -> tuple[bool, str]:
        return _stragglers_check(history + usual + [throttled, named, *extra], [_slow(10.0)], set())

    ok, detail = judged()
    assert not ok and "rank 2 (pid 9) was named at step 8600 but never slowed" in detail, detail
    ok, detail = judged(started("a", 21.5, 9.8))
    assert ok and "1 worker(s) never slowed named while a starved agent started on their machine (at step(s) [8600])" \
        in detail, detail
    assert judged(started("a", 17.2, 9.8))[0], "its start-up ended at 27.0 s, the start of the 3 s window before 30 s"
    for elsewhere in (started("b", 21.5, 9.8),  # another machine
                      started("a", 17.0, 9.8),  # ended 26.8 s: before the window
                      started("a", 30.5, 9.8),  # began after the naming
                      started("a", 26.0, 3.5)):  # the usual length: the machine was not short of cores
        assert not judged(elsewhere)[0], elsewhere
    hostless = {k: v for k, v in bystander.items() if k != "host"}
    assert not judged(started("a", 21.5, 9.8), named=hostless)[0], "no host: no machine to share"
    # Events from before the window was recorded (the soak's): the window is the slow seconds, 1.6 s.
    windowless = {k: v for k, v in bystander.items() if k != "window_s"}
    assert judged(started("a", 18.7, 9.8), named=windowless)[0]  # ended 28.5 s
    assert not judged(started("a", 18.3, 9.8), named=windowless)[0]  # ended 28.1 s, before 28.4 s
