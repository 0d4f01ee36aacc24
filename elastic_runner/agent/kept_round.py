"""A new rendezvous round that keeps this node's workers: the agent side of in-process recovery across a
membership change (a node joins, a node is lost, a node restarts every worker).

torch's agent restarts every worker for each new round: ``_restart_workers`` stops them all, and
``_initialize_workers`` runs the round and starts new processes with the round's environment. With
``recovery.in_process`` our agent (:class:`~elastic_runner.agent.agent.ElasticRunnerAgent`) instead

1. asks each running worker to park (:func:`park`): it leaves its attempt at the next step boundary, keeps that
   step in node memory, gives its process group up and waits (:mod:`elastic_runner.worker.handover`);
2. runs the round as torch does;
3. hands each parked worker its place in the new round instead of starting a process (:func:`handing_over`):
   the environment torch would have given a new one. Only a local rank whose process is gone gets a new process.

A worker that does not park within :data:`PARK_WAIT_S` (stuck in native code, still building its workload) makes
the agent fall back to torch's restart of every worker of the node (a parked worker ends at once on its SIGTERM).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import time
from typing import Any, Iterator

from ..worker.handover import HANDOVER_DIR_VAR, Handover
from ..worker.lifecycle import proc_state
from .worker_context import KeepingContext

log = logging.getLogger(__name__)

#: Seconds the node's workers have to reach a step boundary and park (a step takes milliseconds to seconds).
PARK_WAIT_S = 15.0
#: Where torch's agent starts the workers of a round (the name is swapped while the places are handed over).
LOCAL_AGENT = "torch.distributed.elastic.agent.server.local_elastic_agent"


def handovers(local_world_size: int) -> list[Handover] | None:
    """This agent's hand-over for each local rank; None where it offers none (no private directory)."""
    directory = os.environ.get(HANDOVER_DIR_VAR)
    if not directory or not os.path.isdir(directory):
        return None
    return [Handover(directory, local_rank) for local_rank in range(local_world_size)]


def _alive(keeping: KeepingContext, local_rank: int) -> bool:
    process = keeping._pc.processes[local_rank] if keeping._pc is not None else None
    return process is not None and process.is_alive() and proc_state(process.pid) not in ("", "Z", "X", "T", "t")


def parked(keeping: KeepingContext, places: list[Handover]) -> list[int]:
    """The local ranks whose worker parked on its own (a peer lost, and no replacement came)."""
    return [h.local_rank for h in places if h.parked_pid() is not None and _alive(keeping, h.local_rank)]


def park(keeping: KeepingContext, places: list[Handover], why: str, wait_s: float = PARK_WAIT_S) -> bool:
    """Ask every running worker of the node to park; True once each has (or its process is gone: a new one takes its
    place), False when one did not within ``wait_s`` (the caller restarts every worker, and clears the requests)."""
    if keeping._pc is None:
        return False
    running = [h for h in places if _alive(keeping, h.local_rank)]
    if not running:
        return False  # nothing to keep: torch's restart
    for place in running:
        if place.parked_pid() is None:
            place.ask_to_park(why)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        waiting = [h.local_rank for h in running if h.parked_pid() is None and _alive(keeping, h.local_rank)]
        if not waiting:
            kept = [h.local_rank for h in running if _alive(keeping, h.local_rank)]
            if kept:
                log.debug("local ranks %s parked for the next round", kept)
            return bool(kept)
        time.sleep(0.01)
    log.warning("local ranks %s did not reach a step boundary within %gs of being asked to park; every worker of "
                "this node restarts for the next round", waiting, wait_s)
    for place in places:
        place.clear()
    return False


@contextlib.contextmanager
def handing_over(keeping: KeepingContext, places: list[Handover]) -> Iterator[list[tuple[int, int, bool]]]:
    """While inside, torch's agent starting the round's workers hands each parked worker its place instead, and
    starts a process only where the old one is gone. Yields the list it fills: ``(local_rank, pid, kept)``."""
    module = importlib.import_module(LOCAL_AGENT)
    original = module.start_processes
    outcome: list[tuple[int, int, bool]] = []

    def hand_over(*, envs: dict[int, dict[str, str]], **_: Any) -> KeepingContext:
        for local_rank, env in sorted(envs.items()):
            place = places[local_rank]
            if place.parked_pid() is not None and _alive(keeping, local_rank):
                keeping.envs[local_rank] = dict(env)
                place.give_place(env)
                outcome.append((local_rank, int(keeping._pc.processes[local_rank].pid), True))  # type: ignore[union-attr]
                continue
            place.clear()
            process = keeping._pc.processes[local_rank]  # type: ignore[union-attr]
            if process.is_alive():  # neither parked nor gone (a race with its own failure): it cannot take a place
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
