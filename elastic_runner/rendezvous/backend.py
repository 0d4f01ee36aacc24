"""``RendezvousBackend`` on etcd v3: the state of one run under one key, fenced by its mod_revision.

torch's ``DynamicRendezvousHandler`` keeps the whole rendezvous (round, participants, wait list,
heartbeats) in one opaque blob and needs two calls from a backend: ``get_state`` and a conditional
``set_state(state, token)``. Here:

- The blob lives at ``{key_prefix}/{run_id}/state``; the token is the key's ``mod_revision``.
- ``set_state`` is one etcd transaction: *if* ``mod_revision == token`` (or, without a token, the
  key does not exist: create-if-absent) *then* put the new blob *else* read the current one. A
  writer with a stale token therefore gets the current state and token back in the same round trip
  and never overwrites a newer state. A token that is not ours (not an int) gets the current state.
- The blob is framed (magic, format version, CRC-32) and zlib-compressed: heartbeats rewrite it
  every ``keep_alive_interval`` from every node, and etcd keeps every revision until compaction,
  so its size matters. Anything that does not decode is reported as ``RendezvousStateError``.
- Every put carries the writing agent's lease (``LeaseKeeper``): while agents heartbeat the state
  is rewritten and their leases refreshed; once all have gone it expires with the last lease.
- A writer that loses the compare-and-swap twice in a row backs off (jittered, doubling from 5 ms
  up to 2 s) and then returns the state as it is after the pause. torch's handler retries a lost
  write at once; with many agents that turns into a storm of refused writes through which the
  keep-alive heartbeats (N per ``keep_alive_interval``) no longer get, and the round never completes.

``create_backend(params)`` builds the client (retries, fail-over, TLS, auth), checks within
``connect_timeout`` that etcd answers, and returns the backend and the store that share it.
"""

from __future__ import annotations

import hmac
import random
import struct
import time
import zlib
from typing import TYPE_CHECKING, Any, Callable

from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from .gateway import EtcdGatewayClient
from .kv import Compare, EtcdError, Get, KVClient, LeaseKeeper, Put
from .options import DEFAULT_KEY_PREFIX, DEFAULTS, parse_options

if TYPE_CHECKING:
    from .options import EtcdOptions
from .seal import Sealer, StateContentError, check_state_pickle, inflate
from .values import WarnLimiter

if TYPE_CHECKING:
    from .store import EtcdStore

BACKEND_NAME = "etcd-v3"
DEFAULT_TTL = DEFAULTS["ttl"]

_MAGIC = b"ERV3"
_FORMAT = 1  #: CRC-framed: magic, version, CRC-32 of the compressed payload, payload
_SIGNED = 2  #: signed: magic, version, HMAC-SHA256 over (etcd key, magic, version, payload), payload
_HEADER = struct.Struct(">4sBI")


def encode_state(state: bytes, sealer: Sealer | None = None, key: str = "") -> bytes:
    """A stored blob: CRC-framed (format 1), or signed under the job's key (format 2)."""
    payload = zlib.compress(state, 1)
    if sealer is None or not sealer.enabled:
        return _HEADER.pack(_MAGIC, _FORMAT, zlib.crc32(payload)) + payload
    head = _MAGIC + bytes([_SIGNED])
    return head + sealer.tag(key.encode(), head + payload) + payload


class ForeignStateError(RendezvousStateError):
    """The state is not signed with the job's key (written without it, with another, or changed): with a key
    configured such a state is ignored — taken as an empty state that the next write replaces — never fatal."""


def empty_state() -> bytes:
    """torch's state of a rendezvous nobody has joined yet, as its handler stores it."""
    import pickle

    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

    return pickle.dumps(_RendezvousState())


