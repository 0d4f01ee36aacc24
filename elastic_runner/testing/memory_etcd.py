"""An etcd server in memory, with the semantics the rendezvous relies on (for fast tests).

``MemoryEtcd`` / ``MemoryKV``: one store revision, ``create_revision``/``mod_revision`` per key, a
failed value-compare on a missing key, leases whose expiry deletes their keys, watch from a
revision or follow a prefix (an event log of every put and delete). The contract suites of :mod:`elastic_runner.testing.contracts` run against it in
milliseconds and can simulate outages (``available = False``) and lost answers
(``fail_after_apply``); the same suites run against a real server.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence

from ..rendezvous.kv import (
    Compare,
    EtcdLeaseNotFound,
    EtcdUnavailable,
    Get,
    KeyValue,
    KVClient,
    Op,
    Put,
    TxnResult,
    WatchEnd,
    WatchEvent,
)


class MemoryEtcd:
    """An etcd server in memory: one revision counter, keys with revisions, leases with expiry.

    ``clock`` drives lease expiry (tests pass a fake clock); ``available = False`` makes every
    request fail like an unreachable server; ``fail_after_apply`` applies the next transaction and
    then reports a connection failure (a response lost on the way back).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.revision = 1
        self.available = True
        self.fail_after_apply = 0
        self._cond = threading.Condition()
        self._data: dict[bytes, KeyValue] = {}
        self._leases: dict[int, tuple[int, float]] = {}  # id -> (ttl, expiry)
        self._next_lease = 1000
        self._put_revision: dict[bytes, int] = {}
        self._events: list[tuple[int, WatchEvent]] = []  # (revision, event), in revision order

    def client(self) -> "MemoryKV":
        return MemoryKV(self)

    def raw_put(self, key: bytes, value: bytes) -> None:
        """Write a key directly (tests corrupt state this way)."""
        with self._cond:
            self._apply_put(Put(key, value))
            self.revision += 1
            self._cond.notify_all()

    # -- internals (call with the condition held) -----------------------------------------------------------------

    def _check(self) -> None:
        if not self.available:
            raise EtcdUnavailable("Could not reach the in-memory etcd (it is marked unavailable). Check that etcd is "
                                  "running and reachable from this node.")
        self._expire()

    def _expire(self) -> None:
        now = self.clock()
        dead = [lid for lid, (_, expiry) in self._leases.items() if expiry <= now]
        if not dead:
            return
        removed = False
        for lid in dead:
            del self._leases[lid]
            for key in [k for k, kv in self._data.items() if kv.lease == lid]:
                self._delete(key, self.revision + 1)
                removed = True
        if removed:
            self.revision += 1
            self._cond.notify_all()

    def _holds(self, c: Compare) -> bool:
        kv = self._data.get(c.key)
        if c.target == "value":
            return kv is not None and kv.value == c.expected  # etcd: a value compare on a missing key fails
        actual = 0 if kv is None else getattr(kv, c.target)
        return actual == c.expected

    def _apply_put(self, op: Put) -> None:
        old = self._data.get(op.key)
        rev = self.revision + 1
        kv = KeyValue(op.key, op.value, old.create_revision if old else rev, rev, op.lease)
        self._data[op.key] = kv
        self._put_revision[op.key] = rev
        self._events.append((rev, WatchEvent("put", kv)))

    def _delete(self, key: bytes, revision: int) -> bool:
        if self._data.pop(key, None) is None:
            return False
        self._events.append((revision, WatchEvent("delete", KeyValue(key, b"", 0, revision))))
        return True

    def revoke(self, lease_id: int) -> None:
        """Revoke a lease as etcd does: its keys go at once."""
        with self._cond:
            self._check()
            if self._leases.pop(lease_id, None) is None:
                return
            keys = [k for k, kv in self._data.items() if kv.lease == lease_id]
            for key in keys:
                self._delete(key, self.revision + 1)
            if keys:
                self.revision += 1
                self._cond.notify_all()

    def expire_lease(self, lease_id: int) -> None:
        """Let one lease expire now (a node that stopped refreshing it, without waiting its TTL)."""
        with self._cond:
            if lease_id in self._leases:
                self._leases[lease_id] = (self._leases[lease_id][0], float("-inf"))
            self._expire()

    def leases_of(self, key: bytes) -> int:
        """The lease a key is attached to (0: none or no such key)."""
        with self._cond:
            kv = self._data.get(key)
            return 0 if kv is None else kv.lease

    def txn(self, compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op]) -> TxnResult:
        with self._cond:
            self._check()
            ok = all(self._holds(c) for c in compare)
            ops = success if ok else failure
            for op in ops:
                if isinstance(op, Put) and op.lease and op.lease not in self._leases:
                    raise EtcdLeaseNotFound("The in-memory etcd no longer knows the lease: requested lease not found.")
            results: list[Any] = []
            writes = False
            for op in ops:
                if isinstance(op, Get):
                    results.append(self._data.get(op.key))
                elif isinstance(op, Put):
                    self._apply_put(op)
                    writes = True
                    results.append(None)
                else:
                    existed = self._delete(op.key, self.revision + 1)
                    writes = writes or existed
                    results.append(int(existed))
            if writes:
                self.revision += 1
                self._cond.notify_all()
            result = TxnResult(ok, self.revision, tuple(results))
            if self.fail_after_apply:
                self.fail_after_apply -= 1
                raise _LostResponse()
            return result


