"""Peer liveness: a neighbour gets the start-up grace before its first heartbeat; only the time the watcher ran
counts against a silent neighbour."""

from __future__ import annotations

import time
from typing import Callable

from elastic_runner.recovery.channel import Channel, WatchdogBeat
from elastic_runner.worker.watchdog import PeerWatchdog


def _beat(store: object, rank: int, count: int) -> None:
    """Rank ``rank``'s watchdog counter in generation 1 at ``count``, as its watchdog writes it."""
    Channel(store, None).send(WatchdogBeat(1, rank, count))


def _count(store: object, rank: int) -> int:
    beat = Channel(store, None).read(WatchdogBeat, f"er/hb/1/{rank}")
    assert beat is not None
    return beat.count


def test_a_neighbour_gets_the_startup_grace_before_its_first_heartbeat() -> None:
    from torch.distributed import HashStore

    fired: list[str] = []
    dog = PeerWatchdog(HashStore(), rank=0, world_size=2, generation=1, timeout=0.3, interval=0.05,
                       startup_grace=1.5, on_lost=fired.append).start()
    time.sleep(0.8)
    assert not fired, "a slow-starting neighbour is not dead yet"
    deadline = time.monotonic() + 5  # due at 1.5 s; slack for a loaded machine's scheduler
    while not fired and time.monotonic() < deadline:
        time.sleep(0.05)
    dog.stop()
    assert fired and "never started heartbeating within 1.5s" in fired[0]


class _Clock:
    """The watcher's monotonic clock, moved by the test (the watcher still ticks in real time)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _until(condition: Callable[[], bool], seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_a_pause_of_the_whole_job_longer_than_the_heartbeat_blames_no_neighbour_but_a_silent_one_is_still_found(
        ) -> None:
    # Before: every worker of a job frozen for longer than dist.heartbeat_seconds (a VM pause, a cgroup freezer,
    # a test that stops them all) woke to neighbours' heartbeats as old as the pause, and declared one lost.
    from torch.distributed import HashStore

    store, clock, fired = HashStore(), _Clock(), []
    _beat(store, 1, 1)  # the neighbour has started
    dog = PeerWatchdog(store, rank=0, world_size=2, generation=1, timeout=5.0, interval=0.01, on_lost=fired.append,
                       clock=clock).start()
    try:
        ticks = lambda: _count(store, 0)  # noqa: E731 - the watcher's own counter: it ran
        seen = ticks()
        assert _until(lambda: ticks() > seen + 3)
        clock.now += 20.0  # everything paused for 20 s, four times the heartbeat
        seen = ticks()
        assert _until(lambda: ticks() > seen + 3)
        assert not fired, "a pause of the watcher itself is not the neighbour's silence"
        _beat(store, 1, 2)  # the neighbour runs again after the pause
        for _ in range(8):  # 4 s of watched silence: within the heartbeat
            clock.now += 0.5
            seen = ticks()
            assert _until(lambda: ticks() > seen + 1)
        assert not fired
        for _ in range(6):  # past 5 s of watched silence
            clock.now += 0.5
            seen = ticks()
            assert _until(lambda: ticks() > seen + 1 or bool(fired))
        assert _until(lambda: bool(fired)), "a neighbour silent while the watcher ran is still found"
        assert "rank 1 stopped heartbeating" in fired[0]
    finally:
        dog.stop()


class _HungStore:
    """The job's store on a host that hangs: once ``hung``, every call blocks for the client's timeout (the test's
    clock moves by that much) and then fails, as a TCPStore client's does."""

    def __init__(self, clock: _Clock, timeout: float) -> None:
        from torch.distributed import HashStore

        self.inner, self.clock, self.timeout, self.hung = HashStore(), clock, timeout, False

    def _call(self, name: str, *args: object) -> object:
        if self.hung:
            self.clock.now += self.timeout
            raise RuntimeError("wait timeout")
        return getattr(self.inner, name)(*args)

    def set(self, key: str, value: bytes) -> None:
        self._call("set", key, value)

    def get(self, key: str) -> bytes:
        return self._call("get", key)  # type: ignore[return-value]

    def check(self, keys: list[str]) -> bool:
        return self._call("check", keys)  # type: ignore[return-value]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._call("multi_get", keys)  # type: ignore[return-value]


def test_a_store_whose_host_hangs_is_still_found_though_each_call_blocks_for_the_heartbeat() -> None:
    # A store call that blocks is time the watcher was running, not a pause of its process.
    clock, fired = _Clock(), []
    store = _HungStore(clock, timeout=5.0)
    _beat(store, 1, 1)
    dog = PeerWatchdog(store, rank=0, world_size=2, generation=1, timeout=5.0, interval=0.01, on_lost=fired.append,
                       clock=clock).start()
    try:
        time.sleep(0.1)
        hung_at, store.hung = clock.now, True
        assert _until(lambda: bool(fired)), "the hung store is reported"
        assert "the job's store at rank 0 stopped answering" in fired[0]
        # Two blocked calls (the second confirms the first); the old count took a hundred, 500 s of a real job.
        assert clock.now - hung_at <= 3 * 5.0, f"reported after {clock.now - hung_at:.0f} s of blocked calls"
    finally:
        dog.stop(done=False)


def test_a_job_store_whose_server_stops_answering_without_closing_is_found_within_the_heartbeat() -> None:
    """Rank 0's machine gone without resetting its connections (here its store's process SIGSTOPped): torch's client
    then waits without end on every call, so the watchdog's calls are bounded; it fires, and the worker with it, in
    about the heartbeat's time instead of never (a frozen rank 0 machine cost 49 s in an etcd-v3 job before)."""
    import os
    import signal

    from ..support import store_server

    fired: list[str] = []
    with store_server() as server:
        dog = PeerWatchdog.connect("127.0.0.1", server.port, 1.0, rank=1, world_size=2, generation=1,
                                   on_lost=fired.append)
        _beat(dog.store, 0, 1)
        dog.start()
        try:
            for count in range(2, 6):  # rank 0 beats on: no neighbour is silent
                time.sleep(0.2)
                _beat(dog.store, 0, count)
            assert not fired, fired
            frozen = time.monotonic()
            os.kill(server.pid, signal.SIGSTOP)
            assert _until(lambda: bool(fired), seconds=15), "the watchdog never fired: its store call blocked"
            assert "the job's store at rank 0 stopped answering" in fired[0] and "StoreUnresponsive" in fired[0]
            assert time.monotonic() - frozen < 4.0, f"fired {time.monotonic() - frozen:.1f}s after the freeze"
        finally:
            dog.stop(done=False)


def test_a_job_store_that_does_not_answer_the_watchdogs_connection_is_a_lost_rank_0() -> None:
    """Rank 0's machine frozen between the process group's start and the watchdog's: the connection is not waited
    for without end (the attempt's first collective would wait as long); the attempt ends as for a lost peer."""
    import os
    import signal
    from types import SimpleNamespace

    from elastic_runner.worker.watchdog import start_watchdog

    from ..support import store_server

    fired: list[str] = []
    with store_server() as server:
        os.kill(server.pid, signal.SIGSTOP)
        env = SimpleNamespace(world_size=2, rank=1, master_addr="127.0.0.1", master_port=server.port)
        began = time.monotonic()
        dog = start_watchdog(env, generation=1, timeout=1.0, startup_grace=30.0, on_lost=fired.append)  # type: ignore[arg-type]
        assert dog is None and len(fired) == 1, fired
        assert fired[0].startswith("the job's store at rank 0 stopped answering (StoreUnresponsive: "), fired[0]
        assert time.monotonic() - began < 5.0
