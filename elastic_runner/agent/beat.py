"""The agent's heartbeat in the job's store: how a survivor tells a lost node from a replacement on its way.

With in-process recovery a worker whose peer failed waits for that peer's agent to announce a replacement
(:meth:`~elastic_runner.recovery.regroup.SameMembers.survive`). A lost node's agent never does, and the survivors
used to wait the whole announcement window (2 s) before they parked for a new round — the largest part of a node
loss's recovery. Each agent that keeps its workers across rounds therefore beats in the job's store every
:data:`BEAT_SECONDS` (``regroup/agent/<group rank>``, a counter, signed with the job's key: :mod:`elastic_runner.recovery.channel`) from a thread of its own; a survivor that sees an
agent's counter stand still for :data:`~elastic_runner.recovery.regroup.AGENT_SILENT` knows that node is gone and parks at
once. An agent that does not beat (torch's own, an older one) is never judged: the survivors wait as before.

The store's server is rank 0's worker, so the beats go with rank 0's node: whether that node's agent is alive is
then asked of the agent itself (:mod:`elastic_runner.recovery.liveness`). It goes whenever that worker ends (the job finished, the worker failed or
parked). torch logs every failed store operation as a C++ warning with a stack trace on the agent's terminal, so the
beat keeps a bare connection to the same server beside its client and stops using a store whose server closed that
connection, before it would write to it.
"""

from __future__ import annotations

import datetime
import logging
import select
import socket
import threading
from typing import Any

from ..recovery.channel import Channel
from ..recovery.regroup import agent_beat, agent_stopping

log = logging.getLogger(__name__)

#: Seconds between two beats (a store ``set``: microseconds on the node, a round trip across nodes).
BEAT_SECONDS = 0.1
#: Seconds before a store that did not answer is tried again (rank 0's worker starts it after the round).
RETRY_SECONDS = 0.25


class AgentBeat:
    """Beats for this agent in the current round's job store, from a daemon thread, while told to."""

    def __init__(self, interval: float = BEAT_SECONDS, key: bytes | None = None) -> None:
        self.interval = interval
        self._key = key  #: the job's key: every beat is signed with it (:mod:`elastic_runner.recovery.channel`)
        self._target: tuple[str, int, int] | None = None  #: (MASTER_ADDR, MASTER_PORT, group rank)
        self._changed = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.beats = 0  #: beats sent in this agent's life (for tests and logs)
        #: Messages sent in this agent's life, its last word included: each carries the count, which only grows (a
        #: survivor takes a count that went back for a replay, not for this agent's silence).
        self._sent = 0

    def follow(self, master_addr: str | None, master_port: int | None, group_rank: int) -> None:
        """Beat into this round's store from now on (None: stop beating: the workers restart every one)."""
        with self._changed:
            self._target = (master_addr, int(master_port), group_rank) if master_addr and master_port else None
            self._changed.notify_all()
        if self._thread is None and self._target is not None:
            self._thread = threading.Thread(target=self._run, name="elastic-runner-agent-beat", daemon=True)
            self._thread.start()

    def pause(self) -> None:
        """Stop beating until the next :meth:`follow` (this agent restarts its workers); the last beat says so."""
        self.follow(None, None, 0)

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def _run(self) -> None:
        store: _Store | None = None
        following: tuple[str, int, int] | None = None
        while True:
            with self._changed:
                closed, target = self._closed, self._target
            if closed or target is None:
                self._say_stopping(store, following)  # (outside the lock: a store gone answers only at its timeout)
                if store is not None:
                    store.close()
                store = following = None
                if closed:
                    return
                with self._changed:
                    while self._target is None and not self._closed:
                        self._changed.wait()
                continue
            if store is not None and target != following:
                store.close()
                store = None
            elif store is not None and store.server_gone():
                store.close()  # (rank 0's worker ended; the same address may serve its successor soon)
                store = following = None
                self._sleep(RETRY_SECONDS)
                continue
            if store is None:
                store, following = _Store.connect(target, self._key), target
                if store is None:
                    following = None
                    self._sleep(RETRY_SECONDS)
                    continue
            try:
                agent_beat(store.channel, target[2], self._sent)
                self._sent += 1
                self.beats += 1
            except Exception as exc:  # noqa: BLE001 - the store gone (rank 0's worker): the next round's, later
                log.debug("agent beat failed (%s); connecting again", exc)
                store.close()
                store = following = None
                self._sleep(RETRY_SECONDS)
                continue
            self._sleep(self.interval)

    def _say_stopping(self, store: _Store | None, following: tuple[str, int, int] | None) -> None:
        """The last beat, when this agent stops beating on purpose: survivors must not count its node out."""
        if store is None or following is None or store.server_gone():
            return
        try:
            agent_stopping(store.channel, following[2], self._sent)
            self._sent += 1
        except Exception as exc:  # noqa: BLE001 - the store gone: nobody reads beats there any more
            log.debug("agent beat: could not say it stops (%s)", exc)

    def _sleep(self, seconds: float) -> None:
        with self._changed:
            if not self._closed:
                self._changed.wait(seconds)


class _Store:
    """A client of the job's store and a bare connection to its server beside it (see the module's docstring)."""

    def __init__(self, client: Any, probe: socket.socket, key: bytes | None, context: str) -> None:
        self.client, self.probe = client, probe
        self.channel = Channel(client, key, context)

    @classmethod
    def connect(cls, target: tuple[str, int, int], key: bytes | None) -> _Store | None:
        addr, port, _ = target
        probe: socket.socket | None = None
        try:
            # Refused at once when the server is not up, without torch's client retrying (and logging) until its
            # timeout; kept open, it is how the beat learns that the server ended.
            probe = socket.create_connection((addr, port), timeout=1.0)
            from torch.distributed import TCPStore

            client = TCPStore(addr, port, is_master=False, timeout=datetime.timedelta(seconds=2),
                              wait_for_workers=False)
            return cls(client, probe, key, f"{addr}:{port}")
        except Exception as exc:  # noqa: BLE001 - not up yet, or gone: tried again
            if probe is not None:
                probe.close()
            log.debug("agent beat: the job's store at %s:%s does not answer (%s)", addr, port, exc)
            return None

    def server_gone(self) -> bool:
        """Whether the server closed the bare connection (it never writes to it: anything readable is its end)."""
        try:
            readable, _, _ = select.select([self.probe], [], [], 0)
            return bool(readable) and self.probe.recv(1, socket.MSG_PEEK) == b""
        except OSError:  # reset: gone as well
            return True

    def close(self) -> None:
        self.probe.close()
        self.client = self.channel.store = None  # torch's client closes its connection when collected
