"""Rendezvous rounds that complete as soon as everyone known is back.

torch's ``DynamicRendezvousHandler`` completes a round ``last_call_timeout``
after the minimum number of nodes joined (an integer, 30 s by default), and
every waiting node re-reads the shared state once per second. After a worker
failure every node of the previous round rejoins within milliseconds, yet the
round still waits out the last call and the polling.

Five changes, applied only inside the ``elastic-runner launch`` agent process:

- **Complete when the previous round is accounted for.** A node that
  rejoins knows the participants of the round it was part of and their last
  heartbeats. When each of them is a participant again or has sent no
  heartbeat for torch's dead-node window (``keep_alive_interval *
  keep_alive_max_attempt``, the rule by which torch itself drops it), the
  minimum is met, and nobody is waiting to join (nor, while a seat is free, waiting as a spare: :func:`spare_coming`),
  the round is marked complete at once. While such a spare is on its way, torch's own last call is held too (for at
  most the dead-node window). Otherwise (this node has no previous round, or a node
  of it is neither back nor dead) torch's rule applies unchanged: wait for
  the last call. The rule never completes a round that torch's rule would
  not also complete with the same members; it only skips the last call,
  which exists for nodes nobody knows about yet (they join through the wait
  list and trigger one more round). (A faster rule for node loss — treat a
  previous participant that is briefly absent from the shared state as
  dead — was tried and dropped: a live agent between leaving the old round
  and joining the new one looks the same, and one round completed without
  it. A live agent's heartbeat is never older than the window.)
- **Count a lost node out on its agent's silence.** With in-process recovery each agent beats in the job's store
  every 0.1 s (:mod:`elastic_runner.agent.beat`); a survivor's workers that saw a node's agent stand still park, and
  their agent names that node's group rank (:func:`count_out`, the handler's ``count_out``, as etcd-v3's lease
  protocol has it). The lost node stays a participant of the finished round until torch's sanitizer drops it after
  the dead-node window (``keep_alive_interval * keep_alive_max_attempt``: 1.5 s and more), and the next round cannot
  start before; once every other member has left that round, the node counted out is removed as the sanitizer would
  remove it (:func:`drop_counted_out`) and counts as dead for the early completion. A node counted out wrongly (alive,
  its beat late) is no longer a participant: its agent sees that (:mod:`elastic_runner.agent.round_members`), stops
  its workers and joins the next round, or waits as a spare where the new round is full; its stale workers can
  complete no collective with the new round's and publish nothing (snapshots are fenced by generation).
- **See a joining node sooner.** While training, the agent asks every monitor interval whether a
  node waits to join, and torch answers from a state read up to 1 s old: ``training_cache``
  (0.2 s for jobs under 20 nodes, growing to torch's 1 s at 100).
- **Heartbeats that keep to the window.** torch's keep-alive timer fires every ``keep_alive_interval``
  but sends only when the last heartbeat is at least that old, so two can be nearly two intervals
  apart; with a window of three, a second of scheduling delay on a loaded machine is enough for a
  joining node to declare a live node dead and start a round of its own. The timer checks twice an
  interval: at most 1.5 intervals between heartbeats.
- **Poll faster.** The 1 s state re-read becomes ``ELASTIC_RUNNER_RDZV_POLL``
  seconds (default 0.1), and while a round forms torch's state cache (reads
  younger than 1 s are served from memory) is cut to the same interval:
  without that a node sees another node's "round complete" up to a second
  late, on every restart. A job of N nodes then reads the shared state about
  N/poll times per second while a round is forming (64 nodes: 640 small
  reads a second; raise the interval for hundreds of nodes on etcd); while
  training, as with torch, each agent reads it once a second.

Both hook torch internals (``_RendezvousJoinOp``, ``_delay``, the state
holder's ``_cache_duration`` during ``next_rendezvous``) that have been
stable since torch 1.9; :func:`install` checks them
(:data:`elastic_runner.torch_patches.FAST_RENDEZVOUS`) and otherwise leaves
torch's behaviour alone with a warning.
"""

from __future__ import annotations

import logging
import os
from datetime import datetime, timedelta, timezone
from typing import Any, Callable

log = logging.getLogger(__name__)

#: Participants of the last round this agent completed (set by the agent before rejoining).
_previous: frozenset[Any] = frozenset()
#: That round's number in the shared state.
_previous_round: int | None = None
#: Group ranks of that round whose agents this node's workers saw stop beating (:meth:`count_out`), and the nodes
#: they are in it: counted dead without waiting out their heartbeats.
_lost_ranks: set[int] = set()
_counted_out: frozenset[Any] = frozenset()
#: Newest heartbeat seen of each of them (UTC datetimes, as in torch's state).
_beats: dict[Any, Any] = {}
#: Spares seen on torch's redundancy list (with their newest heartbeat). A spare that sees a free seat removes itself
#: from that list, and its heartbeat from the state, one poll before it joins the wait list or the participants: for
#: that poll (longer on a loaded machine) the state shows it nowhere, and a round completed then would leave it out.
_spares: dict[Any, Any] = {}
_installed = False
#: True when the last round this agent joined was completed by the rule above.
completed_early = False
#: Called (with the round's maximum) when this node adds itself to torch's redundancy list: the running round is
#: full and has no seat for it, so it waits as a spare and takes the next free one (the agent reports it).
on_spare: Callable[[int], None] | None = None


