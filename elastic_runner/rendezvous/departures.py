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

A third kind is known while agents wait in the rendezvous, where no worker reads a beat any more: an agent that keeps
its workers across rounds answers liveness challenges on a port of its own (:mod:`elastic_runner.recovery.liveness`)
and says where in its node key (``alive``: port and agent name). While a round waits for a member that has not come,
or for a sealer that does not seal, the waiting agents ask it (:class:`AskSchedule`: at once, then at doubling
intervals up to a quarter of the dead-node window, 5 s at most); one whose port refuses or does not answer within
the liveness module's limits is lost, and its key goes (and its sealer claim):
:meth:`DepartureRole.count_out_silent`, :meth:`DepartureRole.count_out_silent_sealer`. An answer that does not verify
is no evidence, and neither is an address whose name does not resolve. Counting out a live agent this way (its
answering thread starved past the limit) costs it the round, as a late beat does: it sees the next record on its
watch, and joins the one after.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable

from ..printable import printable
from .kv import Compare, Delete, EtcdError, Get, KeyValue, KVClient
from .rounds import Joiner, NodeId, Round, Settings

if TYPE_CHECKING:
    from .values import Codec

log = logging.getLogger("elastic_runner.rendezvous.leases")


#: The first interval between two questions to the same agent (seconds); it doubles after each answer, up to a
#: quarter of the dead-node window and at most :data:`LONGEST_ASK_S`.
ASK_EVERY_S = 0.5
LONGEST_ASK_S = 5.0
#: The longest one pass of questions may take before the asker reads its watch again (seconds; one question takes
#: milliseconds, a lost node's up to the liveness module's 2 s, a name lookup up to the resolver's timeout).
ASK_PASS_S = 1.0
#: The shortest watch between two passes (seconds): the watch is read even while questions are due.
LEAST_WATCH_S = 0.05


@dataclass(frozen=True)
class AgentLiveness:
    """This agent's liveness port (``port``, answered as ``agent``) and how to ask another: ``lost(address, port,
    agent)`` is True only on evidence that nobody answers there (:func:`elastic_runner.recovery.liveness.offer`)."""

    port: int
    agent: str
    lost: Callable[[str, int, str], bool]


@dataclass
class AskSchedule:
    """When each waited-for agent is asked next: at once, then ``first`` seconds later, each wait twice the last up
    to ``longest`` (a quarter of the dead-node window, :data:`LONGEST_ASK_S` at most): a live agent is asked a few
    times a window, and a lost one is found within ``longest``."""

    first: float
    longest: float
    clock: Callable[[], float] = time.monotonic
    _next: dict[str, tuple[float, float]] = field(default_factory=dict)  #: name -> (when, the interval after it)

    def when(self, name: str) -> float:
        """When ``name`` is to be asked next (0: never asked: at once)."""
        return self._next.get(name, (0.0, 0.0))[0]

    def due(self, name: str) -> bool:
        """Whether ``name`` is to be asked now (one never asked is)."""
        return self.when(name) <= self.clock()

    def asked(self, name: str) -> None:
        """``name`` was asked now: the next question waits twice as long as the last wait."""
        interval = self._next.get(name, (0.0, self.first / 2))[1]
        interval = min(self.longest, max(self.first, 2 * interval))
        self._next[name] = (self.clock() + interval, interval)

    def next_due(self, names: Iterable[str]) -> float | None:
        """When the first of ``names`` that were asked before is due again (None: none of them was)."""
        return min((self._next[n][0] for n in names if n in self._next), default=None)


