"""What a worker does when its attempt ends, so the next attempt loses (almost) nothing.

- :class:`StateGuard` is the lock the training loop holds while it changes
  the saved state (optimizer step, schedule, sampler, step counter) plus a
  ``dirty`` mark that stays set if an exception escapes that window: such a
  half-applied step is never kept.
- :class:`Keeper` writes the last *completed* step into the node's memory tier
  (see :mod:`elastic_runner.snapshot.memory`), from whichever thread.
- :class:`AttemptEnd` is what the peer watchdog calls when a peer is lost. If
  the main thread is already ending the attempt (a failure or a stop it is
  handling), it leaves that to the main thread. Otherwise the main thread is
  stuck in a collective with the lost peer: with NCCL the process group is
  aborted first (only that returns the GPU stream to us), then the state is
  kept and the worker exits with :data:`EXIT_PEER_LOST` — or 0 when this rank
  was asked to stop anyway.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from typing import Any, Callable, Iterator

from .dist import Dist
from .env import WorkerEnv
from .events import EventLog
from .lifecycle import StopRequest
from .snapshot.memory import MemoryTier
from .watchdog import PeerWatchdog

log = logging.getLogger(__name__)

#: Exit status of a worker that ended its attempt because a peer died or hung.
EXIT_PEER_LOST = 76


class StateGuard:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.dirty = False

    @contextlib.contextmanager
    def mutating(self) -> Iterator[None]:
        with self.lock:
            self.dirty = True
            yield
            self.dirty = False  # not reached when the block raised: the state stays "dirty"


class Keeper:
    def __init__(self, memory: MemoryTier | None, capture: Callable[[], tuple[dict[str, Any], dict[str, Any]]],
                 guard: StateGuard, state: Any, events: EventLog) -> None:
        self.memory = memory
        self.capture = capture
        self.guard = guard
        self.state = state
        self.events = events
        #: The step this attempt resumed at: that state is already stored where it came from.
        self.resumed_step: int | None = None
        self._kept_step: int | None = None

    def keep(self, reason: str, lock_timeout: float = 10.0) -> bool:
        """Keep the newest completed step in node memory; True if the node holds it."""
        if self.memory is None or self.state.step == 0 or self.state.step == self.resumed_step:
            return False
        if self._kept_step == self.state.step:
            return True
        started = time.perf_counter()
        if not self.guard.lock.acquire(timeout=lock_timeout):
            log.warning("could not keep the state in memory: the training step did not finish within %.0fs", lock_timeout)
            return False
        try:
            if self.guard.dirty:
                log.error("not keeping step %d in memory: an error interrupted the optimizer step, so the "
                          "state is half-applied; the next attempt resumes from the previous snapshot", self.state.step)
                return False
            step = self.state.step
            ok = self.memory.save(step, self.capture)
        finally:
            self.guard.lock.release()
        if ok:
            self._kept_step = step
            self.events.emit("kept_in_memory", step=step, reason=reason, seconds=time.perf_counter() - started)
            log.info("kept step %d in node memory (%s) in %.3fs", step, reason, time.perf_counter() - started)
        return ok


class AttemptEnd:
    """The watchdog's handler; knows how far this rank has come."""

    def __init__(self, env: WorkerEnv, dist: Dist, stop: StopRequest, events: EventLog) -> None:
        self.env = env
        self.dist = dist
        self.stop = stop
        self.events = events
        self.keeper: Keeper | None = None  #: set once the model exists
        self.ending = threading.Event()  #: the main thread is handling the end of the attempt

    def on_peer_lost(self, reason: str) -> None:
        step = self.keeper.state.step if self.keeper is not None else None
        self.events.emit("failure", error=f"peer lost: {reason}", step=step, detected_by="watchdog")
        if self.ending.is_set():
            return  # the main thread is already keeping state and exiting
        if self.dist.device.type == "cuda":
            _abort_process_group()
            # The main thread now raises out of its collective and ends the attempt
            # through its own failure path; if it does not, we do it here.
            if self.ending.wait(5.0):
                return
        if self.keeper is not None:
            self.keeper.keep("peer lost")
        code = 0 if self.stop.requested else EXIT_PEER_LOST
        sys.stderr.write(f"elastic_runner: rank {self.env.rank}: {reason}; ending this attempt\n")
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code)


def start_watchdog(env: WorkerEnv, dist: Dist, generation: int, timeout: float, startup_grace: float,
                   handler: AttemptEnd) -> PeerWatchdog | None:
    """Start right after the process group is up, before any rank's (possibly slow) set-up."""
    if timeout <= 0 or env.world_size < 2 or env.master_addr is None or env.master_port is None:
        return None
    try:
        return PeerWatchdog.connect(env.master_addr, env.master_port, timeout, rank=env.rank,
                                    world_size=env.world_size, generation=generation, on_lost=handler.on_peer_lost,
                                    startup_grace=startup_grace).start()
    except Exception as exc:  # noqa: BLE001 - liveness checking is a safety net, not a requirement
        log.warning("peer watchdog not started (%s); dead peers are detected by collective errors only", exc)
        return None


def _abort_process_group() -> None:
    try:
        from torch.distributed import distributed_c10d

        abort = getattr(distributed_c10d, "_abort_process_group", None)
        if abort is not None:
            abort()
    except Exception:  # noqa: BLE001
        log.debug("process group abort failed", exc_info=True)


__all__ = ["EXIT_PEER_LOST", "AttemptEnd", "Keeper", "StateGuard", "start_watchdog"]
