"""A node that waits as a spare: agents started beyond ``--nnodes``' maximum.

A round that is full has no seat for one more node. torch's c10d rendezvous puts such a node on its redundancy list,
the etcd-v3 lease protocol lets it wait without a deadline (:mod:`elastic_runner.rendezvous.leases`); either way it
takes the place of the next node that is lost or leaves, in the round that replaces it, so the world size, the global
batch's split and the data shares stay as they were. Its agent is warm while it waits (the zygote has imported torch
and the worker), and its workers load the state from a survivor's node memory (a broadcast), as any new node's do.

:class:`SpareWait` reports it: one line and an ``agent_spare_waiting`` event (the round's ``max_nodes`` and this
node's ``local_world_size``: the full world it waits beside is their product; the ``elastic_runner_agent_spare``
gauge) when the node starts to wait, and how long it waited in the round's ``agent_rendezvous`` event
(``spare_s``).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from . import fast_rendezvous

log = logging.getLogger(__name__)


class SpareWait:
    """Watches one rendezvous call of this agent for the node waiting as a spare."""

    def __init__(self, handler: Any, notify: Callable[..., None], clock: Callable[[], float] = time.monotonic,
                 local_world_size: int = 1) -> None:
        self._notify = notify
        self._local_world_size = local_world_size  #: this node's workers: the ranks it brings to the full round
        self._clock = clock
        self.since: float | None = None  #: when this node started to wait as a spare (None: it did not)
        if hasattr(handler, "on_spare"):  # the etcd-v3 lease protocol says so itself; torch's through our patch
            handler.on_spare = self.waits
        else:
            fast_rendezvous.on_spare = self.waits

    def waits(self, max_nodes: int) -> None:
        """The handler found the round full; reported once per rendezvous call."""
        if self.since is not None:
            return
        self.since = self._clock()
        log.info("The rendezvous round is full (%d nodes, --nnodes' maximum): this node waits as a spare and takes "
                 "the place of the next node that is lost or leaves.", max_nodes)
        self._notify("spare_waiting", max_nodes=max_nodes, local_world_size=self._local_world_size)

    def fields(self) -> dict[str, float]:
        """The round's event's fields: how long this node waited as a spare, if it did."""
        return {} if self.since is None else {"spare_s": round(self._clock() - self.since, 3)}
