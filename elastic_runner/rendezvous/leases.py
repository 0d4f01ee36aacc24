"""The etcd-native rendezvous protocol (``protocol=leases``, the default of ``--rdzv_backend=etcd-v3``).

torch's ``DynamicRendezvousHandler`` keeps every node (participants, wait list, heartbeats) in one blob
that every node rewrites by compare-and-swap on every join and every keep-alive: a round of N nodes
costs O(N²) bytes and conflicts, and past ~128 nodes it no longer completes (``protocol=state``, kept
for a mixed-version upgrade, see :mod:`elastic_runner.rendezvous.handler`). Here each node writes only
its own key, liveness is an etcd lease, and one transaction seals a round.

Keys, under ``{key_prefix}/{run_id}/rdzv/``:

- ``node/<node>``: a live agent and the round it wants (``want``), JSON, on the agent's *liveness
  lease* (TTL = ``keep_alive_interval * keep_alive_max_attempt``, torch's dead-node window). A
  keep-alive is one lease refresh; a dead agent's key disappears when its lease expires. The key's
  ``create_revision`` is the node's *ticket*: it changes only if the key was deleted in between.
- ``ctl/round``: the newest sealed round, ``{"round", "members": [[node, ticket], ...] in rank order,
  "lease", "sealed_by"}``, written only by a transaction that compares its ``mod_revision`` with the
  one the writer read (create-if-absent for the first) and that the run is not closed.
- ``ctl/sealer/<R>``: the agent that seals round R (create-if-absent, on its liveness lease: if it
  dies the key goes and the next waiting agent takes over).
- ``ctl/next/<R>``: "a node waits for round R", created by the first joiner that needs the running
  round to end (a member restarting, or a new node while the round has room): what
  ``num_nodes_waiting`` reports to the agents that train.
- ``ctl/closed``: the run is over (``set_closed``/``shutdown``).

A round R forms like this: each joining agent reads ``ctl/round`` (round R-1), puts its node key with
``want = R`` (compared against the round it read), claims ``ctl/sealer/R`` or else waits on one watch
of ``ctl/``. The sealer reads the node keys once, then follows them on one watch, and seals when

- ``max_nodes`` want R (the rest wait for the next round; previous members first, then join order), or
- at least ``min_nodes`` want R and every member of round R-1 wants R or is dead (its key expired) and
  at least one of them is back: a restart or a lost node re-forms without the last call, or
- at least ``min_nodes`` want R and ``last_call_timeout`` has passed since that was first true
  (the first round, and new nodes of a job whose previous members are all gone).

Ranks are the members sorted by (address, pid, local id), as torch's handler assigns them. Requests
per agent and round: about five (read, join, claim, one watch, one check) however large the job;
the sealer alone reads the N node keys, once. While training, an agent refreshes its lease once per
``keep_alive_interval`` and keeps one idle watch on ``ctl/``: ``num_nodes_waiting`` costs nothing.

**Why two rounds can never both be current.** ``ctl/round`` changes only through a transaction that
compares its ``mod_revision`` with the value the writer read and writes round number read+1; etcd
transactions are serialisable, so the record's values form one chain with one member list per round
number, and ``next_rendezvous`` returns round R only to a node listed in the record of round R. A node
of round R whose lease expired (partitioned, paused) may have been counted dead when round R+1 was
sealed without it: it takes a seat in a round only if its node key still has the ticket the record
lists, read in the same transaction as the record, so a key that was deleted at any point after the
sealer read it (its lease expired, it was re-created) loses the seat; it joins the next round
instead. While it trains in an older round, its watch shows the newer ``ctl/round`` (or the failing
collectives do) and ``num_nodes_waiting`` makes its agent stop the workers and rejoin. The members of
round R+1 all left round R before joining (the agent stops its workers before ``next_rendezvous``),
so a stale round can never reach a quorum with them, and snapshot fencing keeps it off the disk.

With the job's key (``auth_key_file``) every value is signed over its etcd key (see ``seal``);
without it values are still only JSON, parsed strictly and bounded in size: nothing is unpickled.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable
from urllib.parse import quote

import torch.distributed as dist
from torch.distributed import Store
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.api import RendezvousHandler, RendezvousStoreInfo

from .kv import Compare, Delete, EtcdError, EtcdLeaseNotFound, Get, KeyValue, KVClient, LeaseKeeper, Put, WatchEvent
from .seal import AuthError, Sealer

log = logging.getLogger(__name__)

PROTOCOL = "leases"
#: The largest value accepted from etcd (a round record of 1,024 members is ~70 KB).
MAX_VALUE_BYTES = 4 << 20
#: Longest single watch of an agent that trains: bounds how long a silently dead stream goes unnoticed.
MEMBER_WATCH_SLICE = 30.0


class RendezvousRefusedError(RendezvousStateError):
    """What this run's keys hold cannot be used (not signed with the job's key, not ours, another protocol);
    the message names the key and what to do, so the agent prints it as one line."""


@dataclass(frozen=True, order=True)
class NodeId:
    """An agent: torch's node description (address, process id, a counter for several per process)."""

    addr: str
    pid: int
    local_id: int

    @property
    def name(self) -> str:
        return f"{quote(self.addr, safe='')}_{self.pid}_{self.local_id}"

    def __str__(self) -> str:
        return f"{self.addr}_{self.pid}_{self.local_id}"


