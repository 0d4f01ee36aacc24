"""The lease rendezvous protocol's handler: torch's ``RendezvousHandler`` for ``--rdzv_backend=etcd-v3``.

The keys, values, sealing rules and the argument why two rounds can never both be current are in
:mod:`elastic_runner.rendezvous.rounds`. This module runs them for one agent: ``next_rendezvous``
(join, claim the sealer or wait on one watch, seal, take the seat), the agent's heartbeat
(:mod:`elastic_runner.rendezvous.heartbeat`), and, while the agent trains, one watch of ``ctl/`` that
``num_nodes_waiting`` answers from.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable

import torch.distributed as dist
from torch.distributed import Store
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousInfo,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.api import RendezvousHandler, RendezvousStoreInfo
from torch.distributed.elastic.utils.distributed import get_free_port

from .heartbeat import Heartbeat
from .kv import (
    WATCH_SLICE_SECONDS,
    Compare,
    Delete,
    EtcdError,
    EtcdLeaseNotFound,
    Get,
    KeyValue,
    KVClient,
    LeaseKeeper,
    Put,
    WatchEvent,
)
from .rounds import (
    Codec,
    NodeId,
    Round,
    Settings,
    View,
    choose_members,
    closed_error,
    new_node,
    other_protocol_error,
    quorum,
    ready_to_seal,
)
from .seal import Sealer
from .watch import MemberWatch

log = logging.getLogger(__name__)


class LeaseRendezvousHandler(RendezvousHandler):
    """torch's ``RendezvousHandler`` on the lease protocol (:mod:`elastic_runner.rendezvous.rounds`)."""

    def __init__(self, client: KVClient, run_prefix: str, settings: Settings, store: Store,
                 local_addr: str | None = None, leases: LeaseKeeper | None = None, sealer: Sealer | None = None,
                 backend_name: str = "etcd-v3", clock: Callable[[], float] = time.monotonic) -> None:
        self._client = client
        self._settings = settings
        self._store = store
        self._node = new_node(local_addr)
        self._leases = leases or LeaseKeeper(client, 7200)
        self._backend_name = backend_name
        self._clock = clock
        base = f"{run_prefix.rstrip('/')}/rdzv/"
        self._prefix = base.encode()
        self._node_prefix = f"{base}node/".encode()
        self._ctl = f"{base}ctl/".encode()
        self._round_key = f"{base}ctl/round".encode()
        self._closed_key = f"{base}ctl/closed".encode()
        self._my_key = self._node_prefix + self._node.name.encode()
        self._codec = Codec(sealer or Sealer(None), self._node_prefix)
        self._legacy_key = f"{run_prefix.rstrip('/')}/state".encode()
        self._heartbeat = Heartbeat(client, settings, self._leases, self._my_key, self._node.name, clock)
        self._last_round = -1  #: the last round this agent was seated in
        self._last_seat: tuple[int, int] = (-1, -1)  #: and its (round, incarnation)
        self._watch: MemberWatch | None = None  #: the watch of the round this agent trains in
        self._tcp_server: Any = None
        #: True when the last round this agent joined was sealed without the last call, because every node of
        #: the round before was back or dead (the agent reports it)
        self.completed_early = False

    # -- torch's RendezvousHandler ---------------------------------------------------------------------------

    @property
    def settings(self) -> Settings:
        return self._settings

    @property
    def node(self) -> NodeId:
        return self._node

    @property
    def seated_in(self) -> Round | None:
        """The record of the round this agent trains in (None while it joins)."""
        return self._heartbeat.record

    def get_backend(self) -> str:
        return self._backend_name

    def get_run_id(self) -> str:
        return self._settings.run_id

    @property
    def use_agent_store(self) -> bool:
        return os.getenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0") != "1"

    def next_rendezvous(self) -> RendezvousInfo:
        self._stop_watcher()
        self._heartbeat.record = None
        deadline = self._clock() + self._settings.join_timeout
        log.info("The node '%s' attempts to join the next round of the rendezvous '%s'.", self._node,
                 self._settings.run_id)
        try:
            record = self._join(deadline)
        except EtcdError as exc:
            raise self._connection_error("join the rendezvous", exc) from exc
        rank = record.names().index(self._node.name)
        self._heartbeat.record = record
        self._last_round = record.round
        self._last_seat = (record.round, record.incarnation)
        self.completed_early = record.reason == "previous round accounted for"
        self._start_watcher(record)
        log.info("The node '%s' has joined round %d of the rendezvous '%s' as rank %d in a world of size %d.",
                 self._node, record.round, self._settings.run_id, rank, len(record.members))
        store = dist.PrefixStore(self._store_prefix(record.round, record.incarnation), self._store)
        return RendezvousInfo(store, rank, len(record.members), self._bootstrap_info(rank, store, record))

    def is_closed(self) -> bool:
        try:
            kv, _ = self._client.get(self._closed_key)
        except EtcdError as exc:
            raise self._connection_error("read whether the rendezvous is closed", exc) from exc
        return self._codec.control(kv)

    def set_closed(self) -> None:
        try:
            self._leases.run(lambda lease: self._client.txn(
                (), [Put(self._closed_key, self._codec.encode(self._closed_key, {"by": self._node.name}), lease)]))
        except EtcdError as exc:
            raise self._connection_error("close the rendezvous", exc) from exc
        log.info("The node '%s' has closed the rendezvous '%s'.", self._node, self._settings.run_id)

    def num_nodes_waiting(self) -> int:
        watch = self._watch
        return 0 if watch is None else watch.waiting

    def shutdown(self) -> bool:
        self._stop_watcher()
        try:
            self.set_closed()
            return True
        except Exception as exc:  # noqa: BLE001 - torch's contract: report, do not raise
            log.warning("The node '%s' has failed to shut down the rendezvous '%s': %s", self._node,
                        self._settings.run_id, exc)
            return False
        finally:
            self._heartbeat.release()

    # -- joining ------------------------------------------------------------------------------------------

    def _join(self, deadline: float) -> Round:
        """Join the round after the newest sealed one and return the record of the round that seats us."""
        want = 0
        was_spare = False
        while True:
            record, record_rev, closed, signalled = self._read_control(self._last_round + 1)
            if closed:
                raise self._closed_error()
            if record is not None and self._node.name in record.names() \
                    and (record.round, record.incarnation) != self._last_seat:
                # Seated without asking: a new incarnation (the record was deleted) counted our key, still
                # wanting round 0 of the old one. The others expect us there, if it is that key.
                seated = self._take_seat(record.round, counted_key_only=True)
                if seated is not None:
                    return seated
            want = 0 if record is None else record.round + 1
            # A node for which the running round has no seat waits for its next re-forming without asking for it
            # and without a deadline (torch's redundancy list): timing out would close the job's rendezvous.
            spare = record is not None and self._node.name not in record.names() \
                and len(record.members) >= self._settings.max_nodes
            if was_spare and not spare:
                deadline = self._clock() + self._settings.join_timeout  # its join starts now
            was_spare = spare
            if not spare and self._clock() >= deadline:
                self._give_up(want)
            try:
                joined = self._put_join(want, record, record_rev, signalled == want)
                if joined is None:
                    continue  # a round was sealed meanwhile: join the one after it
                sealer_present, revision = joined
                self._wait_for_round(want, sealer_present, revision, float("inf") if spare else deadline)
            except EtcdLeaseNotFound:
                self._heartbeat.regrant(self._heartbeat.current)  # etcd lost our lease while we joined: register again
                continue
            seated = self._take_seat(want)
            if seated is not None:
                return seated

    def _put_join(self, want: int, record: Round | None, record_rev: int,
                  signalled: bool) -> tuple[bool, int] | None:
        """Write our node key for round ``want`` (and the "waiting" signal when the running round must end);
        None when the record changed since we read it. Returns whether a sealer exists, and the revision."""
        node = self._node
        offer = {} if self.use_agent_store else {"port": get_free_port()}  # MASTER_PORT if it becomes rank 0
        value = self._codec.encode(self._my_key, {"node": node.name, "addr": node.addr, "pid": node.pid,
                                                  "local_id": node.local_id, "nonce": node.nonce, "want": want,
                                                  **offer})
        self._heartbeat.value = value
        next_key = self._ctl + f"next/{want}".encode()
        sealer_key = self._ctl + f"sealer/{want}".encode()
        record_compare = Compare.mod_revision(self._round_key, record_rev) if record_rev else \
            Compare.absent(self._round_key)
        signal = not signalled and record is not None and (self._node.name in record.names() or
                                                           len(record.members) < self._settings.max_nodes)
        lease = self._heartbeat.lease()
        try:
            return self._put_join_with(lease, value, want, record, record_rev, signal, next_key, sealer_key,
                                       record_compare)
        except EtcdLeaseNotFound:
            self._heartbeat.regrant(lease)
            return None

    def _put_join_with(self, lease: int, value: bytes, want: int, record: Round | None, record_rev: int,
                       signal: bool, next_key: bytes, sealer_key: bytes, record_compare: Compare
                       ) -> tuple[bool, int] | None:
        puts: list[Any] = [Put(self._my_key, value, lease)]
        if signal:
            puts.append(Put(next_key, self._codec.encode(next_key, {"round": want, "by": self._node.name}), lease))
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
        return self._codec.claim(result.results[-1]), result.revision

    def _wait_for_round(self, want: int, sealer_present: bool, revision: int, deadline: float) -> Round | None:
        """Seal round ``want`` or wait until a record newer than the one we read appears, the run is closed,
        or the watch's history is gone; our own seal, or None (the caller reads the record)."""
        seen = revision
        while True:
            if self._clock() >= deadline:
                self._give_up(want)
            claim = 0 if sealer_present else self._claim_sealer(want)
            if claim:
                sealed = self._seal_round(want, deadline, claim)
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
                        state["closed"] = self._codec.control(event.kv)
                return bool(state["record"] or state["sealer_gone"] or state["closed"])

            end = self._client.watch_prefix(self._ctl, seen + 1,
                                            max(0.0, min(deadline - self._clock(), WATCH_SLICE_SECONDS)), handle)
            if state["closed"] or state["record"] is not None or end == "compacted":
                return None  # re-read everything: closed, sealed (by someone), or history gone
            if state["sealer_gone"]:
                sealer_present = False

    def _claim_sealer(self, want: int) -> int:
        """The revision of our claim to seal round ``want`` (0: another node holds a valid claim). A claim
        without a lease, or one the job's key did not sign, is replaced: it would block the round for ever."""
        key = self._ctl + f"sealer/{want}".encode()
        value = self._codec.encode(key, {"by": self._node.name})
        result = self._client.txn([Compare.absent(key)], [Put(key, value, self._heartbeat.lease())], [Get(key)])
        if result.succeeded:
            return result.revision
        (current,) = result.results
        if current is None or self._codec.claim(current):
            return 0
        result = self._client.txn([Compare.mod_revision(key, current.mod_revision)],
                                  [Put(key, value, self._heartbeat.lease())])
        return result.revision if result.succeeded else 0

    def _drop_sealer_claim(self, want: int) -> None:
        key = self._ctl + f"sealer/{want}".encode()
        self._client.txn([Compare.value(key, self._codec.encode(key, {"by": self._node.name}))], [Delete(key)])

    def _seal_round(self, want: int, deadline: float, claim: int) -> Round | None:
        """As the sealer of round ``want``: follow the node keys until the round can be sealed, seal it."""
        view = View()
        kvs, revision = self._client.get_prefix(self._prefix)
        for kv in kvs:
            self._apply(view, kv, "put")
        settings = self._settings
        open_since: float | None = None  # when min_nodes wanted the round and the previous one was accounted for
        sealer_key = self._ctl + f"sealer/{want}".encode()

        def is_open() -> bool:
            count, accounted, _ = quorum(view, want, settings)
            return accounted and count >= settings.min_nodes

        while True:
            if view.closed or (view.record is not None and view.record.round >= want):
                return None  # closed, or sealed by someone else (a sealer we thought dead)
            now = self._clock()
            open_since = (now if open_since is None else open_since) if is_open() else None
            ready, why = ready_to_seal(view, want, settings, open_since, now)
            if ready:
                # None: the record changed, or our claim expired (we stalled: the view may be stale): start over
                return self._write_round(want, view, why, sealer_key, claim)
            if now >= deadline:
                self._give_up(want)
            due = min(deadline, now + WATCH_SLICE_SECONDS)
            if open_since is not None:
                due = min(due, open_since + settings.last_call_timeout)

            def handle(events: list[WatchEvent]) -> bool:
                nonlocal revision
                for event in events:
                    revision = max(revision, event.kv.mod_revision)
                    self._apply(view, event.kv, event.kind)
                if view.closed or (view.record is not None and view.record.round >= want):
                    return True
                if is_open() != (open_since is not None):
                    return True  # the last call starts, or stops (a node left)
                return ready_to_seal(view, want, settings, open_since, self._clock())[0] or self._clock() >= due

            if self._client.watch_prefix(self._prefix, revision + 1, max(0.0, due - now), handle) == "compacted":
                return None

    def _write_round(self, want: int, view: View, why: str, sealer_key: bytes, claim: int) -> Round | None:
        candidates = [j for j in view.nodes.values() if j.want == want]
        previous = view.record if view.record is not None and view.record.round == want - 1 else None
        members = choose_members(candidates, previous, self._settings.max_nodes)
        # Revisions as read (0: absent, for etcd a missing key's), and our claim still the one we made.
        compare = [Compare.mod_revision(self._round_key, view.record_revision),
                   Compare.mod_revision(self._closed_key, view.closed_revision), Compare.created(sealer_key, claim)]

        first = members[0]
        master = {"master": [first.node.addr, first.port]} if first.port else {}

        def write(lease: int) -> Any:  # on the lasting lease, which every member refreshes while it lives
            value = self._codec.encode(self._round_key, {
                "round": want, "members": [[j.node.name, j.ticket] for j in members], "lease": lease,
                "sealed_by": self._node.name, "reason": why, **master})
            return self._client.txn(compare, [Put(self._round_key, value, lease), Delete(sealer_key),
                                              Delete(self._ctl + f"next/{want}".encode()),
                                              Delete(self._ctl + f"next/{want - 1}".encode())])

        if not self._leases.run(write).succeeded:
            return None
        log.info("rendezvous '%s': sealed round %d with %d node(s) (%s)", self._settings.run_id, want,
                 len(members), why)
        if previous is not None and want >= 2:
            self._forget_store_of(want - 2, previous.incarnation)
        return Round(want, tuple((j.node.name, j.ticket) for j in members))

    def _store_prefix(self, round_: int, incarnation: int) -> str:
        return f"torch.rendezvous.{self._settings.run_id}.{incarnation}.{round_}"

    def _forget_store_of(self, round_: int, incarnation: int) -> None:
        """Delete the store keys of a round two back (~2 per node): all its members left it before round+1."""
        prefix = getattr(self._store, "prefix", None)
        if not isinstance(prefix, str):
            return
        try:
            self._client.delete_prefix(f"{prefix}{self._store_prefix(round_, incarnation)}/".encode())
        except EtcdError as exc:
            log.debug("could not delete the store keys of round %d: %s", round_, exc)

    def _take_seat(self, want: int, counted_key_only: bool = False) -> Round | None:
        """Our seat in round ``want`` or later from the newest record and our key, read together; None: join again
        (also, with ``counted_key_only``, when our key is not the one the record counted)."""
        result = self._client.txn((), [Get(self._round_key), Get(self._my_key), Get(self._closed_key)])
        record_kv, mine, closed = result.results
        if self._codec.control(closed):
            raise self._closed_error()
        record = self._codec.round(record_kv) if record_kv is not None else None
        if record is None or record.round < want:
            return None
        ticket = dict(record.members).get(self._node.name)
        if ticket is None:
            return None  # not seated (the round was full, or sealed before we joined): join the next one
        counted = mine is not None and (mine.create_revision, mine.lease) == (ticket, self._heartbeat.current)
        if counted_key_only and not counted:
            return None  # that seat is another process's of the same name (a restarted container's predecessor)
        if mine is None or mine.create_revision != ticket:
            # Its lease expired after the sealer read its key. No newer round exists (this is the newest record),
            # so nobody has counted it out: the others expect it, and it takes its seat.
            log.warning("The liveness lease of node '%s' expired after round %d of the rendezvous '%s' was sealed; "
                        "no newer round exists, so it takes its seat.", self._node, record.round,
                        self._settings.run_id)
        return record

    def _give_up(self, want: int) -> None:
        try:  # roll back: our key (if it is still the one we wrote) and a sealer claim of ours
            self._client.txn([Compare.value(self._my_key, self._heartbeat.value)], [Delete(self._my_key)])
            self._drop_sealer_claim(want)
        except EtcdError:
            pass
        raise RendezvousTimeoutError(
            f"The rendezvous '{self._settings.run_id}' did not complete round {want} within join_timeout="
            f"{self._settings.join_timeout:.0f} s (--nnodes min {self._settings.min_nodes}): fewer nodes joined. "
            "Check that the other nodes run with the same --rdzv_id and --rdzv_endpoint, or raise join_timeout "
            "in --rdzv_conf.")

    # -- reading ------------------------------------------------------------------------------------------

    def _read_control(self, guess: int) -> tuple[Round | None, int, bool, int]:
        """The newest record, its revision, whether the run is closed, and ``guess`` if the "waiting" signal for
        round ``guess`` exists (-1 if not): after a restart all members signal at once, and all but one would
        lose that race and pay a request for it."""
        next_key = self._ctl + f"next/{guess}".encode()
        result = self._client.txn((), [Get(self._round_key), Get(self._closed_key), Get(self._legacy_key),
                                       Get(next_key)])
        record_kv, closed, legacy, signal = result.results
        if legacy is not None:
            raise other_protocol_error(self._legacy_key.decode())
        record = self._codec.round(record_kv) if record_kv is not None else None
        return (record, (record_kv.mod_revision if record_kv is not None else 0), self._codec.control(closed),
                guess if self._codec.control(signal) else -1)

    def _apply(self, view: View, kv: KeyValue, kind: str) -> None:
        key = kv.key
        if key.startswith(self._node_prefix):
            name = key[len(self._node_prefix):].decode(errors="replace")
            if kind == "delete":
                view.nodes.pop(name, None)
                return
            joiner = self._codec.node(kv)
            if joiner is not None:
                view.nodes[name] = joiner
        elif key == self._round_key and kind == "put":
            view.record, view.record_revision = self._codec.round(kv), kv.mod_revision
        elif key == self._closed_key:
            view.closed, view.closed_revision = (self._codec.control(kv), kv.mod_revision) if kind == "put" \
                else (False, 0)

    def _closed_error(self) -> RendezvousClosedError:
        return closed_error(self._settings.run_id, self._closed_key.decode())

    def _connection_error(self, action: str, exc: EtcdError) -> Exception:
        return RendezvousConnectionError(f"The etcd-v3 rendezvous could not {action} (run '{self._settings.run_id}'). "
                                         f"{exc}")

    # -- while training -----------------------------------------------------------------------------------

    def _start_watcher(self, record: Round) -> None:
        self._watch = MemberWatch(self._client, self._codec, self._ctl, record, self._node.name,
                                  self._settings.run_id).start()

    def _stop_watcher(self) -> None:
        if self._watch is not None:
            self._watch.stop()
            self._watch = None

    # -- torch's store bootstrap --------------------------------------------------------------------------

    def _bootstrap_info(self, rank: int, store: Store, record: Round) -> RendezvousStoreInfo:
        """MASTER_ADDR/PORT for the workers. Without the shared store (launch's and the torchrun hook's default)
        they are in the round record: rank 0 offered the port when it joined, and nobody waits on anybody after
        the seal. Rank 0 still writes them to the round's store, where an agent of an older build reads them.

        With the shared store (torch's default) rank 0 hosts the TCPStore server the workers use, on a port
        only it knows once seated, and hands address and port over through the store as torch's handler does,
        but in every round, not only in the first: a node that joins a running job reads them from the new
        round's store, where torch's handler leaves it waiting for a key nobody writes."""
        if not self.use_agent_store:
            if record.master is None:  # sealed by an older build, or rank 0 is one
                return RendezvousStoreInfo.build(rank, store, local_addr=self._node.addr)
            addr, port = record.master
            if rank == 0:
                store.set(RendezvousStoreInfo.MASTER_ADDR_KEY, addr.encode())
                store.set(RendezvousStoreInfo.MASTER_PORT_KEY, str(port).encode())
            return RendezvousStoreInfo(master_addr=addr, master_port=port)
        port = 0
        if rank == 0:
            if self._tcp_server is None:
                self._tcp_server = dist.TCPStore(host_name=self._node.addr, port=0, is_master=True,
                                                 multi_tenant=True)
            port = self._tcp_server.port
        return RendezvousStoreInfo.build(rank, store, local_addr=self._node.addr, server_port=port)
