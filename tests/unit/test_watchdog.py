"""Peer liveness: a neighbour gets the start-up grace before its first heartbeat."""

from __future__ import annotations

import time

from elastic_runner.worker.watchdog import PeerWatchdog


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
