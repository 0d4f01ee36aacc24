"""The agent's side of the job's configuration record (:mod:`elastic_runner.recovery.job_config`).

- **Refusing.** Before its first round an agent compares its node's configuration with the running job's record; where
  a key differs it leaves with exit status 2 (:data:`~elastic_runner.lifecycle.EXIT_USAGE`) and one line that names
  the keys (:class:`ConfigRefused`), and the job's nodes never wait for it. A spare is refused so before it waits.
- **Recording.** The round's first node (group rank 0) records its configuration from a thread of its own, every
  :data:`~elastic_runner.recovery.job_config.REFRESH_S` while it is the first (:class:`ConfigRecord`); it does not
  write over a fresh record of another node that differs from its own.

Where the rendezvous keeps no records (the static one) or cannot be reached yet, nothing is compared: the workers'
resume still refuses a snapshot of another model or data.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any, Callable

from torch.distributed.elastic.multiprocessing.api import SignalException

from ..lifecycle import EXIT_USAGE
from ..printable import printable
from ..recovery.exclusions import lasting_store, node_name
from ..recovery.job_config import REFRESH_S, STALE_S, JobConfigs, node_local_keys
from ..rendezvous.options import run_scope
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


def job_records(handler: Any, key: bytes | None, clock: Callable[[], float] = time.time) -> JobConfigs | None:
    """The configuration records of the job ``handler`` runs; None where its rendezvous keeps no records."""
    try:
        run_id = str(handler.get_run_id())
    except Exception:  # noqa: BLE001 - a handler without a run id keeps no records
        return None
    store = lasting_store(handler, STALE_S)
    return None if store is None else JobConfigs(store, run_id, key, clock, scope=run_scope())


def refuse_if_config_differs(handler: Any, key: bytes | None, ours: dict[str, str] | None,
                             clock: Callable[[], float] = time.time) -> None:
    """Raise :class:`ConfigRefused` where the job ``handler`` runs records a configuration that differs from
    ``ours`` (:func:`~elastic_runner.recovery.job_config.digest`; None: nothing to compare)."""
    if ours is None:
        return
    records = job_records(handler, key, clock)
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
    # (the record's keys and node are whoever wrote it: printable() keeps them to one line that encodes)
    more = f" and {len(keys) - NAMED_KEYS} more" if len(keys) > NAMED_KEYS else ""
    named = ", ".join(printable(k, 80) for k in keys[:NAMED_KEYS]) + more
    termination_message(f"refused: its configuration differs from the running job's ({named})")  # (Kubernetes)
    raise ConfigRefused(
        f"elastic_runner: node {node_name()} does not join job {records.run_id}: its configuration differs from the "
        f"running job's ({named}; the job's as node {printable(running.node, 80)} has it). Start it with the job's "
        f"--config and --set overrides, script and versions (only {node_local_keys()} may differ by node)")


class ConfigRecord:
    """Records this node's configuration as the running job's, every :data:`REFRESH_S` from a thread of its own (a
    store that does not answer never holds up the agent's loop), while this node is the round's first."""

    def __init__(self, key: bytes | None, ours: dict[str, str] | None,
                 clock: Callable[[], float] = time.time) -> None:
        self._key, self._ours, self._clock = key, ours, clock
        self._records: JobConfigs | None = None  #: where this node records, while it is the round's first
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._declined: str | None = None  #: the other node whose differing record this node does not write over

    def round_done(self, handler: Any, group_rank: int) -> None:
        """A round completed with this node at ``group_rank``: the first node records from now on, the others stop
        (the new first node writes over their record). No store request here: not on the recovery path."""
        records = job_records(handler, self._key, self._clock) if self._ours is not None and group_rank == 0 else None
        with self._changed:
            self._records = records
            self._changed.notify_all()
        if records is not None and self._thread is None and not self._closed:
            self._thread = threading.Thread(target=self._run, name="elastic-runner-config-record", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """This node stops recording (its agent ends). Its last record goes stale within STALE_S."""
        with self._changed:
            self._closed, self._records = True, None
            self._changed.notify_all()

    def _run(self) -> None:
        while True:
            with self._changed:
                while self._records is None and not self._closed:
                    self._changed.wait()
                if self._closed:
                    return
                records = self._records
            self.write(records)
            with self._changed:
                if not self._closed:
                    self._changed.wait(REFRESH_S)

    def write(self, records: JobConfigs | None) -> bool:
        """One record of this node's configuration in ``records``, unless a fresh one of another node that differs
        is there (a node that got in unchecked does not make its configuration the job's: it is the one refused when it
        starts again). True where written."""
        if records is None or self._ours is None:
            return False
        try:
            there = records.running()
            differ = records.differing(self._ours, there) if there is not None and there.node != node_name() else []
            if there is not None and differ:
                if self._declined != there.node:
                    self._declined = there.node
                    log.warning("this node's configuration differs from the job's record (written by node %s: %s): "
                                "it does not write over it. The job's nodes run with two configurations; start every "
                                "node with the same --config and --set overrides", printable(there.node, 80),
                                ", ".join(printable(k, 80) for k in differ[:NAMED_KEYS]))
                return False
            records.record(node_name(), self._ours)
            return True
        except Exception as exc:  # noqa: BLE001 - a node that joins meanwhile goes uncompared, as before the check
            log.debug("could not record the job's configuration in the rendezvous (%s: %s)", type(exc).__name__, exc)
            return False