class _LostResponse(Exception):
    """The fake applied a request and 'lost' the answer."""


class MemoryKV(KVClient):
    """A client of a ``MemoryEtcd``; several clients of one server act like several agents."""

    endpoint_text = "memory"

    def __init__(self, server: MemoryEtcd) -> None:
        super().__init__()
        self.server = server
        #: True: this client cannot reach the server (a partitioned node); the others still can
        self.partitioned = False

    def _reach(self) -> None:
        if self.partitioned:
            raise EtcdUnavailable("Could not reach the in-memory etcd from this client (partitioned). Check that etcd "
                                  "is reachable from this node.")

    def txn(self, compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()) -> TxnResult:
        self._count()
        self._reach()
        try:
            return self.server.txn(compare, success, failure)
        except _LostResponse:
            # Like the gateway client: a lost answer is retried once the server answers again.
            self._count()
            return self.server.txn(compare, success, failure)

    def get(self, key: bytes, *, budget: float | None = None) -> tuple[KeyValue | None, int]:
        self._count()
        self._reach()
        s = self.server
        with s._cond:
            s._check()
            return s._data.get(key), s.revision

    def get_prefix(self, prefix: bytes, limit: int = 0) -> tuple[list[KeyValue], int]:
        self._reach()
        s = self.server
        with s._cond:
            s._check()
            found = [kv for k, kv in sorted(s._data.items()) if k.startswith(prefix)]
            found = found[:limit] if limit else found
            self._count(1, sum(len(kv.key) + len(kv.value) for kv in found))
            return found, s.revision

    def revoke_lease(self, lease_id: int) -> None:
        self._count()
        self._reach()
        self.server.revoke(lease_id)

    def watch_prefix(self, prefix: bytes, start_revision: int, timeout: float,
                     handle: Callable[[list[WatchEvent]], bool]) -> WatchEnd:
        self._count()
        s = self.server
        deadline = time.monotonic() + timeout
        seen = start_revision
        with s._cond:
            while True:
                if not s.available or self.partitioned:
                    s._cond.wait(0.05)  # as the gateway client pauses before the caller looks again
                    return "retry"
                s._expire()
                batch = [e for rev, e in s._events if rev >= seen and e.kv.key.startswith(prefix)]
                if batch:
                    seen = s.revision + 1
                    self._count(0, sum(len(e.kv.key) + len(e.kv.value) for e in batch))
                    s._cond.release()  # the handler may call the server
                    try:
                        if handle(batch):
                            return "done"
                    finally:
                        s._cond.acquire()
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return "timeout"
                s._cond.wait(min(remaining, 0.05))

    def count_prefix(self, prefix: bytes) -> int:
        self._count()
        self._reach()
        s = self.server
        with s._cond:
            s._check()
            return sum(1 for k in s._data if k.startswith(prefix))

    def delete_prefix(self, prefix: bytes) -> int:
        self._count()
        self._reach()
        s = self.server
        with s._cond:
            s._check()
            keys = [k for k in s._data if k.startswith(prefix)]
            for k in keys:
                s._delete(k, s.revision + 1)
            if keys:
                s.revision += 1
                s._cond.notify_all()
            return len(keys)

    def grant_lease(self, ttl: int) -> int:
        self._count()
        self._reach()
        s = self.server
        with s._cond:
            s._check()
            s._next_lease += 1
            ttl = max(int(ttl), 1)
            s._leases[s._next_lease] = (ttl, s.clock() + ttl)
            return s._next_lease

    def keep_alive_lease(self, lease_id: int) -> int:
        self._count()
        self._reach()
        s = self.server
        with s._cond:
            s._check()
            if lease_id not in s._leases:
                return -1
            ttl, _ = s._leases[lease_id]
            s._leases[lease_id] = (ttl, s.clock() + ttl)
            return ttl

    def wait_for_change(self, key: bytes, start_revision: int, timeout: float) -> bool:
        self._count()
        s = self.server
        deadline = time.monotonic() + timeout
        with s._cond:
            while True:
                if not s.available or self.partitioned:
                    return True
                s._expire()
                if s._put_revision.get(key, 0) >= start_revision:
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                s._cond.wait(min(remaining, 0.05))
