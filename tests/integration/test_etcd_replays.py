"""Signed etcd values cannot be replayed: someone who can write etcd but lacks the job's key puts back values
captured from a real earlier run or round (with no lease, on a lease of their own, or over the current value),
and the run is not closed, no round is blocked, no ghost is seated, no agent takes a stale seat or master, and
nobody is restarted for nothing.

The agents are the real handlers (``create_handler``: what torchrun builds from ``--rdzv_backend=etcd-v3``)
on the session's real etcd, with a 3 s dead-node window; the captured values are read from etcd's own history
of the earlier run (a watch from its first revision). A torchrun-level case is at the end.
"""

from __future__ import annotations

import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_runner.rendezvous.kv import KeyValue, Put, WatchEvent
from elastic_runner.rendezvous.plugin import create_handler
from elastic_runner.rendezvous.seal import Sealer
from elastic_runner.rendezvous.values import Codec
from elastic_runner.testing.etcd_server import EtcdServer

from ..support import run_bounded, write_config
from .etcd_support import gateway_client
from .test_etcd_backend import together

pytestmark = pytest.mark.timeout(120)

PREFIX = "/replay"


@pytest.fixture
def job_key(tmp_path: Path) -> str:
    path = tmp_path / "job.key"
    path.write_text("k" * 64 + "\n")
    path.chmod(0o600)
    return str(path)


def agents(server: EtcdServer, run_id: str, n: int, job_key: str, *, min_nodes: int = 1, max_nodes: int = 3,
           **conf: str) -> list[Any]:
    settings = {"keep_alive_interval": "1", "keep_alive_max_attempt": "3", "last_call_timeout": "1",
                "join_timeout": "20", "key_prefix": PREFIX, "auth_key_file": job_key, **conf}
    return [create_handler(RendezvousParameters("etcd-v3", server.endpoint, run_id, min_nodes, max_nodes,
                                                local_addr="127.0.0.1", **settings)) for _ in range(n)]


def rdzv(run_id: str, key: str = "") -> bytes:
    return f"{PREFIX}/{run_id}/rdzv/{key}".encode()


class History:
    """Every value put under a prefix since a revision, from etcd's own history (what an attacker could capture)."""

    def __init__(self, server: EtcdServer, prefix: bytes) -> None:
        self.client = gateway_client(server)
        self.prefix = prefix
        _, self.since = self.client.get(b"/")

    def puts(self, key: bytes) -> list[KeyValue]:
        found: list[KeyValue] = []

        def handle(events: list[WatchEvent]) -> bool:
            found.extend(e.kv for e in events if e.kind == "put" and e.kv.key == key)
            return False

        self.client.watch_prefix(self.prefix, self.since + 1, 1.0, handle)
        assert found, f"no value of {key!r} in the run's history"
        return found


def put_back(server: EtcdServer, kv: KeyValue, on_lease: str = "none") -> int:
    """``kv``'s bytes put back as they were captured: with no lease, or on a lease of the attacker's own."""
    admin = gateway_client(server)
    lease = admin.grant_lease(60) if on_lease == "attacker" else 0
    return admin.txn((), [Put(kv.key, kv.value, lease)]).revision


def shut(handlers: list[Any]) -> None:
    for h in handlers:
        h._stop_watcher()
        h._heartbeat.release()


def delete_run(server: EtcdServer, run_id: str) -> None:
    gateway_client(server).delete_prefix(f"{PREFIX}/{run_id}/".encode())


@pytest.mark.parametrize("on_lease", ["none", "attacker"])
def test_an_old_close_closes_no_new_run(etcd_server: EtcdServer, job_key: str, on_lease: str) -> None:
    run_id = f"closed-{uuid.uuid4().hex[:6]}"
    first = agents(etcd_server, run_id, 2, job_key)
    together(first)
    for h in first:
        h.shutdown()  # the run ends: its agents close it
    old_close, _ = gateway_client(etcd_server).get(rdzv(run_id, "ctl/closed"))
    assert old_close is not None
    delete_run(etcd_server, run_id)  # the keys are gone (expired, or deleted by the operator); the id is reused

    put_back(etcd_server, old_close, on_lease)  # before the new run starts
    second = agents(etcd_server, run_id, 2, job_key)
    try:
        infos = together(second)
        assert sorted(i.rank for i in infos) == [0, 1], "the new run formed"
        assert not any(h.is_closed() for h in second)
        put_back(etcd_server, old_close, on_lease)  # while it trains
        time.sleep(0.5)
        assert not any(h.is_closed() or h._watch.closed for h in second), "a replayed close counts for nobody"
        assert sorted(i.rank for i in together(second)) == [0, 1], "the next round forms too"
    finally:
        shut(second)


def captured_from_an_earlier_run(server: EtcdServer, run_id: str, job_key: str, key: str) -> KeyValue:
    """The first value ``key`` held in a run of two agents that formed round 0, once that run's keys are gone."""
    history = History(server, rdzv(run_id))
    first = agents(server, run_id, 2, job_key)
    together(first)
    shut(first)
    (value, *_) = history.puts(rdzv(run_id, key))
    delete_run(server, run_id)
    return value


def test_an_old_sealer_claim_on_another_lease_blocks_no_round(etcd_server: EtcdServer, job_key: str) -> None:
    run_id = f"sealer-{uuid.uuid4().hex[:6]}"
    claim = captured_from_an_earlier_run(etcd_server, run_id, job_key, "ctl/sealer/0")
    put_back(etcd_server, claim, "attacker")  # round 0's claim, alive on the attacker's lease
    second = agents(etcd_server, run_id, 2, job_key, join_timeout="10")
    try:
        started = time.monotonic()
        assert sorted(i.rank for i in together(second, timeout=15)) == [0, 1]
        assert time.monotonic() - started < 8, "the round sealed without waiting for the replayed claim's owner"
    finally:
        shut(second)


