"""A ``torch.distributed.Store`` on etcd v3, under the run's key prefix.

The rendezvous handler gives this store (wrapped in a ``PrefixStore`` per round) to the agents:
rank assignment (``set``, ``multi_get``, ``multi_set``, ``get``), the exit barrier (``add``,
``wait``) and, with torch's shared-store default, the workers' ``MASTER_ADDR``/``MASTER_PORT``.
Semantics follow ``TCPStore``:

- Keys live at ``{key_prefix}/{run_id}/store/{key}``; values are bytes. Every write carries the
  process's lease (shared with the backend), so the store of an abandoned run expires with it.
- ``get``/``wait``/``multi_get`` block until every key exists or the timeout passes (the store's
  timeout, ``read_timeout`` by default; a zero timeout waits without limit, as in c10d), then raise
  ``DistStoreError``. A wait reads the keys once and, while one is missing, *watches* that key from
  the revision of the read: etcd pushes the write, so a waiting agent costs one request per key it
  waits for, not a poll per interval.
- ``add`` is a compare-and-swap loop on the key's ``mod_revision``. The same transaction writes an
  operation marker (``ops/<process>-<thread>``) and the failure branch reads it back, so an ``add``
  whose answer was lost in a connection failure and is then retried is not applied twice.
- ``compare_set`` is TCPStore's: a missing key matches ``expected == b""``; otherwise the current
  value (or ``expected`` for a missing key) is returned when it does not match.
- Failures to reach etcd raise ``EtcdStoreConnectionError``, both a ``DistNetworkError`` (what c10d
  callers catch) and a ``RendezvousConnectionError`` (what the agent reports).
- With the job's key (``auth_key_file``), every value is stored signed and a value that does not carry
  a valid signature is refused (``EtcdStoreAuthError``): a writer without the key cannot plant
  addresses or ranks (see :mod:`elastic_runner.rendezvous.seal`).
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from datetime import timedelta
from typing import Any, Sequence

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from .kv import (
    MAX_TXN_OPS,
    WATCH_SLICE_SECONDS,
    Compare,
    Delete,
    EtcdError,
    Get,
    KeyValue,
    KVClient,
    LeaseKeeper,
    Put,
)
from .options import DEFAULTS
from .seal import AuthError, Sealer

DEFAULT_READ_TIMEOUT = DEFAULTS["read_timeout"]


class EtcdStoreConnectionError(dist.DistNetworkError, RendezvousConnectionError):
    """The store could not reach etcd (or etcd refused it); the message says what to check."""


def _as_bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (list, tuple)):
        return bytes(value)
    raise TypeError(f"Store keys and values must be str or bytes, not {type(value).__name__}.")


class EtcdStoreAuthError(dist.DistStoreError):
    """A store value is not signed with the job's key."""


