"""What a worker learns about its place in the job from its environment.

torchrun (torch.distributed.elastic's agent) sets RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR/PORT, TORCHELASTIC_RESTART_COUNT,
TORCHELASTIC_MAX_RESTARTS and TORCHELASTIC_RUN_ID. ``torch.distributed.launch``
passed ``--local_rank`` on the command line instead. Without either, the worker
runs alone: world size 1.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from .printable import printable


class EnvError(ValueError):
    """A malformed launcher environment variable."""


def _int(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise EnvError(f"environment variable {name}={raw!r} is not an integer; unset it or launch through torchrun") from exc


#: Set by elastic_runner's agent (both paths) for its workers: ``HOST-PID-STARTTIME`` of the agent process.
AGENT_ID_VAR = "ELASTIC_RUNNER_AGENT_ID"
#: Set by elastic_runner's agent: a file in its private directory where local rank 0 leaves the job's live
#: goodput clock for the agent's own metric (elastic_runner.observe.goodput).
GOODPUT_FILE_VAR = "ELASTIC_RUNNER_GOODPUT_FILE"
#: Set by elastic_runner's agent for a worker it started in place of a failed one whose peers kept their process
#: (in-process recovery): the failed worker's pid.
REPLACES_VAR = "ELASTIC_RUNNER_REPLACES"


@dataclass(frozen=True)
class WorkerEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    group_rank: int = 0
    #: The round's agents (nodes).
    group_world_size: int = 1
    restart_count: int = 0
    max_restarts: int = 0
    run_id: str = "local"
    master_addr: str | None = None
    master_port: int | None = None
    under_torchrun: bool = False
    hostname: str = ""
    #: The agent that started this worker (``launch`` or an adopted torchrun; None under torch's own agent).
    agent_id: str | None = None
    #: The pid of the failed worker this one replaces while its peers kept their process; None: a new round.
    replaces: int | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None, legacy_local_rank: int | None = None) -> "WorkerEnv":
        env = os.environ if environ is None else environ
        world_size = _int(env, "WORLD_SIZE", 1)
        rank = _int(env, "RANK", 0)
        local_rank = _int(env, "LOCAL_RANK", legacy_local_rank if legacy_local_rank is not None else 0)
        local_world_size = _int(env, "LOCAL_WORLD_SIZE", world_size)
        if world_size < 1:
            raise EnvError(f"WORLD_SIZE={world_size} must be >= 1")
        if not 0 <= rank < world_size:
            raise EnvError(f"RANK={rank} is outside 0..WORLD_SIZE-1 (WORLD_SIZE={world_size})")
        if local_rank < 0:
            raise EnvError(f"LOCAL_RANK={local_rank} must be >= 0")
        port = env.get("MASTER_PORT")
        return cls(
            rank=rank,
            local_rank=local_rank,
            world_size=world_size,
            local_world_size=local_world_size,
            group_rank=_int(env, "GROUP_RANK", 0),
            group_world_size=_int(env, "GROUP_WORLD_SIZE", 1),
            restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", 0),
            max_restarts=_int(env, "TORCHELASTIC_MAX_RESTARTS", 0),
            run_id=env.get("TORCHELASTIC_RUN_ID", "local") or "local",
            master_addr=env.get("MASTER_ADDR") or None,
            master_port=int(port) if port and port.isdigit() else None,
            under_torchrun="TORCHELASTIC_RUN_ID" in env,
            hostname=socket.gethostname(),
            agent_id=env.get(AGENT_ID_VAR) or None,
            replaces=_int(env, REPLACES_VAR, 0) or None,
        )

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    @property
    def is_local_leader(self) -> bool:
        """The first worker on its node: the one that writes node-local state."""
        return self.local_rank == 0


def agent_private_dir() -> str:
    """This process's agent's private directory (elastic_runner's agent, mode 0700: :data:`GOODPUT_FILE_VAR`'s), where
    an agent and its workers leave each other word; "" under an agent that is not ours."""
    return os.path.dirname(os.environ.get(GOODPUT_FILE_VAR, ""))


#: A worker's word to its agent that it finished the job (:func:`say_finished`), in the agent's private directory.
FINISHED_PREFIX = "finished-"


def say_finished(local_rank: int) -> None:
    """Tell this worker's agent (elastic_runner's: its private directory is :data:`GOODPUT_FILE_VAR`'s) that it
    finished the job, its final snapshot durable. Should the process still fail after this (in its teardown), the
    agent takes the exit for the success it was: a new round that nobody joins — every other node waits in torch's
    exit barrier — would hold the job up to its barrier's timeout (300 s)."""
    directory = agent_private_dir()
    if not directory or not os.path.isdir(directory):
        return  # torch's own agent, or none
    from .files import write_file_atomically

    try:
        write_file_atomically(Path(directory) / f"{FINISHED_PREFIX}{local_rank}", str(os.getpid()).encode())
    except OSError:
        pass  # the agent then judges the exit status alone, as torch's does


