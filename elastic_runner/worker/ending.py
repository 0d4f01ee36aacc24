"""How an attempt ends: the one place that decides its ``end`` event, what is kept, and the exit status.

Every way out of an attempt passes through :func:`ending_for`, the attempt records it
(:meth:`~elastic_runner.worker.attempt.Attempt.run`), and the process returns its exit status
(:func:`elastic_runner.worker.process.run`):

============================  ==================  =====================  =============================
what happened                 ``end`` status      exit status            state left for the next attempt
============================  ==================  =====================  =============================
training finished             finished            0                      final snapshot (node memory dropped)
a stop signal, honoured       stopped             0                      stop snapshot + node memory
the agent's park request      parked              (the process stays)    node memory
(a new membership)
a stop signal, but peers      stopped             0                      stop snapshot + node memory
stopped first and broke a
collective
config / resume / set-up      failed              2 (not restarted)      nothing changed
NaN or inf gradient           failed              3 (not restarted)      snapshots as they were (no stop
                                                                         snapshot, nothing kept: diverged)
a sticky device error         failed              1 (the process is  the last completed step, in
(illegal memory access...)                        never kept: a new one) node memory
replicas that differ          failed              1 (restarted)          snapshots after the last agreeing
(a fingerprint check)                                                    check moved aside, node memory too
NaN or inf gradient with      rolled_back         (the process stays:    the snapshots (none is of a state
``on_nonfinite: rollback``                        its next attempt       after the step); node memory after
                                                  skips the step)        it removed
too many rollbacks            failed              3 (not restarted)      the same
final snapshot not written    finished_not_durable  4 (not restarted)    node memory (``snapshot persist``)
a newer generation owns the   failed              1                      nothing (fenced)
run; a stop snapshot failed;
run.dir not ready (I/O)
anything else (a peer died)   failed              1, with traceback      the last completed step, in
                                                                         node memory
============================  ==================  =====================  =============================

A peer lost while this rank waits in a collective is detected on the watchdog's thread, which
cannot raise into the main thread: :func:`peer_lost_exit` gives its exit status.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..config import ConfigError
from ..snapshot import StaleWriterError
from ..training.checkpointer import FinalSnapshotFailed, ResumeError, StopSnapshotFailed
from ..training.fingerprint import ReplicasDiverged, TooManyRollbacks
from ..training.gradients import NonFiniteGradient, NonFiniteRollback
from ..training.loop import GracefulStop, MembershipChange
from ..dist import DistError
from ..recovery.states import DeviceUnusable
from ..lifecycle import EXIT_DIVERGED, EXIT_FAILED, EXIT_NOT_DURABLE, EXIT_OK, EXIT_PEER_LOST, EXIT_USAGE


class SetupError(RuntimeError):
    """Rank 0 could not prepare the run; every rank stops with its message."""


class RetryableSetupError(RuntimeError):
    """Rank 0 could not prepare the run for a reason that may pass (I/O): the attempt is retried."""


@dataclass(frozen=True)
class Ending:
    status: str  #: the ``end`` event's status: finished, stopped, parked, finished_not_durable or failed
    exit_code: int | None  #: None: re-raise, so that torchrun's ``@record`` reports the traceback (exit 1)
    say: bool = False  #: print the exception's message as one line (it says what to fix)
    #: Who prints it: every rank; the first of each node (every rank of a node met the same config, run directory
    #: or snapshot, and the node's terminal needs one line); or rank 0 (every rank of the job saw the same thing).
    said_by: Literal["rank", "node", "job"] = "rank"
    #: If the loop had started: the last completed step is kept for the next attempt (in node memory,
    #: or as a stop snapshot when a stop was requested), and the peers' watchdogs are told at once.
    keeps_state: bool = False
    #: A stop was requested and peers that stopped first broke a collective: the stop we were asked for.
    peers_stopped_first: bool = False

    @property
    def stopped(self) -> bool:
        return self.status == "stopped"


FINISHED = Ending("finished", EXIT_OK)

# keeps_state where the loop may have run: the last completed step is left for the next attempt. The others write
# their snapshot on the way out, have kept the state already, or must not keep it (a diverged or unvouched state).
_KNOWN: tuple[tuple[tuple[type[BaseException], ...], Ending], ...] = (
    ((GracefulStop,), Ending("stopped", EXIT_OK)),
    # Kept at the boundary already; the process waits for its place in the new round (76 if it cannot).
    ((MembershipChange,), Ending("parked", EXIT_PEER_LOST)),
    ((ConfigError, ResumeError, SetupError), Ending("failed", EXIT_USAGE, say=True, said_by="node", keeps_state=True)),
    ((DistError,), Ending("failed", EXIT_USAGE, say=True, keeps_state=True)),
    ((NonFiniteGradient,), Ending("failed", EXIT_DIVERGED, say=True, said_by="job")),
    # Nothing kept: the state now is the one no check vouches for (the snapshots after the last check that
    # agreed are moved aside already); the next attempt resumes from the newest vouched-for one.
    ((ReplicasDiverged,), Ending("failed", EXIT_FAILED, say=True, said_by="job")),
    ((TooManyRollbacks,), Ending("failed", EXIT_DIVERGED, say=True, said_by="job")),
    # The process runs the next attempt itself, with the step skipped (the exit status only where it cannot).
    ((NonFiniteRollback,), Ending("rolled_back", EXIT_FAILED, say=True, said_by="job")),
    ((FinalSnapshotFailed,), Ending("finished_not_durable", EXIT_NOT_DURABLE, say=True)),
    ((RetryableSetupError,), Ending("failed", EXIT_FAILED, say=True, said_by="node", keeps_state=True)),
    ((StaleWriterError, StopSnapshotFailed), Ending("failed", EXIT_FAILED, say=True, keeps_state=True)),
    # Raised between attempts (the state was kept, or not, as the attempt ended): the agent starts a new process.
    ((DeviceUnusable,), Ending("failed", EXIT_FAILED, say=True)),
)


def ending_for(exc: BaseException | None, stop_requested: bool) -> Ending:
    """How an attempt that raised ``exc`` (None: returned normally) ends."""
    if exc is None:
        return FINISHED
    for kinds, ending in _KNOWN:
        if isinstance(exc, kinds):
            return ending
    if stop_requested and isinstance(exc, Exception):
        # Peers stopping at the same time broke our collective after we kept our state: that is the
        # stop we were asked for, not a failure.
        return Ending("stopped", EXIT_OK, keeps_state=True, peers_stopped_first=True)
    return Ending("failed", None, keeps_state=True)


def peer_lost_exit(stop_requested: bool) -> int:
    """The watchdog found a peer gone while this rank waits in a collective: leave at once."""
    return EXIT_OK if stop_requested else EXIT_PEER_LOST
