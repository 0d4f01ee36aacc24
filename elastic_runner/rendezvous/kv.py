"""The narrow etcd v3 interface the rendezvous backend and store are written against.

Everything the rendezvous needs from etcd fits in a handful of calls: read one key (with its
``mod_revision``) or a prefix, one *transaction* (compare a key's mod/create revision or value, then
put, get or delete; otherwise get), count and delete a prefix, grant/refresh/revoke a lease, *wait
until a key changes after a revision* and *follow the changes under a prefix* (watches).
``KVClient`` is that interface; its errors are full sentences that say what to check.

Implementations: :class:`~elastic_runner.rendezvous.gateway.EtcdGatewayClient` (etcd's HTTP/JSON
gateway, the one agents use) and :class:`~elastic_runner.testing.memory_etcd.MemoryKV` (an in-memory
fake with the same semantics, for fast tests; the contract suites in
:mod:`elastic_runner.testing.contracts` run against both).

``LeaseKeeper`` gives one client one lease: granted on the first write, refreshed (one keep-alive
request) when a third of the TTL has passed since the last refresh and the process writes again,
re-granted when etcd no longer knows it. The keys of a process thus live while it keeps writing and
vanish between 2/3 TTL and TTL after it stopped, with no background thread.
"""

from __future__ import annotations

import random
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence, TypeVar, Union

T = TypeVar("T")

MAX_TXN_OPS = 128  # etcd's default --max-txn-ops
WATCH_SLICE_SECONDS = 10.0  # longest single watch request; bounds how long a silently dead stream goes unnoticed


# -- data model ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int = 0


@dataclass(frozen=True)
class Compare:
    """``key``'s ``target`` equals ``expected`` (etcd's compare; a missing key has revisions 0)."""

    key: bytes
    target: Literal["mod_revision", "create_revision", "value"]
    expected: int | bytes

    @staticmethod
    def mod_revision(key: bytes, revision: int) -> "Compare":
        return Compare(key, "mod_revision", revision)

    @staticmethod
    def created(key: bytes, revision: int) -> "Compare":
        """``key`` is the one created at ``revision`` (not deleted and put again since)."""
        return Compare(key, "create_revision", revision)

    @staticmethod
    def absent(key: bytes) -> "Compare":
        return Compare(key, "create_revision", 0)

    @staticmethod
    def value(key: bytes, value: bytes) -> "Compare":
        return Compare(key, "value", value)


@dataclass(frozen=True)
class Put:
    key: bytes
    value: bytes
    lease: int = 0


@dataclass(frozen=True)
class Get:
    key: bytes


@dataclass(frozen=True)
class Delete:
    key: bytes


Op = Union[Put, Get, Delete]


@dataclass(frozen=True)
class WatchEvent:
    """One change under a watched prefix: a put (``kv`` is the new key-value) or a delete (``kv`` has the
    key, an empty value and the revision of the delete as ``mod_revision``)."""

    kind: Literal["put", "delete"]
    kv: KeyValue


#: How a ``watch_prefix`` ended: the handler said done, the time ran out, the stream broke (look again
#: from the last revision seen), or the start revision was compacted (read everything again).
WatchEnd = Literal["done", "timeout", "retry", "compacted"]


@dataclass(frozen=True)
class TxnResult:
    succeeded: bool
    revision: int  #: store revision after the transaction (the mod_revision of its puts)
    results: tuple[Any, ...]  #: per op of the branch taken: Get → KeyValue | None, Delete → count, Put → None


# -- errors -----------------------------------------------------------------------------------------


class EtcdError(Exception):
    """Base of the client's errors; the message is a full sentence that says what to check."""


class EtcdUnavailable(EtcdError):
    """No endpoint answered within the operation's retry budget."""


class EtcdAuthError(EtcdError):
    """Authentication is required, failed, or the user lacks permission."""


class EtcdTLSError(EtcdError):
    """TLS handshake or scheme mismatch between client and server."""


class EtcdLeaseNotFound(EtcdError):
    """A put referred to a lease etcd does not know (expired or revoked)."""


class EtcdRequestError(EtcdError):
    """etcd refused the request for a reason retrying does not fix."""


# -- interface -----------------------------------------------------------------------------------------


