"""A new rendezvous round that keeps this node's workers: the agent side of in-process recovery across a
membership change (a node joins, a node is lost, a node restarts every worker).

torch's agent restarts every worker for each new round: ``_restart_workers`` stops them all, and
``_initialize_workers`` runs the round and starts new processes with the round's environment. With
``recovery.in_process`` our agent (:class:`~elastic_runner.agent.agent.ElasticRunnerAgent`) instead

1. asks each running worker that can park (in its training loop) to do so (:func:`park`): it leaves its attempt at
   the next step boundary, keeps that step in node memory, gives its process group up and waits
   (:mod:`elastic_runner.recovery.handover`);
2. runs the round as torch does;
3. hands each parked worker its place in the new round instead of starting a process (:func:`handing_over`):
   the environment torch would have given a new one. A local rank whose worker could not park (it was building,
   resuming or starting) or is gone gets a new process. A worker placed in the round before, still waiting there for
   a new peer, parks again.

A worker that was asked and does not park within :data:`PARK_WAIT_S` (a step stuck in native code) makes the agent
fall back to torch's restart of every worker of the node (a parked worker ends at once on its SIGTERM).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import time
from typing import Any, Iterator

from ..recovery.handover import HANDOVER_DIR_VAR, Handover
from ..lifecycle import proc_state
from .. import torch_patches
from .worker_context import KeepingContext

log = logging.getLogger(__name__)

#: Seconds the node's workers have to reach a step boundary and park (a step takes milliseconds to seconds).
PARK_WAIT_S = 15.0


def handovers(local_world_size: int) -> list[Handover] | None:
    """This agent's hand-over for each local rank; None where it offers none (no private directory)."""
    directory = os.environ.get(HANDOVER_DIR_VAR)
    if not directory or not os.path.isdir(directory):
        return None
    return [Handover(directory, local_rank) for local_rank in range(local_world_size)]


def _pid(keeping: KeepingContext, local_rank: int) -> int | None:
    """The pid of ``local_rank``'s worker while it runs (not stopped: a SIGSTOPped one answers nothing)."""
    process = keeping._pc.processes[local_rank] if keeping._pc is not None else None
    if process is None or not process.is_alive() or proc_state(process.pid) in ("", "Z", "X", "T", "t"):
        return None
    return int(process.pid)


def _is_parked(keeping: KeepingContext, place: Handover) -> bool:
    pid = place.parked_pid()
    return pid is not None and pid == _pid(keeping, place.local_rank)


def parked(keeping: KeepingContext, places: list[Handover]) -> list[int]:
    """The local ranks whose worker parked on its own (a peer lost, and no replacement came)."""
    return [h.local_rank for h in places if _is_parked(keeping, h)]


def lost_agents(keeping: KeepingContext, places: list[Handover], agents: int) -> tuple[int, ...]:
    """The group ranks of the round's agents (``agents`` of them) that this node's parked workers saw stop beating:
    their nodes are lost."""
    return tuple(sorted({g for h in places if _is_parked(keeping, h) for g in h.lost_agents(agents)}))


def park(keeping: KeepingContext, places: list[Handover], why: str, wait_s: float = PARK_WAIT_S) -> bool:
    """Ask every worker of the node that can park to do so; True once each has (a worker that cannot — it builds,
    resumes or starts — or whose process is gone gets a new process in the round), False when none
    can be kept or one that was asked did not park within ``wait_s`` (the caller restarts every worker; the requests
    are withdrawn)."""
    if keeping._pc is None:
        return False
    asked = []
    for place in places:
        pid = _pid(keeping, place.local_rank)
        if pid is None or place.parked_pid() == pid:
            continue
        if place.ready_pid() == pid:
            place.ask_to_park(why)
            asked.append(place)
    deadline = time.monotonic() + wait_s
    while True:
        waiting = [h.local_rank for h in asked if not _is_parked(keeping, h) and _pid(keeping, h.local_rank)]
        if not waiting:
            break
        if time.monotonic() >= deadline:
            log.warning("local ranks %s did not reach a step boundary within %gs of being asked to park; every "
                        "worker of this node restarts for the next round", waiting, wait_s)
            for place in places:
                place.withdraw()
            return False
        time.sleep(0.01)
    kept = parked(keeping, places)
    if kept:
        log.debug("local ranks %s parked for the next round", kept)
    else:
        for place in places:
            place.withdraw()
    return bool(kept)


@contextlib.contextmanager
def handing_over(keeping: KeepingContext, places: list[Handover]) -> Iterator[list[tuple[int, int, bool]]]:
    """While inside, torch's agent starting the round's workers hands each parked worker its place instead, and
    starts a process only where the old one is gone. Yields the list it fills: ``(local_rank, pid, kept)``."""
    # Where torch's agent starts the workers of a round (the name is swapped while the places are handed over;
    # checked by torch_patches.KEPT_ROUNDS).
    module = importlib.import_module(torch_patches.LOCAL_AGENT)
    original = module.start_processes
    outcome: list[tuple[int, int, bool]] = []

    def hand_over(*, envs: dict[int, dict[str, str]], **_: Any) -> KeepingContext:
        for local_rank, env in sorted(envs.items()):
            place = places[local_rank]
            if _is_parked(keeping, place):
                keeping.envs[local_rank] = dict(env)
                place.give_place(env)
                outcome.append((local_rank, int(keeping._pc.processes[local_rank].pid), True))  # type: ignore[union-attr]
                continue
            place.clear()
            process = keeping._pc.processes[local_rank]  # type: ignore[union-attr]
            if process.is_alive():  # it could not park (or its own failure raced the request): a new process
                process.kill()
                process.join(5)
            pid, _from_standby = keeping.replace(local_rank, env)
            outcome.append((local_rank, pid, False))
        return keeping

    module.start_processes = hand_over
    try:
        yield outcome
    finally:
        module.start_processes = original
