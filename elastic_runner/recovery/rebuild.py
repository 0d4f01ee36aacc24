"""The process group rebuilt for a new membership inside the running process: the core of in-process recovery.

When a peer dies, a node leaves or one joins, the surviving workers keep their process (model, optimizer,
compiled code, data loader workers) and only their communicator is rebuilt for the new members, in one of two
ways, whichever this torch build and backend have:

- ``reconfigure``: torch's experimental reconfigure API (torch >= 2.14: ``init_process_group(...,
  enable_reconfigure=True)``, ``_get_reconfigure_handle``, ``_reconfigure``). Each member posts its current
  handle under the new generation in the job's store and reconfigures with every member's handle in rank order.
  A handle changes with every reconfigure (it carries the member's rank and the communicator's id), and handles
  must be unique, so a new group first reconfigures alone under a random id: two fresh processes never hand in
  the same handle. Measured on gloo here: 1-3 ms for 2-3 members.
- ``recreate``: the group is destroyed and created again in the same process, on a store prefix of its own per
  generation, so a new group never reads a key an earlier one left behind (what NVIDIA's in-process restart
  does; ~0.1 s on gloo here). torch 2.13.0 has nothing else.

Members are named, not numbered: a rank is a member's place in the generation's list, so the list decides who is
rank 0 (whose state a newcomer heals from) and a survivor may get another rank than it had. Whoever calls
:meth:`Regroup.join` for a generation blocks until every member of it has; a member that never comes fails the
call within ``timeout`` (the caller falls back to today's restart).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as tdist

from ..dist import destroy_default_group
from ..lifecycle import EXIT_PEER_LOST, exit_now
from .channel import PREFIX, Arrived, Channel, Handle, arrived_key, handle_key

log = logging.getLogger(__name__)

#: How often a member looks whether the others' messages verify, and (past the first 0.1 s) whether they arrived.
POLL_S = 0.02


class RegroupError(RuntimeError):
    """The group could not be rebuilt for the new membership (a member missing, the backend refused).
    ``lost_agents``: the group ranks of the agents whose beat stood still (their nodes are lost), for this worker's
    agent to count them out of the next round (:mod:`elastic_runner.recovery.handover`)."""

    def __init__(self, message: str, lost_agents: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.lost_agents = lost_agents


class AskedToPark(RegroupError):
    """This member's agent asked it to park for a new round while it waited for the others: the group it waited for
    will not form (its agent and theirs are in the new round), and the member parks instead of failing."""

    def __init__(self, waiting_for: str = "the others") -> None:
        super().__init__(f"the membership changes (this worker's agent asked it to park while it waited for "
                         f"{waiting_for})")
        self.waiting_for = waiting_for


class ReconfigureRefused(RegroupError):
    """This build's backend does not create a reconfigurable group (whatever the members do)."""


#: How often a member inside its group's native start looks whether its agent asks it to leave (one ``stat``).
NATIVE_POLL_S = 0.02
#: How long a member asked to leave may still take to come out of its group's native start before its process
#: ends: a start that works takes milliseconds (then the member parks once it is out:
#: :mod:`elastic_runner.worker.process`), and a kept process is worth more than a second (its imports, its model,
#: its compiled code).
NATIVE_GRACE_S = 1.0


