"""A member of a new round that dies before it takes its part in the rank assignment: the other agents leave the
round as soon as the rendezvous counts it dead, not after torch's ``read_timeout``.

The rank assignment is torch's own (``_assign_worker_ranks`` of our agent), on the round's real store, for the two
rendezvous: torch's ``c10d`` handler and the etcd-v3 lease protocol (on the in-memory etcd). Every store here has a
timeout of an hour: a wait that ran to it would outlast the test's own timeout, so a test that passes did not wait it
out.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from torch.distributed import HashStore
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

from elastic_runner.agent.agent import ElasticRunnerAgent
from elastic_runner.observe.events import read_events
from elastic_runner.agent.round_members import MemberGoneError, MemberWatch, WatchfulStore, gone_check
from elastic_runner.testing.contracts import each_in_a_thread, rendezvous_together

from .test_lease_rendezvous import Cluster, together

pytestmark = pytest.mark.timeout(90)
HOUR = timedelta(hours=1)


def assign_ranks(handler: Any, info: Any) -> Any:
    """What our agent does after a round is sealed: torch's rank assignment, one worker per node."""
    agent = object.__new__(ElasticRunnerAgent)  # the method reads nothing of the agent's own
    spec = SimpleNamespace(rdzv_handler=handler, role="default", local_world_size=1)
    info.store.set_timeout(HOUR)
    return agent._assign_worker_ranks(info.store, info.rank, info.world_size, spec)


def assign_in_threads(handlers: list[Any], infos: list[Any]) -> list[Any]:
    return each_in_a_thread([lambda h=h, i=i: assign_ranks(h, i) for h, i in zip(handlers, infos)], timeout=60)


def c10d_handlers(count: int) -> list[Any]:
    store, run_id = HashStore(), f"members-{uuid.uuid4().hex[:8]}"
    backend = C10dRendezvousBackend(store, run_id)
    timeout = dr.RendezvousTimeout(join=timedelta(seconds=60), last_call=timedelta(seconds=1))
    return [dr.DynamicRendezvousHandler.from_backend(run_id, store, backend, min_nodes=count, max_nodes=count,
                                                     local_addr="127.0.0.1", timeout=timeout, keep_alive_interval=1,
                                                     keep_alive_max_attempt=2)
            for _ in range(count)]


def test_a_round_whose_members_all_take_part_assigns_every_rank_c10d(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    handlers = c10d_handlers(2)
    try:
        infos = rendezvous_together(handlers, timeout=60)
        assert all(gone_check(h)() is None for h in handlers)
        workers = assign_in_threads(handlers, infos)
        assert sorted(w[0].global_rank for w in workers) == [0, 1], workers
        assert {w[0].world_size for w in workers} == {2}
    finally:
        for h in handlers:
            h._stop_heartbeats()


@pytest.mark.parametrize("dead_rank", [0, 1])
def test_a_member_that_died_after_the_seal_is_not_waited_for_c10d(dead_rank: int,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``dead_rank`` 0: the survivor waits for its ranks; 1: the survivor, rank 0, waits for the dead one's part."""
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    handlers = c10d_handlers(2)
    try:
        infos = rendezvous_together(handlers, timeout=60)
        dead = next(i for i, info in enumerate(infos) if info.rank == dead_rank)
        handlers[dead]._stop_heartbeats()  # SIGKILLed: no heartbeat, no part in the store
        survivor = 1 - dead
        with pytest.raises(MemberGoneError, match=r"is gone before it took its part in the rank assignment"):
            assign_ranks(handlers[survivor], infos[survivor])
    finally:
        for h in handlers:
            h._stop_heartbeats()


def test_a_round_whose_members_all_take_part_assigns_every_rank_etcd() -> None:
    cluster = Cluster(min_nodes=2, max_nodes=2)
    try:
        handlers = [cluster.agent(), cluster.agent()]
        infos = together(handlers)
        assert all(h.member_gone() is None for h in handlers)
        workers = assign_in_threads(handlers, infos)
        assert sorted(w[0].global_rank for w in workers) == [0, 1], workers
    finally:
        cluster.close()


@pytest.mark.parametrize("dead_rank", [0, 1])
def test_a_member_that_died_after_the_seal_is_not_waited_for_etcd(dead_rank: int) -> None:
    cluster = Cluster(min_nodes=2, max_nodes=2)
    try:
        handlers = [cluster.agent(), cluster.agent()]
        infos = together(handlers)
        dead = next(i for i, info in enumerate(infos) if info.rank == dead_rank)
        cluster.kill(handlers[dead])  # its lease expires: its node key is gone
        survivor = 1 - dead
        name = handlers[dead].node.name
        with pytest.raises(MemberGoneError, match=rf"the member '{name}' of this round is gone"):
            assign_ranks(handlers[survivor], infos[survivor])
    finally:
        cluster.close()


class SlowStore:
    """A store whose keys appear only after some looks; counts the looks."""

    def __init__(self, appear_after: int) -> None:
        self.looks, self.appear_after, self.timeout = 0, appear_after, HOUR

    def check(self, keys: list[str]) -> bool:
        self.looks += 1
        return self.looks > self.appear_after

    def get(self, key: str) -> bytes:
        return b"part"


def test_a_slow_member_that_is_alive_is_waited_for_and_a_failing_look_is_no_verdict() -> None:
    looks: list[int] = []

    def gone() -> str | None:
        looks.append(1)
        if len(looks) % 2:
            raise ConnectionError("the rendezvous did not answer")
        return None

    store = SlowStore(appear_after=40)  # about 3 s of looks at 5 ms doubling to 100 ms
    assert WatchfulStore(store, gone, slice_seconds=0.2).get("k") == b"part"
    assert looks, "the members were looked at while the part was late"


def test_while_the_workers_run_a_member_gone_counts_as_a_node_waiting_once_a_round() -> None:
    """Workers that wait for a dead member's worker outside a collective (in the process group's start) are
    restarted by torch's agent for the next round, as for a node that waits to join."""
    cluster = Cluster(min_nodes=2, max_nodes=2)
    try:
        handlers = [cluster.agent(), cluster.agent()]
        together(handlers)
        survivor, dead = handlers
        heard: list[str] = []
        watch = MemberWatch(slice_seconds=0.0)
        watch.watch(survivor, heard.append)
        assert survivor.num_nodes_waiting() == 0 and not heard
        cluster.kill(dead)
        assert survivor.num_nodes_waiting() == 1
        assert survivor.num_nodes_waiting() == 1 and heard == [f"'{dead.node.name}'"], "told once a round"
        watch.watch(survivor, heard.append)  # the next round (here: the same record, re-read)
        assert survivor.num_nodes_waiting() == 1 and len(heard) == 2
    finally:
        cluster.close()


def test_the_failure_story_of_a_node_whose_loss_an_agent_saw_says_how_long_recovery_took(tmp_path: Path) -> None:
    from elastic_runner.observe.events import EventLog
    from elastic_runner.observe.failure_story import failure_story

    worker = EventLog(str(tmp_path), "gen-1-rank-0")
    worker.emit("start", generation=1, world_size=2)
    agent = EventLog(str(tmp_path), "agent-a", role="agent")
    agent.emit("agent_member_gone", member="'b'")
    gone_at = max(e["time"] for e in read_events(tmp_path))
    story = failure_story(tmp_path, 2, 1, {"step": 40, "furthest_step": 40, "tier": "memory",
                                           "steps_recomputed": 0}, now=gone_at + 1.5)
    assert story == ("a node left (world size 2 → 1) at step 40 → recovered in 1.50 s at world size 1, resumed "
                     "step 40 from memory, 0 steps lost")
