"""The lease rendezvous protocol (``protocol=leases``, the default of ``--rdzv_backend=etcd-v3``): its keys, values
and rules; the handler that runs it is :mod:`elastic_runner.rendezvous.leases`.

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
  ``alive`` (optional): ``[port, agent]``, where the agent answers liveness challenges
  (:mod:`elastic_runner.rendezvous.departures`).
- ``ctl/round``: the newest sealed round, ``{"round", "members": [[node, ticket], ...] in rank order,
  "lease", "sealed_by", "reason", "master"}``, written only by a transaction that compares its
  ``mod_revision`` with the one the writer read (create-if-absent for the first) and that the run is
  not closed. ``master`` is rank 0's address and a port it found free when it joined (each node offers
  one in its key): MASTER_ADDR/MASTER_PORT for the workers, so that no agent waits for rank 0 to hand
  them over through the store after the seal (torch's handover; kept where the agent's TCPStore is
  shared with the workers, whose port only rank 0 knows once seated).
- ``ctl/sealer/<R>``: the agent that seals round R (create-if-absent, on its liveness lease: if it
  dies the key goes and the next waiting agent takes over).
- ``ctl/next/<R>``: "a node waits for round R", created by the first joiner that needs the running
  round to end (a member restarting, or a new node while the round has room): what
  ``num_nodes_waiting`` reports to the agents that train.
- ``ctl/closed``: the run is over (``set_closed``/``shutdown``).

A round R forms like this: each joining agent reads ``ctl/round`` (round R-1), puts its node key with
``want = R`` (compared against the round it read), claims ``ctl/sealer/R`` or else waits on one watch
of ``ctl/``. The sealer reads the node keys once, then follows them on one watch. Nothing is sealed
while a member of round R-1 is alive (its key exists) and does not want R: it still runs its workers
in round R-1 (torch's handler, too, starts a round only once every participant has left). Once every
member of R-1 wants R or is dead (its key expired), the sealer seals when

- ``max_nodes`` want R (the rest wait for the next round; previous members first, then join order), or
- at least ``min_nodes`` want R and at least one member of R-1 is among them: a restart, a lost node
  or a join re-forms without the last call, or
- at least ``min_nodes`` want R and ``last_call_timeout`` has passed since that was first true
  (the first round, and new nodes of a job whose previous members are all gone).

A node that finds the running round full (``max_nodes`` members) waits without asking it to end and
without a deadline, like torch's redundancy list: it gets a seat when the round next re-forms.

Ranks are the members sorted by (address, pid, local id), as torch's handler assigns them. Requests
per agent and round: about five (read, join, claim, one watch, one seat) however large the job;
the sealer alone reads the N node keys, once. While training, an agent refreshes its lease once per
``keep_alive_interval`` and keeps one idle watch on ``ctl/``: ``num_nodes_waiting`` costs nothing.

**Why two rounds can never both be current.** ``ctl/round`` changes only through a transaction that
compares its ``mod_revision`` with the value the writer read and writes round number read+1; etcd
transactions are serialisable, so the record's values form one chain with one member list per round
number, and ``next_rendezvous`` returns round R only to a node listed in the newest record, read in
the same transaction as its own key. Round R+1 is sealed only when every member of round R wants R+1
— its agent stopped its round-R workers before it joined — or is dead to etcd: its key expired, so a
node partitioned or paused past the window is counted out, and round R+1 never lists it (the
``ticket``, its key's creation revision, records which incarnation of a key was seated). Such a node
cannot get back into round R+1: when it reaches etcd again its lease is gone, the newest record does
not list it, and its watch of ``ctl/round`` makes ``num_nodes_waiting`` positive, so its agent stops
the stale workers and it joins round R+2. Until then it can train in round R only with other members
of R that are cut off from etcd too — every member that etcd still hears from has left R — and
snapshot fencing keeps that stale group off the disk. If ``ctl/round`` itself disappears (deleted by
hand, etcd data loss), numbering starts over in a new *incarnation* (the record key's creation
revision, part of every round's store prefix) and every member sees the deletion and rejoins.
A node key can also go before its lease expires (:mod:`elastic_runner.rendezvous.departures`): an agent
stopped by a signal revokes its own once its workers stopped, and survivors delete the key of a member
whose agent's beat stood still (its node lost). The sealing rules are the same; for a member counted out
while alive (its beat late) the argument rests on its round-R workers completing no collective (every
other member has left R's groups) and on snapshot fencing, not on etcd having lost it.

With the job's key (``auth_key_file``) every value is signed over its etcd key (see ``seal``) and *bound*
to what it means, so that a signed value captured earlier cannot be put back to mean it again:

- every value carries ``after``, the ``mod_revision`` of the round record its writer acted on (0: there was
  none). A record's mod_revision is unique in etcd's history: it pins the incarnation and the round;
- a value that lives on a lease carries that lease, and counts only on it (``kv.lease == value.lease``): it
  cannot be moved onto another lease, or onto none, and a departed node's lease is gone;
- ``ctl/round`` also carries ``inc``, the record key's creation revision (0: the put created the key). An agent
  takes a record only if it follows the newest one it has seen (``after`` at least that record's revision, or
  that very record), so a replayed older record is void for every agent that saw a newer one, and a replayed
  first record of an incarnation no longer fits the key once it was recreated;
- a node wants round R only with ``after`` the current record; a sealer's claim and a "waiting" signal count
  only for the current record; ``ctl/closed`` counts only if it names the current record and its writer is a
  member of it (or no record exists).

A value that fails a check is *void*: ignored, with one warning per kind and minute, never an error and never
a reason to close the run; a void round record is deleted by the next agent that joins (an etcd writer can
delete it anyway), which starts a new incarnation. Without the job's key values are only JSON — parsed strictly
(no floats, bounded nesting) and bounded in size: nothing is unpickled, and nothing is bound either: anyone
who can write the prefix can write anything.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import socket
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import quote

from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousStateError

from .kv import KeyValue

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

log = logging.getLogger(__name__)

PROTOCOL = "leases"
#: The largest value accepted from etcd (a round record of 1,024 members is ~70 KB).
MAX_VALUE_BYTES = 4 << 20
_DEFLATED = b"z"  #: first byte of a compressed value (JSON starts with "{")
#: The format of values bound to their record and lease (written with the job's key).
BOUND_FORMAT = 2


class RendezvousRefusedError(RendezvousStateError):
    """What this run's keys hold cannot be used (not signed with the job's key, not ours, another protocol);
    the message names the key and what to do, so the agent prints it as one line."""


@dataclass(frozen=True, order=True)
class NodeId:
    """An agent: torch's node description (address, process id, a counter for several per process), and a
    random nonce: a container restarted in place has the same host name and, in its own PID namespace,
    often the same pid; without the nonce the new agent would find the dead one's seat in the running
    round and take it without joining, and the survivors would never be asked to re-form."""

    addr: str
    pid: int
    local_id: int
    nonce: str = ""  #: empty in keys written before it existed

    @property
    def name(self) -> str:
        return f"{quote(self.addr, safe='')}_{self.pid}_{self.local_id}" + (f"_{self.nonce}" if self.nonce else "")

    def __str__(self) -> str:
        return f"{self.addr}_{self.pid}_{self.local_id}"


_local_ids = iter(range(1 << 62))
_local_lock = threading.Lock()


def new_node(local_addr: str | None) -> NodeId:
    with _local_lock:
        local_id = next(_local_ids)
    return NodeId(local_addr or socket.getfqdn(), os.getpid(), local_id, secrets.token_hex(4))


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
        # Never below the window (rounding down would count a live node dead early), and at least a second
        # more than one refresh interval: with keep_alive_max_attempt=1 a lease as long as the interval
        # would expire from request latency alone. etcd's shortest lease is about 2 s.
        return max(2, math.ceil(self.window), math.ceil(self.keep_alive_interval) + 1)


@dataclass(frozen=True)
class Joiner:
    node: NodeId
    want: int
    ticket: int  #: the key's create_revision
    port: int = 0  #: a free port it found when it joined: MASTER_PORT if it becomes rank 0 (0: none offered)
    after: int = -1  #: the record revision it joined after (-1: unbound, without the job's key)
    #: Where its agent answers liveness challenges (:mod:`elastic_runner.rendezvous.departures`): port and agent
    #: name (0, "": it does not; only agents that keep their workers across rounds do)
    alive_port: int = 0
    alive_agent: str = ""

    def wants(self, round_: int, record_revision: int) -> bool:
        """It wants ``round_``, joined after the current record (a replayed older value wants nothing)."""
        return self.want == round_ and (self.after < 0 or self.after == record_revision)


@dataclass(frozen=True)
class Round:
    round: int
    members: tuple[tuple[str, int], ...]  #: (node name, ticket) in rank order
    lease: int = 0
    sealed_by: str = ""
    reason: str = ""  #: why the sealer sealed it: max_nodes, previous round accounted for, last call
    revision: int = 0  #: the etcd revision of the seal (not stored: the key's mod_revision)
    incarnation: int = 0  #: the record key's creation revision: numbering starts over if it is ever deleted
    master: tuple[str, int] | None = None  #: rank 0's address and offered port (MASTER_ADDR/MASTER_PORT)

    def names(self) -> list[str]:
        return [name for name, _ in self.members]


@dataclass
class View:
    """What a sealer knows of the run: every live node key, the newest record, whether it is closed."""

    nodes: dict[str, Joiner] = field(default_factory=dict)
    record: Round | None = None
    record_revision: int = 0
    closed_kv: KeyValue | None = None  #: the closed key as read (valid or not): whether it counts depends on the record
    closed_revision: int = 0  #: of the closed key as read, valid or not (0: absent): sealing compares it
    void_record: bool = False  #: the record key holds a value no agent of this job can take (it is deleted first)
    sealer_present: bool = True


def choose_members(candidates: list[Joiner], previous: Round | None, max_nodes: int) -> list[Joiner]:
    """Who of more than ``max_nodes`` candidates gets a seat: the previous round's members first, then
    in join order; the chosen in rank order (torch's: sorted node descriptions)."""
    kept = set(previous.names()) if previous else set()
    ordered = sorted(candidates, key=lambda j: (j.node.name not in kept, j.ticket))
    return sorted(ordered[:max_nodes], key=lambda j: j.node)


def quorum(view: View, want: int, settings: Settings) -> tuple[int, bool, bool]:
    """For round ``want``: how many live nodes want it, whether the previous round is accounted for (each of
    its members wants ``want`` too or is dead: no live key), and whether at least one of them is back."""
    rev = view.record_revision
    count = sum(1 for j in view.nodes.values() if j.wants(want, rev))
    previous = view.record if view.record is not None and view.record.round == want - 1 else None
    if previous is None:
        return count, True, False
    states = [view.nodes[n].wants(want, rev) for n in previous.names() if n in view.nodes]
    return count, all(states), any(states)


def ready_to_seal(view: View, want: int, settings: Settings, open_since: float | None,
                  now: float) -> tuple[bool, str]:
    """Whether round ``want`` can be sealed now, and why (see the module docstring). ``open_since``: when the
    round was first *open* — at least ``min_nodes`` want it and the previous round is accounted for — the start
    of the last call. As in torch's handler, no round starts while a member of the previous one is alive and
    has not left it: a live member still runs its workers in that round."""
    count, accounted, back = quorum(view, want, settings)
    if not accounted:
        return False, ""
    if count >= settings.max_nodes:
        return True, "max_nodes"
    if count < settings.min_nodes:
        return False, ""
    if back:
        return True, "previous round accounted for"
    if open_since is not None and now - open_since >= settings.last_call_timeout:
        return True, "last call"
    return False, ""


def closed_error(run_id: str, key: str) -> RendezvousClosedError:
    return RendezvousClosedError(
        f"The rendezvous '{run_id}' is closed: its agents have ended it (etcd key '{key}', kept for up to two "
        "hours after the job ends). To start a new job, give it a new --rdzv_id; to run this one again under the "
        f"same id, 'etcdctl del {key}' first.")


def other_protocol_error(key: str) -> RendezvousRefusedError:
    return RendezvousRefusedError(
        f"The etcd key '{key}' holds a rendezvous of the 'state' protocol: agents of an elastic_runner build from "
        "before the lease protocol, or started with --rdzv_conf protocol=state, use this run id, and the two "
        "protocols do not see each other. Start every node of the job with the same protocol (add protocol=state "
        f"to --rdzv_conf until all nodes are upgraded), or, if no such agent runs any more, 'etcdctl del {key}'.")


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