def test_old_waiting_signals_restart_nobody(etcd_server: EtcdServer, job_key: str) -> None:
    run_id = f"next-{uuid.uuid4().hex[:6]}"
    history = History(etcd_server, rdzv(run_id))
    members = agents(etcd_server, run_id, 2, job_key)
    try:
        together(members)
        together(members)  # a restart: the members asked round 0 to end (ctl/next/1)
        (signal, *_) = history.puts(rdzv(run_id, "ctl/next/1"))
        together(members)  # round 2; its members watch ctl/next/3
        replay = KeyValue(rdzv(run_id, "ctl/next/3"), signal.value, 0, 0)  # the old bytes under the key they watch
        for kv in (signal, replay):
            for on_lease in ("none", "attacker"):
                put_back(etcd_server, kv, on_lease)
        time.sleep(0.5)
        assert [h.num_nodes_waiting() for h in members] == [0, 0], "no member is asked to restart"
    finally:
        shut(members)

    delete_run(etcd_server, run_id)  # and in a later run under the same id
    later = agents(etcd_server, run_id, 2, job_key)
    try:
        together(later)
        put_back(etcd_server, signal, "attacker")
        time.sleep(0.5)
        assert [h.num_nodes_waiting() for h in later] == [0, 0]
    finally:
        shut(later)


@pytest.mark.parametrize("on_lease", ["none", "attacker"])
def test_a_departed_nodes_key_put_back_is_no_ghost(etcd_server: EtcdServer, job_key: str, on_lease: str) -> None:
    run_id = f"ghost-{uuid.uuid4().hex[:6]}"
    survivor, departed = agents(etcd_server, run_id, 2, job_key, min_nodes=1, max_nodes=2)
    try:
        together([survivor, departed])
        key = departed._my_key
        ghost, _ = gateway_client(etcd_server).get(key)
        shut([departed])  # the node leaves: its lease is revoked, its key goes
        put_back(etcd_server, ghost, on_lease)
        started = time.monotonic()
        (info,) = together([survivor], timeout=15)
        assert info.world_size == 1, "the ghost got no seat"
        assert time.monotonic() - started < 8, "the round was not held back by the ghost"
        record, _ = gateway_client(etcd_server).get(rdzv(run_id, "ctl/round"))
        sealed = Codec(Sealer(b"k" * 64), rdzv(run_id, "node/")).round(record)
        assert sealed is not None and sealed.names() == [survivor.node.name]
        assert sealed.master is None or sealed.master[0] == "127.0.0.1"
    finally:
        shut([survivor])


def test_a_replayed_round_record_seats_nobody_and_gives_no_stale_master(etcd_server: EtcdServer,
                                                                       job_key: str) -> None:
    run_id = f"record-{uuid.uuid4().hex[:6]}"
    members = agents(etcd_server, run_id, 2, job_key)
    admin = gateway_client(etcd_server)
    try:
        together(members)
        round0, _ = admin.get(rdzv(run_id, "ctl/round"))
        together(members)  # round 1
        for delete_first in (True, False):
            if delete_first:
                admin.delete_prefix(rdzv(run_id, "ctl/round"))  # deleted by hand, then round 0 put back
            revision = put_back(etcd_server, round0)
            time.sleep(0.3)
            assert all(h.num_nodes_waiting() for h in members), "the members leave a round whose record is gone"
            infos = together(members)
            assert sorted(i.rank for i in infos) == [0, 1]
            current, _ = admin.get(rdzv(run_id, "ctl/round"))
            assert current is not None and current.value != round0.value and current.mod_revision > revision, \
                "the agents sealed a fresh record instead of taking the replayed one"
            assert all(h.seated_in.revision == current.mod_revision for h in members)
    finally:
        shut(members)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_close_from_an_earlier_run_does_not_close_a_torchrun_job(etcd_server: EtcdServer, job_key: str,
                                                                  tmp_path: Path) -> None:
    """The same id for a new run (a Kubernetes manifest's fixed --rdzv_id): the old run's signed close, put back,
    must not end the new one; the job trains to its end."""
    run_id = f"torchrun-{uuid.uuid4().hex[:6]}"
    config = write_config(tmp_path / "c.yaml", train={"epochs": 1, "max_steps": 20, "eval_every_steps": 0},
                          snapshot={"every_steps": 10})
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:1", "--nproc_per_node=1",
               "--rdzv_backend=etcd-v3", f"--rdzv_endpoint={etcd_server.endpoint}", f"--rdzv_id={run_id}",
               f"--rdzv_conf=last_call_timeout=1,key_prefix={PREFIX},auth_key_file={job_key}",
               "-m", "elastic_runner.train", "--config", str(config)]
    first = run_bounded(command + ["--set", f"run.dir={tmp_path / 'run1'}"], timeout=120)
    assert first.returncode == 0, first.stdout[-3000:]
    old_close, _ = gateway_client(etcd_server).get(rdzv(run_id, "ctl/closed"))
    assert old_close is not None, "the first run closed its rendezvous"
    delete_run(etcd_server, run_id)
    put_back(etcd_server, old_close, "attacker")
    stop = threading.Event()

    def keep_putting_it_back() -> None:
        while not stop.wait(0.5):
            put_back(etcd_server, old_close, "none")

    thread = threading.Thread(target=keep_putting_it_back, daemon=True)
    thread.start()
    try:
        second = run_bounded(command + ["--set", f"run.dir={tmp_path / 'run2'}"], timeout=120)
    finally:
        stop.set()
        thread.join(5)
    assert second.returncode == 0, second.stdout[-3000:]
    assert "is closed" not in second.stdout