#: A worker's request to its agent that its node leave the job and stay out (:func:`ask_to_exclude_this_node`).
EXCLUDE_FILE = "exclude-node.json"


def ask_to_exclude_this_node(reason: str, seconds: float) -> bool:
    """Ask this worker's agent (elastic_runner's) to take its node out of the job, and to keep it out for ``seconds``
    (``recovery.evict_stragglers``): the agent records the exclusion in the rendezvous and leaves as a preempted node
    does. False where no agent of ours can hear it (torch's own, or none)."""
    directory = agent_private_dir()
    if not directory or not os.path.isdir(directory):
        return False
    from .files import write_file_atomically

    try:
        write_file_atomically(Path(directory) / EXCLUDE_FILE, json.dumps(
            {"reason": reason, "seconds": float(seconds), "pid": os.getpid()}).encode())
    except OSError:
        return False
    return True


def exclusion_asked(directory: str) -> tuple[str, float] | None:
    """(reason, seconds) of a worker's :func:`ask_to_exclude_this_node` in ``directory`` (the agent's private one);
    None when none asked, or what is there is not such a request. Taken: read once."""
    path = Path(directory) / EXCLUDE_FILE if directory else None
    if path is None or not path.is_file():
        return None
    try:
        asked = json.loads(path.read_text())
    except (OSError, ValueError):
        asked = None
    finally:
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
    if not isinstance(asked, dict) or not isinstance(asked.get("reason"), str) or \
            not isinstance(asked.get("seconds"), (int, float)) or isinstance(asked.get("seconds"), bool):
        return None
    return asked["reason"][:500], float(asked["seconds"])


def finished_pids(directory: str) -> set[int]:
    """The processes that said :func:`say_finished` in ``directory`` (the agent's private one)."""
    found = set()
    for path in Path(directory).glob(f"{FINISHED_PREFIX}*") if directory else ():
        try:
            found.add(int(path.read_text().strip()))
        except (OSError, ValueError):
            continue
    return found


#: The agent's word to its workers that it is stopping them and why (:func:`announce_stopping`), in its private
#: directory: one file, replaced at each announcement.
STOPPING_FILE = "stopping.json"
#: The longest reason told (a worker's last line says it).
STOP_REASON_CHARS = 500
#: How long an announcement accounts for a SIGTERM: torch sends it at once, but a worker the agent kept through a new
#: round (in-process recovery) stays named in the file, and a person's SIGTERM to it later is not the agent's.
STOP_ANNOUNCED_WITHIN_S = 30.0


def announce_stopping(pids: list[int], reason: str) -> None:
    """Tell this agent's workers ``pids``, before it sends them SIGTERM, that it stops them and why (a new round, a
    failed sibling, its own shutdown), so that none reports a person's SIGTERM. Written atomically in the agent's
    private directory (mode 0700, this user's alone); a no-op where there is none (an agent that is not ours)."""
    directory = agent_private_dir()
    if not directory or not os.path.isdir(directory):
        return
    from .files import write_file_atomically

    with contextlib.suppress(OSError):  # the worker then tells a SIGTERM without the reason: one line's wording
        write_file_atomically(Path(directory) / STOPPING_FILE, json.dumps(
            {"pids": [int(pid) for pid in pids], "reason": reason[:STOP_REASON_CHARS], "time": time.time()}).encode())


def stop_announced(pid: int, since: float, now: float | None = None) -> str | None:
    """Why this worker's agent stops process ``pid``, if it said so (:func:`announce_stopping`) at or after ``since``
    (the process's start: a pid can be used again) and in the last :data:`STOP_ANNOUNCED_WITHIN_S`; None when nobody
    announced it (a person, Kubernetes, torch's own agent). It runs in a signal handler: one small local file, nothing
    imported, nothing that may raise."""
    directory = agent_private_dir()
    if not directory:
        return None
    try:
        with open(Path(directory) / STOPPING_FILE, "rb") as fh:
            said = json.loads(fh.read(8192))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(said, dict) or not isinstance(said.get("pids"), list) or pid not in said["pids"]:
        return None
    when, reason = said.get("time"), said.get("reason")
    if isinstance(when, bool) or not isinstance(when, (int, float)) or not since <= when:
        return None
    if (time.time() if now is None else now) - when > STOP_ANNOUNCED_WITHIN_S:
        return None
    return printable(reason if isinstance(reason, str) and reason else "a new rendezvous round", STOP_REASON_CHARS)
