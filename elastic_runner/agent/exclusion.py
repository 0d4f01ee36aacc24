"""The agent's side of excluding a node (``recovery.evict_stragglers``, :mod:`elastic_runner.recovery.exclusions`).

- **Leaving.** A worker of this node asks (:func:`elastic_runner.env.ask_to_exclude_this_node`: its node is a
  straggler); the agent records the exclusion in the rendezvous, writes a Kubernetes termination message, and leaves
  as a preempted node does (:class:`NodeExcluded` is torch's ``SignalException`` for SIGTERM: torch stops the workers,
  the rendezvous stays open for the others, the agent leaves it); it exits with
  :data:`~elastic_runner.recovery.exclusions.EXIT_EXCLUDED`. Never where the job would fall below ``--nnodes``'
  minimum: the node stays, and says so.
- **Refusing.** An agent whose node is excluded and not yet let back in leaves before its first round
  (:class:`NodeRefused`), with the same exit status and one line.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any, Callable

from torch.distributed.elastic.multiprocessing.api import SignalException

from ..env import agent_private_dir, exclusion_asked
from ..printable import printable
from ..recovery.exclusions import EXIT_EXCLUDED, Exclusions, for_handler, node_name
from ..rendezvous.options import run_scope

log = logging.getLogger(__name__)

#: Where Kubernetes reads a container's termination message (``terminationMessagePath``, its default); written only
#: where it exists (Kubernetes creates it), never created.
TERMINATION_LOG = "/dev/termination-log"
TERMINATION_LOG_VAR = "ELASTIC_RUNNER_TERMINATION_LOG"


class NodeExcluded(SignalException):
    """This node leaves the job and stays out (its workers stopped as on SIGTERM); the agent exits 6."""

    exit_status = EXIT_EXCLUDED

    def __init__(self, line: str) -> None:
        super().__init__(line, sigval=signal.SIGTERM)
        self.line = line


class NodeRefused(SignalException):
    """This node is excluded from the job and may not join yet: the agent exits 6 before its first round. (A
    ``SignalException`` too: torch's launcher shuts the rendezvous down after any other error, which would close the
    job for every node.)"""

    exit_status = EXIT_EXCLUDED

    def __init__(self, line: str) -> None:
        super().__init__(line, sigval=signal.SIGTERM)
        self.line = line


def exclusions_of(handler: Any, key: bytes | None, seconds: float | None = None) -> Exclusions | None:
    try:
        run_id = handler.get_run_id()
    except Exception:  # noqa: BLE001 - a handler without a run id keeps no exclusions
        return None
    return for_handler(handler, str(run_id), key, seconds, scope=run_scope())


def refuse_if_excluded(handler: Any, key: bytes | None) -> None:
    """Raise :class:`NodeRefused` where this node is excluded from the job ``handler`` runs and not let back in yet."""
    exclusions = exclusions_of(handler, key)
    if exclusions is None:
        return
    try:
        found = exclusions.find(node_name())
    except Exception:  # noqa: BLE001 - the rendezvous answers nothing yet: its own start-up says so
        log.debug("could not read this node's exclusion", exc_info=True)
        return
    if found is not None:
        left = found.until - time.time()
        raise NodeRefused(f"elastic_runner: node {found.node} is excluded from job {found.run_id} for another "
                          f"{left:.0f} s ({printable(found.reason, 1000)}); it may join again after "
                          "(recovery.exclusion_seconds), or once the record is removed from the rendezvous")


def minimum_nodes(handler: Any) -> int:
    """``--nnodes``' minimum, as the rendezvous has it (1 where it does not say)."""
    settings = getattr(handler, "settings", None) or getattr(handler, "_settings", None)
    return int(getattr(settings, "min_nodes", 1) or 1)


