"""How members leave a round of the lease protocol before their leases expire, or are found gone.

A mixin of :class:`~elastic_runner.rendezvous.leases.LeaseRendezvousHandler` (the handler's state is its own). A round
counts a member dead when its node key is gone (:mod:`elastic_runner.rendezvous.rounds`); normally that is when its
liveness lease expires, a dead-node window (``keep_alive_interval * keep_alive_max_attempt``) after its last refresh.
With in-process recovery two departures are known sooner, and the next round need not wait that window for them:

- an agent stopped by a signal (preempted, drained) leaves: its key goes with its lease (:meth:`leave`);
- the survivors' workers saw a node's agent stop beating in the job's store (:mod:`elastic_runner.agent.beat`): its
  node is lost, and their agent deletes that member's key (:meth:`count_out`).

What keeps this safe is weaker than an expiry's "cut off from etcd for the whole window", and is said here: a member
is counted out only on its agent's beat standing still (an agent that stops beating on purpose — it restarts its
workers, or ends — says so with its last beat and is never counted out), only while the round that seated it is the
newest record, and only in the incarnation that round seated. A member counted out wrongly (alive, its beat late)
may still run workers of the old round: they can complete no collective (their peers have left that group) and
publish nothing (snapshots are fenced by generation), and the member, left out of the next round, sees it on its
watch and joins the one after.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Iterable

from ..printable import printable
from .kv import Compare, Delete, EtcdError, Get, KVClient
from .rounds import NodeId, Round, Settings

if TYPE_CHECKING:
    from .values import Codec

log = logging.getLogger("elastic_runner.rendezvous.leases")


class DepartureRole:
    _client: KVClient
    _codec: Codec
    _settings: Settings
    _node: NodeId
    _node_prefix: bytes
    _round_key: bytes
    _heartbeat: Any
    _ports: Any
    _stop_watcher: Callable[[], None]
    _connection_error: Callable[[str, EtcdError], Exception]
    seated_in: Round | None  #: the handler's: the record of the round this agent trains in

    def member_gone(self) -> str | None:
        """A member of the round this agent is seated in whose node key is gone (its liveness lease expired: the
        rule by which a round counts a node dead), or None. The agent asks while it waits for the members' parts
        of the rank assignment (:mod:`elastic_runner.agent.round_members`)."""
        record = self.seated_in
        if record is None:
            return None
        others = [name for name in record.names() if name != self._node.name]
        if not others:
            return None
        try:
            found = self._client.txn((), [Get(self._node_prefix + name.encode()) for name in others]).results
        except EtcdError as exc:
            raise self._connection_error("read the round's members", exc) from exc
        return next((f"'{printable(name, 80)}'" for name, kv in zip(others, found) if kv is None), None)

    def count_out(self, group_ranks: Iterable[int]) -> list[str]:
        """Count members of the round this agent trains in as dead now: those whose agents its workers saw stop
        beating in the job's store (:mod:`elastic_runner.agent.beat`: their nodes are lost). Their node keys are
        deleted, so the next round is sealed once the survivors want it instead of a lease's TTL (the dead-node
        window) later. A key is deleted only if it is still the incarnation the round seated and has not changed
        since it was read (a member that wants the next round is alive and counted as such), and only while the
        round that seated it is the newest record (safety: the module's docstring). The names counted out."""
        record = self.seated_in
        if record is None:
            return []
        out = []
        for group_rank in sorted(set(group_ranks)):
            if not 0 <= group_rank < len(record.members):
                continue
            name, ticket = record.members[group_rank]
            if name == self._node.name:
                continue
            key = self._node_prefix + name.encode()
            try:
                (kv,) = self._client.txn((), [Get(key)]).results
                joiner = self._codec.node(kv) if kv is not None else None
                if kv is None or kv.create_revision != ticket or joiner is None or joiner.want > record.round:
                    continue  # gone already, another incarnation, unreadable, or it wants the next round
                unchanged = [Compare.mod_revision(key, kv.mod_revision),  # it has not joined the next round
                             Compare.mod_revision(self._round_key, record.revision)]  # no newer round exists
                if self._client.txn(unchanged, [Delete(key)]).succeeded:
                    out.append(name)
            except EtcdError as exc:  # the lease's expiry counts it out later, as it always did
                log.debug("could not count out node '%s': %s", name, exc)
        if out:
            log.warning("The node '%s' counts %s out of round %d of the rendezvous '%s': its workers saw their agents "
                        "stop beating (nodes lost), so the next round does not wait for their leases to expire.",
                        self._node, ", ".join(f"'{n}'" for n in out), record.round, self._settings.run_id)
        return out

    def leave(self) -> None:
        """This agent leaves on a signal (preempted, drained, stopped by hand), after its workers stopped: its node
        key goes now (its liveness lease revoked), so the others' next round does not wait the dead-node window for
        it. The run stays open for the others (torch's launcher does not shut the handler down on a signal: that
        would close the run for every node)."""
        self._stop_watcher()
        self._heartbeat.release()
        self._ports.release()
        log.info("The node '%s' has left the rendezvous '%s' (its key is gone now).", self._node,
                 self._settings.run_id)
