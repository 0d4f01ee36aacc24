"""A node whose configuration differs from the running job's is refused before it joins (a spare before it waits):
what is compared, the record in the rendezvous (signed, fresh only while the job runs, removed when its node ends),
and the agent's one line and exit status 2."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as tdist

from elastic_runner.agent.config_check import ConfigRecord, ConfigRefused, job_records, refuse_if_config_differs
from elastic_runner.agent.terminal import agent_exit_status
from elastic_runner.config import load_config
from elastic_runner.lifecycle import EXIT_USAGE
from elastic_runner.recovery.exclusions import NODE_NAME_VAR
from elastic_runner.rendezvous.options import SCOPE_VAR
from elastic_runner.recovery.job_config import (
    NODE_LOCAL,
    REFRESH_S,
    STALE_S,
    JobConfigs,
    decode,
    differing,
    digest,
    encode,
    for_this_node,
)
from elastic_runner.rendezvous.leases import LeasedSlots
from elastic_runner.testing.memory_etcd import MemoryEtcd, MemoryKV

from ..support import Clock

KEY = b"k" * 32


class FakeHandler:
    """What the agent reads of a rendezvous handler: its run and a store that lasts."""

    def __init__(self, run_id: str = "job1", store: Any = None) -> None:
        self.run_id = run_id
        self.store = store if store is not None else tdist.HashStore()
        self.ttls: list[float | None] = []

    def get_run_id(self) -> str:
        return self.run_id

    def lasting_store(self, ttl: float | None) -> Any:
        self.ttls.append(ttl)
        return self.store


def _cfg(tmp_path: Path, *overrides: str) -> Any:
    path = tmp_path / "job.yaml"
    path.write_text("train: {max_steps: 20}\n")
    return load_config(str(path), list(overrides))


# -- what is compared ----------------------------------------------------------------------------------------------


def test_every_key_that_shapes_the_computation_is_compared_and_only_a_nodes_own_keys_are_not(tmp_path: Path) -> None:
    job = digest(_cfg(tmp_path))
    assert differing(job, digest(_cfg(tmp_path, "optim.lr=0.2"))) == ["optim.lr"]
    assert differing(job, digest(_cfg(tmp_path, "logging.every_steps=7", "model.compile=true"))) == \
        ["logging.every_steps", "model.compile"]
    assert differing(job, digest(_cfg(tmp_path, "run.dir=/elsewhere", "data.num_workers=2", "metrics.port=9100",
                                       "logging.level=DEBUG", "recovery.standby=false"))) == []
    assert {"torch", "elastic_runner"} <= job.keys() and not NODE_LOCAL & job.keys()
    assert not [k for k in job if k.startswith("metrics.")], "metrics.* is a node's own"


def test_a_free_form_value_is_hashed_whole_so_its_own_keys_never_reach_the_store(tmp_path: Path) -> None:
    keys = digest(_cfg(tmp_path, "model.params={'s3://bucket/customer-x': 1, 'lang=en;x': 2}"))
    assert "model.params" in keys and not [k for k in keys if "customer" in k or "lang" in k]
    records = JobConfigs(tdist.HashStore(), "job1", KEY)
    records.record("node-a", keys)
    found = records.running()
    assert found is not None and records.differing(keys, found) == [], "keys with '=' or ';' in them compare equal"


def test_a_record_of_another_runs_scope_is_not_the_running_jobs(tmp_path: Path) -> None:
    keys = digest(_cfg(tmp_path))
    store = tdist.HashStore()
    JobConfigs(store, "job1", KEY, scope="uid-old").record("node-a", keys)
    assert JobConfigs(store, "job1", KEY, scope="uid-old").running() is not None
    assert JobConfigs(store, "job1", KEY, scope="uid-new").running() is None, \
        "an earlier run's record (same id, same key) does not verify in this run's scope"


def test_the_record_holds_keyed_hashes_not_values(tmp_path: Path) -> None:
    secret_path = "/data/customer-42/corpus"
    keys = digest(_cfg(tmp_path, f"data.path={secret_path}"))
    records = JobConfigs(tdist.HashStore(), "job1", KEY)
    found = records.running() if records.record("node-a", keys) else None
    assert found is not None and secret_path not in found.digest and "customer" not in found.digest
    assert decode(found.digest)["optim.lr"] != keys["optim.lr"], "keyed: optim.lr's hash cannot be guessed without KEY"
    assert records.differing(keys, found) == [] and decode(encode(keys)) == keys


def test_a_script_of_the_users_own_is_compared_by_its_bytes(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('v1')\n")
    first = for_this_node(None, sys.executable, ["-u", str(script), "--out", "/node-a"], ours=False)
    same = for_this_node(None, sys.executable, ["-u", str(script), "--out", "/node-b"], ours=False)
    assert first is not None and differing(first, same) == [], "its arguments may name the node's own paths"
    script.write_text("print('v2')\n")
    assert differing(first, for_this_node(None, sys.executable, ["-u", str(script)], ours=False) or {}) == ["script"]


def test_nothing_is_compared_where_nothing_comparable_is_known() -> None:
    worker = ["-u", "-m", "elastic_runner.train", "--config", "x"]
    assert for_this_node(None, sys.executable, worker, ours=True) is None, \
        "our worker whose config does not load here: its workers exit 2 with the reason"
    assert for_this_node(None, "/usr/bin/my-trainer", ["--flag"], ours=False) is None, "a binary entrypoint"


# -- the record -----------------------------------------------------------------------------------------------------


def test_a_record_is_the_jobs_only_while_it_is_fresh() -> None:
    clock = Clock()
    records = JobConfigs(tdist.HashStore(), "job1", KEY, clock)
    records.record("node-a", {"optim.lr": "aa"})
    found = records.running()
    assert found is not None and found.node == "node-a" and records.differing({"optim.lr": "aa"}, found) == []
    assert records.differing({"optim.lr": "bb"}, found) == ["optim.lr"]
    clock.now += STALE_S + 1
    assert records.running() is None, "a stopped job's: its rendezvous id may be used again with another config"


def test_a_record_nobody_signed_refuses_nobody() -> None:
    store = tdist.HashStore()
    store.set("elastic_runner/config/job1", json.dumps(
        {"kind": "job_config", "run_id": "job1", "node": "x", "written": 9e12, "digest": "optim.lr=ff"}).encode())
    assert JobConfigs(store, "job1", KEY).running() is None
    refuse_if_config_differs(FakeHandler(store=store), KEY, {"optim.lr": "aa"})


def test_on_etcd_a_record_lives_under_a_lease_as_long_as_it_is_fresh() -> None:
    clock = Clock()
    server = MemoryEtcd(clock=clock)
    records = JobConfigs(LeasedSlots(MemoryKV(server), b"/er/job1/lasting/", STALE_S), "job1", KEY, clock)
    records.record("node-a", {"optim.lr": "aa"})
    clock.now += STALE_S + 1
    assert MemoryKV(server).get(b"/er/job1/lasting/elastic_runner/config/job1")[0] is None, "etcd deleted it itself"


# -- the agent ------------------------------------------------------------------------------------------------------


def test_a_node_with_another_config_is_refused_before_its_first_round_with_exit_status_2(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NODE_NAME_VAR, "node-c")
    monkeypatch.setenv("ELASTIC_RUNNER_TERMINATION_LOG", str(tmp_path / "termination-log"))
    (tmp_path / "termination-log").touch()  # Kubernetes creates it; we never do
    handler, clock = FakeHandler(), Clock()
    job = digest(_cfg(tmp_path))
    assert ConfigRecord(KEY, job, clock).write(job_records(handler, KEY, clock))
    assert handler.ttls == [STALE_S], "on etcd-v3 the record's lease is as long as it is fresh"
    refuse_if_config_differs(handler, KEY, digest(_cfg(tmp_path, "run.dir=/node-c")), clock)  # the same job
    with pytest.raises(ConfigRefused) as refused:
        refuse_if_config_differs(handler, KEY, digest(_cfg(tmp_path, "optim.lr=0.2", "batch.global_size=32")), clock)
    line = refused.value.line
    assert "node node-c does not join job job1" in line and "(batch.global_size, optim.lr;" in line, line
    assert agent_exit_status(refused.value) == EXIT_USAGE
    assert (tmp_path / "termination-log").read_text() == \
        "refused: its configuration differs from the running job's (batch.global_size, optim.lr)"
    refuse_if_config_differs(FakeHandler(run_id="job2", store=handler.store), KEY,
                             digest(_cfg(tmp_path, "optim.lr=0.2")), clock)  # another job's: nothing recorded
    clock.now += STALE_S + 1
    refuse_if_config_differs(handler, KEY, digest(_cfg(tmp_path, "optim.lr=0.2")), clock)  # the job ended


def test_a_planted_record_without_the_jobs_key_is_refused_in_one_line_that_encodes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the job's key whoever reaches the store writes the record (docs/trust.md). What it plants may keep
    a node out, but the line that says so stays one line, and the termination message is written, whatever the
    record's keys and node hold (a newline, a lone surrogate, a terminal's escape)."""
    monkeypatch.setenv(NODE_NAME_VAR, "node-c")
    monkeypatch.setenv("ELASTIC_RUNNER_TERMINATION_LOG", str(tmp_path / "termination-log"))
    (tmp_path / "termination-log").touch()
    handler = FakeHandler()
    JobConfigs(handler.store, "job1", None).record("node-x\nERROR forged", {"a\n\udfff\x1b[2J": "0"})  # (sorts first)
    with pytest.raises(ConfigRefused) as refused:
        refuse_if_config_differs(handler, None, digest(_cfg(tmp_path)))
    line = refused.value.line
    assert "\n" not in line and line.encode("utf-8"), ascii(line)
    assert "(a\\n\\udfff\\x1b[2J, " in line and "node node-x\\nERROR forged has it" in line, line
    assert "\\udfff" in (tmp_path / "termination-log").read_text()


