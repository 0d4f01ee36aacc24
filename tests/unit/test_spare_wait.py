"""An agent started beyond --nnodes' maximum says once that it waits as a spare, and how long it waited."""

from __future__ import annotations

from typing import Any

from elastic_runner.agent import fast_rendezvous
from elastic_runner.agent.spare import SpareWait


class LeaseHandler:
    """What the etcd-v3 lease protocol's handler offers: a hook it calls itself."""

    on_spare = None


def test_the_wait_is_reported_once_per_rendezvous_and_its_length_goes_with_the_round() -> None:
    told: list[tuple[str, dict[str, Any]]] = []
    now = [100.0]
    handler = LeaseHandler()
    wait = SpareWait(handler, lambda event, **fields: told.append((event, fields)), clock=lambda: now[0],
                     local_world_size=2)
    assert wait.fields() == {}, "a node that got a seat at once was no spare"
    handler.on_spare(2)
    now[0] = 103.5
    handler.on_spare(2)  # (torch's join op decides again at every poll)
    assert told == [("spare_waiting", {"max_nodes": 2, "local_world_size": 2})], "a full world of 2 x 2 ranks"
    assert wait.fields() == {"spare_s": 3.5}


def test_torchs_c10d_handler_is_watched_through_the_rendezvous_patch() -> None:
    told: list[str] = []
    try:
        SpareWait(object(), lambda event, **fields: told.append(event))
        assert fast_rendezvous.on_spare is not None
        fast_rendezvous.on_spare(3)
        assert told == ["spare_waiting"]
    finally:
        fast_rendezvous.on_spare = None
