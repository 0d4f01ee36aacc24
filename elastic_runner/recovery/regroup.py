"""In-process recovery at an unchanged membership: who waits for whom, and what the agents tell the survivors.

A failed worker is replaced on its node under the same rank (its agent's standby, or a new process), and the other
workers keep their process and rebuild their group with it (:class:`SameMembers`; the rebuild itself is
:class:`~.rebuild.Regroup`'s). Through the job's store, signed with the job's key (:mod:`.channel`):

- each agent beats (:func:`agent_beat`, :func:`agent_stopping` when it stops on purpose): a survivor that sees a
  round's agent stand still for :data:`AGENT_SILENT` concludes that its node is lost and parks;
- an agent that replaces a failed worker says so (:func:`announce_replacements`), and the survivors wait for that
  announcement (:data:`ANNOUNCE_WAIT`) before they wait for the newcomer; without one, nobody comes (a node lost, or
  its agent restarts every worker).

A survivor whose agent asks it to park (the membership changes) leaves either wait at once.
"""

from __future__ import annotations

import datetime
import logging
import socket
import time
from typing import Any, Callable

import torch

from ..bounded_store import BoundedStore
from . import liveness
from .channel import AgentBeat, AliveAt, Channel, Coming, InGeneration, agent_key, generation_key
from .rebuild import AskedToPark, Membership, Regroup, RegroupError

log = logging.getLogger(__name__)


#: How long survivors wait for an agent to say that it replaces a failed worker (it does so within its monitor
#: interval, 0.1 s under launch) before they conclude that nobody does (a node lost: every worker restarts).
ANNOUNCE_WAIT = datetime.timedelta(seconds=2)
#: How long an agent's heartbeat in the job's store (:mod:`elastic_runner.agent.beat`, every 0.1 s) may stand still
#: before a survivor concludes that its node is lost: it parks then, without waiting for the announcement any longer.
AGENT_SILENT = datetime.timedelta(seconds=0.6)

#: Seconds a survivor waits for one answer of the job's store while it waits for an announcement: a store that takes
#: longer is gone for this recovery (its machine vanished, or froze), whatever torch's client would do. Generous: on a
#: loaded machine a store that stalls is slow, not gone, and a survivor's count-out of node 0 follows from it.
STORE_ANSWER_S = 5.0
#: How often a survivor looks for that announcement (a store ``check``: a blocking ``wait`` cut short logs a warning
#: each time), and whether its agent asks it to park instead.
ANNOUNCE_POLL_S = 0.02


def agent_beat(channel: Channel, group_rank: int, beat: int) -> None:
    """The agent of ``group_rank`` is alive (its ``beat``-th beat)."""
    channel.send(AgentBeat(group_rank, beat))


def agent_stopping(channel: Channel, group_rank: int, beat: int) -> None:
    """The agent of ``group_rank`` stops beating on purpose (its last beat, the ``beat``-th: see :class:`AgentBeat`):
    its node is never counted out for the silence that follows; its workers go, so survivors park for the new round."""
    channel.send(AgentBeat(group_rank, beat, stopping=True))


