"""What an agent does as the sealer of a round in the lease protocol: follow the node keys, seal the round.

A mixin of :class:`~elastic_runner.rendezvous.leases.LeaseRendezvousHandler` (the handler's state is its
own): the sealer's view of the run (:class:`~elastic_runner.rendezvous.rounds.View`, read with bounded
reads and followed on one watch), the sealing rules of :mod:`elastic_runner.rendezvous.rounds`, and the one
transaction that writes the round record.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

from .kv import WATCH_SLICE_SECONDS, Compare, Delete, EtcdError, Get, KeyValue, KVClient, LeaseKeeper, Put, WatchEvent
from .departures import ASK_EVERY_S, LEAST_WATCH_S, LONGEST_ASK_S, AgentLiveness, AskSchedule
from .rounds import Joiner, NodeId, Round, Settings, View, choose_members, quorum, ready_to_seal

if TYPE_CHECKING:
    from torch.distributed import Store

    from .values import Codec

log = logging.getLogger("elastic_runner.rendezvous.leases")


class SealerRole:
    _client: KVClient
    _codec: Codec
    _settings: Settings
    _node: NodeId
    _leases: LeaseKeeper
    _store: Store
    _clock: Callable[[], float]
    _prefix: bytes
    _node_prefix: bytes
    _ctl: bytes
    _round_key: bytes
    _closed_key: bytes
    _give_up: Callable[[int], None]  #: the handler's: roll back our join and raise the timeout
    _heartbeat: Any
    _claim_sealer: Callable[[int, int], int]
    _drop_sealer_claim: Callable[[int], None]
    liveness: AgentLiveness | None  #: (departures.py's, as the methods below)
    count_out_silent: Callable[[Round, list[Joiner], AskSchedule], list[str]]
    count_out_silent_sealer: Callable[[Round | None, int, KeyValue, str, AskSchedule], bool]

    def _wait_for_round(self, want: int, sealer_present: bool, revision: int, deadline: float,
                        record: Round | None = None, record_rev: int = 0) -> Round | None:
        """Seal round ``want`` or wait until a record newer than the one we read (``record`` at ``record_rev``)
        appears, the run is closed, or the watch's history is gone; our own seal, or None (the caller reads the
        record). While another agent holds the sealer claim, that agent is asked whether it lives (where this one
        asks: :mod:`.departures`): a lost sealer's claim goes at once, and this agent claims the round."""
        seen = revision
        schedule = self._ask_schedule()
        sealer_key = self._ctl + f"sealer/{want}".encode()
        while True:
            if self._clock() >= deadline:
                self._give_up(want)
            ask_at: float | None = None
            if sealer_present and self.liveness is not None:
                sealer_present, ask_at = self._ask_sealer(sealer_key, record, record_rev, schedule)
            claim = 0 if sealer_present else self._claim_sealer(want, record_rev)
            if claim:
                sealed = self._seal_round(want, deadline, claim, record_rev)
                if sealed is None:
                    self._drop_sealer_claim(want)  # someone else sealed it, or it closed: the claim would linger
                return sealed
            sealer_present = True  # another agent's claim holds the round (maybe one that claimed first): ask it
            state: dict[str, Any] = {"record": None, "sealer_gone": False, "closed": False}

            def handle(events: list[WatchEvent]) -> bool:
                nonlocal seen
                for event in events:
                    seen = max(seen, event.kv.mod_revision)
                    if event.kv.key == self._round_key and event.kind == "put":
                        state["record"] = event.kv
                    elif event.kv.key == sealer_key and event.kind == "delete":
                        state["sealer_gone"] = True
                    elif event.kv.key == self._closed_key and event.kind == "put":
                        state["closed"] = self._codec.closed(event.kv, record, record_rev)
                return bool(state["record"] or state["sealer_gone"] or state["closed"])

            self._heartbeat.restore()  # our key as we wrote it: a value of ours put back would hold the sealer
            now = self._clock()
            until = min(deadline, now + WATCH_SLICE_SECONDS, ask_at if ask_at is not None else deadline)
            if ask_at is not None:
                until = max(until, min(deadline, now + LEAST_WATCH_S))
            end = self._client.watch_prefix(self._ctl, seen + 1, max(0.0, until - now), handle)
            if state["closed"] or state["record"] is not None or end == "compacted":
                return None  # re-read everything: closed, sealed (by someone), or history gone
            if state["sealer_gone"]:
                sealer_present = False

    def _ask_sealer(self, sealer_key: bytes, record: Round | None, record_rev: int,
                    schedule: AskSchedule) -> tuple[bool, float | None]:
        """While another agent's claim holds the round: whether a claim still does (False: claim it), and when to
        ask its agent next (None: not asked, its key names no port)."""
        try:
            (claim_kv,) = self._client.txn((), [Get(sealer_key)]).results
        except EtcdError as exc:  # (asking is only faster: the watch retries as before)
            log.debug("could not read the sealer claim at '%s': %s", sealer_key.decode(errors="replace"), exc)
            return True, None
        if claim_kv is None or not self._codec.claim(claim_kv, record_rev):
            return False, None  # gone already, or a claim that does not count: claim it (replaced)
        claimant = self._codec.claimant(claim_kv)
        if claimant is None:
            return False, None
        if self.count_out_silent_sealer(record, record_rev, claim_kv, claimant, schedule):
            return False, None
        return True, schedule.next_due([claimant])

    def _ask_schedule(self) -> AskSchedule:
        """When the agents this one waits for are asked whether they live (:class:`~.departures.AskSchedule`)."""
        return AskSchedule(ASK_EVERY_S, max(ASK_EVERY_S, min(self._settings.window / 4, LONGEST_ASK_S)), self._clock)

    def _seal_round(self, want: int, deadline: float, claim: int, joined_after: int = 0) -> Round | None:
        """As the sealer of round ``want`` (joined after the record at ``joined_after``): follow the node keys until
        the round can be sealed, seal it. Members of the round before that have not asked for this one are asked
        whether their agents live (where this agent asks: :mod:`.departures`), and counted out when they do not."""
        view = View()
        revision = self._read_view(view)
        settings = self._settings
        open_since: float | None = None  # when min_nodes wanted the round and the previous one was accounted for
        sealer_key = self._ctl + f"sealer/{want}".encode()
        schedule = self._ask_schedule()

        def is_open() -> bool:
            count, accounted, _ = quorum(view, want, settings)
            return accounted and count >= settings.min_nodes

        def over() -> bool:  # closed, the record changed since we joined (sealed by someone else, a sealer we thought
            # dead; or deleted: a new incarnation), or it holds a value nobody can take (the next join deletes it)
            return self._view_closed(view) or view.record_revision != joined_after or view.void_record

        while True:
            if over():
                return None
            waited = self._waited_for(view, want)
            if waited and view.record is not None and self.liveness is not None:
                for name in self.count_out_silent(view.record, waited, schedule):
                    view.nodes.pop(name, None)  # (its deletion's event follows on the watch)
                waited = [j for j in waited if j.node.name in view.nodes]
            now = self._clock()
            open_since = (now if open_since is None else open_since) if is_open() else None
            ready, why = ready_to_seal(view, want, settings, open_since, now)
            if ready:
                # None: the record changed, or our claim expired (we stalled: the view may be stale): start over
                return self._write_round(want, view, why, sealer_key, claim, revision)
            if now >= deadline:
                self._give_up(want)
            due = min(deadline, now + WATCH_SLICE_SECONDS)
            if open_since is not None:
                due = min(due, open_since + settings.last_call_timeout)
            ask_at = schedule.next_due(j.node.name for j in waited)
            if ask_at is not None:  # (the watch is read even while questions are due: ASK_PASS_S)
                due = max(min(deadline, now + LEAST_WATCH_S), min(due, ask_at))

            def handle(events: list[WatchEvent]) -> bool:
                nonlocal revision
                for event in events:
                    revision = max(revision, event.kv.mod_revision)
                    self._apply(view, event.kv, event.kind)
                if over():
                    return True
                if is_open() != (open_since is not None):
                    return True  # the last call starts, or stops (a node left)
                return ready_to_seal(view, want, settings, open_since, self._clock())[0] or self._clock() >= due

            if self._client.watch_prefix(self._prefix, revision + 1, max(0.0, due - now), handle) == "compacted":
                return None

    @staticmethod
    def _waited_for(view: View, want: int) -> list[Joiner]:
        """The members of the round before ``want`` whose keys live but have not asked for it: whom a seal waits
        for until they ask or their leases expire (or they are counted out: :meth:`count_out_silent`)."""
        record = view.record
        if record is None or record.round != want - 1:
            return []
        members = set(record.names())
        return [j for j in view.nodes.values()
                if j.node.name in members and not j.wants(want, view.record_revision)]

    def _write_round(self, want: int, view: View, why: str, sealer_key: bytes, claim: int,
                     seen_revision: int = 0) -> Round | None:
        """Seal round ``want`` from ``view``; ``seen_revision``: the newest store revision the sealer saw, which the
        first record of an incarnation names as what it follows (it is past any deletion of the record before)."""
        candidates = [j for j in view.nodes.values() if j.wants(want, view.record_revision)]
        previous = view.record if view.record is not None and view.record.round == want - 1 else None
        members = choose_members(candidates, previous, self._settings.max_nodes)
        # Revisions as read (0: absent, for etcd a missing key's), and our claim still the one we made.
        compare = [Compare.mod_revision(self._round_key, view.record_revision),
                   Compare.mod_revision(self._closed_key, view.closed_revision), Compare.created(sealer_key, claim)]

        first = members[0]
        master = {"master": [first.node.addr, first.port]} if first.port else {}

        after = view.record_revision if view.record is not None else max(seen_revision, self._codec.newest)
        incarnation = view.record.incarnation if view.record is not None else 0  # 0: this put creates the key

        def write(lease: int) -> Any:  # on the lasting lease, which every member refreshes while it lives
            value = self._codec.encode(self._round_key, {
                "round": want, "members": [[j.node.name, j.ticket] for j in members], "lease": lease,
                "sealed_by": self._node.name, "reason": why, **master}, after=after, lease=lease,
                incarnation=incarnation)
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

    def _read_view(self, view: View) -> int:
        """The sealer's view: the control keys by name and the node keys, at most a bounded number of them (keys
        planted by the thousand are not read); the store revision to watch on from."""
        result = self._client.txn((), [Get(self._round_key), Get(self._closed_key)])
        for kv in result.results:
            if kv is not None:
                self._apply(view, kv, "put")
        kvs, revision = self._client.get_prefix(self._node_prefix, limit=node_read_limit(self._settings))
        for kv in kvs:
            self._apply(view, kv, "put")
        previous = view.record.names() if view.record is not None else []
        missing = [self._node_prefix + name.encode() for name in previous if name not in view.nodes]
        if missing and len(kvs) >= node_read_limit(self._settings):  # never count a live member out for the limit
            found, _ = self._client.get_many(missing)
            for kv in found.values():
                self._apply(view, kv, "put")
        return result.revision  # the first read's: the watch replays what changed since (applying twice is harmless)

    def _view_closed(self, view: View) -> bool:
        return self._codec.closed(view.closed_kv, view.record, view.record_revision)

    def _apply(self, view: View, kv: KeyValue, kind: str) -> None:
        key = kv.key
        if key.startswith(self._node_prefix):
            name = key[len(self._node_prefix):].decode(errors="replace")
            joiner = self._codec.node(kv) if kind == "put" else None
            if joiner is None:  # deleted, or a value that does not count: as if absent
                view.nodes.pop(name, None)
            elif name in view.nodes or len(view.nodes) < node_read_limit(self._settings):
                view.nodes[name] = joiner
        elif key == self._round_key:
            if kind == "put":
                view.record, view.record_revision = self._codec.round(kv), kv.mod_revision
                view.void_record = view.record is None
            else:
                view.record, view.record_revision, view.void_record = None, 0, False
        elif key == self._closed_key:
            view.closed_kv, view.closed_revision = (kv, kv.mod_revision) if kind == "put" else (None, 0)


def node_read_limit(settings: Settings) -> int:
    """The most node keys a sealer reads: every agent a job can have, several times over."""
    return 4 * settings.max_nodes + 64
