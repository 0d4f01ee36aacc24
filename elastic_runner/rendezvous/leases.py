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

from .heartbeat import Heartbeat
from .kv import (
    Compare,
    Delete,
    EtcdError,
    EtcdLeaseNotFound,
    Get,
    KeyValue,
    KVClient,
    LeaseKeeper,
    Put,
)
from .ports import PortHold
from .rounds import (
    NodeId,
    RendezvousRefusedError,
    Round,
    Settings,
    closed_error,
    new_node,
    other_protocol_error,
)
from .departures import DepartureRole
from .seal import Sealer
from .sealing import SealerRole
from .values import Codec, shown
from .watch import MemberWatch

log = logging.getLogger(__name__)


class LeaseRendezvousHandler(SealerRole, DepartureRole, RendezvousHandler):
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
        self._claim_value = b""  #: our sealer claim's value as written (dropping it compares it)
        self._ports = PortHold()  #: the port we offer as MASTER_PORT, held until our worker binds it
        #: This agent cannot take part (the run's values are signed with a key it lacks, or belong to another
        #: protocol): it must not close a run it was never part of.
        self._refused = False
        #: True when the last round this agent joined was sealed without the last call, because every node of
        #: the round before was back or dead (the agent reports it)
        self.completed_early = False
        #: Called (with the round's maximum) when this node starts to wait as a spare: the running round is full
        self.on_spare: Callable[[int], None] | None = None

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

    def lasting_store(self, ttl_seconds: float | None) -> "LeasedSlots":
        """A store for records that outlast rounds and agents (``set``, ``get``, ``check``) under this run's prefix:
        each value written lives ``ttl_seconds`` (a lease of its own; None: as long as etcd keeps it)."""
        return LeasedSlots(self._client, self._prefix + b"lasting/", ttl_seconds)

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
        except RendezvousRefusedError:
            self._refused = True
            raise
        rank = record.names().index(self._node.name)
        self._heartbeat.record = record
        self._last_round = record.round
        self._last_seat = (record.round, record.incarnation)
        self.completed_early = record.reason == "previous round accounted for"
        self._start_watcher(record)
        self._ports.round_begins()
        log.info("The node '%s' has joined round %d of the rendezvous '%s' as rank %d in a world of size %d.",
                 self._node, record.round, self._settings.run_id, rank, len(record.members))
        store = dist.PrefixStore(self._store_prefix(record.round, record.incarnation), self._store)
        return RendezvousInfo(store, rank, len(record.members), self._bootstrap_info(rank, store, record))

    def is_closed(self) -> bool:
        try:
            closed, record_kv = self._client.txn((), [Get(self._closed_key), Get(self._round_key)]).results
        except EtcdError as exc:
            raise self._connection_error("read whether the rendezvous is closed", exc) from exc
        return self._closed(closed, self._codec.round(record_kv) if record_kv is not None else None, record_kv)

    def set_closed(self) -> None:
        """Close the run, for its current round record (with the job's key a close names it, and counts only for
        it and from one of its members: a close replayed into a later round or run closes nothing)."""
        try:
            for _ in range(3):
                (record_kv,) = self._client.txn((), [Get(self._round_key)]).results
                rev = record_kv.mod_revision if record_kv is not None else 0
                compare = [Compare.mod_revision(self._round_key, rev)]

                def close(lease: int, rev: int = rev, compare: list[Compare] = compare) -> Any:
                    value = self._codec.encode(self._closed_key, {"by": self._node.name}, after=rev, lease=lease)
                    return self._client.txn(compare, [Put(self._closed_key, value, lease)])

                if self._leases.run(close).succeeded:
                    break  # else a round was sealed meanwhile: close that one
        except EtcdError as exc:
            raise self._connection_error("close the rendezvous", exc) from exc
        log.info("The node '%s' has closed the rendezvous '%s'.", self._node, self._settings.run_id)

    def num_nodes_waiting(self) -> int:
        watch = self._watch
        return 0 if watch is None else watch.waiting

    def shutdown(self) -> bool:
        self._stop_watcher()
        try:
            if self._refused:
                log.info("The node '%s' leaves the rendezvous '%s' without closing it: it could not take part.",
                         self._node, self._settings.run_id)
                return True
            self.set_closed()
            return True
        except Exception as exc:  # noqa: BLE001 - torch's contract: report, do not raise
            log.warning("The node '%s' has failed to shut down the rendezvous '%s': %s", self._node,
                        self._settings.run_id, exc)
            return False
        finally:
            self._heartbeat.release()
            self._ports.release()

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
            if spare and not was_spare and self.on_spare is not None:
                self.on_spare(self._settings.max_nodes)
            was_spare = spare
            if not spare and self._clock() >= deadline:
                self._give_up(want)
            try:
                joined = self._put_join(want, record, record_rev, signalled == want)
                if joined is None:
                    continue  # a round was sealed meanwhile: join the one after it
                sealer_present, revision = joined
                self._wait_for_round(want, sealer_present, revision, float("inf") if spare else deadline,
                                     record, record_rev)
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
        offer = {} if self.use_agent_store else {"port": self._ports.offer()}  # MASTER_PORT if it becomes rank 0
        liveness = self.liveness  # where its agent answers while it waits here (departures.py)
        alive = {"alive": [liveness.port, liveness.agent]} if liveness is not None else {}
        body = {"node": node.name, "addr": node.addr, "pid": node.pid, "local_id": node.local_id,
                "nonce": node.nonce, "want": want, **offer, **alive}

        def encoder(lease: int) -> bytes:  # bound to the record it joins after and to its lease
            return self._codec.encode(self._my_key, body, after=record_rev, lease=lease)

        next_key = self._ctl + f"next/{want}".encode()
        sealer_key = self._ctl + f"sealer/{want}".encode()
        record_compare = Compare.mod_revision(self._round_key, record_rev) if record_rev else \
            Compare.absent(self._round_key)
        signal = not signalled and record is not None and (self._node.name in record.names() or
                                                           len(record.members) < self._settings.max_nodes)
        lease = self._heartbeat.lease()
        value = encoder(lease)
        self._heartbeat.value, self._heartbeat.encoder = value, encoder
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
            puts.append(Put(next_key, self._codec.encode(next_key, {"round": want, "by": self._node.name},
                                                         after=record_rev, lease=lease), lease))
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
        return self._codec.claim(result.results[-1], record_rev), result.revision

    def _claim_sealer(self, want: int, record_rev: int) -> int:
        """The revision of our claim to seal round ``want`` after the record at ``record_rev`` (0: another node holds
        a valid claim). A claim without a lease, one the job's key did not sign, or one from another round, is
        replaced: it would block the round for ever."""
        key = self._ctl + f"sealer/{want}".encode()
        lease = self._heartbeat.lease()
        value = self._claim_value = self._codec.encode(key, {"by": self._node.name}, after=record_rev, lease=lease)
        result = self._client.txn([Compare.absent(key)], [Put(key, value, lease)], [Get(key)])
        if result.succeeded:
            return result.revision
        (current,) = result.results
        if current is None or self._codec.claim(current, record_rev):
            return 0
        result = self._client.txn([Compare.mod_revision(key, current.mod_revision)], [Put(key, value, lease)])
        return result.revision if result.succeeded else 0

    def _drop_sealer_claim(self, want: int) -> None:
        if self._claim_value:
            self._client.txn([Compare.value(self._ctl + f"sealer/{want}".encode(), self._claim_value)],
                             [Delete(self._ctl + f"sealer/{want}".encode())])

    def _take_seat(self, want: int, counted_key_only: bool = False) -> Round | None:
        """Our seat in round ``want`` or later from the newest record and our key, read together; None: join again
        (also, with ``counted_key_only``, when our key is not the one the record counted)."""
        result = self._client.txn((), [Get(self._round_key), Get(self._my_key), Get(self._closed_key)])
        record_kv, mine, closed = result.results
        record = self._codec.round(record_kv) if record_kv is not None else None
        if self._closed(closed, record, record_kv):
            raise self._closed_error()
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
        lose that race and pay a request for it. A record no agent of this job can take (not signed with the job's
        key, or a replayed older one) is deleted first, as an etcd writer could anyway: numbering starts over."""
        next_key = self._ctl + f"next/{guess}".encode()
        for _ in range(8):
            result = self._client.txn((), [Get(self._round_key), Get(self._closed_key), Get(self._legacy_key),
                                           Get(next_key)])
            record_kv, closed, legacy, signal = result.results
            self._codec.seen_revision(result.revision)
            if legacy is not None:
                self._legacy_state(legacy)
            record = self._codec.round(record_kv) if record_kv is not None else None
            if record_kv is not None and record is None:
                log.warning("The round record in '%s' is void for this job; it is deleted and the rendezvous starts a "
                            "new incarnation.", shown(self._round_key))
                self._client.txn([Compare.mod_revision(self._round_key, record_kv.mod_revision)],
                                 [Delete(self._round_key)])
                continue
            rev = record_kv.mod_revision if record_kv is not None else 0
            return (record, rev, self._closed(closed, record, record_kv),
                    guess if self._codec.control(signal, rev, leased=True) else -1)
        raise RendezvousRefusedError(f"The round record in etcd key '{shown(self._round_key)}' is replaced by values "
                                     "this job cannot take as fast as it is deleted: check who can write the key "
                                     "prefix (docs/trust.md).")

    def _legacy_state(self, legacy: KeyValue) -> None:
        """The ``state`` protocol's key under the run: another build's rendezvous of this run (an error that says
        so), unless a job key is configured and the value is not signed with it (planted: ignored)."""
        if self._codec.bound:
            try:
                self._codec.signer.open(legacy.key, legacy.value)
            except Exception as exc:  # noqa: BLE001 - not ours: ignore it, with a warning
                self._codec.ignore("state key", legacy, exc)
                return
        raise other_protocol_error(self._legacy_key.decode())

    def _closed(self, closed: KeyValue | None, record: Round | None, record_kv: KeyValue | None) -> bool:
        """Whether ``closed`` closes the run whose record (``record``, decoded from ``record_kv``) was read with it."""
        return closed is not None and self._codec.closed(closed, record,
                                                         record_kv.mod_revision if record_kv is not None else 0)

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


class LeasedSlots:
    """Values under ``prefix`` in etcd, each put under a lease of its own that lasts ``ttl_seconds`` (etcd deletes it
    then, whoever is alive); the same ``set``/``get``/``check`` a ``torch.distributed.Store`` has. Values are stored as
    given: their writers sign them (:mod:`elastic_runner.recovery.channel`)."""

    def __init__(self, client: KVClient, prefix: bytes, ttl_seconds: float | None) -> None:
        self._client, self._prefix, self._ttl = client, prefix, ttl_seconds

    def _key(self, key: str) -> bytes:
        return self._prefix + key.encode()

    def set(self, key: str, value: bytes | str) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        lease = self._client.grant_lease(max(1, int(self._ttl + 0.999))) if self._ttl else 0
        self._client.txn((), [Put(self._key(key), data, lease)])

    def get(self, key: str) -> bytes:
        kv, _ = self._client.get(self._key(key))
        if kv is None:
            raise KeyError(key)
        return kv.value

    def check(self, keys: list[str]) -> bool:
        return all(self._client.get(self._key(k))[0] is not None for k in keys)