def leave_excluded(handler: Any, key: bytes | None, reason: str, seconds: float, nodes_now: int) -> NodeExcluded | None:
    """This node leaves the job for ``seconds`` (a worker asked, for ``reason``): the exception that stops the agent,
    or None where it stays (the job would fall below ``--nnodes``' minimum)."""
    least = minimum_nodes(handler)
    if nodes_now - 1 < least:
        log.warning("this node is a straggler, but it stays: without it the job would have %d nodes, fewer than "
                    "--nnodes' minimum %d (%s)", nodes_now - 1, least, reason)
        return None
    store = getattr(handler, "_store", None)
    if not callable(getattr(handler, "lasting_store", None)) and store is not None and \
            _listens_on(int(getattr(store, "port", 0) or 0)):
        log.warning("this node is a straggler, but it stays: its agent hosts the c10d rendezvous, which would end "
                    "with it for every node (etcd-v3 has no such node) (%s)", reason)
        return None
    node = node_name()
    exclusions = exclusions_of(handler, key, seconds)
    if exclusions is None:  # (the static rendezvous: a job that cannot go on without the node; or torch changed)
        log.warning("this node is a straggler, but it stays: its rendezvous (%s) keeps no exclusions, and a node that "
                    "left could not be kept out (%s)", _backend(handler), reason)
        return None
    recorded = False
    try:
        exclusions.exclude(node, seconds, reason)
        recorded = True
    except Exception as exc:  # noqa: BLE001 - it leaves all the same; it may come back at once
        log.warning("could not record this node's exclusion in the rendezvous (%s: %s): it leaves, and may join "
                    "again at once", type(exc).__name__, exc)
    line = (f"elastic_runner: node {node} leaves the job: {reason}. It is kept out for {seconds:g} s "
            f"(recovery.evict_stragglers){'' if recorded else ' (not recorded: it may join again at once)'}")
    termination_message(f"excluded: {reason}")
    return NodeExcluded(line)


def leave_if_asked(handler: Any, key: bytes | None, nodes_now: int, notify: Callable[..., None]) -> None:
    """Where a worker of this node asked that the node leave (:func:`elastic_runner.env.ask_to_exclude_this_node`, in
    the agent's private directory): raise :class:`NodeExcluded` (or say why it stays); ``notify(event, **fields)``
    hears which (``excluded`` or ``exclusion_declined``)."""
    asked = exclusion_asked(agent_private_dir())
    if asked is None:
        return
    reason, seconds = asked
    leaving = leave_excluded(handler, key, reason, seconds, nodes_now)
    notify("excluded" if leaving is not None else "exclusion_declined", reason=reason, seconds=seconds,
           node_name=node_name())
    if leaving is not None:
        log.warning("%s", leaving.line)
        raise leaving


def _backend(handler: Any) -> str:
    try:
        return str(handler.get_backend())
    except Exception:  # noqa: BLE001 - only for a log line
        return type(handler).__name__


def _listens_on(port: int) -> bool:
    """Whether this process listens on TCP ``port`` (it hosts the c10d rendezvous' store): its listening socket's
    inode among this process's open files (Linux's /proc; False where it cannot be told)."""
    if port <= 0:
        return False
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as rows:
                next(rows, None)
                for row in rows:
                    fields = row.split()
                    if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(fields[9])  # 0A: LISTEN
        except OSError:
            continue
    if not inodes:
        return False
    opened = set()
    try:
        descriptors = os.listdir("/proc/self/fd")
    except OSError:
        return False
    for fd in descriptors:
        try:
            opened.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue  # (closed meanwhile: the listing's own descriptor, for one)
    return any(f"socket:[{inode}]" in opened for inode in inodes)


def termination_message(text: str) -> None:
    """Say why this node's agent ends where Kubernetes shows it (``kubectl describe pod``), if it made the file."""
    path = os.environ.get(TERMINATION_LOG_VAR) or TERMINATION_LOG
    if not os.path.isfile(path):
        return
    try:
        with open(path, "w", encoding="utf-8", errors="backslashreplace") as out:
            out.write(text[:4000])  # Kubernetes keeps 4096 bytes of it
    except OSError:
        log.debug("could not write the termination message to %s", path, exc_info=True)
