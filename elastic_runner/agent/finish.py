"""How an agent's part of a job ends within seconds, whatever happens in the job's last moments.

torch's agent, once its workers succeeded, waits in an *exit barrier* until every agent of the round has arrived,
for up to ``exit_barrier_timeout`` (300 s). An agent whose worker dies in the job's last moments — the final
snapshot durable, the process failing in its teardown — would instead start a new rendezvous round that nobody
joins, and every other node would wait out the barrier. So:

- a worker says it finished the job (:func:`~elastic_runner.env.say_finished`) the moment it has; a failure
  of that process afterwards is the success it was (:func:`failed_after_finishing`): no new round;
- an agent in the exit barrier stops waiting when a node asks for a new round instead of arriving
  (:func:`wait_at_exit`): the job is finished here, and that node resumes from the final snapshot on its own.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from torch.distributed.elastic.multiprocessing.api import SignalException

from ..env import agent_private_dir, finished_pids
from . import stop_signal

log = logging.getLogger(__name__)

#: torch's key prefix of the exit barrier (``torch.distributed.elastic.agent.server.api._TERMINAL_STATE_SYNC_ID``).
BARRIER_KEY = "torchelastic/agent/terminal_state"
#: How often the barrier is looked at.
SLICE_S = 0.2


def failed_after_finishing(failures: dict[int, Any], directory: str | None = None) -> bool:
    """Whether every failed worker (``RunResult.failures``: rank -> ProcessFailure) had said it finished the job
    before it failed."""
    directory = directory if directory is not None else agent_private_dir()
    said = finished_pids(directory)
    return bool(failures) and all(getattr(f, "pid", None) in said for f in failures.values())


def wait_at_exit(store: Any, world_size: int, timeout_s: float, nodes_waiting: Callable[[], int]) -> str:
    """Arrive at torch's exit barrier and wait for the round's other agents: ``"all"`` once they have arrived,
    ``"new round"`` when a node asks for a round instead (it will not arrive), ``"timeout"`` after ``timeout_s``."""
    arrived = store.add(f"{BARRIER_KEY}/num_members", 1)
    last = f"{BARRIER_KEY}/last_member"
    if arrived == world_size:
        store.set(last, "<val_ignored>")  # as torch's barrier: the last to arrive lets the others go
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if store.check([last]):
            return "all"
        stop_signal.raise_if_received()  # (a stop that arrived in a store request of this wait)
        try:
            waiting = nodes_waiting()
        except SignalException:
            raise
        except Exception:  # noqa: BLE001 - a rendezvous that cannot say: wait on, as torch does
            waiting = 0
        if waiting > 0:
            return "new round"
        time.sleep(SLICE_S)
    return "timeout"
