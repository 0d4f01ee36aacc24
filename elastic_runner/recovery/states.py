"""The worker's recovery state machine: after each attempt, what the process does next — decided here, once.

A worker process trains in attempts (:class:`~elastic_runner.worker.attempt.Attempt`). When one ends, the process
is *broken* until this machine says where it goes; :func:`~elastic_runner.worker.process.run` carries it out. The
transitions, in the order they are tried (:data:`TRANSITIONS` is this table; a test holds the two together):

=========  ===================================================================  =========
from       when                                                                 to
=========  ===================================================================  =========
training   the attempt finished                                                 exit
training   the attempt raised                                                   broken
broken     this process's device is unusable (a sticky CUDA error)              exit
broken     the agent stops the job, or the error ends the job (config, NaN)     exit
broken     a non-finite step to roll back (every rank read it, group intact)    training
broken     the agent asks this worker to park (the membership changes)          park
broken     a peer failed, and this process is kept (``recovery.in_process``)    rejoin
broken     anything else (its own failure)                                      exit
rejoin     the group is rebuilt with the failed peer's replacement              training
rejoin     it is not, and the agent can hand this worker a place                park
rejoin     it is not, and no agent hands places                                 exit
rejoin     the agent asks it to park inside the group's native start            exit
park       a place in the new round, and the group is up there                  training
park       the agent asks it to park again while that group comes up            park
park       the agent asks it to park inside the group's native start            exit
park       no place (the agent stopped it, gave up, or the round failed)        exit
=========  ===================================================================  =========

Why a sticky device error always exits, even where every other failure keeps the process: CUDA leaves a context
that met one (an illegal memory access, a device-side assert, an uncorrectable ECC error) unusable until the process
ends, and an NCCL communicator caught in it may not abort — NVIDIA's resiliency extension gave up its in-process
restart for this class of fault. Here the process that met it is never kept: it exits (status 1, the event names the
device's error) and its agent starts a new process in its place, with a new context, which heals from its peers'
node memory like any replacement; the peers rebuild their group with it as with a killed worker. What is kept in
process is only ever a process whose device still answers (asked with a synchronisation between attempts).

Why a sharded model (``parallel.strategy`` fsdp or hsdp) is not kept under ``recovery.in_process: auto``, and every
worker restarts instead: a survivor's own shards at the step where its peer failed are no state anyone can resume —
the lost rank's shards exist only as of the last refresh of node memory (``snapshot.memory_every_steps``) — so the
next attempt resumes every rank from the newest refresh all of them hold, whether the process is kept or new. Keeping
it saves the process's start (imports, the model's build and compile), not steps; the process group and device mesh
are made anew either way (``recreate``). ``recovery.in_process: true`` keeps sharded workers all the same.

A worker asked to park while its group's start is in native code (the members connecting, a reconfigure, the first
collective) cannot leave it: a member that arrived and then died holds it there until the start's deadline. Still
inside a second after the request, it ends its process instead (:func:`~elastic_runner.recovery.rebuild.\
leaves_when_asked`, status 76), and its agent, which waits for it to park, starts a new process in its place; out
within that second, it parks.

Exit statuses are :mod:`elastic_runner.worker.ending`'s: 0 for a finish or a stop, 76 where no place or group came
(every worker restarts), the error's own otherwise.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

import torch

from ..training.gradients import NonFiniteRollback
from ..training.loop import MembershipChange

if TYPE_CHECKING:
    from ..dist import Dist


class State(Enum):
    TRAINING = "training"
    BROKEN = "broken"
    REJOIN = "rejoin"
    PARK = "park"
    EXIT = "exit"


@dataclass(frozen=True)
class Transition:
    source: State
    when: str
    target: State


T, B, R, P, X = State.TRAINING, State.BROKEN, State.REJOIN, State.PARK, State.EXIT

#: The machine's transitions, in the order they are tried (the module's docstring shows them).
TRANSITIONS: tuple[Transition, ...] = (
    Transition(T, "the attempt finished", X),
    Transition(T, "the attempt raised", B),
    Transition(B, "this process's device is unusable (a sticky CUDA error)", X),
    Transition(B, "the agent stops the job, or the error ends the job (config, NaN)", X),
    Transition(B, "a non-finite step to roll back (every rank read it, group intact)", T),
    Transition(B, "the agent asks this worker to park (the membership changes)", P),
    Transition(B, "a peer failed, and this process is kept (``recovery.in_process``)", R),
    Transition(B, "anything else (its own failure)", X),
    Transition(R, "the group is rebuilt with the failed peer's replacement", T),
    Transition(R, "it is not, and the agent can hand this worker a place", P),
    Transition(R, "it is not, and no agent hands places", X),
    Transition(R, "the agent asks it to park inside the group's native start", X),
    Transition(P, "a place in the new round, and the group is up there", T),
    Transition(P, "the agent asks it to park again while that group comes up", P),
    Transition(P, "the agent asks it to park inside the group's native start", X),
    Transition(P, "no place (the agent stopped it, gave up, or the round failed)", X),
)


class DeviceUnusable(RuntimeError):
    """This process's device cannot be trusted any more: the process exits and its agent starts a new one."""