class KVClient(ABC):
    """The calls the rendezvous backend and store make; see the module docstring."""

    endpoint_text: str = "etcd"

    def __init__(self) -> None:
        self._requests = 0
        self._bytes = 0
        self._count_lock = threading.Lock()

    @property
    def requests(self) -> int:
        """Requests sent so far (retries, watches and lease calls included)."""
        return self._requests

    @property
    def bytes(self) -> int:
        """Payload bytes sent and received so far (request and answer bodies, watch events)."""
        return self._bytes

    def _count(self, requests: int = 1, nbytes: int = 0) -> None:
        with self._count_lock:
            self._requests += requests
            self._bytes += nbytes

    @abstractmethod
    def txn(self, compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()) -> TxnResult:
        """One atomic transaction: if every compare holds run ``success``, else ``failure``."""

    @abstractmethod
    def get(self, key: bytes, *, budget: float | None = None) -> tuple[KeyValue | None, int]:
        """The key (or None) and the store revision of the read."""

    @abstractmethod
    def count_prefix(self, prefix: bytes) -> int:
        """Number of keys that start with ``prefix``."""

    @abstractmethod
    def delete_prefix(self, prefix: bytes) -> int:
        """Delete every key that starts with ``prefix``; return how many there were."""

    @abstractmethod
    def grant_lease(self, ttl: int) -> int:
        """A new lease id with the given TTL in seconds."""

    @abstractmethod
    def keep_alive_lease(self, lease_id: int) -> int:
        """Refresh a lease; its new TTL, or <= 0 when etcd no longer knows it."""

    @abstractmethod
    def wait_for_change(self, key: bytes, start_revision: int, timeout: float) -> bool:
        """Block until ``key`` is written at a revision >= ``start_revision`` or ``timeout`` passes.

        Returns False only on timeout. True means "look again": it is also returned after a
        connection problem (after a short pause) so the caller re-reads with its own retries.
        """

    @abstractmethod
    def get_prefix(self, prefix: bytes, limit: int = 0) -> tuple[list[KeyValue], int]:
        """Every key that starts with ``prefix`` (in key order; at most ``limit`` of them unless 0) and the store
        revision of the read."""

    @abstractmethod
    def revoke_lease(self, lease_id: int) -> None:
        """Revoke a lease: its keys are deleted now (an unknown lease is not an error)."""

    @abstractmethod
    def watch_prefix(self, prefix: bytes, start_revision: int, timeout: float,
                     handle: Callable[[list[WatchEvent]], bool]) -> WatchEnd:
        """Follow the changes under ``prefix`` from ``start_revision`` on, calling ``handle`` with each
        batch of events in revision order, until it returns True (``"done"``) or ``timeout`` passes.

        One request however many events arrive. A broken stream returns ``"retry"`` (after a short
        pause) and a compacted start revision ``"compacted"``: the caller looks again, from the
        revision after the last event it handled, or with a fresh read.
        """

    def get_many(self, keys: Sequence[bytes]) -> tuple[dict[bytes, KeyValue], int]:
        """Present keys among ``keys`` and the (lowest) revision at which they were read."""
        found: dict[bytes, KeyValue] = {}
        revision: int | None = None
        for start in range(0, len(keys), MAX_TXN_OPS):
            chunk = keys[start:start + MAX_TXN_OPS]
            result = self.txn((), [Get(k) for k in chunk])
            revision = result.revision if revision is None else min(revision, result.revision)
            for kv in result.results:
                if kv is not None:
                    found[kv.key] = kv
        return found, revision or 0

    def close(self) -> None:
        """Release connections."""


# -- lease --------------------------------------------------------------------------------------------------


class LeaseKeeper:
    """One lease for one client, granted and refreshed lazily on writes (see module docstring)."""

    def __init__(self, client: KVClient, ttl: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.ttl = int(ttl)
        self._clock = clock
        self._lock = threading.Lock()
        self._id = 0
        self._refreshed = 0.0

    def current(self) -> int:
        with self._lock:
            now = self._clock()
            if self._id and now - self._refreshed < self.ttl / 3:
                return self._id
            if self._id and self.client.keep_alive_lease(self._id) > 0:
                self._refreshed = now
                return self._id
            self._id = self.client.grant_lease(self.ttl)
            self._refreshed = now
            return self._id

    def invalidate(self, lease_id: int) -> None:
        with self._lock:
            if self._id == lease_id:
                self._id = 0

    def run(self, write: Callable[[int], T]) -> T:
        """Call ``write(lease_id)``; if etcd lost the lease meanwhile, once more with a new one."""
        lease = self.current()
        try:
            return write(lease)
        except EtcdLeaseNotFound:
            self.invalidate(lease)
            return write(self.current())


# -- retries ------------------------------------------------------------------------------------------------


@dataclass
class Backoff:
    """Exponential backoff with jitter: attempt k sleeps uniformly in [d/2, d], d = min(cap, base·2^k)."""

    base: float = 0.05
    cap: float = 2.0
    attempt: int = 0

    def next_delay(self) -> float:
        d = min(self.cap, self.base * (2 ** self.attempt))
        self.attempt += 1
        return random.uniform(d / 2, d)
