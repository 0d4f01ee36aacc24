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
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], dict[str, Any], threading.Event]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        #: The call that did not return within its deadline: its name, when it began, and its "returned" event.
        self._stuck: tuple[str, float, threading.Event] | None = None

    @property
    def unresponsive(self) -> bool:
        """A call has not returned within its deadline, and has not returned since."""
        return self._stuck is not None and not self._stuck[2].is_set()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)
        if not callable(method):
            return method
        return lambda *args, **kwargs: self._call(name, lambda: method(*args, **kwargs))

    def _call(self, name: str, call: Callable[[], Any]) -> Any:
        with self._lock:  # one call at a time, as on the client itself (callers on other threads take turns)
            if self._stuck is not None:
                what, since, returned = self._stuck
                if not returned.is_set():
                    raise StoreUnresponsive(f"the store has not answered {what}, called {self._clock() - since:.1f}s "
                                            "ago", since)
                self._stuck = None  # it answered at last: the helper thread is free again
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="elastic-runner-bounded-store", daemon=True)
                self._thread.start()
            began, done = self._clock(), threading.Event()
            box: dict[str, Any] = {}
            self._calls.put((call, box, done))
            if not done.wait(self.deadline):
                self._stuck = (f"{name}()", began, done)
                raise StoreUnresponsive(f"the store did not answer {name}() within {self.deadline:g}s", began)
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def _serve(self) -> None:
        while True:
            call, box, done = self._calls.get()
            try:
                box["value"] = call()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, raised in its thread
                box["error"] = exc
            done.set()
