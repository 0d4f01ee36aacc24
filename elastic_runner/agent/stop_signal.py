"""The agent's stop signals, never lost inside a ``try``.

torch's agent learns of SIGTERM, SIGINT, SIGHUP and SIGQUIT from a handler that raises ``SignalException`` in the
main thread, wherever that thread is. Inside a ``try: ... except Exception`` (a look at the round's members, an
observer, the exit barrier's question to the rendezvous) the exception is caught as any other failure and the agent
runs on as if it had never been told: seen in CI, an agent SIGTERMed while it looked at the round's members did not
stop its workers, and when the other node (stopped by the same preemption) was gone, it parked them and waited for a
new round that never came.

:func:`latch` puts a thin handler before torch's that records the signal and then raises as torch's does; the agent
calls :func:`raise_if_received` where it goes on (each monitoring look, each rendezvous attempt, each wait in a loop,
and in every broad ``except`` of its own), so a signal swallowed anywhere stops the agent at its next step at the
latest. The signal stays recorded: an agent that was told to stop never starts anything again.
"""

from __future__ import annotations

import os
import signal
from types import FrameType
from typing import Any

from torch.distributed.elastic.multiprocessing.api import SignalException

#: The signals torch's process context handles (its ``TORCHELASTIC_SIGNALS_TO_HANDLE`` default).
TORCH_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"

_received: list[signal.Signals] = []  #: the first stop signal this process received, once it has


def _handled() -> list[signal.Signals]:
    names = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", TORCH_SIGNALS).split(",")
    return [getattr(signal, n.strip()) for n in names if isinstance(getattr(signal, n.strip(), None), signal.Signals)]


def latch() -> None:
    """Record every stop signal before the handler installed now runs (torch's, installed when its process context
    starts; called after each start, as that start installs torch's again). Signals left at their default or ignored
    are left as they are: the default ends the process, which needs no record."""
    for sig in _handled():
        current = signal.getsignal(sig)
        if not callable(current) or getattr(current, "_elastic_runner_latch", False):
            continue
        signal.signal(sig, _latching(current))


def _latching(previous: Any) -> Any:
    def handler(signum: int, frame: FrameType | None) -> None:
        if not _received:
            _received.append(signal.Signals(signum))
        previous(signum, frame)

    handler._elastic_runner_latch = True  # type: ignore[attr-defined]
    return handler


def received() -> signal.Signals | None:
    """The stop signal this process received (the first), or None."""
    return _received[0] if _received else None


def as_exception() -> SignalException | None:
    """torch's ``SignalException`` for the stop signal received earlier, or None."""
    return SignalException(f"Process {os.getpid()} got signal: {_received[0]}", sigval=_received[0]) if _received \
        else None


def raise_if_received() -> None:
    """Raise torch's ``SignalException`` for a stop signal received earlier, whether or not some ``except`` caught
    the one its handler raised then."""
    stop = as_exception()
    if stop is not None:
        raise stop


def behind(exc: BaseException) -> SignalException | None:
    """torch's stop signal, if ``exc`` wraps it (a rendezvous or store error raised ``from`` it): the launcher must
    see it as such, or it closes the rendezvous for every node (and exits 1, not 128 + the signal)."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, SignalException):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


def forget() -> None:
    """For tests: as if no signal had been received."""
    _received.clear()