_local_ids = iter(range(1 << 62))
_local_lock = threading.Lock()


def new_node(local_addr: str | None) -> NodeId:
    with _local_lock:
        local_id = next(_local_ids)
    return NodeId(local_addr or socket.getfqdn(), os.getpid(), local_id)


@dataclass(frozen=True)
class Settings:
    run_id: str
    min_nodes: int
    max_nodes: int
    join_timeout: float = 600.0
    last_call_timeout: float = 30.0
    close_timeout: float = 30.0
    keep_alive_interval: float = 5.0
    keep_alive_max_attempt: int = 3

    def __post_init__(self) -> None:
        if not self.run_id:
            raise ValueError("The run id must be a non-empty string (torchrun's --rdzv_id).")
        if self.min_nodes < 1:
            raise ValueError(f"The minimum number of nodes ({self.min_nodes}) must be at least 1 (--nnodes=MIN:MAX).")
        if self.max_nodes < self.min_nodes:
            raise ValueError(f"The maximum number of nodes ({self.max_nodes}) must be at least the minimum "
                             f"({self.min_nodes}) (--nnodes=MIN:MAX).")
        if self.keep_alive_interval <= 0 or self.keep_alive_max_attempt < 1:
            raise ValueError("keep_alive_interval must be positive and keep_alive_max_attempt at least 1 "
                             f"(got {self.keep_alive_interval} and {self.keep_alive_max_attempt}) in --rdzv_conf.")

    @property
    def window(self) -> float:
        """torch's dead-node window: a node silent this long is dead (the liveness lease's TTL)."""
        return self.keep_alive_interval * self.keep_alive_max_attempt

    @property
    def lease_ttl(self) -> int:
        return max(2, round(self.window))  # etcd's shortest lease is about 2 s with default election settings


@dataclass(frozen=True)
class Joiner:
    node: NodeId
    want: int
    ticket: int  #: the key's create_revision


@dataclass(frozen=True)
class Round:
    round: int
    members: tuple[tuple[str, int], ...]  #: (node name, ticket) in rank order
    lease: int = 0
    sealed_by: str = ""
    reason: str = ""  #: why the sealer sealed it: max_nodes, previous round accounted for, last call

    def names(self) -> list[str]:
        return [name for name, _ in self.members]


@dataclass
class View:
    """What a sealer knows of the run: every live node key, the newest record, whether it is closed."""

    nodes: dict[str, Joiner] = field(default_factory=dict)
    record: Round | None = None
    record_revision: int = 0
    closed: bool = False
    sealer_present: bool = True


def choose_members(candidates: list[Joiner], previous: Round | None, max_nodes: int) -> list[Joiner]:
    """Who of more than ``max_nodes`` candidates gets a seat: the previous round's members first, then
    in join order; the chosen in rank order (torch's: sorted node descriptions)."""
    kept = set(previous.names()) if previous else set()
    ordered = sorted(candidates, key=lambda j: (j.node.name not in kept, j.ticket))
    return sorted(ordered[:max_nodes], key=lambda j: j.node)


