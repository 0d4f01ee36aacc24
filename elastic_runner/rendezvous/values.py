"""The values of the lease protocol: strict JSON, signed with the job's key and bound to what they mean.

How values are bound (``after``, ``lease``, ``inc``) and why a replayed one is void is in
:mod:`elastic_runner.rendezvous.rounds`; this module reads and writes them (:class:`Codec`), and warns about
the ones it ignores at most once a minute per kind, with the keys escaped (:class:`WarnLimiter`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import zlib
from typing import Any

from .kv import KeyValue
from .rounds import _DEFLATED, BOUND_FORMAT, MAX_VALUE_BYTES, Joiner, NodeId, RendezvousRefusedError, Round
from .seal import SIGNED_MAGIC, AuthError, Sealer, StateContentError, inflate

log = logging.getLogger(__name__)


class VoidValue(ValueError):
    """A value this job's agents did not write, or wrote for another round or lease (replayed): ignored."""


def _strict_json(data: bytes) -> Any:
    """JSON as this rendezvous writes it: no floats or NaN/Infinity (``1e999`` is refused, not infinity), nesting
    bounded by the parser's own recursion limit (a refusal, not a crash)."""
    def refuse(text: str) -> Any:
        raise ValueError(f"the number {text[:20]!r} is not one this rendezvous writes")

    try:
        return json.loads(data, parse_float=refuse, parse_constant=refuse)
    except RecursionError as exc:
        raise ValueError("it is nested too deeply") from exc


def _int(obj: Any, field_name: str, low: int = 0) -> int:
    value = obj[field_name]
    if type(value) is not int or not low <= value < 1 << 63:
        raise ValueError(f"its {field_name} is not a non-negative integer")
    return value


def _str(obj: Any, field_name: str, default: str | None = None) -> str:
    value = obj.get(field_name, default) if default is not None else obj[field_name]
    if type(value) is not str:
        raise ValueError(f"its {field_name} is not a string")
    return value


#: The longest agent name an ``alive`` field may carry (ours: host, pid and start time, well under it).
MAX_AGENT_NAME = 256


def _alive(value: Any) -> tuple[int, str]:
    """A node key's ``alive`` field: ``[port, agent]``, where its agent answers liveness challenges."""
    if type(value) is not list or len(value) != 2 or type(value[0]) is not int or not 0 < value[0] < 65536 \
            or type(value[1]) is not str or not 0 < len(value[1]) <= MAX_AGENT_NAME or not value[1].isprintable():
        raise ValueError("its alive field is not [a port, an agent's printable name]")
    return value[0], value[1]


class WarnLimiter:
    """One warning per kind at once, then at most one line per ``every`` seconds with how many were suppressed;
    the etcd keys it names are escaped (a planted key cannot forge log lines)."""

    def __init__(self, every: float = 60.0, clock: Any = time.monotonic) -> None:
        self.every, self.clock = every, clock
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()

    def warn(self, kind: str, message: str, *args: Any) -> None:
        with self._lock:
            now = self.clock()
            last = self._last.get(kind)
            if last is not None and now - last < self.every:
                self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
                return
            self._last[kind] = now
            suppressed = self._suppressed.pop(kind, 0)
        log.warning(message + ("" if not suppressed else f" ({suppressed} more like it in the last minute)"), *args)


def shown(key: bytes) -> str:
    """An etcd key for a log line: printable ASCII, escapes for the rest, at most 200 characters."""
    return repr(key)[2:-1][:200]


