"""The agent's recovery policy (:mod:`elastic_runner.recovery.policy`): for each failure of its workers, decided once,
whether the job is done, stops, has the failed workers replaced alone, or restarts every worker."""

from __future__ import annotations

import re

import pytest

from elastic_runner.lifecycle import EXIT_DIVERGED, EXIT_FAILED, EXIT_NOT_DURABLE, EXIT_PEER_LOST, EXIT_USAGE
from elastic_runner.recovery import policy
from elastic_runner.recovery.policy import NEW_ROUND_RULES, RULES, Action, after_worker_failure, for_new_round

KILLED = -9


def test_the_docstring_is_the_rule_table() -> None:
    doc = policy.__doc__ or ""
    rows = [line for line in doc.splitlines()
            if re.match(r"^\S.*\s{2,}(finishes|stops|restarts all|replaces|keeps)$", line)]
    parsed = [tuple(part.strip() for part in re.split(r"\s{2,}", row)) for row in rows]
    assert parsed == [(rule.when, rule.action.value) for rule in RULES + NEW_ROUND_RULES]


def _decide(codes: dict[int, int], *, finished: bool = False, keeps: bool = True, left: int = 10) -> Action:
    return after_worker_failure(codes, finished=finished, keeps_workers=keeps, restarts_left=left).action


@pytest.mark.parametrize(("codes", "finished", "keeps", "left", "action"), [
    ({3: KILLED}, True, True, 10, Action.FINISH),  # failed after it said it finished: nothing to do again
    ({3: EXIT_USAGE}, False, True, 10, Action.STOP),
    ({3: EXIT_DIVERGED, 2: KILLED}, False, True, 10, Action.STOP),  # one job-ending status stops it all
    ({3: EXIT_NOT_DURABLE}, False, False, 10, Action.STOP),
    ({3: KILLED}, False, False, 10, Action.RESTART_ALL),  # torch's own way: workers are not kept
    ({3: KILLED, 2: KILLED}, False, True, 1, Action.RESTART_ALL),  # not enough restarts for two replacements
    ({0: KILLED}, False, True, 10, Action.RESTART_ALL),  # rank 0's process hosts the store
    ({3: EXIT_PEER_LOST}, False, True, 10, Action.RESTART_ALL),  # it left because its peers were lost
    ({3: KILLED}, False, True, 10, Action.REPLACE),
    ({3: EXIT_FAILED, 2: KILLED}, False, True, 2, Action.REPLACE),  # a crash (a sticky device error too: exit 1)
], ids=["finished", "config", "diverged", "not-durable-not-kept", "not-kept", "restarts-short", "rank-0",
        "peers-lost", "killed", "crashed"])
def test_what_the_agent_does_about_failed_workers(codes: dict[int, int], finished: bool, keeps: bool, left: int,
                                                  action: Action) -> None:
    assert _decide(codes, finished=finished, keeps=keeps, left=left) is action


def test_a_stop_names_the_status_that_ends_the_job_and_a_restart_says_why() -> None:
    stop = after_worker_failure({1: EXIT_DIVERGED}, finished=False, keeps_workers=True, restarts_left=3)
    assert stop.final_status == EXIT_DIVERGED and "restarting would fail the same way" in stop.why
    restart = after_worker_failure({0: KILLED}, finished=False, keeps_workers=True, restarts_left=3)
    assert restart.why == "rank 0's worker hosts the job's store"


def test_for_a_new_round_the_workers_are_kept_only_where_offered_and_every_one_asked_parked() -> None:
    asked: list[bool] = []

    def park(answer: bool) -> bool:
        asked.append(answer)
        return answer

    assert for_new_round(offered=False, park=lambda: park(True)).action is Action.RESTART_ALL
    assert asked == [], "no worker is asked to park where none can be handed a place"
    late = for_new_round(offered=True, park=lambda: park(False))
    assert late.action is Action.RESTART_ALL and "did not reach a step boundary" in late.why
    assert for_new_round(offered=True, park=lambda: park(True)).action is Action.KEEP
    assert asked == [False, True]
