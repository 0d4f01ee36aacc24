"""The etcd-v3 lease protocol (``protocol=leases``), specified against the in-memory etcd.

Agents are handlers in threads, each with its own client of one ``MemoryEtcd``; lease time runs on a
fake clock, so a node dies exactly when a test lets its lease expire (``expire_lease``) and a
partitioned node is a client that cannot reach the server (``partitioned``). What the agent sees
(ranks, world size, ``num_nodes_waiting``, closed, errors) is what torchrun's agent would see; the
same protocol runs against a real etcd in tests/integration/test_etcd_backend.py and under torchrun
in tests/integration/test_etcd_torchrun.py.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
import zlib
from typing import Any, Callable

import pytest
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousTimeoutError,
)

from elastic_runner.rendezvous.departures import AgentLiveness, AskSchedule
from elastic_runner.rendezvous.kv import Delete, Get, KeyValue, Put
from elastic_runner.rendezvous.leases import LeaseRendezvousHandler
from elastic_runner.rendezvous.rounds import (
    Joiner,
    NodeId,
    Round,
    Settings,
    View,
    choose_members,
    ready_to_seal,
    settings_from,
)
from elastic_runner.rendezvous.seal import Sealer
from elastic_runner.rendezvous.store import EtcdStore
from elastic_runner.rendezvous.values import Codec
from elastic_runner.testing.contracts import FakeClock, each_in_a_thread
from elastic_runner.testing.memory_etcd import MemoryEtcd, MemoryKV

pytestmark = pytest.mark.timeout(60)


class Cluster:
    """One in-memory etcd and the agents of one run."""

    def __init__(self, **settings: Any) -> None:
        self.clock = FakeClock()
        self.server = MemoryEtcd(clock=self.clock)
        self.prefix = f"/t/{uuid.uuid4().hex[:8]}/run"
        self.settings = Settings(**{"run_id": "run", "min_nodes": 1, "max_nodes": 8, "last_call_timeout": 30.0,
                                    "join_timeout": 30.0, **settings})
        self.handlers: list[LeaseRendezvousHandler] = []

    def agent(self, sealer: Sealer | None = None, **settings: Any) -> LeaseRendezvousHandler:
        client = self.server.client()
        s = Settings(**{**self.settings.__dict__, **settings})
        handler = LeaseRendezvousHandler(client, self.prefix, s, EtcdStore(client, self.prefix),
                                         local_addr="127.0.0.1", sealer=sealer)
        self.handlers.append(handler)
        return handler

    def kill(self, handler: LeaseRendezvousHandler) -> None:
        """The agent dies: nothing of it runs any more, and etcd expires its lease."""
        handler._heartbeat.stop()
        handler._stop_watcher()
        assert isinstance(handler._client, MemoryKV)
        handler._client.partitioned = True
        self.server.expire_lease(handler._heartbeat.current)

    def close(self) -> None:
        for h in self.handlers:
            h._heartbeat.stop()
            h._stop_watcher()


@pytest.fixture
def cluster() -> Any:
    made: list[Cluster] = []

    def make(**settings: Any) -> Cluster:
        made.append(Cluster(**settings))
        return made[-1]

    yield make
    for c in made:
        c.close()


def together(handlers: list[LeaseRendezvousHandler], timeout: float = 20) -> list[Any]:
    """Every handler's ``next_rendezvous`` at once; their RendezvousInfo (or the exception each raised)."""
    out = each_in_a_thread([h.next_rendezvous for h in handlers], timeout)
    assert all(o is not None for o in out), "a next_rendezvous did not return in time"
    return out


def in_background(handler: LeaseRendezvousHandler) -> tuple[threading.Thread, list[Any]]:
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(handler.next_rendezvous())
        except BaseException as exc:  # noqa: BLE001
            box.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def eventually(condition: Callable[[], bool], timeout: float = 5.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.02)
    raise AssertionError(f"not within {timeout:.0f} s: {what}")


def seats(infos: list[Any]) -> list[tuple[int, int]]:
    return sorted((i.rank, i.world_size) for i in infos)


# == forming a round ======================================================================================

def test_agents_form_one_round_ranked_by_node_with_a_few_requests_each(cluster: Callable[..., Cluster]) -> None:
    c = cluster(min_nodes=16, max_nodes=16)
    agents = [c.agent() for _ in range(16)]
    infos = together(agents)
    assert seats(infos) == [(r, 16) for r in range(16)]
    by_rank = sorted(zip((i.rank for i in infos), (a.node for a in agents)))
    assert [n for _, n in by_rank] == sorted(a.node for a in agents), "ranks follow the sorted node descriptions"
    # A constant per agent (rendezvous, lease, the training watch, and the workers' address: a store read that
    # may wait), with the sealer's one read of every node key and its watch on top.
    requests = sorted(a._client.requests for a in agents)
    assert requests[-2] <= 14 and requests[-1] <= 20, f"requests per agent should not grow with the job: {requests}"