def set_previous_participants(nodes: Any, heartbeats: Any = None, round_: int | None = None) -> None:
    """The round that just ended: its participants (torch's ``{node: group rank}``, or any iterable of nodes), their
    last heartbeats and its number; the group ranks counted out since (:func:`count_out`) become its nodes."""
    global _previous, _previous_round, _counted_out, completed_early
    _previous = frozenset(nodes)
    _previous_round = round_
    ranks = nodes if isinstance(nodes, dict) else {}
    _counted_out = frozenset(node for node, rank in ranks.items() if rank in _lost_ranks)
    _lost_ranks.clear()
    _beats.clear()
    _spares.clear()
    _note_beats(heartbeats or {})
    completed_early = False


def note_spares(redundancy_list: Any, heartbeats: Any) -> None:
    """Remember the spares a state read shows waiting, with their newest heartbeat (:data:`_spares`; a spare's
    heartbeat is followed on the wait list too, where it goes next)."""
    for node in set(redundancy_list) | (_spares.keys() & set(heartbeats)):
        beat = heartbeats.get(node)
        if beat is not None and (node not in _spares or beat > _spares[node]):
            _spares[node] = beat


def spare_coming(participants: Any, max_nodes: int, window: timedelta, now: datetime) -> bool:
    """A seat is free and a spare seen waiting since the last round ended is not seated yet, its newest heartbeat
    younger than ``window`` (a spare that died is waited for no longer than torch's sanitizer would keep it)."""
    return len(participants) < max_nodes and any(
        node not in participants and now - beat <= window for node, beat in _spares.items())


def count_out(participants: dict[Any, int], this_node: Any, group_ranks: Any) -> list[str]:
    """Group ranks of the running round whose agents this node's workers saw stop beating in the job's store
    (:mod:`elastic_runner.agent.beat`): the next round counts their nodes dead at once instead of waiting out torch's
    dead-node window. The nodes' names, for the agent's event."""
    lost = {int(r) for r in group_ranks}
    nodes = [node for node, rank in participants.items() if rank in lost and node != this_node]
    _lost_ranks.update(participants[node] for node in nodes)
    return [str(node) for node in nodes]


def drop_counted_out(node: Any, state: Any, settings: Any, epilogue: Any) -> bool:
    """Remove the nodes counted out from the round that just ended, once every other member has left it (as torch's
    own sanitizer removes a node whose heartbeats stopped, and with its epilogue: the round then moves on). True when
    ``state`` changed (the caller writes it; a node that changed it first wins and this is decided again)."""
    if not _counted_out or not state.complete or state.round != _previous_round or node in state.participants:
        return False
    listed = set(state.participants)
    if not listed or not listed <= _counted_out:
        return False
    for dead in listed:
        del state.participants[dead]
        state.last_heartbeats.pop(dead, None)
        state.wait_list.discard(dead)
    log.info("rendezvous: %d node(s) of the previous round counted out (their agents stopped beating): the next "
             "round starts without waiting out their heartbeats", len(listed))
    epilogue(state, settings)
    return True


def _note_beats(heartbeats: Any) -> None:
    for node in _previous:
        beat = heartbeats.get(node)
        if beat is not None and (node not in _beats or beat > _beats[node]):
            _beats[node] = beat


def previous_round_accounted_for(participants: Any, heartbeats: Any, window: timedelta, now: datetime) -> bool:
    """Every node of the previous round is back, or silent for longer than ``window``."""
    if not _previous:
        return False
    _note_beats(heartbeats)
    return all(node in participants or node in _counted_out or (node in _beats and now - _beats[node] > window)
               for node in _previous)


def poll_interval() -> float:
    try:
        return max(0.01, float(os.environ.get("ELASTIC_RUNNER_RDZV_POLL", "0.1")))
    except ValueError:
        return 0.1


def training_cache(torch_cache: float, nodes: int) -> float:
    """How old a state read may be while training (torch: 1 s). The agent asks every monitor interval
    (0.1 s) whether a node waits to join; each read past the cache goes to the store, and the state grows
    with the job (about 100 bytes a node). Small jobs see a joining node within 0.2 s instead of up to a
    second; from 100 nodes on, torch's once a second (N reads a second of N * 100 bytes each)."""
    try:
        floor = float(os.environ.get("ELASTIC_RUNNER_RDZV_WAITING_POLL", "0.2"))
    except ValueError:
        floor = 0.2
    return min(torch_cache, max(floor, 0.01 * nodes))