@dataclass(frozen=True)
class Broken:
    """Where a broken process goes (:func:`after_failure`), and why (one line, for the logs)."""

    target: State
    why: str
    #: For an exit because of the device: the device's error (the process raises :class:`DeviceUnusable`).
    device_error: str | None = None


def after_failure(exc: BaseException, dist: Dist, *, stop_requested: bool, ends_job: bool) -> Broken:
    """The transition out of ``broken`` for an attempt that raised ``exc``. ``ends_job``: the error is one that ends
    the job or this worker whatever the recovery (:func:`elastic_runner.worker.ending.ending_for` gives it an exit
    status: a bad config, a non-finite gradient, a fenced writer). A non-finite step to roll back, a park request
    and a peer's failure are the ones the process survives."""
    device_error = unusable_device(exc, dist.device) if isinstance(exc, Exception) else None
    if device_error is not None:
        return Broken(State.EXIT, "this process's device is unusable", device_error)
    if isinstance(exc, NonFiniteRollback):
        return Broken(State.TRAINING, str(exc))
    if isinstance(exc, MembershipChange):
        return Broken(State.PARK, str(exc))
    if stop_requested or ends_job:
        return Broken(State.EXIT, "stopped" if stop_requested else "the error ends the job")
    if _peer_failure(exc, dist):
        return Broken(State.REJOIN, first_line(exc))
    return Broken(State.EXIT, "its own failure")


def _peer_failure(exc: BaseException, dist: Dist) -> bool:
    if not isinstance(exc, Exception) or dist.in_process is None:
        return False
    if isinstance(exc, RuntimeError) and "DataLoader worker" in str(exc):
        # torch's words for a dead loader process of this rank, raised by its SIGCHLD handler wherever the main thread
        # is, inside a collective too: this process's own failure, however its traceback reads.
        return False
    if isinstance(exc, torch.distributed.DistError):
        return True
    # gloo and NCCL raise a plain RuntimeError from inside a collective's wait.
    frames = traceback.extract_tb(exc.__traceback__)
    return isinstance(exc, RuntimeError) and (
        any("/torch/distributed/" in frame.filename for frame in frames[-3:])
        or any(word in str(exc) for word in ("Connection closed", "Connection reset", "Broken pipe", "NCCL",
                                             "gloo", "aborted")))


#: What CUDA says when a context is unusable until its process exits (a "sticky" error: the device or its memory
#: failed). NCCL reports one inside its own error ("unhandled cuda error ... Cuda failure 'an illegal memory access
#: was encountered'"), which otherwise reads like a peer's failure.
STICKY_DEVICE_ERRORS = ("illegal memory access", "device-side assert", "unspecified launch failure",
                        "misaligned address", "illegal instruction", "uncorrectable ecc", "hardware stack error",
                        "invalid program counter", "illegal address")


def unusable_device(exc: BaseException | None, device: torch.device) -> str | None:
    """Why this process's device cannot be trusted any more (one line), or None. A sticky CUDA error leaves the context
    unusable until the process exits, so a process that met one is never kept through a recovery, however its error
    reads. ``exc``: what ended the attempt (its causes are read too); on a GPU the device is asked as well (a
    synchronisation raises a sticky error again). Costs a host synchronisation: between attempts only."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        matching = [line.strip() for line in str(exc).splitlines()
                    if any(word in line.lower() for word in STICKY_DEVICE_ERRORS)]
        if matching:  # the line that says what failed (NCCL's first line only says that CUDA did)
            return matching[0][:300]
        exc = exc.__cause__ or exc.__context__
    if device.type == "cuda":
        try:
            torch.cuda.synchronize(device)
        except RuntimeError as err:
            return str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
    return None


def first_line(exc: BaseException) -> str:
    """``Type: the first line of its message`` (200 characters at most), for a log line."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200]}" if text else type(exc).__name__