def decode_state(blob: bytes, key: str, sealer: Sealer | None = None) -> bytes:
    """The state bytes of a stored blob; ``RendezvousStateError`` if it is not one of ours, damaged, not
    signed with the job's key (when there is one), or larger than any state decompressed."""
    hint = (f"Another program may write to this key: check that nothing else uses the key prefix, or delete "
            f"the key ('etcdctl del {key}') to start the rendezvous afresh.")
    signing = sealer is not None and sealer.enabled
    if len(blob) < _HEADER.size:
        raise RendezvousStateError(f"The rendezvous state in etcd key '{key}' is corrupt: {len(blob)} bytes is too "
                                   f"short for a state. {hint}")
    if blob[:4] != _MAGIC:
        raise RendezvousStateError(f"The rendezvous state in etcd key '{key}' is corrupt: it was not written by the "
                                   f"etcd-v3 backend (unknown header). {hint}")
    version = blob[4]
    if version not in (_FORMAT, _SIGNED):
        raise RendezvousStateError(f"The rendezvous state in etcd key '{key}' has format {version}, this version "
                                   f"of elastic_runner reads formats {_FORMAT} and {_SIGNED}: run the same "
                                   f"elastic_runner version on every node.")
    if version == _SIGNED and not signing:
        raise RendezvousStateError(f"The rendezvous state in etcd key '{key}' is signed, but this agent has no key: "
                                   "give every node the same --rdzv_conf auth_key_file.")
    if version == _FORMAT and signing:
        raise ForeignStateError(f"The rendezvous state in etcd key '{key}' is not signed, but this agent requires "
                                   "states signed with the job's key (auth_key_file): it was written by an agent "
                                   f"without the key, or planted. Give every node the same auth_key_file. {hint}")
    if version == _SIGNED:
        assert sealer is not None
        head, tag, payload = blob[:5], blob[5:5 + 32], blob[5 + 32:]
        if len(tag) < 32 or not hmac.compare_digest(tag, sealer.tag(key.encode(), head + payload)):
            raise ForeignStateError(f"The rendezvous state in etcd key '{key}' does not carry a valid signature "
                                       "of the job's key: it was written with another key, changed or planted. "
                                       f"Check that every node has the same auth_key_file. {hint}")
    else:
        _, _, crc = _HEADER.unpack_from(blob)
        payload = blob[_HEADER.size:]
        if zlib.crc32(payload) != crc:
            raise RendezvousStateError(f"The rendezvous state in etcd key '{key}' is corrupt: its checksum does not "
                                       f"match. {hint}")
    try:
        return inflate(payload)
    except StateContentError as exc:
        raise RendezvousStateError(f"The rendezvous state in etcd key '{key}' is refused: {exc}. {hint}") from exc


class CheckedStates(RendezvousBackend):
    """A backend whose states torch may unpickle: each is first unpickled here with only a rendezvous
    state's classes admitted (see :mod:`elastic_runner.rendezvous.seal`). The handler uses this wrapper;
    the backend itself keeps torch's contract (opaque bytes)."""

    def __init__(self, backend: EtcdRendezvousBackend) -> None:
        self.backend = backend

    @property
    def name(self) -> str:
        return self.backend.name

    def _checked(self, state: bytes) -> bytes:
        try:
            check_state_pickle(state)
        except StateContentError as exc:
            raise RendezvousStateError(
                f"The rendezvous state in etcd key '{self.backend.key}' is refused unread: {exc}. Something other "
                f"than an elastic_runner agent wrote it: check who can write the key prefix (docs/trust.md), "
                f"then delete the key ('etcdctl del {self.backend.key}').") from exc
        return state

    def get_state(self) -> tuple[bytes, Token] | None:
        result = self.backend.get_state()
        return None if result is None else (self._checked(result[0]), result[1])

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        result = self.backend.set_state(state, token)
        return None if result is None else (self._checked(result[0]), result[1], result[2])


def run_prefix(key_prefix: str, run_id: str) -> str:
    return f"{key_prefix.rstrip('/')}/{run_id}"


