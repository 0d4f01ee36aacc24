"""The agent's side of the job's configuration record (:mod:`elastic_runner.recovery.job_config`).

- **Refusing.** Before its first round an agent compares its node's configuration with the running job's record; where
  a key differs it leaves with exit status 2 (:data:`~elastic_runner.lifecycle.EXIT_USAGE`) and one line that names
  the keys (:class:`ConfigRefused`), and the job's nodes never wait for it. A spare is refused so before it waits.
- **Recording.** The round's first node (group rank 0) records its configuration after each round, and again every
  :data:`~elastic_runner.recovery.job_config.REFRESH_S` while its workers run (:class:`ConfigRecord`).

Where the rendezvous keeps no records (the static one) or cannot be reached yet, nothing is compared: the workers'
resume still refuses a snapshot of another model or data.
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Any, Callable

from torch.distributed.elastic.multiprocessing.api import SignalException

from ..lifecycle import EXIT_USAGE
from ..recovery.exclusions import lasting_store, node_name
from ..recovery.job_config import REFRESH_S, STALE_S, JobConfigs
from .exclusion import termination_message

log = logging.getLogger(__name__)

#: Keys named in the refusal's line before "and N more".
NAMED_KEYS = 8


class ConfigRefused(SignalException):
    """This node's configuration differs from the running job's: the agent exits 2 before its first round. (A
    ``SignalException``: torch's launcher shuts the rendezvous down after any other error, which would close the job
    for every node.)"""

    exit_status = EXIT_USAGE

    def __init__(self, line: str) -> None:
        super().__init__(line, sigval=signal.SIGTERM)
        self.line = line


def _records(handler: Any, key: bytes | None, clock: Callable[[], float] = time.time) -> JobConfigs | None:
    try:
        run_id = str(handler.get_run_id())
    except Exception:  # noqa: BLE001 - a handler without a run id keeps no records
        return None
    store = lasting_store(handler, STALE_S)
    return None if store is None else JobConfigs(store, run_id, key, clock)


def refuse_if_config_differs(handler: Any, key: bytes | None, ours: dict[str, str] | None,
                             clock: Callable[[], float] = time.time) -> None:
    """Raise :class:`ConfigRefused` where the job ``handler`` runs records a configuration that differs from
    ``ours`` (:func:`~elastic_runner.recovery.job_config.digest`; None: nothing to compare)."""
    if ours is None:
        return
    records = _records(handler, key, clock)
    if records is None:
        return
    try:
        running = records.running()
    except Exception:  # noqa: BLE001 - the rendezvous answers nothing yet: its own start-up says so
        log.debug("could not read the job's configuration record", exc_info=True)
        return
    if running is None:
        return
    keys = records.differing(ours, running)
    if not keys:
        return
    named = ", ".join(keys[:NAMED_KEYS]) + (f" and {len(keys) - NAMED_KEYS} more" if len(keys) > NAMED_KEYS else "")
    termination_message(f"refused: its configuration differs from the running job's ({named})")  # (Kubernetes)
    raise ConfigRefused(
        f"elastic_runner: node {node_name()} does not join job {records.run_id}: its configuration differs from the "
        f"running job's ({named}; the job's as node {running.node} has it). Start it with the job's --config and "
        "--set overrides, script and versions (only run.dir, snapshot.dir, data.num_workers, metrics.*, logging.level/"
        "format/progress_bar, recovery.health_check/standby may differ by node)")


class ConfigRecord:
    """Records this node's configuration as the running job's, while it is the round's first node."""

    def __init__(self, key: bytes | None, ours: dict[str, str] | None,
                 clock: Callable[[], float] = time.time) -> None:
        self._key, self._ours, self._clock = key, ours, clock
        self._records: JobConfigs | None = None
        self._due: float | None = None  #: when (``clock``) the next record is written; None: this node writes none
        self._last: Any = None  #: the last record this node wrote

    def round_done(self, handler: Any, group_rank: int) -> None:
        """A round completed with this node at ``group_rank``: the first node records, the others stop."""
        self._due = None
        if self._ours is None or group_rank != 0:
            self.close()
            return
        self._records = _records(handler, self._key, self._clock)
        if self._records is not None:
            self._due = self._clock()  # written at the next look of the monitoring loop: not on the recovery path

    def tick(self) -> None:
        """Called from the agent's monitoring loop: writes the record when it is due (one store write a minute)."""
        if self._due is None or self._records is None or self._ours is None or self._clock() < self._due:
            return
        self._due = self._clock() + REFRESH_S
        try:
            self._last = self._records.record(node_name(), self._ours)
        except Exception as exc:  # noqa: BLE001 - a node that joins then goes uncompared, as before the check
            log.debug("could not record the job's configuration in the rendezvous (%s: %s)", type(exc).__name__, exc)

    def close(self) -> None:
        """This node stops recording (it ends, or is no longer the round's first): its last record is removed where
        it is still the one there, so that the job's rendezvous id can be used again at once with another
        configuration."""
        self._due = None
        last, self._last = self._last, None
        if last is None or self._records is None:
            return
        try:
            self._records.withdraw(last)
        except Exception:  # noqa: BLE001 - it goes stale in STALE_S all the same
            log.debug("could not remove the job's configuration record", exc_info=True)