class DepartureRole:
    #: Set by the agent when it answers liveness challenges (and then asks others): see the module docstring.
    liveness: AgentLiveness | None = None
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
        names = [record.members[g][0] for g in sorted(set(group_ranks)) if 0 <= g < len(record.members)]
        return self._count_out(record, names, "its workers saw their agents stop beating (nodes lost)")

    def silent(self, joiners: Iterable[Joiner], schedule: AskSchedule) -> list[Joiner]:
        """Those of ``joiners`` due to be asked (``schedule``) whose agents do not answer on their liveness ports;
        none where this agent does not ask (no liveness of its own) or they say no port. The questions of one call
        take :data:`ASK_PASS_S` at most (then those still due wait for the next): the caller reads its watch between
        two calls, and a round whose members come back must not wait for the questions to the others."""
        liveness = self.liveness
        if liveness is None:
            return []
        lost = []
        start = schedule.clock()
        due = [j for j in joiners if j.alive_port and j.node.name != self._node.name and schedule.due(j.node.name)]
        for joiner in sorted(due, key=lambda j: schedule.when(j.node.name)):  # the longest due first: none starves
            if schedule.clock() - start >= ASK_PASS_S:
                break
            if liveness.lost(joiner.node.addr, joiner.alive_port, joiner.alive_agent):
                lost.append(joiner)
            schedule.asked(joiner.node.name)  # (a lost one too: if counting it out fails, it is asked again later)
        return lost

    def count_out_silent(self, record: Round, joiners: Iterable[Joiner], schedule: AskSchedule) -> list[str]:
        """As the sealer of the round after ``record``: count out the members of ``record`` among ``joiners`` (live
        keys that have not asked for the next round) whose agents no longer answer (:meth:`silent`): their nodes
        are lost while the others wait for them in the rendezvous, where no worker reads their beats."""
        members = set(record.names())
        lost = self.silent([j for j in joiners if j.node.name in members], schedule)
        return self._count_out(record, [j.node.name for j in lost], "their agents do not answer on their liveness "
                               "ports (nodes lost while the others wait for them)")

    def count_out_silent_sealer(self, record: Round | None, record_rev: int, claim: KeyValue, name: str,
                                schedule: AskSchedule) -> bool:
        """While this agent waits for another, ``name``, to seal the next round (``claim``, its sealer claim, read
        after the record ``record`` at ``record_rev``): whether that sealer's agent no longer answers (:meth:`silent`)
        and its claim and key are gone now (deleted together, only if neither nor the record changed), so that a
        waiting agent claims the round instead of waiting the dead-node window for the sealer's lease."""
        if name == self._node.name or not schedule.due(name):
            return False
        key = self._node_prefix + name.encode()
        try:
            (kv,) = self._client.txn((), [Get(key)]).results
            joiner = self._codec.node(kv) if kv is not None else None
            # (a claim and a node key of one agent live on its one lease)
            if kv is None or joiner is None or claim.lease != kv.lease or not self.silent([joiner], schedule):
                return False
            record_compare = Compare.mod_revision(self._round_key, record_rev) if record_rev else \
                Compare.absent(self._round_key)
            unchanged = [Compare.mod_revision(key, kv.mod_revision), Compare.mod_revision(claim.key, claim.mod_revision),
                         record_compare]
            if not self._client.txn(unchanged, [Delete(key), Delete(claim.key)]).succeeded:
                return False
        except EtcdError as exc:  # its lease's expiry ends the claim later, as it always did
            log.debug("could not count out the sealer '%s': %s", printable(name, 80), exc)
            return False
        log.warning("The node '%s' counts the sealer '%s' out of round %d of the rendezvous '%s': its agent does not "
                    "answer on its liveness port (node lost), so the round does not wait for its lease to expire.",
                    self._node, printable(name, 80), record.round + 1 if record is not None else 0,
                    self._settings.run_id)
        return True

    def _count_out(self, record: Round, names: Iterable[str], why: str) -> list[str]:
        """Delete the node keys of ``names``, members of ``record``, each only if it is still the incarnation
        ``record`` seated, has not asked for a later round, and ``record`` is still the newest: the names deleted."""
        tickets = dict(record.members)
        out = []
        for name in names:
            if name == self._node.name or name not in tickets:
                continue
            key = self._node_prefix + name.encode()
            try:
                (kv,) = self._client.txn((), [Get(key)]).results
                joiner = self._codec.node(kv) if kv is not None else None
                if kv is None or kv.create_revision != tickets[name] or joiner is None or joiner.want > record.round:
                    continue  # gone already, another incarnation, unreadable, or it wants the next round
                unchanged = [Compare.mod_revision(key, kv.mod_revision),  # it has not joined the next round
                             Compare.mod_revision(self._round_key, record.revision)]  # no newer round exists
                if self._client.txn(unchanged, [Delete(key)]).succeeded:
                    out.append(name)
            except EtcdError as exc:  # the lease's expiry counts it out later, as it always did
                log.debug("could not count out node '%s': %s", printable(name, 80), exc)
        if out:
            log.warning("The node '%s' counts %s out of round %d of the rendezvous '%s': %s, so the next round does "
                        "not wait for their leases to expire.", self._node, ", ".join(f"'{printable(n, 80)}'" for n in out),
                        record.round, self._settings.run_id, why)
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