@contextlib.contextmanager
def leaves_when_asked(leaving: Callable[[], bool] | None, what: str,
                      grace_s: float = NATIVE_GRACE_S) -> Iterator[None]:
    """Around a group's start in native code (gloo or NCCL connecting the members, a reconfigure, the first
    collective) for a member that may be asked to leave (``leaving``; None: nothing is done). Native code cannot be
    asked anything, and a member that arrived and then died holds the others there until the start's deadline: seen
    in the thousand-fault soak, a kept worker placed in a round whose other node's agent was killed just after the
    round was sealed sat 15 s in its group's start while its agent waited for it to park, then was restarted (a
    20.1 s recovery). Once ``leaving()`` has said so for ``grace_s`` and the start still runs, this process ends
    (status 76, :data:`~elastic_runner.lifecycle.EXIT_PEER_LOST`) and its agent, waiting for it to park, starts a new
    process in its place at once, as for a worker that could not be asked (:mod:`elastic_runner.agent.kept_round`).
    ``what``: the start, for the line it leaves."""
    if leaving is None:
        yield
        return
    done = threading.Event()

    def watch() -> None:
        asked_at = None
        while not done.wait(NATIVE_POLL_S):
            if asked_at is None:
                asked_at = time.monotonic() if leaving() else None
            elif time.monotonic() - asked_at >= grace_s and not done.is_set():
                exit_now(EXIT_PEER_LOST, f"its agent asked this worker (pid {os.getpid()}) to park while {what}, in "
                         f"native code that cannot be asked to leave, and {grace_s:g}s later it was still there: this "
                         "process ends and its agent starts a new one in its place")

    watcher = threading.Thread(target=watch, name="elastic-runner-leaves-when-asked", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


def first_collective(device: torch.device) -> None:
    """The first collective of a new group, waited for on the host: every member is there and reachable, not just
    registered. (An NCCL collective returns before it ran: a dead member would hold the next step instead.)"""
    tdist.all_reduce(torch.zeros(1, device=device))
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def chosen_regroup(wanted: str, backend: str) -> str:
    """The method for ``recovery.regroup`` (``auto``, ``reconfigure`` or ``recreate``) on a ``backend`` group; raises
    :class:`RegroupError` for ``reconfigure`` where this build or backend does not have it."""
    possible, why = regroup_method(backend)
    if wanted == "auto":
        return possible
    if wanted == "reconfigure" and possible != "reconfigure":
        raise RegroupError(f"recovery.regroup: reconfigure is not possible here: {why}. Use auto (reconfigure "
                           "where it is possible, else recreate) or recreate")
    return wanted


def regroup_method(backend: str) -> tuple[str, str]:
    """How this torch build rebuilds a ``backend`` group in the process: ``("reconfigure" | "recreate", why)``."""
    from ..torch_patches import PROCESS_GROUP_RECONFIGURE

    missing = PROCESS_GROUP_RECONFIGURE.problems()
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        return "recreate", f"torch {_torch_version()} has no process-group reconfigure API ({missing[0]}{more})"
    if backend != "gloo":
        # Only gloo has been run through reconfigure here; NCCL's support depends on the NCCL build.
        return "recreate", f"reconfigure is only used on gloo so far (this group is {backend})"
    return "reconfigure", f"torch {_torch_version()} reconfigures gloo groups in place"


@dataclass(frozen=True)
class Membership:
    """One generation's members, in rank order."""

    generation: int
    members: tuple[str, ...]

    def rank_of(self, member: str) -> int:
        try:
            return self.members.index(member)
        except ValueError as exc:
            raise RegroupError(f"{member} is not a member of generation {self.generation} "
                               f"({', '.join(self.members)})") from exc


class Regroup:
    """The default process group of one worker process, rebuilt for each new membership.

    ``store``: the job's store, reachable by every member of every generation (the agents' rendezvous store, or
    a survivor's). ``member``: this process's name, the same for its whole life. ``key``: the job's key, which signs
    what the members tell each other there (:mod:`.channel`; None: unsigned); ``context``: the store's address
(``MASTER_ADDR:MASTER_PORT``), which the signatures bind.
    """

    def __init__(self, store: Any, member: str, backend: str, timeout: datetime.timedelta,
                 method: str | None = None, device: torch.device | None = None,
                 wait: datetime.timedelta | None = None, key: bytes | None = None, context: str = "") -> None:
        self.store, self.member, self.backend, self.timeout = store, member, backend, timeout
        self.channel = Channel(store, key, context)
        #: How long a member waits for the others to arrive (``timeout``, the group's own, by default); the
        #: rebuilt group's collectives keep ``timeout``.
        self.wait = wait if wait is not None else timeout
        self.device = device if device is not None else torch.device("cpu")
        self.method = method if method is not None else regroup_method(backend)[0]
        if self.method not in ("reconfigure", "recreate"):
            raise ValueError(f"regroup method {self.method!r}: use 'reconfigure' or 'recreate'")
        self.membership: Membership | None = None

    def join(self, membership: Membership, wait: datetime.timedelta | None = None,
             leaving: Callable[[], bool] | None = None) -> float:
        """Make the default group this membership's (rank = this member's place in it); seconds it took. Every
        member of ``membership`` calls this; it returns once the group works (a first collective went through).
        ``wait``: how long to wait for the other members this time (default :attr:`wait`); ``leaving``: raises
        :class:`RegroupError` as soon as it says so while this member waits for the others (its agent asks it to
        park for a new round)."""
        rank = membership.rank_of(self.member)
        started = time.perf_counter()
        try:
            if self.method == "reconfigure":
                self._reconfigure(membership, rank, wait or self.wait, leaving)
            else:
                self._recreate(membership, rank, wait or self.wait, leaving)
            # Every member is there and reachable, not just registered.
            with leaves_when_asked(leaving, f"generation {membership.generation}'s first collective"):
                first_collective(self.device)
        except RegroupError:
            raise
        except Exception as exc:  # noqa: BLE001 - store timeouts and backend errors alike: the caller falls back
            raise RegroupError(f"could not rebuild the process group for generation {membership.generation} "
                               f"({len(membership.members)} members, {self.method}): {type(exc).__name__}: "
                               f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}") from exc
        self.membership = membership
        seconds = time.perf_counter() - started
        log.debug("process group of generation %d: rank %d of %d in %.3fs (%s)", membership.generation, rank,
                  len(membership.members), seconds, self.method)
        return seconds

    def abandon(self) -> None:
        """This member saw the group fail (a peer died mid-collective): close its connections now. A member blocked
        in the same collective on a peer that is alive but gave up (gloo's ring: rank 0 waits on rank 1, which saw
        rank 2 die) would otherwise wait the group's whole timeout; once this member's connections close, it fails at
        once and the failure spreads through the ring as a process's death does."""
        gc.collect()  # a wrapper's reference cycle may hold the group's work and keep its connections open
        if not tdist.is_initialized():
            return
        if self.method == "reconfigure":
            # A reconfigurable group's abort leaves its connections open (measured: the blocked member waits its
            # whole timeout). Reconfiguring alone swaps the communicator out and closes them (~2 ms).
            try:
                self._alone()
                return
            except Exception:  # noqa: BLE001 - abort below, as for any group
                log.debug("reconfiguring the failed group alone failed", exc_info=True)
        try:
            tdist.distributed_c10d._get_default_group().abort()
        except Exception:  # noqa: BLE001 - the group is being given up anyway
            log.debug("abort of the failed group failed", exc_info=True)

    def arrive(self, membership: Membership) -> None:
        """Say this member arrived for ``membership``'s group (see :meth:`wait_for_arrivals`)."""
        self.channel.send(Arrived(membership.generation, self.member))

    def wait_for_arrivals(self, membership: Membership, wait: datetime.timedelta | None = None,
                          leaving: Callable[[], bool] | None = None) -> None:
        """Wait ``wait`` (default :attr:`wait`) for every member of ``membership`` to have arrived, before its group
        is created: torch's own group start would wait its whole timeout, in native code, where nobody can ask this
        member to leave. ``leaving``: :class:`AskedToPark` ends the wait as soon as it says so."""
        self._wait_for(Arrived, [arrived_key(membership.generation, m) for m in membership.members],
                       wait or self.wait, leaving)

    def leave(self) -> None:
        """Destroy the group (the process ends, or falls back to a restart)."""
        destroy_default_group()
        self.membership = None

    # -- the two ways ------------------------------------------------------------------------------------------

    def _reconfigure(self, membership: Membership, rank: int, wait: datetime.timedelta,
                     leaving: Callable[[], bool] | None = None) -> None:
        if not tdist.is_initialized():
            try:
                tdist.init_process_group(self.backend, store=tdist.PrefixStore(f"{PREFIX}/pg", self.store), rank=0,
                                         world_size=1, timeout=self.timeout, enable_reconfigure=True)
            except Exception as exc:  # noqa: BLE001 - a group of one waits for nobody: the backend refused
                raise ReconfigureRefused(f"the {self.backend} group of torch {_torch_version()} could not be created "
                                         f"reconfigurable ({type(exc).__name__}: {exc})") from exc
            if not tdist._supports_reconfigure():
                tdist.destroy_process_group()
                raise ReconfigureRefused(f"the {self.backend} group of torch {_torch_version()} does not support "
                                         "reconfigure")
            self._alone()  # a fresh group's handle is the same in every process until then
        generation = membership.generation
        keys = [handle_key(generation, m) for m in membership.members]
        self.channel.send(Handle(generation, self.member, tdist._get_reconfigure_handle()))
        self._wait_for(Handle, keys, wait, leaving)
        read = self.channel.read_many(Handle, keys)
        handles = [message.handle for message in read.values() if message is not None]
        if len(handles) != len(keys):
            raise RegroupError(f"generation {generation}'s handles in the job's store are not all signed with the "
                               "job's key (someone else wrote them): this group is not joined")
        # The id is the generation's: every member passes the same one, and no two generations share it.
        with leaves_when_asked(leaving, f"generation {membership.generation}'s group reconfigures"):
            tdist._reconfigure(uuid=membership.generation, handles=handles, timeout=self.timeout).wait()

    def _alone(self) -> None:
        """Reconfigure the group to this member alone, under a random id (no two processes share one)."""
        # From the OS, not ``random``: forked workers share its state, and training seeds it the same on every rank
        # (kept workers' first groups of a new round all failed with "handles must be unique").
        tdist._reconfigure(uuid=int.from_bytes(os.urandom(8), "little") >> 2, handles=[tdist._get_reconfigure_handle()],
                           timeout=self.timeout).wait()

    def _recreate(self, membership: Membership, rank: int, wait: datetime.timedelta,
                  leaving: Callable[[], bool] | None = None) -> None:
        self.leave()
        self.arrive(membership)  # every member there first, within the wait
        self.wait_for_arrivals(membership, wait, leaving)
        store = tdist.PrefixStore(f"{PREFIX}/{membership.generation}", self.store)
        with leaves_when_asked(leaving, f"generation {membership.generation}'s group starts"):
            tdist.init_process_group(self.backend, store=store, rank=rank, world_size=len(membership.members),
                                     timeout=self.timeout)


    def _wait_for(self, cls: type[Handle] | type[Arrived], keys: list[str], wait: datetime.timedelta,
                  leaving: Callable[[], bool] | None = None) -> None:
        """Until every key holds a valid message (a value someone else put there first is waited past: its member
        overwrites it), or ``wait`` (the store's own timeout error, as torch's ``wait`` raises); or until
        ``leaving()`` says so (a :class:`RegroupError`)."""
        if leaving is None:
            self.store.wait(keys, wait)
        else:
            _until_there(self.store, keys, wait, leaving)
        deadline = time.monotonic() + wait.total_seconds()
        while not self.channel.has(cls, keys):
            if time.monotonic() >= deadline:
                raise RegroupError(f"the members' {cls.kind} messages in the job's store did not all verify within "
                                   f"{wait.total_seconds():g}s (values not signed with the job's key are ignored)")
            time.sleep(POLL_S)


#: How often a member that may be asked to leave looks whether the others arrived: often at first, where a ready
#: replacement arrives within milliseconds (a blocking ``wait`` would wake at once, but cannot be asked anything),
#: then at :data:`POLL_S`, as for a replacement that still builds.
ARRIVAL_POLLS = ((0.1, 0.001), (float("inf"), POLL_S))


def _until_there(store: Any, keys: list[str], wait: datetime.timedelta, leaving: Callable[[], bool]) -> None:
    """``store.wait(keys, wait)`` that also ends, raising :class:`RegroupError`, once ``leaving()`` is true."""
    started = time.monotonic()
    deadline = started + wait.total_seconds()
    while not store.check(keys):
        if leaving():
            raise AskedToPark()
        now = time.monotonic()
        if now >= deadline:
            raise RegroupError(f"the other members did not arrive within {wait.total_seconds():g}s")
        time.sleep(next(poll for until, poll in ARRIVAL_POLLS if now - started < until))


def _torch_version() -> str:
    return torch.__version__.split("+")[0]
