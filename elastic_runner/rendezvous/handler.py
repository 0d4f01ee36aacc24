"""torch's ``DynamicRendezvousHandler`` on the etcd backend, made to survive an etcd outage.

The handler drops a node from the rendezvous once its heartbeat is older than
``keep_alive_interval * keep_alive_max_attempt`` (the *window*: 3 s with ``elastic-runner
launch``'s settings, 15 s with torch's). It applies that rule to whatever it reads, its own node
included, and writes only when it has changes of its own. When etcd is away for longer than the
window (a restart, a slow leader election), every heartbeat in the state is stale when it comes
back, so each agent, on its first read, drops every node, itself included, from its local copy,
sees nothing to write and stops heartbeating for good. Training goes on (workers never talk to
etcd), but the record in etcd is frozen: the next node to arrive finds only dead participants,
starts a round of its own instead of joining the wait list, and trains beside the old group until
snapshot fencing stops the older generation (seen with a 10 s outage: a world of 1 next to the
world of 2, then a world of 3).

``EtcdRendezvousHandler`` keeps torch's protocol and adds two rules, applied whenever the state
is read (``OutageTolerantStateHolder._sanitize``):

- *A live agent is not dead.* While this agent is a participant of a complete round (between the
  end of its ``next_rendezvous`` and the start of the next one), it never counts its own heartbeat
  as missed: if its heartbeat is stale, or another agent dropped it meanwhile, it puts itself back
  with its rank and a fresh heartbeat, and writes that. Its workers are in fact still part of that
  round; dropping a participant from a complete round restarts nobody anyway, it only falsifies
  the record the next round is formed from.
- *Grace after an outage.* After a read that follows a gap longer than the window (this agent could
  not reach etcd either), it counts no missed heartbeats of others for one more window, so agents
  that get through to etcd a little later are not dropped in the meantime.

A node that stays silent for a full window after etcd is back is dropped as before. The classes
override torch internals that have been stable since torch 1.9 (``from_backend``, the state
holder's ``_sanitize``), checked by :data:`elastic_runner.torch_patches.OUTAGE_TOLERANT_HANDLER`.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timedelta, timezone

from torch.distributed import Store
from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    RendezvousSettings,
    RendezvousTimeout,
    _BackendRendezvousStateHolder,
    _NodeDesc,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    create_handler as torch_create_handler,
)

log = logging.getLogger(__name__)


class OutageTolerantStateHolder(_BackendRendezvousStateHolder):
    """torch's state holder plus the two rules of the module docstring."""

    def __init__(self, backend: RendezvousBackend, settings: RendezvousSettings, node: _NodeDesc) -> None:
        super().__init__(backend, settings)
        self.node = node
        #: (round, rank) of the complete round this agent is part of; None while it (re)joins
        self.member_of: tuple[int, int] | None = None
        self._previous_sync = -1.0
        self._grace_until = -1.0
        self._repaired = False

    @property
    def window(self) -> float:
        return (self._settings.keep_alive_interval * self._settings.keep_alive_max_attempt).total_seconds()

    def sync(self) -> bool | None:
        result = self._sync_once()
        for _ in range(3):
            if not self._repaired:
                break
            # Write the repaired record at once, with the token just read: left for the next sync (a
            # second later) it would lose every time against the other agents' heartbeats.
            result = self._sync_once()
        return result

    def _sync_once(self) -> bool | None:
        self._repaired = False
        self._previous_sync = self._last_sync_time  # the round trip before this one (torch updates it in sync)
        return super().sync()

    def _sanitize(self) -> None:
        now = time.monotonic()
        gap = now - self._previous_sync
        if self._previous_sync >= 0 and gap > self.window:
            self._grace_until = now + self.window
            log.warning("The rendezvous backend could not be reached for %.0f s; nodes whose heartbeats went stale "
                        "meanwhile get %.0f s to send a new one before they count as dead.", gap, self.window)
        self._keep_self_alive()
        if now < self._grace_until:
            self._dead_nodes = []
            return
        super()._sanitize()

    def _keep_self_alive(self) -> None:
        if self.member_of is None:
            return
        state = self._state
        round_, rank = self.member_of
        if state.round != round_ or not state.complete or state.closed:
            return
        now = datetime.now(timezone.utc)
        beat = state.last_heartbeats.get(self.node)
        dropped = self.node not in state.participants
        if not dropped and beat is not None and (now - beat).total_seconds() <= self.window:
            return
        if dropped:
            log.warning("The node '%s' was dropped from round %d of the rendezvous '%s' (its heartbeats did not reach "
                        "the backend in time); it is still running that round as rank %d and puts itself back.",
                        self.node, round_, self._settings.run_id, rank)
        state.participants[self.node] = rank
        state.last_heartbeats[self.node] = now
        self._dirty = self._repaired = True


class EtcdRendezvousHandler(DynamicRendezvousHandler):
    """``DynamicRendezvousHandler`` with an ``OutageTolerantStateHolder`` (see the module docstring)."""

    _state_holder: OutageTolerantStateHolder

    @classmethod
    def from_backend(cls, run_id: str, store: Store, backend: RendezvousBackend, min_nodes: int, max_nodes: int,
                     local_addr: str | None = None, timeout: RendezvousTimeout | None = None,
                     keep_alive_interval: int = 5, keep_alive_max_attempt: int = 3) -> "EtcdRendezvousHandler":
        # torch's from_backend, with our state holder
        node = cls._node_desc_generator.generate(local_addr)
        settings = RendezvousSettings(run_id, min_nodes, max_nodes, timeout or RendezvousTimeout(),
                                      keep_alive_interval=timedelta(seconds=keep_alive_interval),
                                      keep_alive_max_attempt=keep_alive_max_attempt)
        return cls(node, settings, backend.name, store, OutageTolerantStateHolder(backend, settings, node))

    def next_rendezvous(self) -> RendezvousInfo:
        holder = self._state_holder
        holder.member_of = None  # our own exit and join change our membership on purpose
        info = super().next_rendezvous()
        holder.member_of = (holder.state.round, info.rank)
        return info


def create_handler(store: Store, backend: RendezvousBackend, params: RendezvousParameters) -> DynamicRendezvousHandler:
    """Like torch's ``create_handler`` (same ``--rdzv_conf`` keys, same validation), returning ours, or
    torch's own handler when this torch's internals no longer fit ours (with a warning)."""
    from ..torch_patches import OUTAGE_TOLERANT_HANDLER, usable

    reference = torch_create_handler(store, backend, params)  # parses and validates exactly as torch does
    if not usable(OUTAGE_TOLERANT_HANDLER, log):
        return reference
    s = reference.settings
    return EtcdRendezvousHandler.from_backend(
        s.run_id, store, backend, s.min_nodes, s.max_nodes, params.local_addr, s.timeout,
        keep_alive_interval=int(s.keep_alive_interval.total_seconds()),
        keep_alive_max_attempt=s.keep_alive_max_attempt)