class _AgentBeats:
    """The round's agents' beats as a survivor first saw them: which stood still since. An agent whose beat is not in
    the store at all (it was lost before it first beat into this round's store) stands still too, as long as another
    agent's beat moved meanwhile: the round's agents do beat (torch's own never do: none is judged then). A slot that
    holds a value not signed with the job's key, or a beat whose counter went below the highest one seen (put back by
    someone else: :mod:`.channel`), is evidence of nothing, and that agent is never counted out on it."""

    def __init__(self, channel: Channel, agents: int) -> None:
        self.channel, self.agents = channel, agents
        self.highest: dict[int, int] = {}
        self.replayed: set[int] = set()  #: agents whose beat went back (logged once each)
        self.seen, self.at = self._read(), time.monotonic()

    def _read(self) -> dict[int, AgentBeat | None]:
        refused: set[str] = set()
        read = self.channel.read_many(AgentBeat, [agent_key(g) for g in range(self.agents)], refused)
        #: Agents whose slot held something nobody signed at the last look: evidence of nothing either way.
        self.tampered = {g for g in range(self.agents) if agent_key(g) in refused}
        beats = {g: read[agent_key(g)] for g in range(self.agents)}
        for g, beat in beats.items():
            if beat is not None:
                self.highest[g] = max(self.highest.get(g, beat.count), beat.count)
        return beats

    def silent(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The group ranks of the agents that have not beaten for :data:`AGENT_SILENT`, looked at once that long has
        passed since the last look (empty otherwise): those seen beating in this store before, and those never seen
        here or that said they stop on purpose (``AgentBeat.stopping``). Only the first are evidence enough to count a
        node out of the rendezvous (:meth:`SameMembers.survive`): an agent never seen may merely be late to this
        round's store, and one that stops on purpose is alive (it restarts its workers, or stops them and leaves)."""
        if time.monotonic() - self.at < AGENT_SILENT.total_seconds():
            return (), ()
        before = self.seen
        before_highest = dict(self.highest)
        now = self._read()
        moved, still = False, []
        for g, beat in now.items():
            old = before.get(g)
            if g in self.tampered:
                continue
            if beat is None:
                if old is None:
                    still.append(g)
                continue
            if beat.count > before_highest.get(g, -1):
                moved = True
            elif beat.count < before_highest.get(g, -1):
                (log.debug if g in self.replayed else log.warning)("the beat of node %d's agent in the job's store went back from %d to %d: someone else "
                            "put an old one there; it is not taken as that node's silence", g,
                            before_highest[g], beat.count)
                self.replayed.add(g)
            elif old is not None and beat == old:
                still.append(g)
        self.seen, self.at = now, time.monotonic()
        if not moved:
            return (), ()
        stopped = tuple(g for g in still if now[g] is not None and not now[g].stopping)  # type: ignore[union-attr]
        never = tuple(g for g in still if now[g] is None or now[g].stopping)  # type: ignore[union-attr]
        return stopped, never


def _replacement_generation(channel: Channel, rank: int) -> int:
    """The generation a replacement of ``rank`` joins: the one after its predecessor's. Raises :class:`RegroupError`
    when the predecessor ended before the round's first group was formed: its peers still wait for it in that
    group's start, where no replacement can take its place (every worker restarts)."""
    said = channel.read(InGeneration, generation_key(rank))
    if said is None:
        raise RegroupError(f"rank {rank} ended before the round's first process group was formed: its peers wait "
                           "for it there, not for a replacement")
    return said.generation + 1


def announce_replacement(channel: Channel, rank: int) -> int:
    """An agent replaces the failed worker of ``rank``: tell the survivors, who wait for this before they wait for
    the newcomer (:meth:`SameMembers.survive`); the generation it joins."""
    generation = _replacement_generation(channel, rank)
    channel.send(Coming(generation, rank))
    return generation


#: Seconds an agent tries to reach the job's store to announce a replacement (on a node's network: milliseconds).
ANNOUNCE_CONNECT_S = 0.5


def announce_replacements(master_addr: str, master_port: int, ranks: list[int], key: bytes | None) -> str:
    """An agent replaces the failed workers of ``ranks``: tell their peers through the job's store (rank 0's worker
    hosts it at ``master_addr:master_port``), signed with the job's ``key``. Why that could not be done (every worker
    restarts then), or ""."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        # A refused connection first, at once: torch's client retries one until its timeout, and rank 0's worker is
        # often gone too (every worker killed at once).
        socket.create_connection((master_addr, master_port), timeout=ANNOUNCE_CONNECT_S).close()
        store = TCPStore(master_addr, master_port, is_master=False, timeout=datetime.timedelta(seconds=2),
                         wait_for_workers=False)
        channel = Channel(store, key, f"{master_addr}:{master_port}")
        for rank in ranks:
            announce_replacement(channel, rank)
    except RegroupError as exc:  # it died in the round's start: its peers wait for it there
        return str(exc)
    except SignalException:
        raise  # the agent's stop, arrived meanwhile
    except Exception as exc:  # noqa: BLE001 - unreachable or gone: nothing to rebuild with
        return f"the job's store does not answer ({type(exc).__name__})"
    return ""


class SameMembers:
    """In-process recovery at an unchanged membership: a failed worker is replaced on its node under the same rank,
    and the other workers keep their process and rebuild their group with it.

    Members are the ranks ``0..world_size-1``. Generation 0 is the round's first group; each rebuild is the next
    one. Survivors know theirs; a replacement reads its predecessor's from the store, so both sides name the same
    generation without talking. With ``reconfigure`` the first group is made by :meth:`first` (it must be created
    reconfigurable); with ``recreate`` by :func:`~elastic_runner.worker.group.up` as any group.
    """

    def __init__(self, store: Any, rank: int, world_size: int, backend: str, device: torch.device,
                 timeout: datetime.timedelta, wait: datetime.timedelta, method: str = "recreate",
                 agents: int = 0, key: bytes | None = None, context: str = "", master_addr: str = "",
                 alive_port: int | None = None, agent_id: str = "", asks_rank0_agent: bool = True) -> None:
        self.rank, self.world_size, self.generation = rank, world_size, 0
        #: The round's agents (nodes): a survivor watches their beats while it waits for an announcement.
        self.agents = agents
        self.regroup = Regroup(store, str(rank), backend, timeout, method=method, device=device, wait=wait, key=key,
                               context=context)
        self.channel = self.regroup.channel
        #: What a survivor reads while it waits for an announcement: bounded, since a store whose machine vanished
        #: without resetting its connections never answers torch's client (:mod:`elastic_runner.bounded_store`).
        self._watching = Channel(BoundedStore(store, STORE_ANSWER_S), key, context)
        self._key, self._master_addr = key, master_addr
        #: Where rank 0's agent answers whether it is alive once the job's store is gone (:mod:`.liveness`), and
        #: MASTER_ADDR's numeric address (looked up while the store serves); only where this worker is the one of its
        #: node that asks (``asks_rank0_agent``: local rank 0; its agent counts out what any of its workers found).
        self.rank0_agent: AliveAt | None = None
        self._rank0_address, self._asks = "", asks_rank0_agent
        if rank == 0 and alive_port is not None and master_addr:
            liveness.publish(self.channel, alive_port, agent_id)  # before any peer can have formed a group with it

    @property
    def method(self) -> str:
        return self.regroup.method

    def first(self, wait: datetime.timedelta, leaving: Callable[[], bool] | None = None) -> float:
        """The round's first group (generation 0), made reconfigurable, waiting ``wait`` for every rank; seconds it
        took. ``leaving``: :class:`~.rebuild.AskedToPark` as soon as it says so while this rank waits."""
        return self.regroup.join(Membership(0, self._members()), wait, leaving=leaving)

    def arrive_first(self, wait: datetime.timedelta, leaving: Callable[[], bool] | None = None) -> None:
        """Before the round's first group is made the ordinary way (``recreate``): say this rank arrived and, where
        it may be asked to leave (``leaving``: a kept worker placed in a round whose new peers are still starting,
        when its agent starts yet another round), wait ``wait`` for the others, ending in
        :class:`~.rebuild.AskedToPark` as soon as ``leaving()`` says so. Every rank says it, whether it waits or not."""
        membership = Membership(0, self._members())
        self.regroup.arrive(membership)
        if leaving is not None:
            self.regroup.wait_for_arrivals(membership, wait, leaving)

    def formed(self) -> None:
        """The round's first group works (its first collective went through): a replacement of this rank may join
        the next generation."""
        self.channel.send(InGeneration(self.rank, 0))
        self._learn_rank0_agent()

    def _learn_rank0_agent(self) -> None:
        """Read where rank 0's agent answers (rank 0's worker wrote it before its first group): after the round's
        first group, or a replacement's first, while the job's store surely still serves."""
        if self.rank != 0 and self._asks and self.rank0_agent is None and self._master_addr:
            self.rank0_agent = liveness.published(self.channel)
            if self.rank0_agent is not None:
                self._rank0_address = liveness.numeric_address(self._master_addr, self.rank0_agent.port)

    def survive(self, announce_wait: datetime.timedelta = ANNOUNCE_WAIT,
                leaving: Callable[[], bool] | None = None) -> float:
        """A peer failed: rebuild the group for the next generation, with its replacement; seconds it took. Raises
        :class:`RegroupError` at once when no agent announced a replacement within ``announce_wait`` (a node was
        lost, or a worker left for a reason a replacement would not mend), when an agent's beat stood still for
        :data:`AGENT_SILENT` (its node is lost: sooner than that), or as soon as ``leaving()`` says the membership
        changes (this worker's agent asks it to park: the peer left for a new round, or a node joins while the
        announced replacement is still on its way)."""
        self.regroup.abandon()
        generation = self.generation + 1
        key, deadline = Coming(generation, 0).key(), time.monotonic() + announce_wait.total_seconds()
        beats: _AgentBeats | None = None
        while True:
            if leaving is not None and leaving():
                raise AskedToPark("a failed peer's replacement to be announced")
            try:
                if self._watching.read(Coming, key) is not None:
                    break
                beats = beats or _AgentBeats(self._watching, self.agents)
                stopped, never = beats.silent()
            except Exception as exc:  # noqa: BLE001 - the store gone with rank 0's worker
                raise self._store_gone(exc) from exc
            if stopped or never:
                raise RegroupError(f"the agent of node {', '.join(map(str, sorted(stopped + never)))} has not beaten "
                                   f"for {AGENT_SILENT.total_seconds():g}s since a peer's failure: that node was lost",
                                   lost_agents=stopped)
            if time.monotonic() >= deadline:
                raise RegroupError(f"no replacement was announced within {announce_wait.total_seconds():g}s of a "
                                   "peer's failure: a node was lost, or its agent restarts every worker")
            time.sleep(ANNOUNCE_POLL_S)
        return self._join(generation, leaving)

    def _store_gone(self, exc: Exception) -> RegroupError:
        """The job's store stopped answering while this survivor waited: rank 0's worker ended. Whether its node went
        with it is rank 0's agent's to answer (:mod:`.liveness`); a lost one is counted out of the next round."""
        said = f"the job's store does not answer after a peer's failure ({type(exc).__name__})"
        if self.rank0_agent is None:
            return RegroupError(f"{said}: rank 0's worker ended, or its node was lost")
        if liveness.agent_lost(self._rank0_address, self.rank0_agent, self._key):
            return RegroupError(f"{said}, nor does node 0's agent: that node was lost", lost_agents=(0,))
        return RegroupError(f"{said}: rank 0's worker ended (node 0's agent is alive)")

    def replace(self) -> float:
        """This process replaces a failed worker of the same rank: join the generation after its predecessor's."""
        seconds = self._join(_replacement_generation(self.channel, self.rank))
        self._learn_rank0_agent()
        return seconds

    def _members(self) -> tuple[str, ...]:
        return tuple(str(r) for r in range(self.world_size))

    def _join(self, generation: int, leaving: Callable[[], bool] | None = None) -> float:
        seconds = self.regroup.join(Membership(generation, self._members()), leaving=leaving)
        self.generation = generation
        self.channel.send(InGeneration(self.rank, generation))
        return seconds
