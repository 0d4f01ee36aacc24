"""A kept worker's new place: how an agent and its workers hand a membership change over without a new process.

With in-process recovery (``recovery.in_process``) a node that leaves or joins the job no longer restarts the other
nodes' workers: each agent asks its workers to leave their attempt at the next step boundary (*park*), takes part in
the new rendezvous round, and hands each parked worker its place in the new round (rank, world size, the job's
store) instead of starting a new process. A worker whose peer was lost and for which no replacement was announced
(a node gone: :meth:`~elastic_runner.recovery.regroup.SameMembers.survive`) parks on its own; its agent sees it and
starts the new round.

The channel is a directory private to the agent (mode 0700, :data:`HANDOVER_DIR_VAR`), one set of files per local
rank, written atomically (a rename) and read as JSON (nothing crosses it that could run code):

- ``ready-<local_rank>``: the worker can park now (its content: its pid): it is in its training loop, or waits for a
  failed peer's replacement. A worker that is not (building, resuming, bringing its group up) is not asked: the
  agent starts a new process in its place;
- ``park-<local_rank>``: the agent asks the worker to park (its content: why);
- ``parked-<local_rank>``: the worker is parked, waiting (its content: its pid);
- ``lost-<local_rank>``: written before ``parked`` by a worker that parked because agents of its round stopped
  beating (their nodes are lost): ``{"agents": <the round's number of agents>, "lost": [<group rank>, ...]}``; its
  agent counts those nodes out of the next round instead of waiting the dead-node window
  (:meth:`~elastic_runner.rendezvous.leases.LeaseRendezvousHandler.count_out`);
- ``place-<local_rank>.json``: the agent's answer, the worker's new environment (what torch's agent gives a new
  worker: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...).

Standard library only (and :mod:`elastic_runner.files`): the agent imports it without the trainer.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Callable, Mapping

from ..files import write_file_atomically

#: Set by elastic_runner's agent for its workers: its private directory for the hand-over (unset: workers never park).
HANDOVER_DIR_VAR = "ELASTIC_RUNNER_HANDOVER_DIR"

#: How often a parked worker looks for its place (the new round's store opens within milliseconds of it).
POLL_SECONDS = 0.02


class HandoverError(RuntimeError):
    """A place that cannot be taken (unreadable, or not a mapping of strings)."""


def _write(path: Path, text: str) -> None:
    """``text`` at ``path``, whole or not at all, with the run's file mode (the directory is the agent's alone)."""
    write_file_atomically(path, text.encode())


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


class Handover:
    """One local rank's files in the agent's hand-over directory (both sides use it)."""

    def __init__(self, directory: str | os.PathLike[str], local_rank: int) -> None:
        self.directory, self.local_rank = Path(directory), local_rank
        self.park_file = self.directory / f"park-{local_rank}"
        self.parked_file = self.directory / f"parked-{local_rank}"
        self.place_file = self.directory / f"place-{local_rank}.json"
        self.ready_file = self.directory / f"ready-{local_rank}"
        self.lost_file = self.directory / f"lost-{local_rank}"
        self._files = (self.place_file, self.parked_file, self.park_file, self.ready_file, self.lost_file)

    @classmethod
    def from_environ(cls, local_rank: int, environ: Mapping[str, str] | None = None) -> "Handover | None":
        """This worker's hand-over, where its agent offers one."""
        directory = (os.environ if environ is None else environ).get(HANDOVER_DIR_VAR)
        return cls(directory, local_rank) if directory and os.path.isdir(directory) else None

    # -- the worker's side -----------------------------------------------------------------------------------

    def ready(self) -> None:
        """This worker can park from now on (its training loop runs)."""
        _write(self.ready_file, str(os.getpid()))

    def busy(self) -> None:
        """This worker cannot park until it says :meth:`ready` again (it builds its next attempt)."""
        _remove(self.ready_file)

    def requested(self) -> bool:
        """Whether the agent asks this worker to park (checked at every step boundary: one ``stat``)."""
        return self.park_file.exists()

    def park(self, wait_seconds: float, stopped: Callable[[], bool] = lambda: False,
             lost_agents: tuple[int, tuple[int, ...]] | None = None) -> dict[str, str] | None:
        """Say this worker is parked and wait up to ``wait_seconds`` for its place; the new environment, or None when
        none came in time or ``stopped()`` became true (the caller exits; its agent starts whatever it needs).
        ``lost_agents``: (the round's number of agents, the group ranks of those whose beat stood still)."""
        _remove(self.place_file)  # an answer to an earlier park is not this one's
        if lost_agents is not None:
            _write(self.lost_file, json.dumps({"agents": lost_agents[0], "lost": list(lost_agents[1])}))
        else:
            _remove(self.lost_file)
        _write(self.parked_file, str(os.getpid()))
        deadline = time.monotonic() + wait_seconds
        try:
            while time.monotonic() < deadline and not stopped():
                try:
                    text = self.place_file.read_text()
                except FileNotFoundError:
                    time.sleep(POLL_SECONDS)
                    continue
                return self._place(text)
            return None
        finally:
            for path in self._files:
                _remove(path)

    def _place(self, text: str) -> dict[str, str]:
        try:
            place = json.loads(text)
        except ValueError as exc:
            raise HandoverError(f"{self.place_file}: not JSON ({exc})") from exc
        if not isinstance(place, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in place.items()):
            raise HandoverError(f"{self.place_file}: not a mapping of environment variables to strings")
        return place

    # -- the agent's side ------------------------------------------------------------------------------------

    def ask_to_park(self, why: str) -> None:
        _write(self.park_file, why)

    def parked_pid(self) -> int | None:
        """The pid of the worker parked here, if one is."""
        return _pid_in(self.parked_file)

    def lost_agents(self, agents: int) -> tuple[int, ...]:
        """The group ranks the worker parked here saw silent, where it saw them in a round of ``agents`` agents (this
        agent's round): anything else (no file, another round's, not the expected JSON) counts out nobody."""
        try:
            found = json.loads(self.lost_file.read_text())
        except (OSError, ValueError):
            return ()
        if not isinstance(found, dict) or found.get("agents") != agents or not isinstance(found.get("lost"), list):
            return ()
        return tuple(sorted({g for g in found["lost"] if isinstance(g, int) and not isinstance(g, bool)
                             and 0 <= g < agents}))

    def ready_pid(self) -> int | None:
        """The pid of the worker that can park now, if one can."""
        return _pid_in(self.ready_file)

    def give_place(self, environment: Mapping[str, str]) -> None:
        _remove(self.parked_file)  # taken: the agent's next look must not see it parked still
        _remove(self.lost_file)
        _write(self.place_file, json.dumps(dict(environment)))

    def withdraw(self) -> None:
        """The request is off (the agent restarts the node's workers instead)."""
        _remove(self.park_file)

    def clear(self) -> None:
        """Nothing asked, nobody parked: before a worker starts at this local rank, and after a fall-back."""
        for path in self._files:
            _remove(path)


def _pid_in(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text.isdigit() else None
