"""The rank assignment of a new round ends as soon as a member of the round is gone, not at torch's timeout.

After a round is sealed every agent writes its part (``role_info``) into the round's store, the rank-0 agent reads
them all and writes back each agent's ranks (``assigned_ranks``); each wait is a store read with torch's
``read_timeout`` (60 s). A node killed within about a second of being seated never writes its part: the others
waited the full 60 s before leaving the round for the next one (:mod:`elastic_runner.agent.agent`) — the five slowest
recoveries of the 1,000-fault soak. :class:`WatchfulStore` looks for the keys instead and every
:data:`SLICE_SECONDS` asks whether a member of the round is gone, by the rule the rendezvous itself counts a node dead:

- ``c10d`` (torch's ``DynamicRendezvousHandler``): the member is no longer a participant of the shared state, or has
  sent no heartbeat for ``keep_alive_interval * keep_alive_max_attempt`` (torch drops it then), or the round was
  superseded;
- ``etcd-v3`` (:class:`~elastic_runner.rendezvous.leases.LeaseRendezvousHandler`): the member's node key is gone
  (its liveness lease expired).

A live member that is merely slow is waited for as before, up to the store's own timeout.

The same question, asked while the workers run (:class:`MemberWatch`: the handler's ``num_nodes_waiting``, which
torch's agent asks every monitor interval, answers 1 once a member is gone), ends the other wait of a node killed
right after it was seated: the new workers waiting for its worker in the process group's start, until
``dist.init_timeout_seconds`` (30 s).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

from torch.distributed import DistStoreError
from torch.distributed.elastic.multiprocessing.api import SignalException

from . import stop_signal

log = logging.getLogger(__name__)

#: How often a wait looks at the round's members (a live round's parts arrive within milliseconds).
SLICE_SECONDS = 0.5
#: The keys are looked for after 5 ms, then at doubling intervals up to 100 ms.
POLL_MIN_SECONDS = 0.005
POLL_MAX_SECONDS = 0.1

#: ``() -> name of a member of the round that is gone, or None``.
GoneCheck = Callable[[], "str | None"]


class MemberGoneError(DistStoreError):
    """A member of the round is gone before it took its part: the agent leaves the round for the next one."""


def gone_check(handler: Any) -> GoneCheck | None:
    """How to tell, for the round ``handler`` has just seated this agent in, that a member is gone; None where the
    handler offers no way (then the waits are torch's)."""
    own = getattr(handler, "member_gone", None)
    if callable(own):
        return own  # type: ignore[no-any-return]
    holder = getattr(handler, "_state_holder", None)
    settings = getattr(handler, "_settings", None)
    state = getattr(holder, "state", None)
    if holder is None or state is None or not hasattr(settings, "keep_alive_max_attempt"):
        return None
    return _c10d_check(holder, dict(state.participants), state.round,
                       settings.keep_alive_interval * settings.keep_alive_max_attempt,
                       getattr(handler, "_heartbeat_lock", None) or contextlib.nullcontext())


def _c10d_check(holder: Any, members: dict[Any, int], round_: int, window: timedelta, lock: Any) -> GoneCheck:
    def gone() -> str | None:
        with lock:  # torch's heartbeat thread syncs the same state holder under this lock
            holder.sync()
            state = holder.state
        if state.round != round_:
            return f"(round {round_} was superseded by round {state.round})"
        now = datetime.now(timezone.utc)
        for node in members:
            beat = state.last_heartbeats.get(node)
            if node not in state.participants or beat is None or now - beat > window:
                return str(node)
        return None

    return gone


def look(gone: GoneCheck) -> str | None:
    """``gone()``, where a look that failed (the rendezvous did not answer) says nothing: None."""
    try:
        return gone()
    except SignalException:
        raise  # the agent's stop, arrived while it looked: never "no verdict" (the agent would run on)
    except Exception:  # noqa: BLE001 - no verdict either way: wait on
        log.debug("could not look at the round's members", exc_info=True)
        return None


class WatchfulStore:
    """The round's store as torch's rank assignment uses it (``set``, ``get``, ``multi_set``, ``multi_get``), with
    reads that end with :class:`MemberGoneError` once ``gone`` names a member."""

    def __init__(self, store: Any, gone: GoneCheck, slice_seconds: float = SLICE_SECONDS) -> None:
        self._store = store
        self._gone = gone
        self._slice = slice_seconds
        self.timeout = store.timeout

    def set(self, key: str, value: Any) -> None:
        self._store.set(key, value)

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._store.multi_set(keys, values)

    def get(self, key: str) -> bytes:
        self._wait([key])
        return self._store.get(key)  # type: ignore[no-any-return]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._wait(keys)
        return self._store.multi_get(keys)  # type: ignore[no-any-return]

    def _wait(self, keys: list[str]) -> None:
        """Until every key is there (looked at every few milliseconds, then every :data:`POLL_MAX_SECONDS`: a
        store's own timed-out wait logs a warning each time), the store's timeout, or a member gone."""
        timeout = self.timeout.total_seconds() if isinstance(self.timeout, timedelta) else float(self.timeout)
        started = time.monotonic()
        looked = started
        pause = POLL_MIN_SECONDS
        while not self._store.check(keys):
            now = time.monotonic()
            if timeout and now - started >= timeout:
                raise DistStoreError(f"waited {timeout:.0f} s for {', '.join(keys[:3])} in the round's store")
            if now - looked >= self._slice:
                looked = now
                member = look(self._gone)
                if member is not None:
                    raise MemberGoneError(
                        f"the member {member} of this round is gone before it took its part in the rank "
                        f"assignment (noticed after {now - started:.1f} s, not at torch's {timeout:.0f} s)")
            time.sleep(pause)
            pause = min(POLL_MAX_SECONDS, pause * 2)


class MemberWatch:
    """While the workers of a round run: the handler's ``num_nodes_waiting`` also answers 1 once a member of the
    round is gone (looked at every :data:`SLICE_SECONDS` at most), and ``on_gone`` hears of it once a round."""

    def __init__(self, slice_seconds: float = SLICE_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        self._gone: GoneCheck | None = None
        self._on_gone: Callable[[str], None] = lambda member: None
        self._found: str | None = None
        self._looked = 0.0
        self._slice = slice_seconds
        self._clock = clock

    def watch(self, handler: Any, on_gone: Callable[[str], None]) -> None:
        """A new round of ``handler``: watch its members (the handler's ``num_nodes_waiting`` is wrapped once)."""
        self._gone, self._found, self._looked = gone_check(handler), None, self._clock()
        self._on_gone = on_gone
        if self._gone is None or getattr(handler, "_members_watched", None) is self:
            return
        asked = handler.num_nodes_waiting

        def num_nodes_waiting() -> int:
            try:
                waiting = int(asked())
            except Exception as exc:
                # torch's c10d handler wraps whatever its store request raised, the agent's stop too: the launcher
                # must see the stop as such (exit 128 + the signal, the rendezvous left open for the next job).
                stop = stop_signal.behind(exc)
                if stop is not None:
                    raise stop from exc
                raise
            stop_signal.raise_if_received()  # (one that the handler swallowed on its way)
            return waiting if waiting else int(self.member_gone() is not None)

        handler.num_nodes_waiting = num_nodes_waiting
        handler._members_watched = self

    def member_gone(self) -> str | None:
        if self._found is not None or self._gone is None or self._clock() - self._looked < self._slice:
            return self._found
        self._looked = self._clock()
        found = look(self._gone)
        if found is not None:
            self._found = found
            self._on_gone(found)
        return found