def test_the_rounds_first_node_records_from_a_thread_and_the_others_do_not(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NODE_NAME_VAR, "node-a")
    monkeypatch.delenv(SCOPE_VAR, raising=False)  # (read back below with no scope, as the agent writes it then)
    handler = FakeHandler()
    records = JobConfigs(handler.store, "job1", KEY)
    second = ConfigRecord(KEY, {"optim.lr": "bb"})
    second.round_done(handler, group_rank=1)
    first = ConfigRecord(KEY, {"optim.lr": "aa"})
    try:
        first.round_done(handler, group_rank=0)
        deadline = time.monotonic() + 10
        while records.running() is None:
            assert time.monotonic() < deadline, "the round's first node records its configuration"
            time.sleep(0.01)
        written = records.running()
        assert written is not None and records.differing({"optim.lr": "aa"}, written) == []
        deadline = time.monotonic() + 10
        while (again := records.running()) is None or again.written == written.written:
            assert time.monotonic() < deadline, f"and again every {REFRESH_S} s while it is the first"
            time.sleep(0.05)
    finally:
        first.close()
        second.close()
    assert second._thread is None, "a node that is not the round's first never records"


def test_a_fresh_record_of_another_node_that_differs_is_not_written_over(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A node that got in unchecked (the job's first round) and became the round's first does not make its
    configuration the job's: the others, not it, would then be refused when they start again."""
    handler, clock = FakeHandler(), Clock()
    records = job_records(handler, KEY, clock)
    monkeypatch.setenv(NODE_NAME_VAR, "node-a")
    assert ConfigRecord(KEY, {"optim.lr": "aa"}, clock).write(records)
    monkeypatch.setenv(NODE_NAME_VAR, "node-b")
    odd = ConfigRecord(KEY, {"optim.lr": "bb"}, clock)
    with caplog.at_level(logging.WARNING):
        assert not odd.write(records)
    assert "differs from the job's record (written by node node-a: optim.lr)" in caplog.text
    found = records.running() if records is not None else None
    assert found is not None and found.node == "node-a"
    clock.now += STALE_S + 1
    assert odd.write(records), "once node-a's record went stale (node-a is gone) this node's is the job's"
    assert ConfigRecord(KEY, {"optim.lr": "aa"}, clock).write(records), "the same configuration: written over"


def test_a_record_dated_in_the_future_or_not_a_mapping_is_nobodys_word() -> None:
    clock = Clock()
    store = tdist.HashStore()
    records = JobConfigs(store, "job1", KEY, clock)
    records.record("node-a", {"optim.lr": "aa"})
    clock.now -= STALE_S + 1  # this reader's clock far behind the writer's
    assert records.running() is None
    assert decode("optim.lr=aa") is None and decode('{"optim.lr": 3}') is None and decode("[]") is None


@pytest.mark.parametrize("spelling", [["--set", "optim.lr=0.05", "train.max_steps=3"],
                                      ["--set=optim.lr=0.05", "--set", "train.max_steps=3"],
                                      ["--set", "optim.lr=0.05", "--set", "train.max_steps=3"]],
                         ids=["two-values-one-flag", "flag=value", "repeated"])
def test_the_agent_reads_its_workers_overrides_as_they_do(tmp_path: Path, spelling: list[str]) -> None:
    """What the agent compares (and checks the health of, and preloads for) is the config its workers load."""
    from elastic_runner.agent.zygote import worker_config
    from elastic_runner.worker.main import parse_args

    path = tmp_path / "job.yaml"
    path.write_text("train: {max_steps: 20}\n")
    argv = ["--config", str(path), *spelling]
    theirs = load_config(str(path), parse_args(argv).overrides)
    ours = worker_config(argv)
    assert ours is not None and (ours.optim.lr, ours.train.max_steps) == (theirs.optim.lr, theirs.train.max_steps) \
        == (0.05, 3)
    assert differing(digest(ours), digest(theirs)) == []