def test_the_first_round_waits_the_last_call_once_min_nodes_joined(cluster: Callable[..., Cluster]) -> None:
    c = cluster(min_nodes=2, max_nodes=3, last_call_timeout=1.0)
    started = time.monotonic()
    infos = together([c.agent(), c.agent()])
    waited = time.monotonic() - started
    assert seats(infos) == [(0, 2), (1, 2)]
    assert waited >= 0.9, "a round below max_nodes completes only after the last call"


def test_a_store_per_round_and_the_bootstrap_address_for_the_workers(cluster: Callable[..., Cluster],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    c = cluster(min_nodes=2, max_nodes=2)
    infos = together([c.agent(), c.agent()])
    assert {i.bootstrap_store_info.master_addr for i in infos} == {"127.0.0.1"}
    assert len({i.bootstrap_store_info.master_port for i in infos}) == 1
    infos[0].store.set("k", b"v")
    assert infos[1].store.get("k") == b"v"


def test_the_workers_address_comes_with_the_round_record_and_rank_0_still_hands_it_over(
        cluster: Callable[..., Cluster], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    c = cluster(min_nodes=3, max_nodes=3)
    agents = [c.agent() for _ in range(3)]
    infos = together(agents)
    record = agents[0].seated_in
    assert record is not None and record.master is not None
    assert {(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in infos} == \
        {record.master}, "every agent reads MASTER_ADDR/PORT from the record: nobody waits for rank 0"
    assert infos[2].store.get("MASTER_PORT") == str(record.master[1]).encode(), "for agents of older builds"


def test_a_record_without_the_address_falls_back_to_torchs_handover(cluster: Callable[..., Cluster],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A round sealed by an older build, or whose rank 0 is one, names no master: the store hands it over."""
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    monkeypatch.setattr("elastic_runner.rendezvous.ports.PortHold.offer", lambda self: 0)  # nobody offers a port
    c = cluster(min_nodes=2, max_nodes=2)
    agents = [c.agent(), c.agent()]
    infos = together(agents)
    assert agents[0].seated_in is not None and agents[0].seated_in.master is None
    ports = {i.bootstrap_store_info.master_port for i in infos}
    assert len(ports) == 1 and 0 not in ports


# == restarts, losses, joins ================================================================================

def test_after_a_restart_the_round_reforms_without_the_last_call(cluster: Callable[..., Cluster]) -> None:
    c = cluster(min_nodes=2, max_nodes=4, last_call_timeout=1.0)
    agents = [c.agent() for _ in range(3)]
    first = together(agents)
    assert {i.world_size for i in first} == {3}
    for a in agents:  # from now on a last call would be noticed
        a._settings = Settings(**{**a.settings.__dict__, "last_call_timeout": 30.0})
    started = time.monotonic()
    second = together(agents)
    assert time.monotonic() - started < 5, "every node of the previous round is back: no last call"
    assert seats(second) == [(0, 3), (1, 3), (2, 3)]
    assert all(a.completed_early for a in agents), "every member learns why from the record"


def test_a_member_that_restarts_is_seen_waiting_by_the_others(cluster: Callable[..., Cluster]) -> None:
    c = cluster(min_nodes=3, max_nodes=3)
    a, b, d = (c.agent() for _ in range(3))
    together([a, b, d])
    assert a.num_nodes_waiting() == b.num_nodes_waiting() == 0
    thread, box = in_background(d)  # its worker failed: its agent rejoins
    eventually(lambda: a.num_nodes_waiting() > 0 and b.num_nodes_waiting() > 0, what="the others see it waiting")
    infos = together([a, b])
    thread.join(10)
    assert seats(infos + box) == [(0, 3), (1, 3), (2, 3)]
    assert a.num_nodes_waiting() == 0, "a new round starts with nobody waiting"


def test_a_new_node_joins_a_running_round_through_num_nodes_waiting(cluster: Callable[..., Cluster]) -> None:
    c = cluster(min_nodes=2, max_nodes=4, last_call_timeout=1.0)
    a, b = c.agent(), c.agent()
    together([a, b])
    newcomer = c.agent()
    thread, box = in_background(newcomer)
    eventually(lambda: a.num_nodes_waiting() > 0 and b.num_nodes_waiting() > 0, what="members see the newcomer")
    started = time.monotonic()
    infos = together([a, b])
    thread.join(10)
    assert seats(infos + box) == [(0, 3), (1, 3), (2, 3)]
    assert time.monotonic() - started < 0.9, "the previous members are back: sealed without the last call"


def test_a_lost_node_is_left_out_once_its_lease_expires(cluster: Callable[..., Cluster]) -> None:
    c = cluster(min_nodes=1, max_nodes=3, last_call_timeout=30.0)
    a, b, dead = (c.agent() for _ in range(3))
    together([a, b, dead], timeout=40)
    c.kill(dead)
    started = time.monotonic()
    infos = together([a, b])
    assert seats(infos) == [(0, 2), (1, 2)]
    assert time.monotonic() - started < 5, "the dead node's key is gone: no last call"


def test_a_lost_node_is_waited_for_until_its_lease_expires(cluster: Callable[..., Cluster]) -> None:
    c = cluster(min_nodes=1, max_nodes=3, last_call_timeout=30.0)
    a, b, silent = (c.agent() for _ in range(3))
    together([a, b, silent], timeout=40)
    silent._heartbeat.stop()  # dead, but etcd has not expired its lease yet
    threads = [in_background(h) for h in (a, b)]
    time.sleep(0.5)
    assert all(not box for _, box in threads), "a member that is neither back nor dead holds the round"
    c.server.expire_lease(silent._heartbeat.current)
    for t, _ in threads:
        t.join(5)
    assert seats([box[0] for _, box in threads]) == [(0, 2), (1, 2)]


def _rank_of(handler: LeaseRendezvousHandler) -> int:
    record = handler.seated_in
    assert record is not None
    return record.names().index(handler.node.name)


def test_a_lost_node_counted_out_by_a_survivor_is_left_out_without_waiting_for_its_lease(
        cluster: Callable[..., Cluster]) -> None:
    c = cluster(min_nodes=1, max_nodes=3, last_call_timeout=30.0)
    a, b, lost = (c.agent() for _ in range(3))
    together([a, b, lost], timeout=40)
    lost._heartbeat.stop()  # dead, and etcd has not expired its lease (the fake clock never moves)
    assert a.count_out([_rank_of(lost), _rank_of(a), 7]) == [lost.node.name], \
        "only the named member that is still seated is counted out (not itself, not a rank out of the round)"
    infos = together([a, b], timeout=10)
    assert seats(infos) == [(0, 2), (1, 2)]


def test_a_member_that_wants_the_next_round_is_never_counted_out(cluster: Callable[..., Cluster]) -> None:
    c = cluster(min_nodes=1, max_nodes=3, last_call_timeout=30.0)
    a, b, back = (c.agent() for _ in range(3))
    together([a, b, back], timeout=40)
    rank = _rank_of(back)
    thread, box = in_background(back)  # it is alive: it has left the round and wants the next one
    eventually(lambda: a.num_nodes_waiting() > 0, what="the member's join is seen")
    assert a.count_out([rank]) == []
    infos = together([a, b], timeout=10)
    thread.join(10)
    assert seats(infos + box) == [(0, 3), (1, 3), (2, 3)]


def test_a_live_member_counted_out_by_mistake_joins_the_round_after(cluster: Callable[..., Cluster]) -> None:
    c = cluster(min_nodes=1, max_nodes=3, last_call_timeout=30.0)
    a, b, late = (c.agent() for _ in range(3))
    together([a, b, late], timeout=40)
    assert a.count_out([_rank_of(late)]) == [late.node.name]  # its beat was late; it is alive
    assert seats(together([a, b], timeout=10)) == [(0, 2), (1, 2)]
    thread, box = in_background(late)  # its workers failed with the others': its agent joins again
    eventually(lambda: a.num_nodes_waiting() > 0, what="the others see it waiting")
    infos = together([a, b], timeout=10)
    thread.join(10)
    assert seats(infos + box) == [(0, 3), (1, 3), (2, 3)]


def test_an_agent_that_leaves_on_a_signal_is_not_waited_for(cluster: Callable[..., Cluster]) -> None:
    c = cluster(min_nodes=1, max_nodes=3, last_call_timeout=30.0)
    a, b, preempted = (c.agent() for _ in range(3))
    together([a, b, preempted], timeout=40)
    preempted.leave()
    assert c.server.client().txn((), [Get(preempted._my_key)]).results == (None,), "its key is gone at once"
    assert seats(together([a, b], timeout=10)) == [(0, 2), (1, 2)]
    assert not a.is_closed(), "leaving does not close the run"


def test_a_full_round_does_not_restart_for_a_node_that_cannot_get_a_seat(cluster: Callable[..., Cluster]) -> None:
    c = cluster(min_nodes=2, max_nodes=2)
    a, b = c.agent(), c.agent()
    together([a, b])
    spare = c.agent()
    thread, box = in_background(spare)
    time.sleep(0.5)
    assert a.num_nodes_waiting() == 0 and b.num_nodes_waiting() == 0, "no seat for it: training goes on"
    c.kill(a)  # a seat frees up: b's workers fail and its agent rejoins
    infos = together([b])
    thread.join(10)
    assert seats(infos + box) == [(0, 2), (1, 2)]


def test_a_node_without_a_seat_neither_ends_the_running_round_nor_times_out(cluster: Callable[..., Cluster]) -> None:
    c = cluster(min_nodes=1, max_nodes=2, last_call_timeout=0.5, join_timeout=1.0)
    a, b = c.agent(), c.agent()
    together([a, b])
    spare = c.agent()
    thread, box = in_background(spare)
    time.sleep(2.5)  # past its join timeout and the last call
    assert not box, f"it waits for a seat: {box}"
    assert a._take_seat(0) is not None, "round 0 still runs: no round was sealed beside it"
    assert not a.is_closed(), "a spare that timed out would have closed the job's rendezvous"
    c.kill(a)
    infos = together([b])
    thread.join(10)
    assert seats(infos + box) == [(0, 2), (1, 2)]


def test_no_round_starts_while_a_live_member_has_not_left_the_previous_one(cluster: Callable[..., Cluster]) -> None:
    c = cluster(min_nodes=2, max_nodes=3, last_call_timeout=0.3)
    agents = [c.agent() for _ in range(3)]
    together(agents)
    quick = [in_background(h) for h in agents[:2]]
    time.sleep(1.0)  # three last calls: the third member still stops its workers
    assert all(not box for _, box in quick), "its workers still run in round 0"
    slow = together(agents[2:])
    for t, _ in quick:
        t.join(5)
    assert seats(slow + [box[0] for _, box in quick]) == [(0, 3), (1, 3), (2, 3)]


def test_a_deleted_record_makes_every_member_rejoin_in_a_new_incarnation(cluster: Callable[..., Cluster]) -> None:
    c = cluster(min_nodes=2, max_nodes=2)
    a, b = c.agent(), c.agent()
    first = together([a, b])
    c.server.client().delete_prefix(f"{c.prefix}/rdzv/ctl/round".encode())  # 'etcdctl del', data loss
    eventually(lambda: a.num_nodes_waiting() > 0 and b.num_nodes_waiting() > 0, what="both see it gone")
    again = together([a, b])
    assert {i.world_size for i in again} == {2}
    assert a.seated_in is not None and a.seated_in.round == 0, "numbering starts over"
    first[0].store.set("k", b"old")
    assert not again[0].store.check(["k"]), "a new incarnation's round 0 has its own store keys"


def test_more_candidates_than_max_nodes_keep_the_previous_members_then_join_order() -> None:
    previous = Round(4, (("n_1_0", 5), ("n_2_0", 6)))
    candidates = [Joiner(NodeId("n", i, 0), 5, ticket) for i, ticket in ((3, 1), (1, 5), (4, 2), (2, 6))]
    chosen = choose_members(candidates, previous, 3)
    assert [j.node.pid for j in chosen] == [1, 2, 3], "members 1 and 2 kept, then the earliest joiner (3)"


def test_the_sealing_rule_waits_for_members_that_are_alive_but_not_back() -> None:
    s = Settings("r", min_nodes=1, max_nodes=4, last_call_timeout=30.0)
    previous = Round(0, (("a_1_0", 1), ("b_1_0", 2)))
    a, b = Joiner(NodeId("a", 1, 0), 1, 1), Joiner(NodeId("b", 1, 0), 0, 2)
    view = View(nodes={"a_1_0": a, "b_1_0": b}, record=previous, record_revision=3)
    assert ready_to_seal(view, 1, s, 100.0, 101.0) == (False, "")
    assert ready_to_seal(view, 1, Settings("r", 1, 1), 100.0, 500.0) == (False, ""), \
        "not even max_nodes or the last call seal beside a live member of the previous round"
    view.nodes.pop("b_1_0")  # b's lease expired
    assert ready_to_seal(view, 1, s, 100.0, 101.0) == (True, "previous round accounted for")
    stale = View(nodes={"c_1_0": Joiner(NodeId("c", 1, 0), 1, 9)}, record=previous, record_revision=3)
    assert ready_to_seal(stale, 1, s, 100.0, 101.0)[0] is False, "none of the previous members is back: last call"
    assert ready_to_seal(stale, 1, s, 100.0, 130.0) == (True, "last call")


# == split brain =====================================================================================================

def test_a_partitioned_node_whose_lease_expired_does_not_rejoin_the_sealed_round(
        cluster: Callable[..., Cluster]) -> None:
    c = cluster(min_nodes=1, max_nodes=3)
    a, b, cut = (c.agent() for _ in range(3))
    together([a, b, cut], timeout=40)
    assert isinstance(cut._client, MemoryKV)
    cut._client.partitioned = True
    c.server.expire_lease(cut._heartbeat.current)
    infos = together([a, b])  # the others restart and seal round 1 without it
    assert seats(infos) == [(0, 2), (1, 2)]
    assert a.seated_in is not None and cut.node.name not in a.seated_in.names()
    cut._client.partitioned = False  # back: its agent's workers failed, it rejoins
    thread, box = in_background(cut)
    eventually(lambda: a.num_nodes_waiting() > 0, what="the members see it waiting for the next round")
    again = together([a, b])
    thread.join(10)
    assert box and not isinstance(box[0], BaseException), box
    assert seats(again + box) == [(0, 3), (1, 3), (2, 3)]
    assert box[0].store is not None and a.seated_in is not None and a.seated_in.round == 2, \
        "it took a seat in round 2, not in the round sealed without it"


def test_a_node_whose_lease_expired_after_the_seal_still_takes_its_seat_if_no_newer_round_exists(
        cluster: Callable[..., Cluster]) -> None:
    """Nobody can have counted it out: a round after it needs every member back or dead first."""
    c = cluster(min_nodes=3, max_nodes=3)
    a, b, late = (c.agent() for _ in range(3))
    together([a, b, late])
    lost = late._heartbeat.current
    c.server.expire_lease(lost)  # right after the seal, before (say) it read the record
    late._heartbeat.regrant(lost)  # back: its key again, with a new ticket
    assert late._take_seat(0) is not None and a._take_seat(0) is not None


def test_a_slow_node_sees_the_newer_round_and_leaves(cluster: Callable[..., Cluster]) -> None:
    c = cluster(min_nodes=1, max_nodes=3)
    a, b, slow = (c.agent() for _ in range(3))
    together([a, b, slow], timeout=40)
    assert isinstance(slow._client, MemoryKV)
    slow._client.partitioned = True  # paused longer than the window
    c.server.expire_lease(slow._heartbeat.current)
    together([a, b])
    assert slow.num_nodes_waiting() == 0
    slow._client.partitioned = False
    eventually(lambda: slow.num_nodes_waiting() > 0, what="it sees round 1 sealed without it and asks to restart")


def test_a_sealer_that_dies_is_replaced(cluster: Callable[..., Cluster]) -> None:
    c = cluster(min_nodes=2, max_nodes=2)
    ghost = c.server.client()
    lease = ghost.grant_lease(10)
    key = f"{c.prefix}/rdzv/ctl/sealer/0".encode()
    ghost.txn((), [Put(key, json.dumps({"by": "ghost_1_0"}).encode(), lease)])
    threads = [in_background(c.agent()) for _ in range(2)]
    time.sleep(0.3)
    assert all(not box for _, box in threads), "the (dead) sealer holds round 0"
    c.server.expire_lease(lease)
    for t, _ in threads:
        t.join(5)
    assert seats([box[0] for _, box in threads]) == [(0, 2), (1, 2)]


# == closing, timeouts, errors =============================================================================

def test_a_closed_rendezvous_turns_new_nodes_away(cluster: Callable[..., Cluster]) -> None:
    c = cluster(min_nodes=1, max_nodes=2, last_call_timeout=1.0)
    a = c.agent()
    together([a])
    assert not a.is_closed()
    assert a.shutdown()
    assert a.is_closed()
    with pytest.raises(RendezvousClosedError, match="is closed"):
        c.agent().next_rendezvous()


def test_a_round_that_never_reaches_min_nodes_times_out_and_leaves_no_key(cluster: Callable[..., Cluster]) -> None:
    c = cluster(min_nodes=2, max_nodes=2, join_timeout=1.0)
    lonely = c.agent()
    with pytest.raises(RendezvousTimeoutError, match="join_timeout"):
        lonely.next_rendezvous()
    kvs, _ = c.server.client().get_prefix(f"{c.prefix}/rdzv/".encode())
    assert kvs == [], [kv.key for kv in kvs]


def test_values_not_signed_with_the_jobs_key_are_ignored_never_fatal(
        cluster: Callable[..., Cluster], caplog: pytest.LogCaptureFixture) -> None:
    c = cluster(min_nodes=1, max_nodes=2, last_call_timeout=1.0)
    key = Sealer(b"k" * 32)
    admin = c.server.client()
    node_key = f"{c.prefix}/rdzv/node/127.0.0.1_1_0".encode()
    admin.txn((), [Put(node_key, json.dumps({"addr": "127.0.0.1", "pid": 1, "local_id": 0, "want": 0}).encode())])
    round_key = f"{c.prefix}/rdzv/ctl/round"
    admin.txn((), [Put(round_key.encode(), json.dumps({"round": 7, "members": [["x_1_0", 1]]}).encode())])
    agent = c.agent(sealer=key)
    with caplog.at_level(logging.WARNING):
        info = agent.next_rendezvous()
    assert info.world_size == 1, "the planted node got no seat"
    assert "Ignoring the rendezvous node key" in caplog.text and "127.0.0.1_1_0" in caplog.text
    assert f"The round record in '{round_key}' is void for this job; it is deleted" in caplog.text
    record, _ = admin.get(round_key.encode())
    assert record is not None and Codec(key, b"").round(record) is not None, "the agent's own record replaced it"


def test_an_agent_without_the_jobs_key_is_refused_and_closes_nothing(cluster: Callable[..., Cluster]) -> None:
    c = cluster(min_nodes=1, max_nodes=2, last_call_timeout=1.0)
    keyed = c.agent(sealer=Sealer(b"k" * 32))
    keyed.next_rendezvous()
    stranger = c.agent()
    with pytest.raises(RendezvousStateError, match="signed with the job's key, and this agent has none"):
        stranger.next_rendezvous()
    assert stranger.shutdown()
    assert c.server.client().get(f"{c.prefix}/rdzv/ctl/closed".encode())[0] is None, "the refused agent closed it"
    assert not keyed.is_closed()


def test_a_run_of_the_older_state_protocol_is_named_with_the_fix(cluster: Callable[..., Cluster]) -> None:
    c = cluster()
    c.server.client().txn((), [Put(f"{c.prefix}/state".encode(), b"ERV3...")])
    with pytest.raises(RendezvousStateError, match=f"protocol=state.*'etcdctl del {c.prefix}/state'"):
        c.agent().next_rendezvous()


def test_settings_come_from_torchrun_options_with_torchs_defaults() -> None:
    params = RendezvousParameters("etcd-v3", "127.0.0.1:2379", "job", 2, 4, keep_alive_interval="1",
                                  last_call_timeout="1")
    s = settings_from(params)
    assert (s.min_nodes, s.max_nodes, s.join_timeout, s.last_call_timeout, s.window) == (2, 4, 600.0, 1.0, 3.0)
    with pytest.raises(ValueError, match="join_timeout"):
        settings_from(RendezvousParameters("etcd-v3", "x", "job", 1, 1, join_timeout="0"))
    with pytest.raises(ValueError, match="--nnodes"):
        Settings("job", 3, 2)


def test_a_large_round_record_is_compressed_signed_and_bounded(caplog: pytest.LogCaptureFixture) -> None:
    prefix = b"/p/run/rdzv/"
    codec = Codec(Sealer(b"k" * 32), prefix + b"node/")
    key = prefix + b"ctl/round"
    members = [[f"10.0.{i // 250}.{i % 250}_{4000 + i}_0", 10_000 + i] for i in range(1024)]
    value = codec.encode(key, {"round": 5, "members": members, "lease": 7, "sealed_by": "x", "reason": "max_nodes"},
                         after=0, lease=7, incarnation=0)
    plain = len(json.dumps(members))
    assert len(value) < plain / 3, f"{len(value)} bytes for {plain} of JSON: every agent reads it"
    record = codec.round(KeyValue(key, value, 42, 42, lease=7))
    assert record is not None and (record.round, len(record.members), record.revision) == (5, 1024, 42)
    bomb = Sealer(b"k" * 32).seal(key, b"z" + zlib.compress(b"{" + b" " * (5 << 20) + b"}"))
    with caplog.at_level(logging.WARNING):
        assert codec.round(KeyValue(key, bomb, 43, 43, lease=7)) is None
    assert "decompresses to more than" in caplog.text


# == review findings: names reused, planted control keys, a stalled sealer ====================================

def test_an_agent_restarted_under_its_predecessors_name_joins_instead_of_taking_its_seat(
        cluster: Callable[..., Cluster]) -> None:
    """A container restarted in place has the same host name and often the same pid: the nonce in every node
    name keeps the names apart; should two ever match, the seat of a key on another lease is not taken."""
    c = cluster(min_nodes=2, max_nodes=2)
    a, b = c.agent(), c.agent()
    assert a.node.nonce and a.node.name != b.node.name and a.node.name.endswith(a.node.nonce)
    assert NodeId("h", 1, 0).name == "h_1_0", "keys written before the nonce keep their names"
    together([a, b])
    successor = c.agent()
    successor._node = b.node  # the same name as its predecessor, whose key is still alive
    successor._my_key = b._my_key
    successor._heartbeat = type(b._heartbeat)(successor._client, successor.settings, successor._leases,
                                              b._my_key, b.node.name, successor._clock)
    thread, box = in_background(successor)
    eventually(lambda: a.num_nodes_waiting() > 0, what="the survivor is asked to re-form")
    assert not box, "the successor took round 0's seat without joining"
    c.kill(b)
    infos = together([a])
    thread.join(10)
    assert seats(infos + box) == [(0, 2), (1, 2)] and infos[0].bootstrap_store_info is not None


def test_control_keys_planted_without_the_jobs_key_neither_close_block_nor_restart_it(
        cluster: Callable[..., Cluster], caplog: pytest.LogCaptureFixture) -> None:
    c = cluster(min_nodes=1, max_nodes=2, last_call_timeout=1.0)
    key = Sealer(b"k" * 32)
    admin = c.server.client()
    ctl = f"{c.prefix}/rdzv/ctl/"
    admin.txn((), [Put(f"{ctl}closed".encode(), b"{}"), Put(f"{ctl}sealer/0".encode(), b'{"by": "x"}')])
    agent = c.agent(sealer=key)
    with caplog.at_level(logging.WARNING):
        info = agent.next_rendezvous()
    assert info.world_size == 1 and not agent.is_closed()
    assert f"Ignoring the rendezvous key '{ctl}closed'" in caplog.text
    admin.txn((), [Put(f"{ctl}next/5".encode(), b'{"round": 5}')])
    time.sleep(0.3)
    assert agent.num_nodes_waiting() == 0, "an unsigned 'waiting' signal restarts nobody"


def test_a_sealer_whose_claim_expired_while_it_stalled_cannot_seal_from_its_old_view(
        cluster: Callable[..., Cluster]) -> None:
    c = cluster(min_nodes=1, max_nodes=2)
    a = c.agent()
    a._put_join(0, None, 0, False)
    claim = a._claim_sealer(0, 0)
    assert claim
    view = View()
    kvs, _ = a._client.get_prefix(a._prefix)
    for kv in kvs:
        a._apply(view, kv, "put")
    sealer_key = f"{c.prefix}/rdzv/ctl/sealer/0".encode()
    c.server.client().delete_prefix(sealer_key)  # its lease expired while it was paused; another may claim
    assert a._write_round(0, view, "last call", sealer_key, claim) is None
    assert c.server.client().get(f"{c.prefix}/rdzv/ctl/round".encode())[0] is None, "no round sealed"


# == values: strict JSON, bounded, warnings that cannot flood or forge the log =================================

@pytest.mark.parametrize("body", [b'{"round": 1e999, "members": [["a_1_0", 1]]}', b'{"round": NaN}',
                                  b"[" * 200_000 + b"]" * 200_000, b'{"round": true, "members": [["a_1_0", 1]]}',
                                  b'{"round": 1.0, "members": [["a_1_0", 1]]}', b'"a string"'])
def test_malformed_json_of_every_kind_is_a_refused_value(body: bytes, caplog: pytest.LogCaptureFixture) -> None:
    prefix = b"/p/run/rdzv/"
    codec = Codec(Sealer(None), prefix + b"node/")
    kv = KeyValue(prefix + b"ctl/round", body, 1, 1)
    with caplog.at_level(logging.WARNING):
        assert codec.round(kv) is None
        assert codec.node(KeyValue(prefix + b"node/a_1_0", body, 1, 1)) is None
        if not body.startswith(b'{"round": true') and not body.startswith(b'{"round": 1.0'):
            assert codec.control(KeyValue(prefix + b"ctl/closed", body, 1, 1)) is False
    assert "Ignoring the rendezvous" in caplog.text


def test_warnings_about_planted_values_are_rate_limited_and_escape_the_key(caplog: pytest.LogCaptureFixture) -> None:
    prefix = b"/p/run/rdzv/"
    codec = Codec(Sealer(b"k" * 32), prefix + b"node/")
    with caplog.at_level(logging.WARNING):
        for i in range(200):
            codec.node(KeyValue(prefix + f"node/x{i}\nFAKE LOG LINE".encode(), b"{}", 1, 1))
    lines = [r for r in caplog.records if "Ignoring the rendezvous node key" in r.getMessage()]
    assert len(lines) == 1, "one line a minute per kind, however many keys were planted"
    assert "\\nFAKE LOG LINE" in lines[0].getMessage() and "\nFAKE" not in lines[0].getMessage()


def test_without_a_key_a_rendezvous_off_this_machine_warns_once_at_start(caplog: pytest.LogCaptureFixture) -> None:
    from elastic_runner.rendezvous.options import parse_options

    with caplog.at_level(logging.WARNING):
        parse_options(RendezvousParameters("etcd-v3", "127.0.0.1:2379", "job", 1, 2))
    assert "without the job's key" not in caplog.text
    with caplog.at_level(logging.WARNING):
        parse_options(RendezvousParameters("etcd-v3", "etcd.example:2379", "job", 1, 2))
    assert caplog.text.count("runs without the job's key") == 1


# == liveness while waiting in the rendezvous: a node lost there is counted out, not waited for ==================

class Ports:
    """The agents' liveness ports, faked: who answers (alive) and who was asked, by agent name."""

    def __init__(self) -> None:
        self.dead: set[str] = set()
        self.asked: list[str] = []

    def give(self, handler: LeaseRendezvousHandler, port: int = 4000) -> LeaseRendezvousHandler:
        """``handler``'s agent answers on ``port`` as its node's name (and asks the others)."""

        def lost(address: str, port: int, agent: str) -> bool:
            assert address == "127.0.0.1", "asked at the address its node key names"
            self.asked.append(agent)
            return agent in self.dead

        handler.liveness = AgentLiveness(port, handler.node.name, lost)
        return handler


def test_a_member_lost_while_the_others_wait_in_the_rendezvous_is_counted_out_when_its_port_is_silent(
        cluster: Callable[..., Cluster], caplog: pytest.LogCaptureFixture) -> None:
    c = cluster(min_nodes=1, max_nodes=3, last_call_timeout=30.0)
    ports = Ports()
    a, b, lost = (ports.give(c.agent()) for _ in range(3))
    together([a, b, lost], timeout=40)
    lost._heartbeat.stop()  # lost while the others wait: no beat counts it out, and its lease has not expired
    ports.dead.add(lost.node.name)
    with caplog.at_level(logging.WARNING, logger="elastic_runner.rendezvous.leases"):
        infos = together([a, b], timeout=10)
    assert seats(infos) == [(0, 2), (1, 2)], "sealed without its lease's expiry (the fake clock never moves)"
    assert lost.node.name in ports.asked
    assert "do not answer on their liveness ports" in caplog.text


def test_a_waited_for_member_that_answers_or_names_no_port_is_waited_for_until_its_lease_expires(
        cluster: Callable[..., Cluster]) -> None:
    c = cluster(min_nodes=1, max_nodes=4, last_call_timeout=30.0)
    ports = Ports()
    a, b = (ports.give(c.agent()) for _ in range(2))
    answering, portless = ports.give(c.agent()), c.agent()  # (an agent that keeps no workers names no port)
    together([a, b, answering, portless], timeout=40)
    for member in (answering, portless):
        member._heartbeat.stop()  # alive (answering) or unknown (portless): neither is evidence of a loss
    threads = [in_background(h) for h in (a, b)]
    eventually(lambda: ports.asked.count(answering.node.name) >= 2, what="asked at once and again after 0.5 s")
    assert all(not box for _, box in threads), "a member that answers, or names no port, holds the round"
    assert portless.node.name not in ports.asked
    for member in (answering, portless):
        c.server.expire_lease(member._heartbeat.current)
    for t, _ in threads:
        t.join(5)
    assert seats([box[0] for _, box in threads]) == [(0, 2), (1, 2)]


def test_a_sealer_lost_while_the_others_wait_for_its_seal_is_counted_out_and_replaced(
        cluster: Callable[..., Cluster]) -> None:
    c = cluster(min_nodes=1, max_nodes=3, last_call_timeout=30.0)
    ports = Ports()
    a, b, sealer = (ports.give(c.agent()) for _ in range(3))
    together([a, b, sealer], timeout=40)
    # The sealer of round 1 claimed it and was lost before it sealed: its claim and key live on its lease.
    sealer._heartbeat.stop()
    claim = f"{c.prefix}/rdzv/ctl/sealer/1".encode()
    ghost = c.server.client()
    ghost.txn((), [Put(claim, json.dumps({"by": sealer.node.name}).encode(), sealer._heartbeat.current)])
    ports.dead.add(sealer.node.name)
    infos = together([a, b], timeout=10)
    assert seats(infos) == [(0, 2), (1, 2)], "the lost sealer's claim and key went: another sealed the round"
    assert sealer.node.name in ports.asked


def test_a_sealer_that_answers_keeps_its_claim(cluster: Callable[..., Cluster]) -> None:
    c = cluster(min_nodes=1, max_nodes=2, last_call_timeout=30.0)
    ports = Ports()
    a, sealer = (ports.give(c.agent()) for _ in range(2))
    together([a, sealer], timeout=40)
    claim = f"{c.prefix}/rdzv/ctl/sealer/1".encode()
    c.server.client().txn((), [Put(claim, json.dumps({"by": sealer.node.name}).encode(),
                                   sealer._heartbeat.current)])
    claimed = c.server.client().get(claim)[0]
    thread, box = in_background(a)
    eventually(lambda: ports.asked.count(sealer.node.name) >= 2, what="the sealer is asked, and again")
    assert not box, "a live sealer is waited for"
    assert c.server.client().get(claim)[0] == claimed, "its claim stands as it wrote it"
    assert c.server.client().get(sealer._my_key)[0] is not None, "and so does its key"
    c.server.client().txn((), [Delete(claim)])  # it gives its claim up, and joins
    sealer_thread, sealer_box = in_background(sealer)
    thread.join(10)
    sealer_thread.join(10)
    assert seats(box + sealer_box) == [(0, 2), (1, 2)]


@pytest.mark.parametrize("alive", [[0, "a"], [65536, "a"], ["4000", "a"], [4000, ""], [4000, "a\nb"], [4000, "a" * 257],
                                   [4000], {"port": 4000}, [True, "a"]])
def test_a_node_key_whose_alive_field_is_malformed_is_void(alive: Any) -> None:
    prefix = b"/p/run/rdzv/"
    codec = Codec(Sealer(None), prefix + b"node/")
    node = NodeId("127.0.0.1", 1, 0, "n")
    body = {"node": node.name, "addr": node.addr, "pid": 1, "local_id": 0, "nonce": "n", "want": 1}

    def read(value: dict[str, Any]) -> Any:
        return codec.node(KeyValue(prefix + b"node/" + node.name.encode(), json.dumps(value).encode(), 1, 1))

    good, portless = read({**body, "alive": [4000, "a-1-2"]}), read(body)
    assert good is not None and (good.alive_port, good.alive_agent) == (4000, "a-1-2")
    assert portless is not None and portless.alive_port == 0
    assert read({**body, "alive": alive}) is None


def test_one_pass_of_questions_is_bounded_so_the_asker_reads_its_watch_between_two(
        cluster: Callable[..., Cluster]) -> None:
    from elastic_runner.rendezvous.departures import ASK_PASS_S

    c = cluster()
    clock = FakeClock()
    asked: list[str] = []

    def slow(address: str, port: int, agent: str) -> bool:  # each question waits out a lookup or a connect
        asked.append(agent)
        clock.advance(0.4)
        return False

    asker = c.agent()
    asker.liveness = AgentLiveness(4000, "asker", slow)
    members = [Joiner(NodeId("127.0.0.1", 10 + i, 0, "n"), 0, 1, alive_port=4000, alive_agent=f"m{i}")
               for i in range(8)]
    schedule = AskSchedule(0.5, 5.0, clock)
    per_pass = int(ASK_PASS_S / 0.4) + 1  # (the question that crosses the limit is the pass's last)
    for _ in range(3):
        before = len(asked)
        assert asker.silent(members, schedule) == []
        assert len(asked) - before == per_pass, "a pass stops at its limit; the rest wait for the next"
    assert sorted(asked[:len(members)]) == sorted(m.alive_agent for m in members), \
        "those never asked come first: every member is asked once before any is asked twice"


def test_the_waited_for_are_asked_at_once_then_at_doubling_intervals_up_to_the_longest() -> None:
    clock = FakeClock()
    schedule = AskSchedule(0.5, 3.0, clock)
    assert schedule.due("x") and schedule.next_due(["x"]) is None, "one never asked is due at once"
    waits = []
    for _ in range(6):
        schedule.asked("x")
        due = schedule.next_due(["x", "never-asked"])
        assert due is not None and not schedule.due("x")
        waits.append(due - clock.now)
        clock.now = due
        assert schedule.due("x")
    assert waits == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]
