"""An etcd server in memory, with the semantics the rendezvous relies on (for fast tests).

``MemoryEtcd`` / ``MemoryKV``: one store revision, ``create_revision``/``mod_revision`` per key, a
failed value-compare on a missing key, leases whose expiry deletes their keys, watch from a
revision. The contract suites of :mod:`elastic_runner.testing.contracts` run against it in
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
                del self._data[key]
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
        self._data[op.key] = KeyValue(op.key, op.value, old.create_revision if old else rev, rev, op.lease)
        self._put_revision[op.key] = rev

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
                    existed = self._data.pop(op.key, None) is not None
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

    def txn(self, compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()) -> TxnResult:
        self._count()
        try:
            return self.server.txn(compare, success, failure)
        except _LostResponse:
            # Like the gateway client: a lost answer is retried once the server answers again.
            self._count()
            return self.server.txn(compare, success, failure)

    def get(self, key: bytes, *, budget: float | None = None) -> tuple[KeyValue | None, int]:
        self._count()
        s = self.server
        with s._cond:
            s._check()
            return s._data.get(key), s.revision

    def count_prefix(self, prefix: bytes) -> int:
        self._count()
        s = self.server
        with s._cond:
            s._check()
            return sum(1 for k in s._data if k.startswith(prefix))

    def delete_prefix(self, prefix: bytes) -> int:
        self._count()
        s = self.server
        with s._cond:
            s._check()
            keys = [k for k in s._data if k.startswith(prefix)]
            for k in keys:
                del s._data[k]
            if keys:
                s.revision += 1
                s._cond.notify_all()
            return len(keys)

    def grant_lease(self, ttl: int) -> int:
        self._count()
        s = self.server
        with s._cond:
            s._check()
            s._next_lease += 1
            ttl = max(int(ttl), 1)
            s._leases[s._next_lease] = (ttl, s.clock() + ttl)
            return s._next_lease

    def keep_alive_lease(self, lease_id: int) -> int:
        self._count()
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
                if not s.available:
                    return True
                s._expire()
                if s._put_revision.get(key, 0) >= start_revision:
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                s._cond.wait(min(remaining, 0.05))
