"""What an agent that trains watches: the ``ctl/`` keys of the lease protocol, on one idle watch.

torch's agent asks its handler ``num_nodes_waiting()`` ten times a second while its workers are
healthy, and restarts them for a new round when the answer is positive. A ``MemberWatch`` answers
from what it has seen, without a request: a ``ctl/next/<R>`` signal for a later round (a node asks
the running round to end), or a newer ``ctl/round`` (a round was sealed without this node: it was
counted dead, and must leave its stale round and join again). It watches from the seal's revision
(nothing written since is missed), one request per ``MEMBER_WATCH_SLICE`` while nothing happens;
it reconnects after a broken stream or an etcd outage, and reads ``ctl/`` afresh when its history
was compacted.
"""

from __future__ import annotations

import logging
import threading
import time

from torch.distributed.elastic.rendezvous import RendezvousStateError

from .kv import EtcdError, Get, KVClient, WatchEvent
from .rounds import Round
from .values import Codec

log = logging.getLogger(__name__)

#: Longest single watch request: bounds how long a silently dead stream goes unnoticed.
MEMBER_WATCH_SLICE = 30.0


class MemberWatch:
    """The watch of one member of one round (a new one per round: an old one's late events go nowhere)."""

    def __init__(self, client: KVClient, codec: Codec, ctl: bytes, record: Round, node: str, run_id: str) -> None:
        self._client = client
        self._codec = codec
        self._ctl = ctl
        self._round_key = ctl + b"round"
        self._closed_key = ctl + b"closed"
        self._next_key = ctl + f"next/{record.round + 1}".encode()
        self._record = record
        self._node = node
        self._run_id = run_id
        self._stop = threading.Event()
        self._revision = record.revision  #: from the seal on: nothing written since is missed
        #: nodes wait for a later round (1: the agent only asks "any?"), or this node was left out of one
        self.waiting = 0
        self.closed = False

    def start(self) -> "MemberWatch":
        threading.Thread(target=self._follow, daemon=True, name=f"rdzv-watch-{self._node}").start()
        return self

    def stop(self) -> None:
        """It ends at its next event or slice; it holds no lock and writes nothing."""
        self._stop.set()

    def _handle(self, events: list[WatchEvent]) -> bool:
        if self._stop.is_set():
            return True
        mine = self._record.round
        for event in events:
            self._revision = max(self._revision, event.kv.mod_revision)
            key = event.kv.key
            if event.kind != "put":
                if key == self._round_key:  # the record was deleted: numbering starts over, rejoin it
                    self.waiting = 1
                continue
            if key == self._next_key:
                # Only the signal for the round after ours, written for our round's record, restarts us.
                if self._codec.control(event.kv, self._record.revision, leased=True):
                    self.waiting = 1
            elif key == self._round_key:
                try:
                    newer = self._codec.round(event.kv)
                except RendezvousStateError as exc:  # signed with a key this agent lacks: it cannot follow the run
                    log.warning("%s", exc)
                    self.waiting = 1
                    continue
                if newer is None:
                    # Our round's record was overwritten with a value nobody can take: the next join deletes it and
                    # numbering starts over, as after a deletion.
                    self.waiting = 1
                    continue
                if newer.round > mine or newer.incarnation != self._record.incarnation:
                    if self._node not in newer.names():
                        log.warning("Round %d of the rendezvous '%s' was sealed without the node '%s' (it was counted "
                                    "dead); it leaves round %d and joins again.", newer.round, self._run_id,
                                    self._node, mine)
                    self.waiting = 1
            elif key == self._closed_key:
                self.closed = self._codec.closed(event.kv, self._record, self._record.revision)
        return self._stop.is_set()

    def _read(self) -> None:
        """The three keys a member follows, by name (a prefix read would take whatever was planted under it)."""
        result = self._client.txn((), [Get(self._round_key), Get(self._closed_key), Get(self._next_key)])
        self._revision = result.revision
        self._handle([WatchEvent("put", kv) for kv in result.results if kv is not None])

    def _follow(self) -> None:
        fresh = not self._revision  # without the seal's revision: read the ctl/ keys as they are, then watch
        warned = False
        while not self._stop.is_set():
            try:
                if fresh:
                    self._read()
                    fresh = False
                end = self._client.watch_prefix(self._ctl, self._revision + 1, MEMBER_WATCH_SLICE, self._handle)
                fresh = end == "compacted"
                warned = False
            except EtcdError as exc:  # etcd away for longer than retry_timeout: keep trying, quietly after once
                if not warned:
                    log.warning("The rendezvous watch of node '%s' lost etcd (%s); it keeps trying. Meanwhile a node "
                                "that joins is noticed when training fails.", self._node, exc)
                    warned = True
                time.sleep(1.0)
            except Exception:  # noqa: BLE001 - a thread must not die silently
                log.warning("The rendezvous watch of node '%s' failed; retrying", self._node, exc_info=True)
                time.sleep(1.0)
