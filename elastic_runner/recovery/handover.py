"""A kept worker's new place: how an agent and its workers hand a membership change over without a new process.

With in-process recovery (``recovery.in_process``) a node that leaves or joins the job no longer restarts the other
nodes' workers: each agent asks its workers to leave their attempt at the next step boundary (*park*), takes part in
the new rendezvous round, and hands each parked worker its place in the new round (rank, world size, the job's
store) instead of starting a new process. A worker whose peer was lost and for which no replacement was announced
(a node gone: :meth:`~elastic_runner.recovery.regroup.SameMembers.survive`) parks on its own; its agent sees it and
starts the new round.

What passes between them are typed messages of the recovery protocol (:mod:`.channel`), through a :class:`~.channel.Channel`
over the agent's private directory (:class:`~.channel.PrivateDirectory`, mode 0700, :data:`HANDOVER_DIR_VAR`): one
file per message and local rank, written whole or not at all (a rename), read as JSON of its type or not at all
(nothing crosses it that could run code):

- :class:`~.channel.ReadyToPark` (``ready-<local_rank>``): the worker can park now: it is in its training loop,
  waits for a failed peer's replacement (its announcement, then its arrival), or, placed in a new round, waits for
  that round's other ranks while its group comes up (a node joins or is lost again before a new peer started: it
  parks for the round after). A worker that is not (building, resuming, starting) is not asked: the agent starts a
  new process in its place;
- :class:`~.channel.ParkRequest` (``park-<local_rank>``): the agent asks the worker to park, and why;
- :class:`~.channel.Parked` (``parked-<local_rank>``): the worker is parked, waiting; where it parked because agents
  of its round stopped beating (their nodes are lost), which of them, in a round of how many agents: its agent counts
  those nodes out of the next round instead of waiting the dead-node window
  (:meth:`~elastic_runner.rendezvous.leases.LeaseRendezvousHandler.count_out`);
- :class:`~.channel.Place` (``place-<local_rank>.json``): the agent's answer, the worker's new environment.

Standard library only (and the protocol's floor): the agent imports it without the trainer.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Mapping

from .channel import Channel, LocalMessage, Parked, ParkRequest, Place, PrivateDirectory, ReadyToPark

#: Set by elastic_runner's agent for its workers: its private directory for the hand-over (unset: workers never park).
HANDOVER_DIR_VAR = "ELASTIC_RUNNER_HANDOVER_DIR"

#: How often a parked worker looks for its place (the new round's store opens within milliseconds of it).
POLL_SECONDS = 0.02


class HandoverError(RuntimeError):
    """A place that cannot be taken (there, but not a place: not a mapping of strings)."""


class Handover:
    """One local rank's messages in the agent's hand-over directory (both sides use it)."""

    def __init__(self, directory: str | os.PathLike[str], local_rank: int) -> None:
        self.directory, self.local_rank = Path(directory), local_rank
        self._store = PrivateDirectory(self.directory)
        self._channel = Channel(self._store, None)
        self.park_file, self.parked_file, self.place_file = (
            self._store.path(cls.at(local_rank)) for cls in (ParkRequest, Parked, Place))

    @classmethod
    def from_environ(cls, local_rank: int, environ: Mapping[str, str] | None = None) -> "Handover | None":
        """This worker's hand-over, where its agent offers one."""
        directory = (os.environ if environ is None else environ).get(HANDOVER_DIR_VAR)
        return cls(directory, local_rank) if directory and os.path.isdir(directory) else None

    def _read(self, cls: type[LocalMessage]) -> LocalMessage | None:
        return self._channel.read(cls, cls.at(self.local_rank))

    def _take_back(self, *kinds: type[LocalMessage]) -> None:
        for cls in kinds:
            self._store.delete_key(cls.at(self.local_rank))

    # -- the worker's side -----------------------------------------------------------------------------------

    def ready(self) -> None:
        """This worker can park from now on (its training loop runs)."""
        self._channel.send(ReadyToPark(self.local_rank, os.getpid()))

    def busy(self) -> None:
        """This worker cannot park until it says :meth:`ready` again (it builds its next attempt)."""
        self._take_back(ReadyToPark)

    def requested(self) -> bool:
        """Whether the agent asks this worker to park (checked at every step boundary: one ``stat``; what the agent
        asks for is read only once it parks)."""
        return self._store.check([ParkRequest.at(self.local_rank)])

    def park(self, wait_seconds: float, stopped: Callable[[], bool] = lambda: False,
             lost_agents: tuple[int, tuple[int, ...]] | None = None) -> dict[str, str] | None:
        """Say this worker is parked and wait up to ``wait_seconds`` for its place; the new environment, or None when
        none came in time or ``stopped()`` became true (the caller exits; its agent starts whatever it needs).
        ``lost_agents``: (the round's number of agents, the group ranks of those whose beat stood still)."""
        # An answer to an earlier park is not this one's; the request is answered, and a parked worker is not "ready"
        # (its agent must not read a ready worker left over from the attempt, and ask again, once it gave the place).
        self._take_back(Place, ParkRequest, ReadyToPark)
        agents, lost = lost_agents if lost_agents is not None else (0, ())
        self._channel.send(Parked(self.local_rank, os.getpid(), agents, tuple(lost)))
        deadline = time.monotonic() + wait_seconds
        try:
            while time.monotonic() < deadline and not stopped():
                if not self._store.check([Place.at(self.local_rank)]):
                    time.sleep(POLL_SECONDS)
                    continue
                place = self._read(Place)
                if not isinstance(place, Place):  # (there, and refused: logged, naming it)
                    raise HandoverError(f"{self.place_file}: not a place in a new round (a mapping of environment "
                                        "variables to strings)")
                return dict(place.environment)
            return None
        finally:
            self._take_back(Place, Parked, ParkRequest, ReadyToPark)

    # -- the agent's side ------------------------------------------------------------------------------------

    def ask_to_park(self, why: str) -> None:
        self._channel.send(ParkRequest(self.local_rank, why))

    def parked_pid(self) -> int | None:
        """The pid of the worker parked here, if one is."""
        parked = self._read(Parked)
        return parked.pid if isinstance(parked, Parked) else None

    def lost_agents(self, agents: int) -> tuple[int, ...]:
        """The group ranks the worker parked here saw silent, where it saw them in a round of ``agents`` agents (this
        agent's round): anything else (nobody parked, another round's, ranks outside the round) counts out nobody."""
        parked = self._read(Parked)
        if not isinstance(parked, Parked) or parked.agents != agents:
            return ()
        return tuple(sorted({g for g in parked.lost if 0 <= g < agents}))

    def ready_pid(self) -> int | None:
        """The pid of the worker that can park now, if one can."""
        ready = self._read(ReadyToPark)
        return ready.pid if isinstance(ready, ReadyToPark) else None

    def give_place(self, environment: Mapping[str, str]) -> None:
        self._take_back(Parked)  # taken: the agent's next look must not see it parked still
        self._channel.send(Place(self.local_rank, dict(environment)))

    def withdraw(self) -> None:
        """The request is off (the agent restarts the node's workers instead)."""
        self._take_back(ParkRequest)

    def clear(self) -> None:
        """Nothing asked, nobody parked: before a worker starts at this local rank, and after a fall-back."""
        self._take_back(Place, Parked, ParkRequest, ReadyToPark)