def install() -> bool:
    """Patch the running process's torch rendezvous (idempotent); False if not possible."""
    global _installed
    if _installed:
        return True
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    from ..torch_patches import FAST_RENDEZVOUS, usable

    if not usable(FAST_RENDEZVOUS, log):
        return False
    base_join, action, original_delay = dr._RendezvousJoinOp, dr._Action, dr._delay
    waiting = {action.SYNC, action.KEEP_ALIVE}

    class FastJoinOp(base_join):  # type: ignore[misc, valid-type]
        def __call__(self, ctx: Any, deadline: float) -> Any:
            if drop_counted_out(ctx.node, ctx.state, ctx.settings, dr._remove_participant_epilogue):
                return action.KEEP_ALIVE  # any action but SYNC has the executor write the state
            decision = super().__call__(ctx, deadline)
            state = ctx.state
            note_spares(state.redundancy_list, state.last_heartbeats)
            window = ctx.settings.keep_alive_interval * ctx.settings.keep_alive_max_attempt
            now = datetime.now(timezone.utc)
            if decision == action.ADD_TO_REDUNDANCY_LIST and on_spare is not None:
                on_spare(ctx.settings.max_nodes)
            if (
                decision == action.MARK_RENDEZVOUS_COMPLETE
                and not state.complete
                and state.deadline is not None
                and now < state.deadline + window
                and spare_coming(state.participants, ctx.settings.max_nodes, window, now)
            ):
                # torch's last call (1 s under launch) fell while a spare is on its way to the free seat, two polls
                # of a loaded machine: completing now would leave it for one more round of every node, seconds.
                # Waiting is bounded by its heartbeat and by the dead-node window past the last call.
                return action.KEEP_ALIVE if dr._should_keep_alive(ctx) else action.SYNC
            if (
                decision in waiting
                and _previous
                and not state.complete
                and ctx.node in state.participants
                and len(state.participants) >= ctx.settings.min_nodes
                and not state.wait_list
                # A spare waiting for a free seat gets it in this round, within a poll or two.
                and not spare_coming(state.participants, ctx.settings.max_nodes, window, now)
                and previous_round_accounted_for(state.participants, state.last_heartbeats, window, now)
            ):
                global completed_early
                completed_early = True
                log.info("rendezvous: the %d node(s) of the previous round are back (%d) or dead; completing without "
                         "the last call", len(_previous), len(_previous & set(state.participants)))
                return action.MARK_RENDEZVOUS_COMPLETE
            return decision

    def fast_delay(seconds: float | tuple[float, float]) -> None:
        # torch sleeps exactly 1 s between state polls; keep its other delays.
        original_delay(poll_interval() if seconds == 1 else seconds)

    handler_cls = dr.DynamicRendezvousHandler
    original_next = handler_cls.next_rendezvous

    def next_rendezvous(self: Any) -> Any:
        # torch serves state reads younger than 1 s from a cache, so a node saw another node's
        # "round complete" up to a second late, on every restart. Only while a round forms: the
        # agent's monitor asks for waiting nodes every 0.1 s during training, and the cache keeps
        # that at one read a second.
        holder = getattr(self, "_state_holder", None)
        state = getattr(holder, "state", None)
        if state is not None and getattr(state, "complete", False):
            # The round that just ended: who to wait for (or to see dead) before completing the next.
            set_previous_participants(state.participants, getattr(state, "last_heartbeats", {}),
                                      getattr(state, "round", None))
            note_spares(getattr(state, "redundancy_list", ()), getattr(state, "last_heartbeats", {}))
        else:
            _lost_ranks.clear()  # they were that round's ranks: never another round's nodes
        saved = getattr(holder, "_cache_duration", None)
        if saved is not None:
            holder._cache_duration = min(saved, poll_interval())
        try:
            return original_next(self)
        finally:
            if saved is not None:
                participants = getattr(getattr(holder, "state", None), "participants", {}) or {}
                holder._cache_duration = training_cache(saved, len(participants))

    original_start_heartbeats = handler_cls._start_heartbeats

    def start_heartbeats(self: Any) -> None:
        # torch's timer fires every keep_alive_interval and sends a heartbeat only when the last one is at
        # least that old: up to two intervals apart, plus any delay of a loaded machine, against a dead-node
        # window of three. Checking twice an interval keeps them at most 1.5 intervals apart.
        original_start_heartbeats(self)
        timer = getattr(self, "_keep_alive_timer", None)
        ctx = getattr(timer, "_ctx", None)
        if ctx is not None and getattr(ctx, "interval", 0) > 0:
            ctx.interval = ctx.interval / 2

    def handler_count_out(self: Any, group_ranks: Any) -> list[str]:
        # The agent's _count_out_lost asks the handler, as it asks etcd-v3's lease protocol.
        state = self._state_holder.state
        return count_out(dict(state.participants) if state.complete else {}, self._this_node, group_ranks)

    dr._RendezvousJoinOp = FastJoinOp
    setattr(handler_cls, "count_out", handler_count_out)  # (torch's class has no such method: one more, not a change)
    dr._delay = fast_delay
    handler_cls.next_rendezvous = next_rendezvous
    handler_cls._start_heartbeats = start_heartbeats
    _installed = True
    return True
