"""What a worker does when its attempt ends, so the next attempt loses (almost) nothing.

- :class:`Keeper` writes the last *completed* step into the node's memory tier
  (see :mod:`elastic_runner.snapshot.memory`). It takes the loop's state lock,
  so it never copies a half-applied optimizer step, whichever thread calls it.
- :func:`start_watchdog` runs the peer watchdog; when it fires, the worker
  keeps its state and exits with :data:`EXIT_PEER_LOST`, so torchrun starts
  the next round within seconds. With NCCL the process group is aborted first:
  the main thread is stuck in a collective on the GPU, and only an abort
  returns it (and the device) to us.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any, Callable

from .dist import Dist
from .env import WorkerEnv
from .events import EventLog
from .snapshot.memory import MemoryTier
from .watchdog import PeerWatchdog

log = logging.getLogger(__name__)

#: Exit status of a worker that ended its attempt because a peer died or hung.
EXIT_PEER_LOST = 76


class Keeper:
    def __init__(self, memory: MemoryTier | None, capture: Callable[[], tuple[dict[str, Any], dict[str, Any]]],
                 lock: threading.Lock, state: Any, events: EventLog) -> None:
        self.memory = memory
        self.capture = capture
        self.lock = lock
        self.state = state
        self.events = events
        self._kept_step: int | None = None

    def keep(self, reason: str, lock_timeout: float = 10.0) -> bool:
        """Keep the newest completed step in node memory; True if the node holds it."""
        if self.memory is None or self.state.step == 0:
            return False
        if self._kept_step == self.state.step:
            return True
        started = time.perf_counter()
        if not self.lock.acquire(timeout=lock_timeout):
            log.warning("could not keep the state in memory: the training step did not finish within %.0fs", lock_timeout)
            return False
        try:
            step = self.state.step
            ok = self.memory.save(step, self.capture)
        finally:
            self.lock.release()
        if ok:
            self._kept_step = step
            self.events.emit("kept_in_memory", step=step, reason=reason, seconds=time.perf_counter() - started)
            log.info("kept step %d in node memory (%s) in %.3fs", step, reason, time.perf_counter() - started)
        return ok


def start_watchdog(env: WorkerEnv, dist: Dist, generation: int, timeout: float, keeper: Keeper,
                   events: EventLog) -> PeerWatchdog | None:
    if timeout <= 0 or env.world_size < 2 or env.master_addr is None or env.master_port is None:
        return None

    def on_lost(reason: str) -> None:
        events.emit("failure", error=f"peer lost: {reason}", step=keeper.state.step, detected_by="watchdog")
        if dist.device.type == "cuda":
            _abort_process_group()
            # The main thread now raises out of its collective, keeps the state and
            # exits through its normal failure path; if it does not, we do it here.
            time.sleep(5.0)
        keeper.keep("peer lost")
        sys.stderr.write(f"elastic_runner: rank {env.rank}: {reason}; ending this attempt\n")
        sys.stderr.flush()
        logging.shutdown()
        os._exit(EXIT_PEER_LOST)

    try:
        return PeerWatchdog.connect(env.master_addr, env.master_port, timeout, rank=env.rank,
                                    world_size=env.world_size, generation=generation, on_lost=on_lost).start()
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


__all__ = ["EXIT_PEER_LOST", "Keeper", "start_watchdog"]
