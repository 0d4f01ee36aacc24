"""When a node's standby worker starts (``recovery.standby``), and when the agent stops starting them.

The standby (:mod:`elastic_runner.worker.standby`) builds the workload ahead and takes a failed worker's place
instead of a new process. It starts :data:`STANDBY_DELAY_S` after the workers (not while they build their own workload
on the same cores), :data:`STANDBY_AGAIN_S` after each replacement or loss, and one that ends on its own is started
again :data:`STANDBYS_LOST_LIMIT` times in a row at most: a standby that cannot live (out of memory, a broken
workload) must not be started forever beside the workers it would compete with.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Protocol

from torch.distributed.elastic.multiprocessing.api import SignalException

log = logging.getLogger(__name__)

#: Seconds from the workers' start to the start of the node's standby worker (they build their workload meanwhile).
STANDBY_DELAY_S = 2.0
#: Seconds from a failed worker's replacement (or a standby's loss) to the start of the next standby: the replacement
#: builds nothing when the standby took its place, and a second failure soon after the first is common.
STANDBY_AGAIN_S = 0.5
#: Standbys in a row that may end without taking a place (each is started again) before the agent stops starting them.
STANDBYS_LOST_LIMIT = 3


class Standbys(Protocol):
    """What the schedule uses of a keeping context (:class:`~elastic_runner.agent.worker_context.KeepingContext`)."""

    def start_standby(self) -> int | None: ...

    def standby_ready(self) -> tuple[int, bool, float] | None: ...

    def standby_lost(self) -> int | None: ...


class StandbySchedule:
    """The node's next standby's start, looked at on every pass of the agent's monitor loop (:meth:`tend`)."""

    def __init__(self, notify: Callable[..., Any]) -> None:
        self._notify = notify  #: the agent's observers: ``(event, **fields)``
        self.due: float | None = None  #: when (monotonic) the next standby starts; None: none is due
        self.lost_in_a_row = 0  #: standbys in a row that ended without taking a place

    def schedule(self, wanted: bool, delay: float | None = None) -> None:
        """The next standby starts ``delay`` seconds from now (default :data:`STANDBY_DELAY_S`), if ``wanted``."""
        self.due = time.monotonic() + (STANDBY_DELAY_S if delay is None else delay) if wanted else None

    def workers_started(self, wanted: bool) -> None:
        """New workers: a fresh count of lost standbys, and one due after the delay."""
        self.lost_in_a_row = 0
        self.schedule(wanted)

    def took_place(self) -> None:
        """The standby took a failed worker's place: it lived, the count of lost ones begins again."""
        self.lost_in_a_row = 0

    def again(self, wanted: bool) -> None:
        """Failed workers were replaced (by the standby or by new processes): the next standby soon, if ``wanted``."""
        self.schedule(wanted, STANDBY_AGAIN_S)

    def cancel(self) -> None:
        self.due = None

    def tend(self, keeping: Standbys | None) -> None:
        """Report a standby ready or lost (a lost one is started again, a few times in a row), and start the next
        one once it is due."""
        ready = keeping.standby_ready() if keeping is not None else None
        if ready is not None:
            pid, built, seconds = ready
            log.debug("standby worker pid %d ready in %.2fs%s", pid, seconds, "" if built else
                      " (without the workload: the worker it becomes builds it)")
            self._notify("standby_ready", pid=pid, built=built, seconds=round(seconds, 3))
        lost = keeping.standby_lost() if keeping is not None else None
        if lost is not None:
            self.lost_in_a_row += 1
            again = self.lost_in_a_row <= STANDBYS_LOST_LIMIT
            log.warning("the standby worker ended (exit status %d) before it took a place; %s", lost,
                        f"another starts in {STANDBY_AGAIN_S:g}s" if again else
                        f"{self.lost_in_a_row} in a row: no more standbys for these workers (a failed one is "
                        "replaced by a new process)")
            self._notify("standby_lost", exitcode=lost)
            if again:  # (only a standby started, hence wanted, can be lost)
                self.schedule(True, STANDBY_AGAIN_S)
        if self.due is None or time.monotonic() < self.due or keeping is None:
            return
        self.due = None
        try:
            pid = keeping.start_standby()
        except SignalException:
            raise
        except Exception as exc:  # noqa: BLE001 - without a standby a failed worker is replaced by a new process
            log.warning("the standby worker could not be started (%s: %s); a failed worker is replaced by a new "
                        "process", type(exc).__name__, exc)
            return
        if pid is not None:
            self._notify("standby_started", pid=pid)