def ready_to_seal(view: View, want: int, settings: Settings, min_reached_at: float | None,
                  now: float) -> tuple[bool, str]:
    """Whether round ``want`` can be sealed now, and why (see the module docstring)."""
    candidates = [j for j in view.nodes.values() if j.want == want]
    if len(candidates) >= settings.max_nodes:
        return True, "max_nodes"
    if len(candidates) < settings.min_nodes:
        return False, ""
    previous = view.record if view.record is not None and view.record.round == want - 1 else None
    if previous is not None:
        live = {name: j for name, j in view.nodes.items()}
        back = [n for n in previous.names() if n in live and live[n].want == want]
        pending = [n for n in previous.names() if n in live and live[n].want != want]
        if back and not pending:
            return True, "previous round accounted for"
    if min_reached_at is not None and now - min_reached_at >= settings.last_call_timeout:
        return True, "last call"
    return False, ""


@dataclass
class _Watched:
    waiting: int = 0  #: nodes wait for a later round (we report 1: the agent only asks "any?")
    closed: bool = False


class LeaseRendezvousHandler(RendezvousHandler):
    """torch's ``RendezvousHandler`` on the protocol of the module docstring."""

    def __init__(self, client: KVClient, run_prefix: str, settings: Settings, store: Store,
                 local_addr: str | None = None, leases: LeaseKeeper | None = None, sealer: Sealer | None = None,
                 backend_name: str = "etcd-v3", clock: Callable[[], float] = time.monotonic) -> None:
        self._client = client
        self._settings = settings
        self._store = store
        self._node = new_node(local_addr)
        self._leases = leases or LeaseKeeper(client, 7200)
        self._signer = sealer or Sealer(None)
        self._backend_name = backend_name
        self._clock = clock
        base = f"{run_prefix.rstrip('/')}/rdzv/"
        self._prefix = base.encode()
        self._node_prefix = f"{base}node/".encode()
        self._ctl = f"{base}ctl/".encode()
        self._round_key = f"{base}ctl/round".encode()
        self._closed_key = f"{base}ctl/closed".encode()
        self._my_key = self._node_prefix + self._node.name.encode()
        self._legacy_key = f"{run_prefix.rstrip('/')}/state".encode()
        self._lock = threading.RLock()
        self._lease = 0  #: liveness lease
        self._my_value = b""
        self._member_of: Round | None = None
        self._seen = _Watched()  #: what the watch of the current round saw
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None
        self._watcher: threading.Thread | None = None
        self._watch_stop = threading.Event()
        self._warned: set[bytes] = set()
        self._tcp_server: Any = None
        #: True when the last round this agent joined was sealed without the last call, because every node of the
    #: round before was back or dead (the agent reports it)
        self.completed_early = False

    # -- torch's RendezvousHandler ---------------------------------------------------------------------------

    @property
    def settings(self) -> Settings:
        return self._settings

    @property
    def node(self) -> NodeId:
        return self._node

    def get_backend(self) -> str:
        return self._backend_name

    def get_run_id(self) -> str:
        return self._settings.run_id

    @property
    def use_agent_store(self) -> bool:
        return os.getenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0") != "1"

    def next_rendezvous(self) -> RendezvousInfo:
        self._stop_watcher()
        self._member_of = None
        deadline = self._clock() + self._settings.join_timeout
        log.info("The node '%s' attempts to join the next round of the rendezvous '%s'.", self._node,
                 self._settings.run_id)
        try:
            record = self._join(deadline)
        except EtcdError as exc:
            raise self._connection_error("join the rendezvous", exc) from exc
        rank = record.names().index(self._node.name)
        self._member_of = record
        self.completed_early = record.reason == "previous round accounted for"
        self._start_watcher(record)
        log.info("The node '%s' has joined round %d of the rendezvous '%s' as rank %d in a world of size %d.",
                 self._node, record.round, self._settings.run_id, rank, len(record.members))
        store = dist.PrefixStore(f"torch.rendezvous.{self._settings.run_id}.{record.round}", self._store)
        return RendezvousInfo(store, rank, len(record.members), self._bootstrap_info(rank, store))

    def is_closed(self) -> bool:
        try:
            kv, _ = self._client.get(self._closed_key)
        except EtcdError as exc:
            raise self._connection_error("read whether the rendezvous is closed", exc) from exc
        return kv is not None

    def set_closed(self) -> None:
        try:
            self._leases.run(lambda lease: self._client.txn(
                (), [Put(self._closed_key, self._seal(self._closed_key, {"by": self._node.name}), lease)]))
        except EtcdError as exc:
            raise self._connection_error("close the rendezvous", exc) from exc
        log.info("The node '%s' has closed the rendezvous '%s'.", self._node, self._settings.run_id)

    def num_nodes_waiting(self) -> int:
        return self._seen.waiting

    def shutdown(self) -> bool:
        self._stop.set()
        self._stop_watcher()
        try:
            self.set_closed()
            return True
        except Exception as exc:  # noqa: BLE001 - torch's contract: report, do not raise
            log.warning("The node '%s' has failed to shut down the rendezvous '%s': %s", self._node,
                        self._settings.run_id, exc)
            return False
        finally:
            self._release()

    # -- joining ------------------------------------------------------------------------------------------

    def _join(self, deadline: float) -> Round:
        """Join the round after the newest sealed one and return the record of the round that seats us."""
        want = 0
        while True:
            if self._clock() >= deadline:
                self._give_up(want)
            record, record_rev, closed = self._read_control()
            if closed:
                raise RendezvousClosedError(f"The rendezvous '{self._settings.run_id}' is closed: its agents have "
                                            "ended it.")
            want = 0 if record is None else record.round + 1
            try:
                joined = self._put_join(want, record, record_rev)
                if joined is None:
                    continue  # a round was sealed meanwhile: join the one after it
                sealer_present, revision = joined
                self._wait_for_round(want, sealer_present, revision, deadline)
            except EtcdLeaseNotFound:
                self._regrant(self._lease)  # etcd lost our lease while we joined: register again
                continue
            seated = self._take_seat(want)
            if seated is not None:
                return seated

    def _put_join(self, want: int, record: Round | None, record_rev: int) -> tuple[bool, int] | None:
        """Write our node key for round ``want`` (and the "waiting" signal when the running round must end);
        None when the record changed since we read it. Returns whether a sealer exists, and the revision."""
        value = self._seal(self._my_key, {"node": self._node.name, "addr": self._node.addr, "pid": self._node.pid,
                                          "local_id": self._node.local_id, "want": want})
        self._my_value = value
        next_key = self._ctl + f"next/{want}".encode()
        sealer_key = self._ctl + f"sealer/{want}".encode()
        record_compare = Compare.mod_revision(self._round_key, record_rev) if record_rev else \
            Compare.absent(self._round_key)
        signal = record is not None and (self._node.name in record.names() or
                                         len(record.members) < self._settings.max_nodes)
        lease = self._liveness_lease()
        try:
            return self._put_join_with(lease, value, want, record, record_rev, signal, next_key, sealer_key,
                                       record_compare)
        except EtcdLeaseNotFound:
            self._regrant(lease)
            return None

    def _put_join_with(self, lease: int, value: bytes, want: int, record: Round | None, record_rev: int,
                       signal: bool, next_key: bytes, sealer_key: bytes, record_compare: Compare
                       ) -> tuple[bool, int] | None:
        puts: list[Any] = [Put(self._my_key, value, lease)]
        if signal:
            puts.append(Put(next_key, self._seal(next_key, {"round": want, "by": self._node.name}), lease))
        compare = [record_compare] + ([Compare.absent(next_key)] if signal else [])
        result = self._client.txn(compare, puts + [Get(sealer_key)], [Get(self._round_key), Get(next_key)])
        if not result.succeeded:
            current, signalled = result.results
            if (current.mod_revision if current else 0) != record_rev:
                return None
            if signal and signalled is not None:  # someone else signalled first: join without it
                result = self._client.txn([record_compare], [Put(self._my_key, value, lease), Get(sealer_key)],
                                          [Get(self._round_key)])
                if not result.succeeded:
                    return None
        sealer_present = result.results[-1] is not None
        return sealer_present, result.revision

    def _wait_for_round(self, want: int, sealer_present: bool, revision: int, deadline: float) -> Round | None:
        """Seal round ``want`` or wait until a record newer than the one we read appears, the run is closed,
        or the watch's history is gone; our own seal, or None (the caller reads the record)."""
        seen = revision
        while True:
            if self._clock() >= deadline:
                self._give_up(want)
            if not sealer_present and self._claim_sealer(want):
                sealed = self._seal_round(want, deadline)
                if sealed is None:
                    self._drop_sealer_claim(want)  # someone else sealed it, or it closed: the claim would linger
                return sealed
            state: dict[str, Any] = {"record": None, "sealer_gone": False, "closed": False}
            sealer_key = self._ctl + f"sealer/{want}".encode()

            def handle(events: list[WatchEvent]) -> bool:
                nonlocal seen
                for event in events:
                    seen = max(seen, event.kv.mod_revision)
                    if event.kv.key == self._round_key and event.kind == "put":
                        state["record"] = event.kv
                    elif event.kv.key == sealer_key and event.kind == "delete":
                        state["sealer_gone"] = True
                    elif event.kv.key == self._closed_key and event.kind == "put":
                        state["closed"] = True
                return bool(state["record"] or state["sealer_gone"] or state["closed"])

            end = self._client.watch_prefix(self._ctl, seen + 1, max(0.0, deadline - self._clock()), handle)
            if state["closed"] or state["record"] is not None or end == "compacted":
                return None  # re-read everything: closed, sealed (by someone), or history gone
            if state["sealer_gone"]:
                sealer_present = False

    def _claim_sealer(self, want: int) -> bool:
        key = self._ctl + f"sealer/{want}".encode()
        result = self._client.txn([Compare.absent(key)],
                                  [Put(key, self._seal(key, {"by": self._node.name}), self._liveness_lease())])
        return result.succeeded

    def _drop_sealer_claim(self, want: int) -> None:
        key = self._ctl + f"sealer/{want}".encode()
        self._client.txn([Compare.value(key, self._seal(key, {"by": self._node.name}))], [Delete(key)])

    def _seal_round(self, want: int, deadline: float) -> Round | None:
        """As the sealer of round ``want``: follow the node keys until the round can be sealed, seal it."""
        view = View()
        kvs, revision = self._client.get_prefix(self._prefix)
        for kv in kvs:
            self._apply(view, kv, "put")
        min_reached_at: float | None = None
        sealer_key = self._ctl + f"sealer/{want}".encode()
        while True:
            if view.closed:
                return None
            if view.record is not None and view.record.round >= want:
                return None  # sealed by someone else (a sealer we thought dead)
            now = self._clock()
            count = sum(1 for j in view.nodes.values() if j.want == want)
            if count >= self._settings.min_nodes:
                min_reached_at = now if min_reached_at is None else min_reached_at
            else:
                min_reached_at = None
            ready, why = ready_to_seal(view, want, self._settings, min_reached_at, now)
            if ready:
                sealed = self._write_round(want, view, why, sealer_key)
                if sealed is not None:
                    return sealed
                return None  # the record or the closed flag changed under us: start over
            if now >= deadline:
                self._give_up(want)
            timeout = deadline - now
            if min_reached_at is not None:
                timeout = min(timeout, min_reached_at + self._settings.last_call_timeout - now)

            def handle(events: list[WatchEvent]) -> bool:
                nonlocal revision
                for event in events:
                    revision = max(revision, event.kv.mod_revision)
                    self._apply(view, event.kv, event.kind)
                n = sum(1 for j in view.nodes.values() if j.want == want)
                at = min_reached_at if min_reached_at is not None else (self._clock() if n >= self._settings.min_nodes
                                                                        else None)
                return view.closed or (view.record is not None and view.record.round >= want) \
                    or ready_to_seal(view, want, self._settings, at, self._clock())[0] \
                    or (min_reached_at is None and at is not None)

            end = self._client.watch_prefix(self._prefix, revision + 1, max(0.0, timeout), handle)
            if end == "compacted":
                return None

    def _write_round(self, want: int, view: View, why: str, sealer_key: bytes) -> Round | None:
        candidates = [j for j in view.nodes.values() if j.want == want]
        previous = view.record if view.record is not None and view.record.round == want - 1 else None
        members = choose_members(candidates, previous, self._settings.max_nodes)
        lease = self._leases.current()
        record = Round(want, tuple((j.node.name, j.ticket) for j in members), lease, self._node.name, why)
        value = self._seal(self._round_key, {"round": record.round, "members": [list(m) for m in record.members],
                                             "lease": lease, "sealed_by": record.sealed_by, "reason": why})
        compare = [Compare.mod_revision(self._round_key, view.record_revision) if view.record_revision
                   else Compare.absent(self._round_key), Compare.absent(self._closed_key)]
        result = self._client.txn(compare, [Put(self._round_key, value, lease), Delete(sealer_key),
                                            Delete(self._ctl + f"next/{want}".encode()),
                                            Delete(self._ctl + f"next/{want - 1}".encode())])
        if not result.succeeded:
            return None
        log.info("rendezvous '%s': sealed round %d with %d node(s) (%s)", self._settings.run_id, want,
                 len(members), why)
        return record

    def _take_seat(self, want: int) -> Round | None:
        """Read the newest record and our own key in one transaction: our seat in round ``want`` (or later),
        or None to join again."""
        result = self._client.txn((), [Get(self._round_key), Get(self._my_key), Get(self._closed_key)])
        record_kv, mine, closed = result.results
        if closed is not None:
            raise RendezvousClosedError(f"The rendezvous '{self._settings.run_id}' is closed: its agents have "
                                        "ended it.")
        record = self._parse_round(record_kv) if record_kv is not None else None
        if record is None or record.round < want:
            return None
        tickets = dict(record.members)
        ticket = tickets.get(self._node.name)
        if ticket is None:
            return None  # not seated (the round was full, or sealed before we joined): join the next one
        if mine is None or mine.create_revision != ticket:
            log.warning("The node '%s' is listed in round %d of the rendezvous '%s', but its lease expired after the "
                        "round was sealed (it may have been counted dead); it joins the next round instead.",
                        self._node, record.round, self._settings.run_id)
            return None
        return record

    def _give_up(self, want: int) -> None:
        try:  # roll back: our key (if it is still the one we wrote) and a sealer claim of ours
            self._client.txn([Compare.value(self._my_key, self._my_value)], [Delete(self._my_key)])
            self._drop_sealer_claim(want)
        except EtcdError:
            pass
        raise RendezvousTimeoutError(
            f"The rendezvous '{self._settings.run_id}' did not complete round {want} within join_timeout="
            f"{self._settings.join_timeout:.0f} s (--nnodes min {self._settings.min_nodes}): fewer nodes joined. "
            "Check that the other nodes run with the same --rdzv_id and --rdzv_endpoint, or raise join_timeout "
            "in --rdzv_conf.")

    # -- reading ------------------------------------------------------------------------------------------

    def _read_control(self) -> tuple[Round | None, int, bool]:
        result = self._client.txn((), [Get(self._round_key), Get(self._closed_key), Get(self._legacy_key)])
        record_kv, closed, legacy = result.results
        if legacy is not None:
            key = self._legacy_key.decode()
            raise RendezvousRefusedError(
                f"The etcd key '{key}' holds a rendezvous of the 'state' protocol: agents of an elastic_runner "
                "build from before the lease protocol, or started with --rdzv_conf protocol=state, use this run id, and the two protocols do "
                "not see each other. Start every node of the job with the same protocol (add protocol=state to "
                f"--rdzv_conf until all nodes are upgraded), or, if no such agent runs any more, 'etcdctl del {key}'.")
        record = self._parse_round(record_kv) if record_kv is not None else None
        return record, (record_kv.mod_revision if record_kv is not None else 0), closed is not None

    def _apply(self, view: View, kv: KeyValue, kind: str) -> None:
        key = kv.key
        if key.startswith(self._node_prefix):
            name = key[len(self._node_prefix):].decode(errors="replace")
            if kind == "delete":
                view.nodes.pop(name, None)
                return
            joiner = self._parse_node(kv)
            if joiner is not None:
                view.nodes[name] = joiner
        elif key == self._round_key and kind == "put":
            view.record, view.record_revision = self._parse_round(kv), kv.mod_revision
        elif key == self._closed_key and kind == "put":
            view.closed = True

    def _open(self, kv: KeyValue) -> Any:
        if len(kv.value) > MAX_VALUE_BYTES:
            raise ValueError(f"{len(kv.value)} bytes is more than any rendezvous value")
        try:
            data = self._signer.open(kv.key, kv.value)
        except AuthError as exc:
            raise PermissionError(str(exc)) from exc
        try:
            return json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"it is not the JSON this rendezvous writes ({exc})") from exc

    def _parse_round(self, kv: KeyValue) -> Round:
        key = kv.key.decode(errors="replace")
        hint = (f"Check who else can write the key prefix (README, 'Trust') and that every node runs the same "
                f"elastic_runner version with the same auth_key_file; 'etcdctl del {key}' starts the rendezvous "
                "afresh.")
        try:
            obj = self._open(kv)
            members = tuple((str(name), int(ticket)) for name, ticket in obj["members"])
            record = Round(int(obj["round"]), members, int(obj.get("lease", 0)), str(obj.get("sealed_by", "")),
                           str(obj.get("reason", "")))
            if record.round < 0 or not members or len({name for name, _ in members}) != len(members):
                raise ValueError("its round or member list is not valid")
            return record
        except PermissionError as exc:
            raise RendezvousRefusedError(f"The rendezvous record in etcd key '{key}' is refused: {exc}. {hint}") from exc
        except (ValueError, KeyError, TypeError) as exc:
            raise RendezvousRefusedError(f"The rendezvous record in etcd key '{key}' is not valid: {exc}. {hint}") \
                from exc

    def _parse_node(self, kv: KeyValue) -> Joiner | None:
        try:
            obj = self._open(kv)
            node = NodeId(str(obj["addr"]), int(obj["pid"]), int(obj["local_id"]))
            if node.name != kv.key[len(self._node_prefix):].decode():
                raise ValueError("its content names another node")
            return Joiner(node, int(obj["want"]), kv.create_revision)
        except (PermissionError, ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            if kv.key not in self._warned:
                self._warned.add(kv.key)
                log.warning("Ignoring the rendezvous node key '%s': %s. Something other than an elastic_runner "
                            "agent of this job wrote it; check who can write the key prefix.",
                            kv.key.decode(errors="replace"), exc)
            return None

    def _seal(self, key: bytes, obj: dict[str, Any]) -> bytes:
        return self._signer.seal(key, json.dumps(obj, separators=(",", ":")).encode())

    def _connection_error(self, action: str, exc: EtcdError) -> Exception:
        from torch.distributed.elastic.rendezvous import RendezvousConnectionError

        return RendezvousConnectionError(f"The etcd-v3 rendezvous could not {action} (run '{self._settings.run_id}'). "
                                         f"{exc}")

    # -- liveness -----------------------------------------------------------------------------------------

    def _liveness_lease(self) -> int:
        with self._lock:
            if not self._lease:
                self._lease = self._client.grant_lease(self._settings.lease_ttl)
            if self._keeper is None:
                self._keeper = threading.Thread(target=self._keep_alive, daemon=True,
                                                name=f"rdzv-keepalive-{self._node.local_id}")
                self._keeper.start()
            return self._lease

    def _keep_alive(self) -> None:
        """Refresh the liveness lease every keep_alive_interval (the heartbeat); re-create our key if etcd
        let the lease expire (we were unreachable for a window: others may have counted us dead)."""
        last_run_refresh = self._clock()
        while not self._stop.wait(self._settings.keep_alive_interval):
            try:
                with self._lock:
                    lease = self._lease
                if lease and self._client.keep_alive_lease(lease) <= 0:
                    self._regrant(lease)
                if self._clock() - last_run_refresh >= self._leases.ttl / 3:
                    last_run_refresh = self._clock()
                    self._leases.current()
                    record = self._member_of
                    if record is not None and record.lease:
                        self._client.keep_alive_lease(record.lease)  # the record outlives its sealer
            except EtcdError as exc:
                log.debug("rendezvous keep-alive failed: %s", exc)
            except Exception:  # noqa: BLE001 - the thread must not die silently
                log.warning("rendezvous keep-alive failed", exc_info=True)

    def _regrant(self, lost: int) -> None:
        with self._lock:
            if self._lease != lost:
                return
            self._lease = self._client.grant_lease(self._settings.lease_ttl)
            lease, value = self._lease, self._my_value
        log.warning("The liveness lease of node '%s' expired (etcd was out of reach for longer than the %.0f s "
                    "window); it registers again.", self._node, self._settings.window)
        if value:
            self._client.txn((), [Put(self._my_key, value, lease)])

    def _release(self) -> None:
        with self._lock:
            lease, self._lease = self._lease, 0
        if lease:
            try:
                self._client.revoke_lease(lease)  # our node key goes now, not a window later
            except EtcdError:
                pass

    # -- while training -----------------------------------------------------------------------------------

    def _start_watcher(self, record: Round) -> None:
        self._watch_stop = threading.Event()
        stop = self._watch_stop
        # A watcher of an earlier round may still deliver an event: it writes to its own record of what it saw.
        seen = self._seen = _Watched()
        mine = record.round
        # Start from the seal's revision: a signal written between the seal and now is not missed.
        start = 0

        def handle(events: list[WatchEvent]) -> bool:
            nonlocal start
            if stop.is_set():
                return True
            for event in events:
                start = max(start, event.kv.mod_revision)
                key = event.kv.key
                if event.kind != "put":
                    continue
                if key.startswith(self._ctl + b"next/"):
                    try:
                        wanted = int(key[len(self._ctl) + 5:].decode())
                    except ValueError:
                        continue
                    if wanted > mine:
                        seen.waiting = max(seen.waiting, 1)
                elif key == self._round_key:
                    try:
                        newer = self._parse_round(event.kv)
                    except RendezvousStateError as exc:
                        log.warning("%s", exc)
                        continue
                    if newer.round > mine:
                        if self._node.name not in newer.names():
                            log.warning("Round %d of the rendezvous '%s' was sealed without the node '%s' (it was "
                                        "counted dead); it leaves round %d and joins again.", newer.round,
                                        self._settings.run_id, self._node, mine)
                        seen.waiting = max(seen.waiting, 1)
                elif key == self._closed_key:
                    seen.closed = True
            return stop.is_set()

        def follow() -> None:
            nonlocal start
            try:
                kvs, revision = self._client.get_prefix(self._ctl)
                start = revision
                handle([WatchEvent("put", kv) for kv in kvs])
                while not stop.is_set() and not self._stop.is_set():
                    end = self._client.watch_prefix(self._ctl, start + 1, MEMBER_WATCH_SLICE, handle)
                    if end == "compacted":
                        kvs, revision = self._client.get_prefix(self._ctl)
                        start = revision
                        handle([WatchEvent("put", kv) for kv in kvs])
            except EtcdError as exc:
                log.warning("The rendezvous watch of node '%s' stopped (%s); a node that joins is noticed when "
                            "training fails instead.", self._node, exc)
            except Exception:  # noqa: BLE001
                log.warning("The rendezvous watch stopped", exc_info=True)

        self._watcher = threading.Thread(target=follow, daemon=True, name=f"rdzv-watch-{self._node.local_id}")
        self._watcher.start()

    def _stop_watcher(self) -> None:
        self._watch_stop.set()
        self._watcher = None  # it ends at its next event or slice; it holds no lock and writes nothing

    # -- torch's store bootstrap --------------------------------------------------------------------------

    def _bootstrap_info(self, rank: int, store: Store) -> RendezvousStoreInfo:
        """As torch's handler: rank 0 publishes MASTER_ADDR/PORT in the round's store; with the shared store
        (torch's default) it also hosts the TCPStore server the workers use. Unlike torch's handler, rank 0
        publishes the address in every round, not only in the first: a node that joins a running job reads
        it from the new round's store, where torch's handler leaves it waiting for a key nobody writes."""
        if not self.use_agent_store:
            return RendezvousStoreInfo.build(rank, store, local_addr=self._node.addr)
        port = 0
        if rank == 0:
            if self._tcp_server is None:
                self._tcp_server = dist.TCPStore(host_name=self._node.addr, port=0, is_master=True,
                                                 multi_tenant=True)
            port = self._tcp_server.port
        return RendezvousStoreInfo.build(rank, store, local_addr=self._node.addr, server_port=port)


def settings_from(params: RendezvousParameters) -> Settings:
    """torch's ``--rdzv_conf`` timeouts and keep-alive settings, with torch's defaults."""

    def seconds(name: str, default: float) -> float:
        value = params.get_as_int(name)
        if value is None:
            return default
        if value <= 0:
            raise ValueError(f"The rendezvous option '{name}' must be a positive number of seconds (got {value}).")
        return float(value)

    return Settings(
        run_id=params.run_id, min_nodes=params.min_nodes, max_nodes=params.max_nodes,
        join_timeout=seconds("join_timeout", 600), last_call_timeout=seconds("last_call_timeout", 30),
        close_timeout=seconds("close_timeout", 30),
        keep_alive_interval=seconds("keep_alive_interval", 5),
        keep_alive_max_attempt=int(params.get_as_int("keep_alive_max_attempt", 3) or 3))


