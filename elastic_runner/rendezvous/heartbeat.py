"""An agent's heartbeat in the lease rendezvous protocol: its liveness lease and the thread that keeps it.

The node key of an agent (``rdzv/node/NAME``) lives on a lease of ``lease_ttl`` seconds (the window);
the thread refreshes it every ``keep_alive_interval``. If etcd let the lease expire (the agent was out of
reach for a whole window, so the others may have counted it dead) the agent registers again with a new
lease, but only where its key is gone: a join meanwhile may have written a newer value. The same thread
refreshes the lasting lease the round records live on, so that a record outlives the agent that sealed it.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from .kv import Compare, EtcdError, KVClient, LeaseKeeper, Put
from .rounds import Round, Settings

log = logging.getLogger(__name__)


class Heartbeat:
    """The liveness lease of one agent's node key, refreshed by a daemon thread until :meth:`release`."""

    def __init__(self, client: KVClient, settings: Settings, leases: LeaseKeeper, key: bytes, node: str,
                 clock: Callable[[], float]) -> None:
        self._client = client
        self._settings = settings
        self._leases = leases
        self._key = key
        self._node = node
        self._clock = clock
        self._lock = threading.Lock()
        self._lease = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: the value of our node key as last written (registering again writes it back)
        self.value = b""
        #: the node key's value for a given lease (a bound value names its lease: a new lease, a new value)
        self.encoder: Callable[[int], bytes] | None = None
        #: the round this agent is seated in (its record's lease is refreshed too)
        self.record: Round | None = None

    @property
    def current(self) -> int:
        """The lease id the node key lives on now (0 before the first :meth:`lease` and after release)."""
        return self._lease

    def lease(self) -> int:
        """The liveness lease, granted on first use, with the keeping thread started."""
        with self._lock:
            if not self._lease:
                self._lease = self._client.grant_lease(self._settings.lease_ttl)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name=f"rdzv-heartbeat-{self._node}")
                self._thread.start()
            return self._lease

    def regrant(self, lost: int) -> None:
        """etcd no longer knows the lease ``lost``: take a new one and put our key back if it is gone."""
        with self._lock:
            if self._lease != lost:
                return  # someone already did
            self._lease = self._client.grant_lease(self._settings.lease_ttl)
            if self.encoder is not None and self.value:
                self.value = self.encoder(self._lease)
            lease, value = self._lease, self.value
        log.warning("The liveness lease of node '%s' expired (etcd was out of reach for longer than the %.0f s "
                    "window); it registers again.", self._node, self._settings.window)
        if value:  # only if it is gone: a join meanwhile wrote a newer value on the new lease
            self._client.txn([Compare.absent(self._key)], [Put(self._key, value, lease)])

    def restore(self) -> None:
        """Put our node key back as we last wrote it if anything else is there (a value of ours from an earlier
        join, put back on our live lease, would hold the sealer back) or it is gone: one request."""
        with self._lock:
            lease, value = self._lease, self.value
        if lease and value:
            self._client.txn([Compare.value(self._key, value)], [], [Put(self._key, value, lease)])

    def stop(self) -> None:
        """Stop refreshing; etcd expires the lease a window from the last refresh."""
        self._stop.set()

    def release(self) -> None:
        """Stop the thread and revoke the lease, so that our node key goes now instead of a window later."""
        self.stop()
        with self._lock:
            lease, self._lease = self._lease, 0
        if lease:
            try:
                self._client.revoke_lease(lease)
            except EtcdError:
                pass

    def _run(self) -> None:
        last_lasting_refresh = self._clock()
        while not self._stop.wait(self._settings.keep_alive_interval):
            try:
                with self._lock:
                    lease = self._lease
                if lease and self._client.keep_alive_lease(lease) <= 0:
                    self.regrant(lease)
                if self._clock() - last_lasting_refresh >= self._leases.ttl / 3:
                    last_lasting_refresh = self._clock()
                    self._leases.current()
                    record = self.record
                    if record is not None and record.lease:
                        self._client.keep_alive_lease(record.lease)  # the record outlives its sealer
            except EtcdError as exc:
                log.debug("rendezvous keep-alive failed: %s", exc)
            except Exception:  # noqa: BLE001 - the thread must not die silently
                log.warning("rendezvous keep-alive failed", exc_info=True)