class EtcdStore(dist.Store):
    """See the module docstring. ``prefix`` is the run's prefix, e.g. ``/elastic_runner/rdzv/job1``."""

    def __init__(self, client: KVClient, prefix: str, leases: LeaseKeeper | None = None,
                 read_timeout: float = DEFAULT_READ_TIMEOUT, sealer: Sealer | None = None) -> None:
        super().__init__()  # required by the pybind trampoline
        self._client = client
        self._sealer = sealer or Sealer(None)
        run_prefix = prefix.rstrip("/")
        self._prefix = f"{run_prefix}/store/".encode()
        self._ops_prefix = f"{run_prefix}/ops/{uuid.uuid4().hex}-".encode()
        self._leases = leases or LeaseKeeper(client, DEFAULTS["ttl"])
        self.set_timeout(timedelta(seconds=read_timeout))

    # -- helpers ---------------------------------------------------------------------------------------------------

    @property
    def client(self) -> KVClient:
        return self._client

    @property
    def prefix(self) -> str:
        """The etcd key prefix of this store's keys."""
        return self._prefix.decode()

    def _key(self, key: Any) -> bytes:
        return self._prefix + _as_bytes(key)

    def _name(self, key: bytes) -> str:
        return key[len(self._prefix):].decode(errors="replace")

    def _seal(self, key: bytes, value: bytes) -> bytes:
        return self._sealer.seal(key, value)

    def _open(self, kv: KeyValue) -> bytes:
        try:
            return self._sealer.open(kv.key, kv.value)
        except AuthError as exc:
            raise EtcdStoreAuthError(
                f"The etcd store value at '{kv.key.decode(errors='replace')}' is refused: {exc}. Check that every "
                "node has the same auth_key_file and who else can write the key prefix (docs/trust.md).") from exc

    def _error(self, action: str, exc: EtcdError) -> EtcdStoreConnectionError:
        return EtcdStoreConnectionError(f"The etcd store under '{self.prefix}' could not {action}. {exc}")

    def _txn(self, action: str, compare: Sequence[Compare], success: Sequence[Any], failure: Sequence[Any] = ()) -> Any:
        def write(lease: int) -> Any:
            leased = [Put(op.key, op.value, lease) if isinstance(op, Put) else op for op in success]
            return self._client.txn(compare, leased, failure)

        try:
            if any(isinstance(op, Put) for op in success):
                return self._leases.run(write)
            return self._client.txn(compare, success, failure)
        except EtcdError as exc:
            raise self._error(action, exc) from exc

    def _deadline(self, timeout: timedelta | None) -> tuple[float, float]:
        seconds = (self.timeout if timeout is None else timeout).total_seconds()
        return seconds, (float("inf") if seconds == 0 else time.monotonic() + seconds)

    def _wait_for(self, keys: Sequence[bytes], timeout: timedelta | None) -> dict[bytes, KeyValue]:
        seconds, deadline = self._deadline(timeout)
        while True:
            try:
                if len(keys) == 1:
                    kv, revision = self._client.get(keys[0])
                    found = {keys[0]: kv} if kv is not None else {}
                else:
                    found, revision = self._client.get_many(keys)
            except EtcdError as exc:
                raise self._error("read keys", exc) from exc
            missing = [k for k in keys if k not in found]
            if not missing:
                return found
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                names = ", ".join(repr(self._name(k)) for k in missing[:5]) + (" ..." if len(missing) > 5 else "")
                raise dist.DistStoreError(
                    f"Timed out after {seconds:.0f} s waiting for {len(missing)} of {len(keys)} key(s) in the etcd "
                    f"store under '{self.prefix}': {names}. The agents that should write them may have failed or "
                    f"be slow; check their logs, or raise read_timeout in --rdzv_conf.")
            try:
                self._client.wait_for_change(missing[0], revision + 1, min(remaining, WATCH_SLICE_SECONDS))
            except EtcdError as exc:
                raise self._error("watch a key", exc) from exc

    # -- torch.distributed.Store ------------------------------------------------------------------------------------

    def set(self, key: str, value: bytes | str) -> None:
        k = self._key(key)
        self._txn("set a key", (), [Put(k, self._seal(k, _as_bytes(value)))])

    def get(self, key: str) -> bytes:
        k = self._key(key)
        return self._open(self._wait_for([k], None)[k])

    def add(self, key: str, amount: int) -> int:
        k = self._key(key)
        marker_key = self._ops_prefix + str(threading.get_ident()).encode()
        marker = uuid.uuid4().hex.encode()
        kv: KeyValue | None = None  # optimistic: try to create it; a failed attempt returns the current value
        conflicts = 0
        while True:
            value = self._open(kv) if kv is not None else b"0"
            try:
                current = int(value)
            except ValueError:
                raise ValueError(f"Store key '{key}' holds {value[:40]!r}, not an integer; add() needs a "
                                 "counter (a key written only by add()).") from None
            new = current + int(amount)
            compare = Compare.mod_revision(k, kv.mod_revision) if kv is not None else Compare.absent(k)
            result = self._txn("add to a counter", [compare],
                               [Put(k, self._seal(k, str(new).encode())), Put(marker_key, marker)],
                               [Get(k), Get(marker_key)])
            if result.succeeded:
                return new
            kv, seen = result.results
            if seen is not None and seen.value == marker:
                return new  # this very transaction was applied before; only its answer was lost and retried
            conflicts += 1
            if conflicts >= 4:
                time.sleep(random.uniform(0, min(0.05, 0.002 * conflicts)))  # spread a thundering herd

    def compare_set(self, key: str, expected_value: bytes | str, desired_value: bytes | str) -> bytes:
        k = self._key(key)
        expected, desired = _as_bytes(expected_value), _as_bytes(desired_value)
        # A signature is a pure function of (key, value): the sealed expectation compares like the value.
        compare = Compare.absent(k) if expected == b"" else Compare.value(k, self._seal(k, expected))
        while True:
            result = self._txn("compare-and-set a key", [compare], [Put(k, self._seal(k, desired))], [Get(k)])
            if result.succeeded:
                return desired
            kv = result.results[0]
            if kv is None:
                if expected == b"":
                    continue  # deleted between compare and read: try to create it again
                return expected  # TCPStore: a missing key with a non-empty expectation returns the expectation
            current = self._open(kv)
            if expected == b"" and current == b"":
                compare = Compare.mod_revision(k, kv.mod_revision)  # exists with the empty value: that matches too
                continue
            return current

    def append(self, key: str, value: bytes | str) -> None:
        k, extra = self._key(key), _as_bytes(value)
        kv: KeyValue | None = None  # optimistic create, as in add()
        while True:
            compare = Compare.mod_revision(k, kv.mod_revision) if kv is not None else Compare.absent(k)
            current = self._open(kv) if kv is not None else b""
            result = self._txn("append to a key", [compare], [Put(k, self._seal(k, current + extra))], [Get(k)])
            if result.succeeded:
                return
            kv = result.results[0]

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._wait_for([self._key(k) for k in keys], timeout)

    def check(self, keys: list[str]) -> bool:
        wanted = [self._key(k) for k in keys]
        try:
            found, _ = self._client.get_many(wanted)
        except EtcdError as exc:
            raise self._error("read keys", exc) from exc
        return all(k in found for k in wanted)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        wanted = [self._key(k) for k in keys]
        found = self._wait_for(wanted, None)
        return [self._open(found[k]) for k in wanted]

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set got {len(keys)} keys but {len(values)} values; pass one value per key.")
        puts = [Put(key, self._seal(key, _as_bytes(v))) for key, v in ((self._key(k), v) for k, v in zip(keys, values))]
        for start in range(0, len(puts), MAX_TXN_OPS):
            self._txn("set keys", (), puts[start:start + MAX_TXN_OPS])

    def delete_key(self, key: str) -> bool:
        result = self._txn("delete a key", (), [Delete(self._key(key))])
        return bool(result.results[0])

    def num_keys(self) -> int:
        try:
            return self._client.count_prefix(self._prefix)
        except EtcdError as exc:
            raise self._error("count keys", exc) from exc

    def has_extended_api(self) -> bool:
        return True
