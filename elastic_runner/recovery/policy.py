"""The agent's recovery policy: for each failure of its workers, decided once — the job is done, the job stops, the
failed workers are replaced alone, or every worker restarts —, and for each new round whether its workers are kept.

:class:`~elastic_runner.agent.agent.ElasticRunnerAgent` asks :func:`after_worker_failure` when torch's monitor reports
failed workers, and carries the answer out (torch's agent restarts every worker; a replacement is started in the
keeping context, :mod:`elastic_runner.agent.worker_context`). The rules, in the order they are tried
(:data:`RULES` is this table; a test holds the two together):

=====================================================================  ============
when                                                                   the agent
=====================================================================  ============
every failed worker had said it finished the job (it failed after)     finishes
a worker exited with a job-ending status (2: config, 3: diverged, 4)   stops
this node's workers are not kept through failures (``in_process``)     restarts all
fewer restarts are left than workers failed                            restarts all
rank 0's worker failed (its process hosts the job's store)             restarts all
a worker exited because its peers were lost (75, 76)                   restarts all
otherwise (a worker killed or crashed)                                 replaces
=====================================================================  ============

A replacement also needs its peers told through the job's store (:func:`~elastic_runner.recovery.regroup.\
announce_replacement`); where that fails (the store is gone, the worker died before the round's first group was
formed) every worker restarts after all. A sticky device error is a crash like any (exit 1): the failed process is
replaced by a new one, never kept (:mod:`.states`).

For a new rendezvous round (a node joins or is lost, another node restarts every worker, or this node's workers
parked on their own: their peer lost, no replacement announced) the agent asks :func:`for_new_round`; the workers'
park and hand-over are :mod:`elastic_runner.agent.kept_round`'s (:data:`NEW_ROUND_RULES`):

=====================================================================  ============
when                                                                   the agent
=====================================================================  ============
this node's workers are not kept across rounds (no hand-over offered)  restarts all
a worker asked to park did not reach a step boundary in time           restarts all
otherwise (each parked worker is handed its place in the new round)    keeps
=====================================================================  ============

A worker that could not be asked (it was building, resuming or starting) or whose process is gone gets a new process
in the kept round (one asked inside its group's native start that does not come out of it ends its process itself:
:func:`~elastic_runner.recovery.rebuild.leaves_when_asked`); the others keep theirs (one placed in the round before
that still waits there for a new peer is asked again, and parks again).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum

from ..lifecycle import EXIT_FINAL, EXIT_PEER_LOST, EXIT_PEER_TIMEOUT


class Action(Enum):
    FINISH = "finishes"
    STOP = "stops"
    RESTART_ALL = "restarts all"
    REPLACE = "replaces"
    KEEP = "keeps"


@dataclass(frozen=True)
class Rule:
    when: str
    action: Action


#: The policy's rules, in the order they are tried (the module's docstring shows them).
RULES: tuple[Rule, ...] = (
    Rule("every failed worker had said it finished the job (it failed after)", Action.FINISH),
    Rule("a worker exited with a job-ending status (2: config, 3: diverged, 4)", Action.STOP),
    Rule("this node's workers are not kept through failures (``in_process``)", Action.RESTART_ALL),
    Rule("fewer restarts are left than workers failed", Action.RESTART_ALL),
    Rule("rank 0's worker failed (its process hosts the job's store)", Action.RESTART_ALL),
    Rule("a worker exited because its peers were lost (75, 76)", Action.RESTART_ALL),
    Rule("otherwise (a worker killed or crashed)", Action.REPLACE),
)

#: The rules for a new rendezvous round, in the order they are tried (the module's docstring shows them).
NEW_ROUND_RULES: tuple[Rule, ...] = (
    Rule("this node's workers are not kept across rounds (no hand-over offered)", Action.RESTART_ALL),
    Rule("a worker asked to park did not reach a step boundary in time", Action.RESTART_ALL),
    Rule("otherwise (each parked worker is handed its place in the new round)", Action.KEEP),
)


@dataclass(frozen=True)
class Decision:
    action: Action
    #: Why, one line for the log ("" where the action says it).
    why: str
    #: The job-ending exit status that stops it (``STOP`` only).
    final_status: int | None = None


def after_worker_failure(exit_codes: Mapping[int, int], *, finished: bool, keeps_workers: bool,
                         restarts_left: int) -> Decision:
    """What the agent does about failed workers: ``exit_codes`` by global rank; ``finished``: each of them had said it
    finished the job; ``keeps_workers``: this node's workers are kept through failures (in-process recovery under our
    agent); ``restarts_left``: ``--max-restarts`` not yet spent."""
    codes = set(exit_codes.values())
    if finished:
        return Decision(Action.FINISH, "its final snapshot is durable: the job is done here")
    final = sorted(codes & EXIT_FINAL)
    if final:
        return Decision(Action.STOP, f"exit status {final[0]}: restarting would fail the same way", final[0])
    if not keeps_workers:
        return Decision(Action.RESTART_ALL, "")
    if restarts_left < len(exit_codes):
        return Decision(Action.RESTART_ALL, "")  # (torch's agent says so, and ends the job where none is left)
    if 0 in exit_codes:
        return Decision(Action.RESTART_ALL, "rank 0's worker hosts the job's store")
    if codes & {EXIT_PEER_LOST, EXIT_PEER_TIMEOUT}:
        return Decision(Action.RESTART_ALL, f"exit status {sorted(codes)}: its peers were lost")
    return Decision(Action.REPLACE, "")


def for_new_round(*, offered: bool, park: Callable[[], bool]) -> Decision:
    """What the agent does with its workers for a new round: ``offered``: they are kept across rounds (in-process
    recovery under our agent, a hand-over for each local rank); ``park()`` asks every worker that can park to do so
    and says whether each one asked did in time (called only where the rules before it do not decide)."""
    if not offered:
        return Decision(Action.RESTART_ALL, "")
    if not park():
        return Decision(Action.RESTART_ALL, "a worker asked to park did not reach a step boundary in time")
    return Decision(Action.KEEP, "")
