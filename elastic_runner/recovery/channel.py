"""The recovery protocol's messages: typed, in the job's store signed with the job's key, and in an agent's private
directory between it and its own workers.

Agents and workers tell each other through the job's store (rank 0's ``TCPStore``, reachable by every node) that an
agent is alive (:class:`AgentBeat`), that it stops beating on purpose (the same slot, ``stopping``), where rank 0's
agent answers whether it is alive once that store is gone (:class:`AliveAt`: :mod:`.liveness`), that it replaces
a failed worker (:class:`Coming`), which generation of the group a rank is in (:class:`InGeneration`), each member's
part in a rebuilt group (:class:`Handle`, :class:`Arrived`), and the peer watchdog's counters and abort
(:class:`WatchdogBeat`, :class:`Abort`), and, in the rendezvous' own store, which nodes are kept out of the job
(:class:`Excluded`) and the configuration the running job trains with (:class:`JobConfig`). Every one of them is a
frozen dataclass with the store key it lives under; :class:`Channel` writes and reads them and nothing else goes
through it.

The store has no access control: whoever reaches its port can write any key. With the job's key
(``--rdzv_conf auth_key_file``, passed on to the workers by path) every message is signed with HMAC-SHA256 over its
store key and its bytes (:class:`~elastic_runner.rendezvous.seal.Sealer`, as the rendezvous' own values): a value
that is not signed with the key, or was signed for another key (moved from one agent's slot to another's), reads as
absent, and the first one of each key is logged as a warning naming it. So a writer without the key cannot make
survivors count a live node out (its beat stood still), wait for a replacement nobody announced, join a group at a
handle of its choosing, or stop every rank with a forged abort; a message signed in an earlier round's store does not
verify in this one's (the signature binds the store's address). Beats and counters only grow: one that went back is
taken for a replay (logged, evidence of nothing). What a writer on the store can still do is delete or race keys, and
hold a node's newest signed beat (or a rank's newest counter) in its slot, written back faster than its owner writes:
survivors then count that node out of one round (it rejoins the next), or a hung rank is found only at the
collective's timeout — a denial of service, never a wrong state. torch's own keys in the same store (the process
group's start) are torch's, unauthenticated as in every torch job (docs/trust.md).

Without a key the messages are the same JSON, unsigned, and are still read as their type or not at all.

Between an agent and its own workers the hand-over's messages (:class:`ReadyToPark`, :class:`ParkRequest`,
:class:`Parked`, :class:`Place`: :mod:`.handover`) go through the same :class:`Channel`, over
:class:`PrivateDirectory` (the agent's private directory, mode 0700: one file per message) instead of the job's
store, unsigned: nobody but the agent's user can write there, and each is still read as its type or not at all.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from ..files import write_file_atomically
from ..printable import printable
from ..rendezvous.seal import AuthError, Sealer

log = logging.getLogger(__name__)

#: Where the recovery protocol's keys live in the job's store.
PREFIX = "regroup"
#: The largest message read (a handle is ~100 bytes; reasons are cut to ~1,000 characters, at most 4 bytes each).
MAX_MESSAGE_BYTES = 8192


@dataclass(frozen=True)
class Message:
    """A message of the protocol: its fields are its JSON; :meth:`key` is where it lives in the store."""

    kind: ClassVar[str] = ""

    def key(self) -> str:
        raise NotImplementedError


@dataclass(frozen=True)
class AgentBeat(Message):
    """The agent of node ``agent`` (its group rank) is alive: its ``count``-th beat in its life. ``stopping``: its
    last beat, when it stops beating on purpose (it restarts its node's workers, or ends): alive, so survivors never
    count its node out for the silence that follows."""

    agent: int
    count: int
    stopping: bool = False
    kind: ClassVar[str] = "beat"

    def key(self) -> str:
        return agent_key(self.agent)


@dataclass(frozen=True)
class AliveAt(Message):
    """Rank 0's agent (named ``agent``: host, pid, start) answers whether it is alive at ``port`` on MASTER_ADDR."""

    port: int
    agent: str
    kind: ClassVar[str] = "alive_at"

    def key(self) -> str:
        return f"{PREFIX}/alive_at"


@dataclass(frozen=True)
class Coming(Message):
    """An agent replaces the failed worker of ``rank``; the replacement joins ``generation``."""

    generation: int
    rank: int
    kind: ClassVar[str] = "coming"

    def key(self) -> str:
        return f"{PREFIX}/{self.generation}/coming"


@dataclass(frozen=True)
class InGeneration(Message):
    """Rank ``rank`` is in ``generation`` of the round's group (its replacement joins the next one)."""

    rank: int
    generation: int
    kind: ClassVar[str] = "in"

    def key(self) -> str:
        return generation_key(self.rank)


@dataclass(frozen=True)
class Handle(Message):
    """Member ``member``'s reconfigure handle for ``generation`` (what torch connects to)."""

    generation: int
    member: str
    handle: str
    kind: ClassVar[str] = "handle"

    def key(self) -> str:
        return handle_key(self.generation, self.member)


@dataclass(frozen=True)
class Arrived(Message):
    """Member ``member`` is ready to create ``generation``'s group."""

    generation: int
    member: str
    kind: ClassVar[str] = "arrived"

    def key(self) -> str:
        return arrived_key(self.generation, self.member)


@dataclass(frozen=True)
class WatchdogBeat(Message):
    """Rank ``rank``'s peer-watchdog counter in ``generation``; ``done``: it ended on purpose (never judged dead)."""

    generation: int
    rank: int
    count: int
    done: bool = False
    kind: ClassVar[str] = "hb"

    def key(self) -> str:
        return watchdog_key(self.generation, self.rank)


@dataclass(frozen=True)
class Abort(Message):
    """Rank ``rank`` ends ``generation``'s attempt everywhere, for ``reason``."""

    generation: int
    rank: int
    reason: str
    kind: ClassVar[str] = "abort"

    def key(self) -> str:
        return abort_key(self.generation)


@dataclass(frozen=True)
class Excluded(Message):
    """Node ``node`` (its name: :func:`~elastic_runner.recovery.exclusions.node_name`) is out of job ``run_id`` until
    ``until`` (seconds since the epoch), for ``reason``. Lives in the rendezvous' own store, not the job's: it
    outlasts rounds (:mod:`.exclusions`)."""

    run_id: str
    node: str
    until: float
    reason: str
    kind: ClassVar[str] = "excluded"

    def key(self) -> str:
        return f"elastic_runner/excluded/{self.run_id}/{self.node}"


@dataclass(frozen=True)
class JobConfig(Message):
    """The configuration the running job ``run_id`` trains with, as node ``node`` (the round's first) has it:
    ``digest`` is ``key=hash`` per dotted config key, ``;``-separated (:mod:`.job_config`: hashes, so no value,
    path or name leaves the node), written at ``written`` (seconds since the epoch) and again while the job runs.
    Lives in the rendezvous' own store: a node reads it before it joins."""

    run_id: str
    node: str
    written: float
    digest: str
    kind: ClassVar[str] = "job_config"

    def key(self) -> str:
        return f"elastic_runner/config/{self.run_id}"


@dataclass(frozen=True)
class LocalMessage(Message):
    """A message between an agent and its own worker at ``local_rank`` (:class:`PrivateDirectory`): one file each,
    named by :attr:`file` with the local rank."""

    local_rank: int
    file: ClassVar[str] = ""

    def key(self) -> str:
        return self.at(self.local_rank)

    @classmethod
    def at(cls, local_rank: int) -> str:
        return cls.file.format(local_rank)


@dataclass(frozen=True)
class ReadyToPark(LocalMessage):
    """The worker at ``local_rank`` (process ``pid``) can park now: it is in its training loop, or waits for a failed
    peer's replacement (its announcement, then its arrival)."""

    pid: int
    kind: ClassVar[str] = "ready"
    file: ClassVar[str] = "ready-{}"


@dataclass(frozen=True)
class ParkRequest(LocalMessage):
    """The agent asks its worker at ``local_rank`` to park at its next step boundary, for ``why``."""

    why: str
    kind: ClassVar[str] = "park"
    file: ClassVar[str] = "park-{}"


@dataclass(frozen=True)
class Parked(LocalMessage):
    """The worker at ``local_rank`` (process ``pid``) is parked and waits for its :class:`Place`. ``lost``: the
    group ranks of the agents it saw stop beating in its round of ``agents`` agents (their nodes are lost: its agent
    counts them out of the next round instead of waiting the dead-node window); none when it parked for another
    reason (``agents`` 0)."""

    pid: int
    agents: int = 0
    lost: tuple[int, ...] = ()
    kind: ClassVar[str] = "parked"
    file: ClassVar[str] = "parked-{}"


@dataclass(frozen=True)
class Place(LocalMessage):
    """The agent's answer to a :class:`Parked` worker: its environment in the new round (what torch's agent gives a
    new worker: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...)."""

    environment: dict[str, str]
    kind: ClassVar[str] = "place"
    file: ClassVar[str] = "place-{}.json"


def agent_key(agent: int) -> str:
    return f"{PREFIX}/agent/{agent}"


def generation_key(rank: int) -> str:
    return f"{PREFIX}/in/{rank}"


def handle_key(generation: int, member: str) -> str:
    return f"{PREFIX}/{generation}/{member}"


def arrived_key(generation: int, member: str) -> str:
    return f"{PREFIX}/{generation}/arrived/{member}"


def watchdog_key(generation: int, rank: int) -> str:
    return f"er/hb/{generation}/{rank}"


def abort_key(generation: int) -> str:
    return f"er/abort/{generation}"


M = TypeVar("M", bound=Message)

_SCALARS = {"int": int, "str": str, "bool": bool, "float": float}


def _checked(name: str, kind: str, value: Any) -> Any:
    """``value`` as the field ``name`` of type ``kind`` holds it (the annotation's text: a scalar,
    ``tuple[int, ...]`` or ``dict[str, str]``), or ValueError naming the field."""
    if kind == "tuple[int, ...]":
        if not isinstance(value, list) or not all(type(v) is int for v in value):
            raise ValueError(f"its {name} is not a list of integers")
        return tuple(value)
    if kind == "dict[str, str]":
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            raise ValueError(f"its {name} is not a mapping of strings to strings")
        return value
    scalar = _SCALARS[kind]
    # type(), not isinstance: JSON's true is no integer here, and an integer is a float's value only
    if type(value) not in ((int, float) if scalar is float else (scalar,)) or \
            scalar is float and not math.isfinite(value):
        raise ValueError(f"its {name} is not a{'n' if scalar is int else ''} {scalar.__name__}")
    return float(value) if scalar is float else value


class Channel:
    """Writes and reads :class:`Message` s in ``store`` (a ``torch.distributed.Store``), signed with ``key`` (the
    job's key; None: unsigned). ``context``: what else the signature binds a message to, the same for its writers and
    readers — the job's store's ``MASTER_ADDR:MASTER_PORT`` (a new round's store has its own), so that a message
    signed in an earlier round's store does not verify in this one's."""

    def __init__(self, store: Any, key: bytes | None, context: str = "") -> None:
        self.store = store
        self._sealer = Sealer(key)
        self._context = context
        self._refused: set[str] = set()  #: keys whose refusal was logged (once each)

    @property
    def signed(self) -> bool:
        return self._sealer.enabled

    def send(self, message: Message) -> None:
        self.store.set(message.key(), self.encode(message))

    def read(self, cls: type[M], key: str) -> M | None:
        """The message of type ``cls`` at ``key``; None where there is none, or what is there is not one (refused)."""
        if not self.store.check([key]):
            return None
        try:
            blob = self.store.get(key)
        except LookupError:  # (a private directory's message taken back between the two looks: none now)
            return None
        return self.decode(cls, key, blob)

    def read_many(self, cls: type[M], keys: list[str], refused: set[str] | None = None) -> dict[str, M | None]:
        """:meth:`read` of each key, the present ones in one round trip (``multi_get``); the keys that held something
        else than a valid message are added to ``refused`` (where given): a value there, but nobody's word."""
        present = [k for k in keys if self.store.check([k])]
        blobs = dict(zip(present, self.store.multi_get(present))) if present else {}
        read: dict[str, M | None] = {}
        for k in keys:
            read[k] = self.decode(cls, k, blobs[k]) if k in blobs else None
            if k in blobs and read[k] is None and refused is not None:
                refused.add(k)
        return read

    def has(self, cls: type[M], keys: list[str]) -> bool:
        """Whether every key holds a valid message of type ``cls``."""
        return self.store.check(keys) and all(m is not None for m in self.read_many(cls, keys).values())

    def encode(self, message: Message) -> bytes:
        body = json.dumps({"kind": message.kind} | asdict(message), sort_keys=True, separators=(",", ":"),
                          ensure_ascii=False).encode()
        return self._sealer.seal(self._bound(message.key()), body)

    def _bound(self, key: str) -> bytes:
        return f"{self._context}\n{key}".encode() if self._context else key.encode()

    def decode(self, cls: type[M], key: str, blob: bytes | str) -> M | None:
        raw = blob.encode() if isinstance(blob, str) else bytes(blob)
        try:
            if len(raw) > MAX_MESSAGE_BYTES + 64:
                raise ValueError(f"it is {len(raw)} bytes, more than any message of the protocol")
            try:
                body = json.loads(self._sealer.open(self._bound(key), raw))
            except AuthError:
                raise
            except (ValueError, UnicodeDecodeError) as exc:
                raise ValueError(f"it is not a message of the protocol ({type(exc).__name__})") from exc
            if not isinstance(body, dict) or body.pop("kind", None) != cls.kind:
                raise ValueError(f"it is not a {cls.kind!r} message")
            wanted = {f.name: f.type for f in fields(cls)}
            if set(body) != set(wanted):
                raise ValueError(f"its fields are {sorted(body)}, not {sorted(wanted)}")
            message = cls(**{name: _checked(name, str(wanted[name]), value) for name, value in body.items()})
            if message.key() != key:
                raise ValueError(f"it names {printable(message.key())}, another key")
        except (AuthError, ValueError) as exc:
            self._refuse(key, str(exc))
            return None
        return message

    def _refuse(self, key: str, why: str) -> None:
        if key in self._refused:
            return
        self._refused.add(key)
        signed = " with the job's key" if self.signed else ""
        where = getattr(self.store, "where", "the job's store")
        who = getattr(self.store, "writers", "Whoever wrote it can reach the store's port: see docs/trust.md")
        log.warning("%s holds a value at %s that is not a message of the recovery protocol%s (%s): it is ignored. %s",
                    where, key, signed, why, who)


class PrivateDirectory:
    """A store of one file per key in ``directory``, which only its agent's user may enter (the agent's private
    directory, mode 0700): the messages between an agent and its own workers (:class:`ReadyToPark`,
    :class:`ParkRequest`, :class:`Parked`, :class:`Place`) go through a :class:`Channel` over it, unsigned — nobody
    else can write there — and still read as their type or not at all. Each value is written whole or not at all (a
    rename) with the run's file mode. The subset of ``torch.distributed.Store`` that :class:`Channel` uses, plus
    ``delete_key``; ``get`` of a missing key raises KeyError instead of waiting for it."""

    where = "the agent's private directory"
    writers = "Only this user's processes can write there: a bug, please report it"

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)

    def path(self, key: str) -> Path:
        if not key or "/" in key or key.startswith("."):
            raise ValueError(f"{key!r} is no file name of {self.directory}")
        return self.directory / key

    def set(self, key: str, value: bytes | str) -> None:
        write_file_atomically(self.path(key), value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key: str) -> bytes:
        try:
            return self.path(key).read_bytes()
        except FileNotFoundError as exc:
            raise KeyError(key) from exc

    def check(self, keys: list[str]) -> bool:
        return all(self.path(k).exists() for k in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def delete_key(self, key: str) -> bool:
        try:
            self.path(key).unlink()
        except FileNotFoundError:
            return False
        return True