class EtcdRendezvousBackend(RendezvousBackend):
    """See the module docstring. ``client`` may be the etcd gateway client or the in-memory fake."""

    def __init__(self, client: KVClient, run_id: str, key_prefix: str = DEFAULT_KEY_PREFIX,
                 ttl: int = DEFAULT_TTL, leases: LeaseKeeper | None = None,
                 conflict_backoff: tuple[float, float] = (0.005, 2.0),
                 sleep: Callable[[float], None] = time.sleep, sealer: Sealer | None = None) -> None:
        if not run_id:
            raise ValueError("The run id must be a non-empty string (torchrun's --rdzv_id).")
        if "/" in run_id:
            raise ValueError(f"The run id '{run_id}' must not contain '/' (it becomes one etcd key segment).")
        self._client = client
        self._warnings = WarnLimiter()
        self._run_id = run_id
        self._key_text = f"{run_prefix(key_prefix, run_id)}/state"
        self._key = self._key_text.encode()
        self._leases = leases or LeaseKeeper(client, ttl)
        self._backoff_base, self._backoff_cap = conflict_backoff
        self._sleep = sleep
        self._conflicts = 0  # consecutive lost compare-and-swaps of this agent
        self._sealer = sealer or Sealer(None)

    @property
    def name(self) -> str:
        return BACKEND_NAME

    @property
    def key(self) -> str:
        """The etcd key that holds the state."""
        return self._key_text

    @property
    def client(self) -> KVClient:
        return self._client

    @property
    def leases(self) -> LeaseKeeper:
        return self._leases

    @property
    def sealer(self) -> Sealer:
        return self._sealer

    @property
    def run_prefix(self) -> str:
        """``{key_prefix}/{run_id}``: every key of the run is under it."""
        return self._key_text[:-len("/state")]

    def _connection_error(self, action: str, exc: EtcdError) -> RendezvousConnectionError:
        return RendezvousConnectionError(
            f"The etcd-v3 rendezvous backend could not {action} the state of run '{self._run_id}' (key "
            f"'{self._key_text}'). {exc}")

    def get_state(self) -> tuple[bytes, Token] | None:
        try:
            kv, _ = self._client.get(self._key)
        except EtcdError as exc:
            raise self._connection_error("read", exc) from exc
        if kv is None:
            return None
        return self._decoded(kv.value), kv.mod_revision

    def _decoded(self, blob: bytes) -> bytes:
        """The state in ``blob``; with the job's key, a state not signed with it is ignored (an empty state,
        whose compare-and-set by the next write replaces it) with one warning a minute."""
        try:
            return decode_state(blob, self._key_text, self._sealer)
        except ForeignStateError as exc:
            self._warnings.warn("state", "Ignoring the rendezvous state in '%s': %s", self._key_text,
                                str(exc).split(": ", 1)[-1])
            return empty_state()

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        if token is not None and not isinstance(token, int):
            # Not a token we issued (e.g. from another backend): it cannot match; report the current state.
            current = self.get_state()
            return None if current is None else (*current, False)
        compare = Compare.mod_revision(self._key, token) if token else Compare.absent(self._key)
        blob = encode_state(state, self._sealer, self._key_text)

        def write(lease: int) -> Any:
            return self._client.txn([compare], [Put(self._key, blob, lease)], [Get(self._key)])

        try:
            result = self._leases.run(write)
        except EtcdError as exc:
            raise self._connection_error("write", exc) from exc
        if result.succeeded:
            self._conflicts = 0
            return state, result.revision, True
        kv = result.results[0]
        if kv is None:
            return None  # our token names a state that has gone (expired or deleted)
        self._conflicts += 1
        if self._conflicts > 1:
            # Lost again: back off (exponentially, jittered), then return the state as it is *then*.
            # torch's handler retries a lost write at once, so with many agents every write is raced
            # by all the others; without this, 128 simulated agents on 2 cores never complete a round
            # (benchmarks/rendezvous_scale.py): the keep-alive writes outpace the successful ones.
            window = min(self._backoff_cap, self._backoff_base * 2 ** min(self._conflicts - 2, 20))
            self._sleep(random.uniform(0, window))
            current = self.get_state()
            return None if current is None else (*current, False)
        return self._decoded(kv.value), kv.mod_revision, False


def parse(params: RendezvousParameters) -> "EtcdOptions":
    """The etcd-v3 options of ``params``, or an :class:`EtcdRendezvousOptionError` that says what to fix."""
    try:
        return parse_options(params)
    except ValueError as exc:
        raise EtcdRendezvousOptionError(f"--rdzv_backend=etcd-v3: {exc}") from exc


class EtcdRendezvousStartError(RendezvousConnectionError):
    """The etcd-v3 rendezvous cannot start (etcd unreachable or refusing us, or an option to fix); the
    message says what to check, so the agent prints it as one line (:mod:`elastic_runner.agent.terminal`)."""


class EtcdRendezvousOptionError(EtcdRendezvousStartError, ValueError):
    """A ``--rdzv_endpoint``/``--rdzv_conf`` value to fix (also a ValueError, as torch's option errors are)."""


def create_backend(params: RendezvousParameters, options: "EtcdOptions | None" = None
                   ) -> tuple[EtcdRendezvousBackend, "EtcdStore"]:
    """Backend and store for ``params`` (``--rdzv_endpoint``, ``--rdzv_id``, ``--rdzv_conf``).

    Fails within ``connect_timeout`` with ``RendezvousConnectionError`` when etcd cannot be reached
    or refuses us (credentials, TLS, permissions), instead of at the first rendezvous step.
    """
    from .store import EtcdStore

    options = options or parse(params)
    client = EtcdGatewayClient(options)
    leases = LeaseKeeper(client, options.ttl)
    sealer = Sealer(options.auth_key)
    backend = EtcdRendezvousBackend(client, params.run_id, options.key_prefix, options.ttl, leases, sealer=sealer)
    try:
        client.get(backend.key.encode(), budget=options.connect_timeout)
    except EtcdError as exc:
        client.close()
        raise EtcdRendezvousStartError(
            f"The etcd-v3 rendezvous cannot start run '{params.run_id}': {exc}") from exc
    store = EtcdStore(client, run_prefix(options.key_prefix, params.run_id), leases=leases,
                      read_timeout=options.read_timeout, sealer=sealer)
    return backend, store