class Codec:
    """The values of the protocol: strict JSON, signed with the job's key when there is one and then bound to
    the record, incarnation and lease they belong to (module docstring), bounded in size.

    One codec per agent, shared by its handler and its member watch: it remembers the newest round record
    either has taken (``newest``), which no replayed record can go behind."""

    def __init__(self, signer: Sealer, node_prefix: bytes) -> None:
        self.signer = signer
        self.node_prefix = node_prefix
        self.bound = signer.enabled  #: values carry and are checked for what binds them
        self.newest = 0  #: the mod_revision of the newest round record taken
        self._lock = threading.Lock()
        self.warnings = WarnLimiter()

    # -- reading ------------------------------------------------------------------------------------------

    def open(self, kv: KeyValue) -> Any:
        """The JSON of ``kv``: :class:`PermissionError` if it is not signed with the job's key,
        :class:`RendezvousRefusedError` if it is signed and this agent has no key, :class:`ValueError` otherwise."""
        if len(kv.value) > MAX_VALUE_BYTES:
            raise ValueError(f"{len(kv.value)} bytes is more than any rendezvous value")
        if not self.signer.enabled and kv.value.startswith(SIGNED_MAGIC):
            raise RendezvousRefusedError(
                f"The rendezvous value in etcd key '{shown(kv.key)}' is signed with the job's key, and this agent has "
                "none: give every node the same --rdzv_conf auth_key_file.")
        try:
            data = self.signer.open(kv.key, kv.value)
        except AuthError as exc:
            raise PermissionError(str(exc)) from exc
        if data[:1] == _DEFLATED:
            try:
                data = inflate(data[1:], MAX_VALUE_BYTES)
            except StateContentError as exc:
                raise ValueError(str(exc)) from exc
        try:
            obj = _strict_json(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"it is not the JSON this rendezvous writes ({exc})") from exc
        if not isinstance(obj, dict):
            raise ValueError("it is not the JSON object this rendezvous writes")
        return obj

    def _bound(self, obj: dict[str, Any], kv: KeyValue) -> int:
        """With the job's key: the value's ``after``, once its format and lease are checked (``VoidValue``)."""
        if obj.get("v") != BOUND_FORMAT:
            raise VoidValue("it was written by an elastic_runner build that did not bind values to their round "
                            "(upgrade every node of the job together)")
        if _int(obj, "lease") != kv.lease:
            raise VoidValue("it is not on the lease it was written on (put back by something else)")
        return _int(obj, "after")

    def round(self, kv: KeyValue) -> Round | None:
        """The record in ``kv``; None if it is void (a value this job's agents did not write here, now)."""
        try:
            obj = self.open(kv)
            listed = obj["members"]
            if not isinstance(listed, list) or not all(isinstance(m, list) and len(m) == 2 for m in listed):
                raise ValueError("its member list is not valid")
            members = tuple((m[0], m[1]) for m in listed)
            if not all(isinstance(name, str) and type(ticket) is int and ticket >= 0 for name, ticket in members):
                raise ValueError("its member list is not valid")
            master = obj.get("master")
            if master is not None and not (isinstance(master, list) and len(master) == 2
                                           and isinstance(master[0], str) and type(master[1]) is int):
                raise ValueError("its master is not an address and a port")
            record = Round(_int(obj, "round"), members, _int(obj, "lease") if "lease" in obj else 0,
                           _str(obj, "sealed_by", ""), _str(obj, "reason", ""), kv.mod_revision, kv.create_revision,
                           None if master is None else (master[0], master[1]))
            if not members or len({name for name, _ in members}) != len(members):
                raise ValueError("its member list is not valid")
            if record.master is not None and not 0 < record.master[1] < 65536:
                raise ValueError(f"its master port {record.master[1]} is not a port")
            if self.bound:
                after = self._bound(obj, kv)
                inc = _int(obj, "inc")
                if (kv.create_revision != inc) if inc else (kv.create_revision != kv.mod_revision):
                    raise VoidValue("it belongs to another incarnation of the record (put back after a deletion)")
                with self._lock:
                    if after < self.newest and kv.mod_revision != self.newest:
                        raise VoidValue(f"it is older than round records already seen (revision {after} < "
                                        f"{self.newest}): a replayed record")
                    self.newest = max(self.newest, kv.mod_revision)
            return record
        except (PermissionError, VoidValue, ValueError, KeyError, TypeError, IndexError) as exc:
            self.ignore("record", kv, exc)
            return None

    def node(self, kv: KeyValue) -> Joiner | None:
        try:
            obj = self.open(kv)
            node = NodeId(_str(obj, "addr"), _int(obj, "pid"), _int(obj, "local_id"), _str(obj, "nonce", ""))
            if node.name != kv.key[len(self.node_prefix):].decode():
                raise ValueError("its content names another node")
            after = self._bound(obj, kv) if self.bound else -1
            if self.bound and not kv.lease:
                raise VoidValue("it is on no lease (a departed node's value, put back)")
            port = _int(obj, "port") if "port" in obj else 0
            alive_port, alive_agent = _alive(obj["alive"]) if "alive" in obj else (0, "")
            return Joiner(node, _int(obj, "want"), kv.create_revision, port, after, alive_port, alive_agent)
        except (PermissionError, VoidValue, ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            self.ignore("node key", kv, exc)
            return None

    def control(self, kv: KeyValue | None, record_revision: int = 0, *, leased: bool = False,
                record: Round | None = None, member_only: bool = False) -> bool:
        """Whether a control key (closed, a sealer claim, a "waiting" signal) holds a value this job's agents wrote
        for the current record (``record_revision``; 0: none): with the job's key, a value anyone else put there —
        or put back from an earlier round — is ignored (with a warning) instead of closing the run, blocking its
        sealing or restarting its members. ``leased``: it must live on a lease; ``member_only``: its writer must be
        a member of ``record`` (when there is one)."""
        if kv is None:
            return False
        try:
            obj = self.open(kv)
            if leased and not kv.lease:
                raise VoidValue("it is on no lease")
            if self.bound:
                if self._bound(obj, kv) != record_revision:
                    raise VoidValue("it was written for another round record (replayed)")
                if member_only and record is not None and _str(obj, "by") not in record.names():
                    raise VoidValue("its writer is not a member of the current round")
            return True
        except (PermissionError, VoidValue, ValueError, KeyError, TypeError) as exc:
            self.ignore("key", kv, exc)
            return False

    def claim(self, kv: KeyValue | None, record_revision: int) -> bool:
        """A sealer's claim that counts: on a lease (it dies with its node), written by this job's agents."""
        return self.control(kv, record_revision, leased=True)

    def claimant(self, kv: KeyValue) -> str | None:
        """Who wrote the sealer claim ``kv`` (a claim that counts: :meth:`claim`), or None where it names nobody."""
        try:
            return _str(self.open(kv), "by")
        except (PermissionError, VoidValue, ValueError, KeyError, TypeError, AttributeError) as exc:
            self.ignore("sealer claim", kv, exc)
            return None

    def closed(self, kv: KeyValue | None, record: Round | None, record_revision: int) -> bool:
        """Whether the run is closed: by a member of the current round, for that round (or with none)."""
        return self.control(kv, record_revision, record=record, member_only=True)

    def ignore(self, what: str, kv: KeyValue, exc: Exception) -> None:
        """Warn (rate-limited per kind) about a value this job's agents did not write, or not for now."""
        if isinstance(exc, RendezvousRefusedError):
            raise exc
        kind = "replayed" if isinstance(exc, VoidValue) else "foreign"
        self.warnings.warn(f"{what}:{kind}", "Ignoring the rendezvous %s '%s': %s. Something other than an "
                           "elastic_runner agent of this job wrote it, or put back an old value; check who can write "
                           "the key prefix (docs/trust.md).", what, shown(kv.key), exc)

    def seen_revision(self, revision: int) -> None:
        """A read at store ``revision``: behind the newest record taken only if etcd was restored from a backup."""
        with self._lock:
            if revision and revision < self.newest:
                log.warning("etcd's revision %d is behind the newest round record seen (%d): it was restored from a "
                            "backup; round records are taken afresh.", revision, self.newest)
                self.newest = 0

    # -- writing ------------------------------------------------------------------------------------------

    def encode(self, key: bytes, obj: dict[str, Any], *, after: int = 0, lease: int = 0,
               incarnation: int | None = None) -> bytes:
        """``obj`` as the value of ``key``; with the job's key, bound to ``after`` (the record revision acted on),
        ``lease`` (the lease it is put on) and, for the round record, ``incarnation``."""
        if self.bound:
            obj = obj | {"v": BOUND_FORMAT, "after": after, "lease": lease} | (
                {"inc": incarnation} if incarnation is not None else {})
        data = json.dumps(obj, separators=(",", ":")).encode()
        if len(data) > 1024:
            # A round record (about 60 bytes a member) reaches every agent, twice: compressed it is a fifth.
            data = _DEFLATED + zlib.compress(data, 6)
        return self.signer.seal(key, data)
