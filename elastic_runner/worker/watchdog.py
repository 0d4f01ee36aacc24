"""Peer liveness: end an attempt within seconds when a peer dies or hangs.

gloo notices a peer's death only if its socket closes; NCCL only at the
collective timeout (10 minutes by default); a SIGSTOPped or wedged peer is
noticed by neither. Each rank therefore runs a small thread that

- bumps a counter under ``er/hb/<generation>/<rank>`` every ``interval``,
- watches its two ring neighbours' counters (O(1) store traffic per rank, so
  it scales to large jobs), and
- watches one job-wide ``er/abort/<generation>`` key.

A neighbour whose counter has not moved for ``timeout`` seconds (measured on
the watcher's monotonic clock: no cross-node clock skew), or a store that no
longer answers (rank 0's process, which hosts it, is gone), makes the watcher
set the abort key, so every rank stops within one interval, not a cascade.
A rank that finished marks itself ``done`` and is never declared dead. Only the time the watcher itself ran
counts against a neighbour: after its own thread did not run for a good part of ``timeout`` (the whole job or
machine paused, a cgroup freezer, a starved scheduler) the neighbours' silence over that gap is not theirs to blame.

The watchdog uses its own store connection with a short timeout, so a process group stuck in a collective cannot block
it, and calls it through :class:`~elastic_runner.bounded_store.BoundedStore`: torch's client waits without end on a
server that does not answer (rank 0's machine gone without resetting its connections, or frozen), and the watchdog
must then fire; so does its connection, made within the same deadline, and a store that does not answer it is a lost
rank 0. Its counters and the abort are messages of the recovery protocol (:mod:`elastic_runner.recovery.channel`),
signed with the job's key where it has one: a writer on the store without the key can neither stop every rank with a
forged abort, nor hide a hung rank behind a forged ``done``, nor make a live rank look hung with an old counter put
back (a counter below the highest seen is evidence of nothing, and does not stop the clock of a rank that hangs).
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from ..bounded_store import BoundedStore, StoreUnresponsive, connect_within
from ..printable import printable
from ..recovery.channel import Abort, Channel, WatchdogBeat, abort_key, watchdog_key

if TYPE_CHECKING:
    from ..env import WorkerEnv

log = logging.getLogger(__name__)

#: The least the watchdog waits for one answer of the job's store (its heartbeat's timeout, if longer): a store that
#: stalls for less on a loaded machine is slow, not gone (torch's client raised after the timeout before the bound).
STORE_ANSWER_S = 2.0

class PeerWatchdog:
    def __init__(self, store: Any, *, rank: int, world_size: int, generation: int, timeout: float,
                 on_lost: Callable[[str], None], interval: float | None = None, startup_grace: float | None = None,
                 clock: Callable[[], float] = time.monotonic, key: bytes | None = None, context: str = "") -> None:
        self.store = store
        self.channel = Channel(store, key, context)  #: context: the store's address, which signatures bind
        self.generation = generation
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        #: How long a neighbour may take to send its first heartbeat (ranks start at slightly different times).
        self.startup_grace = max(timeout, startup_grace or 0.0)
        self.interval = interval if interval is not None else max(0.1, min(1.0, timeout / 5))
        self.on_lost = on_lost
        #: A gap this much longer than ``interval`` between two of the watcher's own ticks was a pause of this
        #: process, not a neighbour's silence (a loaded machine delays a tick by a second or two, not half the timeout).
        self.pause_after = max(2 * self.interval, timeout / 2)
        self._clock = clock
        self.abort_key = abort_key(generation)
        self.neighbours = sorted({(rank - 1) % world_size, (rank + 1) % world_size} - {rank})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="elastic-runner-watchdog", daemon=True)
        self._counter = 0
        self._replayed: set[int] = set()  #: neighbours whose counter went back (logged once each)

    @classmethod
    def connect(cls, master_addr: str, master_port: int, timeout: float, **kwargs: Any) -> "PeerWatchdog":
        from torch.distributed import TCPStore

        deadline = max(timeout, STORE_ANSWER_S)
        store = connect_within(lambda: TCPStore(master_addr, master_port, is_master=False, wait_for_workers=False,
                                                timeout=datetime.timedelta(seconds=timeout)),
                               deadline, f"the job's store at rank 0 ({master_addr}:{master_port})")
        return cls(BoundedStore(store, deadline), timeout=timeout, context=f"{master_addr}:{master_port}", **kwargs)

    def start(self) -> "PeerWatchdog":
        self._beat()
        self._thread.start()
        return self

    def stop(self, done: bool = True) -> None:
        """Stop watching; ``done`` tells the neighbours this rank ended on purpose."""
        # No join: the thread may sit in a store call to a dead rank 0 for up to
        # `timeout`, and a failing worker must not wait for it (it is a daemon).
        self._stop.set()
        if done:
            try:
                self.channel.send(WatchdogBeat(self.generation, self.rank, self._counter + 1, done=True))
            except Exception:  # noqa: BLE001 - the store may be gone at the very end
                pass

    def abort(self, reason: str) -> None:
        """Tell every rank of this generation to stop (used on local failures too)."""
        try:
            self.channel.send(Abort(self.generation, self.rank, reason[:1024]))
        except Exception:  # noqa: BLE001
            pass

    # -- thread ------------------------------------------------------------------------

    def _beat(self) -> None:
        self._counter += 1
        self.channel.send(WatchdogBeat(self.generation, self.rank, self._counter))

    def _run(self) -> None:
        started = asleep_from = self._clock()
        last_value: dict[int, int | None] = {n: None for n in self.neighbours}
        last_change: dict[int, float] = {n: started for n in self.neighbours}
        store_failed_since: float | None = None
        while not self._stop.wait(self.interval):
            now = self._clock()
            # Only the sleep's overrun: a store call that blocks (rank 0's host hung) is watched time, not a pause.
            paused = now - asleep_from - self.interval
            if paused > self.pause_after:
                # Every process of a paused job wakes to heartbeats as old as the pause: count only watched time.
                log.info("peer watchdog: this process did not run for %.1fs; the neighbours' silence over that time "
                         "is not counted", paused)
                last_change = {n: min(now, t + paused) for n, t in last_change.items()}
                if store_failed_since is not None:
                    store_failed_since = min(now, store_failed_since + paused)
            try:
                self._beat()
                aborted = self.channel.read(Abort, self.abort_key)
                if aborted is not None:
                    self._fire(f"another rank aborted this attempt (rank {aborted.rank}: {printable(aborted.reason, 500)})")
                    return
                read = self.channel.read_many(WatchdogBeat, [watchdog_key(self.generation, n) for n in self.neighbours])
                values = {n: read[watchdog_key(self.generation, n)] for n in self.neighbours}
                store_failed_since = None
            except Exception as exc:  # noqa: BLE001 - any store failure means rank 0's host is gone or cut off
                if store_failed_since is None:
                    store_failed_since = now
                if now - store_failed_since >= min(self.timeout, 2 * self.interval + 1):
                    self._fire(f"the job's store at rank 0 stopped answering ({type(exc).__name__}: {exc})")
                    return
                asleep_from = self._clock()
                continue
            for n in self.neighbours:
                beat = values.get(n)
                if beat is not None and beat.done:
                    last_change[n] = now
                    continue
                value = beat.count if beat is not None else None
                limit = self.timeout if last_value[n] is not None or value is not None else self.startup_grace
                last = last_value[n]
                if value is not None and last is not None and value < last:
                    # Put back by someone else (its own counter only grows): not its silence, and not a sign of life
                    # (its time since the last rise goes on counting: a replay cannot hide a hung rank).
                    (log.debug if n in self._replayed else log.warning)(
                        "peer watchdog: rank %d's counter in the job's store went back from %d to %d: someone else put "
                        "an old one there; ignored", n, last, value)
                    self._replayed.add(n)
                elif value != last:
                    last_value[n], last_change[n] = value, now
                    continue
                if now - last_change[n] > limit:
                    if value is None:
                        reason = f"rank {n} never started heartbeating within {limit:g}s: it did not start or hangs"
                    else:
                        reason = (f"rank {n} stopped heartbeating {now - last_change[n]:.1f}s ago "
                                  f"(dist.heartbeat_seconds={self.timeout:g}): it died or hangs")
                    self.abort(reason)
                    self._fire(reason)
                    return
            asleep_from = self._clock()

    def _fire(self, reason: str) -> None:
        _lost(self.on_lost, reason)


def _lost(on_lost: Callable[[str], None], reason: str) -> None:
    log.error("peer watchdog: %s; ending this attempt", reason)
    on_lost(reason)


def start_watchdog(env: WorkerEnv, generation: int, timeout: float, startup_grace: float,
                   on_lost: Callable[[str], None], key: bytes | None = None) -> PeerWatchdog | None:
    """Start right after the process group is up, before any rank's (possibly slow) set-up; None
    when there is nothing to watch (alone, off) or the job's store cannot be reached."""
    if timeout <= 0 or env.world_size < 2 or env.master_addr is None or env.master_port is None:
        return None
    try:
        return PeerWatchdog.connect(env.master_addr, env.master_port, timeout, rank=env.rank,
                                    world_size=env.world_size, generation=generation, on_lost=on_lost,
                                    startup_grace=startup_grace, key=key).start()
    except StoreUnresponsive as exc:
        # The store is there and does not answer: rank 0's machine gone without resetting its connections (a refused
        # or reset connection raises otherwise). Its first collective would wait for it as long; the watchdog's
        # verdict, given now.
        _lost(on_lost, f"the job's store at rank 0 stopped answering ({type(exc).__name__}: {exc})")
        return None
    except Exception as exc:  # noqa: BLE001 - liveness checking is a safety net, not a requirement
        log.warning("peer watchdog not started (%s); dead peers are detected by collective errors only", exc)
        return None
