"""A store whose calls end within a deadline, whatever its server does.

torch's TCPStore client applies its timeout to a server that is gone (its connection refused or reset), not to one
that is there and does not answer: a machine that vanished without resetting its connections (powered off, cut off,
frozen) or a server process that is stopped. Against such a server every call blocks, a ``get`` of a key that exists
and a new client's connection included (torch 2.13 and 2.14, measured with a SIGSTOPped server: more than 8 s with
``timeout=1s``, and no end in sight). Code that must go on deciding while the job's store may be that server (the
peer watchdog; a survivor waiting to rebuild its group) calls through :class:`BoundedStore`: each call runs on a
helper thread, and the caller waits for it at most ``deadline`` seconds. Past that the store is unresponsive until
that call returns, if ever: the helper thread stays blocked inside torch's client (a daemon, gone with the process)
and every call meanwhile raises :class:`StoreUnresponsive` at once; once it returns (a server that only stalled), calls
go through again.

Standard library only; the wrapped store is any object with the methods called (a ``TCPStore``, a fake).
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from typing import Any, Callable


class StoreUnresponsive(TimeoutError):
    """The store did not answer a call within the deadline (or an earlier call never returned)."""

    def __init__(self, message: str, since: float) -> None:
        super().__init__(message)
        self.since = since  #: when (monotonic) the call that did not return began


class BoundedStore:
    """``store``'s methods, each returning or raising within ``deadline`` seconds (:class:`StoreUnresponsive`)."""

    def __init__(self, store: Any, deadline: float, clock: Callable[[], float] = time.monotonic) -> None:
        if deadline <= 0:
            raise ValueError(f"deadline must be positive, not {deadline!r}")
        self.store, self.deadline, self._clock = store, deadline, clock
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        #: The call that did not return within its deadline: its name, when it began, and its "returned" event.
        self._stuck: tuple[str, float, threading.Event] | None = None
        # The helper holds the queue only, not this object nor the store (rank 0's store must close when its last
        # owner lets it go); it ends once this object is collected (a blocked one, with the process).
        weakref.finalize(self, self._calls.put, None)

    @property
    def unresponsive(self) -> bool:
        """A call has not returned within its deadline, and has not returned since."""
        stuck = self._stuck
        return stuck is not None and not stuck[2].is_set()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)
        if not callable(method):
            return method
        return lambda *args, **kwargs: self._call(name, lambda: method(*args, **kwargs))

    def _call(self, name: str, call: Callable[[], Any]) -> Any:
        began = self._clock()
        # One call at a time, as on the client itself; a caller behind another waits for the same deadline in all.
        if not self._lock.acquire(timeout=self.deadline):
            raise StoreUnresponsive(f"the store did not answer {name}() within {self.deadline:g}s (another call was "
                                    "still waiting for it)", began)
        try:
            if self._stuck is not None:
                what, since, returned = self._stuck
                if not returned.is_set():
                    raise StoreUnresponsive(f"the store has not answered {what}, called {self._clock() - since:.1f}s "
                                            "ago", since)
                self._stuck = None  # it answered at last: the helper thread is free again
            if self._thread is None:
                self._thread = threading.Thread(target=_serve, args=(self._calls,), name="elastic-runner-bounded-store",
                                                daemon=True)
                self._thread.start()
            job = _Call(call)
            self._calls.put(job)
            try:
                answered = job.done.wait(max(0.0, self.deadline - (self._clock() - began)))
            except BaseException:  # (a stop signal's exception, raised while waiting: the call is still out there)
                self._stuck = (f"{name}()", began, job.done)
                raise
            if not answered:
                self._stuck = (f"{name}()", began, job.done)
                raise StoreUnresponsive(f"the store did not answer {name}() within {self.deadline:g}s", began)
        finally:
            self._lock.release()
        if job.error is not None:
            raise job.error
        return job.value


def connect_within(connect: Callable[[], Any], deadline: float, what: str) -> Any:
    """``connect()`` (a store client's construction), returned or raised within ``deadline`` seconds: a new client of
    a server that does not answer blocks as its calls do. Past the deadline :class:`StoreUnresponsive`; the thread
    left waiting is a daemon, and what it makes, if ever, is dropped."""
    if deadline <= 0:
        raise ValueError(f"deadline must be positive, not {deadline!r}")
    began = time.monotonic()
    job = _Call(connect)
    queue_: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
    queue_.put(job)
    queue_.put(None)
    threading.Thread(target=_serve, args=(queue_,), name="elastic-runner-store-connect", daemon=True).start()
    if not job.done.wait(deadline):
        raise StoreUnresponsive(f"{what} did not answer a new connection within {deadline:g}s", began)
    if job.error is not None:
        raise job.error
    return job.value


class _Call:
    """One call handed to the helper thread, and what came of it."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self.call: Callable[[], Any] | None = call
        self.value: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()


def _serve(calls: queue.SimpleQueue[_Call | None]) -> None:
    """The helper thread: runs the calls in turn until it is handed None (its BoundedStore collected)."""
    while (job := calls.get()) is not None:
        call, job.call = job.call, None  # (held no longer than it runs: the store it is bound to may have to close)
        try:
            job.value = call() if call is not None else None
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, raised in its thread
            job.error = exc
        job.done.set()
        del call, job
