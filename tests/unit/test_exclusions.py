"""Nodes kept out of a job (``recovery.evict_stragglers``): the worker's request to its agent, the record in the
rendezvous (signed, with a time to live), the refusal of an excluded node, and the settings' bad values."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as tdist

from elastic_runner.agent.exclusion import NodeRefused, leave_excluded, refuse_if_excluded
from elastic_runner.agent.terminal import agent_exit_status
from elastic_runner.config import ConfigError, load_config
from elastic_runner.env import EXCLUDE_FILE, GOODPUT_FILE_VAR, ask_to_exclude_this_node, exclusion_asked
from elastic_runner.recovery.exclusions import EXIT_EXCLUDED, NODE_NAME_VAR, Exclusions
from elastic_runner.rendezvous.leases import LeasedSlots
from elastic_runner.rendezvous.options import SCOPE_VAR
from elastic_runner.testing.memory_etcd import MemoryEtcd, MemoryKV

from ..support import Clock

KEY = b"k" * 32


def test_an_exclusion_holds_until_its_time_is_up_and_only_for_its_node() -> None:
    clock = Clock()
    exclusions = Exclusions(tdist.HashStore(), "job1", KEY, clock)
    exclusions.exclude("node-b", 600, "rank 1 (node 1) is a straggler")
    found = exclusions.find("node-b")
    assert found is not None and found.reason == "rank 1 (node 1) is a straggler" and found.until == clock.now + 600
    assert exclusions.find("node-a") is None
    clock.now += 601
    assert exclusions.find("node-b") is None, "let back in once the time is up"


def test_an_exclusion_of_another_job_keeps_nobody_out() -> None:
    store = tdist.HashStore()
    Exclusions(store, "job1", KEY).exclude("node-b", 600, "slow")
    assert Exclusions(store, "job2", KEY).find("node-b") is None


def test_a_record_nobody_signed_keeps_no_healthy_node_out() -> None:
    store = tdist.HashStore()
    store.set("elastic_runner/excluded/job1/node-a", json.dumps(
        {"kind": "excluded", "run_id": "job1", "node": "node-a", "until": 9e12, "reason": "planted"}).encode())
    assert Exclusions(store, "job1", KEY).find("node-a") is None
    assert Exclusions(store, "job1", None).find("node-a") is not None, "(without a key, whoever reaches it decides)"


def test_on_etcd_a_record_lives_under_a_lease_as_long_as_the_exclusion() -> None:
    clock = Clock()
    server = MemoryEtcd(clock=clock)
    exclusions = Exclusions(LeasedSlots(MemoryKV(server), b"/er/job1/lasting/", 120), "job1", KEY, clock)
    exclusions.exclude("node-b", 120, "slow")
    assert exclusions.find("node-b") is not None
    clock.now += 121
    assert exclusions.find("node-b") is None
    assert MemoryKV(server).get(b"/er/job1/lasting/elastic_runner/excluded/job1/node-b")[0] is None, \
        "etcd deleted the key itself"


def test_a_record_copied_from_another_run_under_the_same_id_keeps_nobody_out() -> None:
    """The run's scope (the Job's UID on Kubernetes) is in the etcd key and in the signature: a record of an earlier run
    with the same ``--rdzv_id`` and job key, copied into this run's keys by whoever can write etcd, is nobody's word."""
    server = MemoryEtcd(clock=Clock())
    old = LeasedSlots(MemoryKV(server), b"/er/job1/scope/uid-old/lasting/", None)
    new = LeasedSlots(MemoryKV(server), b"/er/job1/scope/uid-new/lasting/", None)
    Exclusions(old, "job1", KEY, scope="uid-old").exclude("node-b", 600, "slow")
    assert Exclusions(old, "job1", KEY, scope="uid-old").find("node-b") is not None
    key = "elastic_runner/excluded/job1/node-b"
    new.set(key, old.get(key))
    assert Exclusions(new, "job1", KEY, scope="uid-new").find("node-b") is None
    assert Exclusions(new, "job1", KEY).find("node-b") is None, "nor in a run that has no scope"


# -- the worker asks, its agent reads once -------------------------------------------------------------------


def test_a_workers_request_reaches_its_agent_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(GOODPUT_FILE_VAR, str(tmp_path / "goodput.json"))
    assert ask_to_exclude_this_node("rank 1 (node 1) is a straggler", 600)
    assert exclusion_asked(str(tmp_path)) == ("rank 1 (node 1) is a straggler", 600.0)
    assert exclusion_asked(str(tmp_path)) is None, "taken"


def test_without_our_agent_nobody_is_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(GOODPUT_FILE_VAR, raising=False)
    assert not ask_to_exclude_this_node("slow", 600)


@pytest.mark.parametrize("content", ["not json", "[1]", '{"reason": 3, "seconds": 5}', '{"reason": "x", "seconds": true}'])
def test_a_request_that_is_not_one_asks_nothing(tmp_path: Path, content: str) -> None:
    (tmp_path / EXCLUDE_FILE).write_text(content)
    assert exclusion_asked(str(tmp_path)) is None and not (tmp_path / EXCLUDE_FILE).exists()


# -- the agent -----------------------------------------------------------------------------------------------


class FakeHandler:
    """What the agent reads of a rendezvous handler: its run, its minimum of nodes, and a store that lasts."""

    def __init__(self, min_nodes: int = 1) -> None:
        self.settings = SimpleNamespace(min_nodes=min_nodes)
        self.store = tdist.HashStore()

    def get_run_id(self) -> str:
        return "job1"

    def lasting_store(self, ttl: float | None) -> Any:
        return self.store


def test_an_evicted_node_is_recorded_and_then_refused_with_its_own_exit_status(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(NODE_NAME_VAR, "node-b")
    monkeypatch.setenv("ELASTIC_RUNNER_TERMINATION_LOG", str(tmp_path / "termination-log"))
    (tmp_path / "termination-log").touch()  # Kubernetes creates it; we never do
    handler = FakeHandler()
    leaving = leave_excluded(handler, KEY, "rank 1 (node 1) is a straggler", 600, nodes_now=3)
    assert leaving is not None and "node node-b leaves the job: rank 1 (node 1) is a straggler" in leaving.line
    assert (tmp_path / "termination-log").read_text() == "excluded: rank 1 (node 1) is a straggler"
    with pytest.raises(NodeRefused, match="node node-b is excluded from job job1 for another 6") as refused:
        refuse_if_excluded(handler, KEY)
    assert agent_exit_status(refused.value) == EXIT_EXCLUDED
    refuse_if_excluded(FakeHandler(), KEY)  # another job's rendezvous: nothing recorded, nobody refused


def test_the_agent_binds_its_records_to_the_runs_scope(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NODE_NAME_VAR, "node-b")
    handler = FakeHandler()
    monkeypatch.setenv(SCOPE_VAR, "uid-old")
    assert leave_excluded(handler, KEY, "slow", 600, nodes_now=3) is not None
    with pytest.raises(NodeRefused):
        refuse_if_excluded(handler, KEY)
    monkeypatch.setenv(SCOPE_VAR, "uid-new")  # the same store and id, another run: the old record is not its word
    refuse_if_excluded(handler, KEY)


def test_a_node_stays_where_the_job_would_fall_below_its_minimum(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NODE_NAME_VAR, "node-b")
    handler = FakeHandler(min_nodes=2)
    assert leave_excluded(handler, KEY, "slow", 600, nodes_now=2) is None
    refuse_if_excluded(handler, KEY)  # nothing recorded


def test_a_node_stays_where_its_rendezvous_keeps_no_exclusions(monkeypatch: pytest.MonkeyPatch) -> None:
    """The static rendezvous: a job of fixed nodes, which a node that left would end."""
    monkeypatch.setenv(NODE_NAME_VAR, "node-b")

    class Static(FakeHandler):
        def get_backend(self) -> str:
            return "static"

    assert leave_excluded(Static(), KEY, "slow", 600, nodes_now=4) is None


def test_no_termination_message_is_written_where_kubernetes_made_none(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    monkeypatch.setenv(NODE_NAME_VAR, "node-b")
    monkeypatch.setenv("ELASTIC_RUNNER_TERMINATION_LOG", str(tmp_path / "termination-log"))
    assert leave_excluded(FakeHandler(), KEY, "slow", 600, nodes_now=3) is not None
    assert not os.path.exists(tmp_path / "termination-log")


# -- bad settings ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("overrides", "key"), [
    (["recovery.evict_stragglers=true", "recovery.straggler_ratio=null"], "recovery.evict_stragglers"),
    (["recovery.evict_stragglers=true", "parallel.strategy=fsdp"], "recovery.evict_stragglers"),
    (["recovery.evict_stragglers=true", "dist.gradient_sync=ddp"], "recovery.evict_stragglers"),
    (["recovery.evict_stragglers=yes please"], "recovery.evict_stragglers"),
    (["recovery.exclusion_seconds=0"], "recovery.exclusion_seconds"),
], ids=["no-ratio", "fsdp", "torch-ddp", "not-a-bool", "zero-seconds"])
def test_settings_that_cannot_evict_are_refused_naming_the_key(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(None, ["train.max_steps=10", *overrides])
    assert key in str(refused.value)
