"""Nodes kept out of a job for a while (``recovery.evict_stragglers``): recorded in the rendezvous, refused at the
next rounds.

A node named a straggler leaves the job (its agent stops its workers as a preempted node's do) and an
:class:`~elastic_runner.recovery.channel.Excluded` record under its name stays in the rendezvous' own store for
``recovery.exclusion_seconds``: an agent started again on that node before the time is up reads it before it joins a
round, and leaves at once with :data:`EXIT_EXCLUDED` and one line that says until when and why. Where the record
lives:

- ``etcd-v3``: a key under the run's prefix with an etcd lease of its own, as long as the exclusion: etcd deletes it
  when the time is up, whoever is alive;
- ``c10d``: a key in the rendezvous host's store (it lives as long as that agent does, and says until when).

Records are messages of the recovery channel, signed with the job's key where it has one: a writer of the store
without the key can neither keep a healthy node out nor let an excluded one back in early (it can delete a record:
the node may then join early). A node is known by its name (:func:`node_name`): the host's name, or
``ELASTIC_RUNNER_NODE_NAME`` (a Kubernetes pod's name is its hostname already).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any, Callable

from ..lifecycle import EXIT_EXCLUDED
from .channel import Channel, Excluded

__all__ = ["EXIT_EXCLUDED", "Exclusions", "for_handler", "lasting_store", "node_name", "NODE_NAME_VAR", "scope_context"]

log = logging.getLogger(__name__)

#: The environment variable that names this node for exclusions (default: the host's name).
NODE_NAME_VAR = "ELASTIC_RUNNER_NODE_NAME"



def node_name() -> str:
    return os.environ.get(NODE_NAME_VAR) or socket.gethostname()


class Exclusions:
    """The exclusions of job ``run_id`` in ``store`` (set/get/check, the rendezvous' own), signed with ``key`` and
    bound to the run's ``scope`` (:func:`scope_context`)."""

    def __init__(self, store: Any, run_id: str, key: bytes | None, clock: Callable[[], float] = time.time,
                 scope: str = "") -> None:
        self.channel, self.run_id, self._clock = Channel(store, key, scope_context(scope)), run_id, clock

    def exclude(self, node: str, seconds: float, reason: str) -> Excluded:
        record = Excluded(self.run_id, node, self._clock() + seconds, reason[:1000])
        self.channel.send(record)
        return record

    def find(self, node: str) -> Excluded | None:
        """The exclusion of ``node`` that is not over yet, or None."""
        record = self.channel.read(Excluded, Excluded(self.run_id, node, 0.0, "").key())
        return record if record is not None and record.until > self._clock() else None


def scope_context(scope: str) -> str:
    """What a lasting record's signature binds besides its key: the run's scope
    (:data:`~elastic_runner.rendezvous.options.SCOPE_VAR`, the Job's UID on Kubernetes). The store's keys are under
    the scope already (etcd-v3); bound in the signature too, a record copied from another run's keys (the same
    ``--rdzv_id``, the same job key) into this run's does not verify: nobody's word."""
    return f"scope {scope}" if scope else ""


def _backend_of(handler: Any) -> str:
    try:
        return str(handler.get_backend())
    except Exception:  # noqa: BLE001 - a handler that does not say
        return ""


def lasting_store(handler: Any, seconds: float | None = None) -> Any | None:
    """The store of the rendezvous ``handler`` runs (our etcd-v3 handler, or torch's c10d one) for records that
    outlast rounds (``set``, ``get``, ``check``); None where it keeps none (the static rendezvous, another backend).
    ``seconds``: the lifetime of a record written through it (etcd-v3 gives it a lease that long; c10d's lives as
    long as the rendezvous host's agent)."""
    if _backend_of(handler) == "static":
        return None  # (no rounds: a node that left ends the job, whatever it records)
    lasting = getattr(handler, "lasting_store", None)
    if callable(lasting):  # etcd-v3: a lease of its own
        return lasting(seconds)
    store = getattr(handler, "_store", None)  # torch's DynamicRendezvousHandler (torch_patches.EXCLUSIONS)
    if store is not None and all(callable(getattr(store, name, None)) for name in ("set", "get", "check")):
        return store
    return None


def for_handler(handler: Any, run_id: str, key: bytes | None, seconds: float | None = None,
                scope: str = "") -> Exclusions | None:
    """The exclusions of the rendezvous ``handler`` runs (:func:`lasting_store`); None where it keeps none.
    ``seconds``: the lifetime of a record written through it (etcd-v3 gives it a lease that long); ``scope``: the
    run's (:func:`scope_context`)."""
    store = lasting_store(handler, seconds)
    return None if store is None else Exclusions(store, run_id, key, scope=scope)
