"""The etcd-v3 rendezvous backend and store, specified against the in-memory etcd.

``BackendContract`` and ``StoreContract`` are the contract suites (modelled on torch's
``RendezvousBackendTestMixin``); they hold no fixture of their own. Here they run against
``MemoryEtcd``; tests/integration/test_etcd_backend.py and test_etcd_store.py run the very same
suites against a real etcd. The rest of this file covers what only a fake can show quickly or
deterministically: lost answers, outages, lease refresh on a fake clock, option parsing.
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Callable

import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

from elastic_runner.localjob import free_port
from elastic_runner.rendezvous.backend import EtcdRendezvousBackend, decode_state, encode_state
from elastic_runner.rendezvous.client import (
    Backoff,
    EtcdGatewayClient,
    EtcdUnavailable,
    KVClient,
    LeaseKeeper,
    MemoryEtcd,
)
from elastic_runner.rendezvous.handler import create_handler as etcd_handler
from elastic_runner.rendezvous.options import OPTIONS, EtcdOptions, markdown_table, parse_endpoints, parse_options
from elastic_runner.rendezvous.store import EtcdStore, EtcdStoreConnectionError

from ..conftest import ROOT


@dataclass
class KVEnv:
    """What a contract suite needs from an etcd: clients (one per simulated agent), time, raw writes."""

    new_client: Callable[[], KVClient]
    raw_put: Callable[[bytes, bytes], None]
    elapse: Callable[[float], None]  #: let this much (lease) time pass
    clock: Callable[[], float]
    prefix: str

    def backend(self, client: KVClient | None = None, run_id: str = "run", ttl: int = 60) -> EtcdRendezvousBackend:
        client = client or self.new_client()
        return EtcdRendezvousBackend(client, run_id, self.prefix, ttl, LeaseKeeper(client, ttl, self.clock))

    def store(self, client: KVClient | None = None, read_timeout: float = 2.0, run_id: str = "run") -> EtcdStore:
        client = client or self.new_client()
        return EtcdStore(client, f"{self.prefix}/{run_id}", LeaseKeeper(client, 60, self.clock), read_timeout)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def memory_env() -> KVEnv:
    clock = FakeClock()
    server = MemoryEtcd(clock=clock)
    return KVEnv(server.client, server.raw_put, clock.advance, clock, f"/test/{uuid.uuid4().hex[:8]}")


# == the backend contract ===================================================================================


class BackendContract:
    """What torch's DynamicRendezvousHandler relies on from a RendezvousBackend (plus TTL and layout)."""

    def test_get_state_returns_none_when_no_state_exists(self, env: KVEnv) -> None:
        assert env.backend().get_state() is None

    def test_set_state_creates_the_state_if_absent(self, env: KVEnv) -> None:
        state, token, has_set = env.backend().set_state(b"x")
        assert (state, has_set) == (b"x", True) and token is not None

    def test_get_state_returns_the_state_and_its_token(self, env: KVEnv) -> None:
        backend = env.backend()
        _, token, _ = backend.set_state(b"x")
        assert backend.get_state() == (b"x", token)

    def test_set_state_with_the_current_token_replaces_the_state(self, env: KVEnv) -> None:
        backend = env.backend()
        _, token1, _ = backend.set_state(b"x")
        state2, token2, has_set = backend.set_state(b"y", token1)
        assert (state2, has_set) == (b"y", True) and token2 != token1
        assert backend.get_state() == (b"y", token2)

    def test_a_stale_token_is_rejected_and_the_current_state_returned(self, env: KVEnv) -> None:
        backend = env.backend()
        _, token1, _ = backend.set_state(b"x")
        _, token2, _ = backend.set_state(b"y", token1)
        state3, token3, has_set = backend.set_state(b"z", token1)
        assert (state3, token3, has_set) == (b"y", token2, False)
        assert backend.get_state() == (b"y", token2)

    def test_without_a_token_an_existing_state_is_not_overwritten(self, env: KVEnv) -> None:
        backend = env.backend()
        state1, token1, _ = backend.set_state(b"x")
        assert backend.set_state(b"y") == (state1, token1, False)

    def test_a_foreign_token_gets_the_current_state(self, env: KVEnv) -> None:
        backend = env.backend()
        state1, token1, _ = backend.set_state(b"x")
        assert backend.set_state(b"y", token="invalid") == (state1, token1, False)

    def test_a_token_of_a_vanished_state_returns_none(self, env: KVEnv) -> None:
        backend = env.backend(ttl=1)
        _, token, _ = backend.set_state(b"x")
        env.elapse(3)
        assert backend.set_state(b"y", token) is None

    def test_two_agents_with_the_same_token_exactly_one_wins(self, env: KVEnv) -> None:
        a, b = env.backend(), env.backend()
        _, token, _ = a.set_state(b"base")
        results: dict[str, tuple] = {}
        barrier = threading.Barrier(2)

        def write(name: str, backend: EtcdRendezvousBackend) -> None:
            barrier.wait()
            results[name] = backend.set_state(name.encode(), token)

        threads = [threading.Thread(target=write, args=(n, be)) for n, be in (("a", a), ("b", b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        winners = [n for n, r in results.items() if r[2]]
        assert len(winners) == 1
        loser = "b" if winners == ["a"] else "a"
        assert results[loser][0] == winners[0].encode(), "the loser learns the winner's state in the same call"
        assert a.get_state()[0] == winners[0].encode()

    def test_corrupted_state_raises_a_state_error_that_says_what_to_check(self, env: KVEnv) -> None:
        backend = env.backend()
        for garbage in (b"not a state", b"", encode_state(b"x")[:-1] + b"!", b"ERV3\x09" + b"\0" * 8):
            env.raw_put(backend.key.encode(), garbage)
            with pytest.raises(RendezvousStateError, match=backend.key) as info:
                backend.get_state()
            assert "etcdctl del" in str(info.value) or "version" in str(info.value)
            with pytest.raises(RendezvousStateError):
                backend.set_state(b"y")  # create-if-absent fails and returns the (corrupt) current state

    def test_state_lives_at_prefix_run_id_state(self, env: KVEnv) -> None:
        backend = env.backend(run_id="job-7")
        backend.set_state(b"x")
        kv, _ = backend.client.get(f"{env.prefix}/job-7/state".encode())
        assert kv is not None and decode_state(kv.value, backend.key) == b"x"
        assert kv.lease != 0, "the state is attached to a lease"

    def test_state_expires_with_the_ttl_once_nobody_writes(self, env: KVEnv) -> None:
        backend = env.backend(ttl=1)
        backend.set_state(b"x")
        env.elapse(3)
        assert backend.get_state() is None

    def test_state_stays_while_agents_keep_writing(self, env: KVEnv) -> None:
        backend = env.backend(ttl=1)
        _, token, _ = backend.set_state(b"x")
        for i in range(6):  # 2.4 s: more than twice the TTL
            env.elapse(0.4)
            _, token, has_set = backend.set_state(f"x{i}".encode(), token)
            assert has_set
        assert backend.get_state() == (b"x5", token)

    def test_torch_dynamic_handler_forms_one_round_of_three(self, env: KVEnv, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        params = RendezvousParameters("etcd-v3", "unused", "hrun", 3, 3, local_addr="127.0.0.1",
                                      join_timeout="30", last_call_timeout="1", keep_alive_interval="1")
        handlers = []
        for _ in range(3):
            client = env.new_client()
            backend = EtcdRendezvousBackend(client, "hrun", env.prefix, 60)
            handlers.append(etcd_handler(EtcdStore(client, f"{env.prefix}/hrun"), backend, params))
        try:
            infos = rendezvous_together(handlers, timeout=30)
            assert sorted(i.rank for i in infos) == [0, 1, 2]
            assert {i.world_size for i in infos} == {3}
            assert len({(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in infos}) == 1
        finally:
            for h in handlers:
                h.shutdown()


def rendezvous_together(handlers: list[Any], timeout: float) -> list[Any]:
    """Every handler's ``next_rendezvous`` at once (each blocks until the round is complete)."""
    infos: list[Any] = [None] * len(handlers)
    errors: list[BaseException] = []

    def join(i: int) -> None:
        try:
            infos[i] = handlers[i].next_rendezvous()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(i,)) for i in range(len(handlers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not errors and all(infos), f"the round did not form: {errors or infos}"
    return infos


class TestBackendContractOnFake(BackendContract):
    @pytest.fixture
    def env(self, memory_env: KVEnv) -> KVEnv:
        return memory_env


# == the store contract ======================================================================================


class StoreContract:
    """torch.distributed.Store semantics (TCPStore's), on etcd."""

    def test_set_then_get_returns_bytes(self, env: KVEnv) -> None:
        store = env.store()
        store.set("k", "v")
        store.set("b", b"\x00\xff")
        assert store.get("k") == b"v" and store.get("b") == b"\x00\xff"

    def test_get_blocks_until_another_agent_sets_the_key(self, env: KVEnv) -> None:
        reader, writer = env.store(), env.store()
        threading.Timer(0.5, writer.set, args=("late", "here")).start()
        started = time.monotonic()
        assert reader.get("late") == b"here"
        assert 0.4 < time.monotonic() - started < 3.0  # returns when set, long before any timeout

    def test_get_times_out_with_a_dist_store_error_naming_the_key(self, env: KVEnv) -> None:
        store = env.store(read_timeout=1)
        started = time.monotonic()
        with pytest.raises(dist.DistStoreError, match="'missing'.*read_timeout"):
            store.get("missing")
        assert 0.9 < time.monotonic() - started < 3.0

    def test_add_counts_from_zero_and_returns_the_new_value(self, env: KVEnv) -> None:
        store = env.store()
        assert [store.add("n", 1), store.add("n", 5), store.add("n", -2)] == [1, 6, 4]
        assert store.get("n") == b"4"

    def test_add_on_a_non_integer_says_so(self, env: KVEnv) -> None:
        store = env.store()
        store.set("text", "hello")
        with pytest.raises(ValueError, match="not an integer"):
            store.add("text", 1)

    def test_compare_set_follows_tcpstore(self, env: KVEnv) -> None:
        store = env.store()
        assert store.compare_set("absent", "x", "y") == b"x"  # missing key, expectation not met: returns it
        assert not store.check(["absent"])
        assert store.compare_set("k", "", "first") == b"first"  # missing key matches the empty expectation
        assert store.compare_set("k", "wrong", "second") == b"first"  # mismatch: current value, unchanged
        assert store.compare_set("k", "first", "second") == b"second"
        assert store.get("k") == b"second"
        store.set("empty", b"")
        assert store.compare_set("empty", "", "filled") == b"filled"

    def test_wait_returns_once_all_keys_exist(self, env: KVEnv) -> None:
        reader, writer = env.store(), env.store()
        threading.Timer(0.2, writer.set, args=("a", "1")).start()
        threading.Timer(0.5, writer.set, args=("b", "2")).start()
        started = time.monotonic()
        reader.wait(["a", "b"])
        assert 0.4 < time.monotonic() - started < 3.0

    def test_wait_times_out_listing_the_missing_keys(self, env: KVEnv) -> None:
        store = env.store(read_timeout=30)
        store.set("here", "1")
        started = time.monotonic()
        with pytest.raises(dist.DistStoreError, match="1 of 2 key.*'gone'"):
            store.wait(["here", "gone"], timedelta(seconds=0.5))
        assert time.monotonic() - started < 1.5

    def test_check_does_not_block(self, env: KVEnv) -> None:
        store = env.store(read_timeout=30)
        store.set("a", "1")
        started = time.monotonic()
        assert store.check(["a"]) and not store.check(["a", "b"])
        assert time.monotonic() - started < 1.0

    def test_multi_set_and_multi_get_keep_order_beyond_one_transaction(self, env: KVEnv) -> None:
        store = env.store()
        keys = [f"k{i}" for i in range(300)]  # more than etcd's 128 operations per transaction
        store.multi_set(keys, [str(i) for i in range(300)])
        assert store.multi_get(keys[::-1]) == [str(i).encode() for i in range(299, -1, -1)]

    def test_multi_get_waits_for_late_keys(self, env: KVEnv) -> None:
        reader, writer = env.store(), env.store()
        writer.set("x", "1")
        threading.Timer(0.3, writer.set, args=("y", "2")).start()
        assert reader.multi_get(["x", "y"]) == [b"1", b"2"]

    def test_delete_key_reports_whether_it_existed(self, env: KVEnv) -> None:
        store = env.store()
        store.set("k", "v")
        assert store.delete_key("k") is True
        assert store.delete_key("k") is False
        assert not store.check(["k"])

    def test_num_keys_counts_this_runs_keys_only(self, env: KVEnv) -> None:
        mine, other = env.store(run_id="mine"), env.store(run_id="other")
        mine.set("a", "1")
        mine.add("b", 1)  # the add's idempotency marker is not a store key
        other.set("c", "1")
        assert mine.num_keys() == 2 and other.num_keys() == 1

    def test_append_creates_and_extends(self, env: KVEnv) -> None:
        store = env.store()
        store.append("log", "a")
        store.append("log", b"bc")
        assert store.get("log") == b"abc"

    def test_through_a_prefix_store_as_the_handler_uses_it(self, env: KVEnv) -> None:
        store = env.store(read_timeout=30)
        wrapped = dist.PrefixStore("torch.rendezvous.run.0", store)
        wrapped.set("MASTER_ADDR", b"10.0.0.1")
        assert store.get("torch.rendezvous.run.0/MASTER_ADDR") == b"10.0.0.1"
        assert wrapped.add("/num_members", 2) == 2
        wrapped.multi_set(["r0", "r1"], [b"a", b"b"])
        assert wrapped.multi_get(["r0", "r1"]) == [b"a", b"b"]
        wrapped.set_timeout(timedelta(seconds=0.5))  # torch's store_timeout() sets it on the wrapper
        started = time.monotonic()
        with pytest.raises(dist.DistStoreError):
            wrapped.wait(["never"])
        assert time.monotonic() - started < 1.5

    def test_concurrent_adds_from_threads_are_all_counted(self, env: KVEnv) -> None:
        stores = [env.store() for _ in range(4)]
        seen: list[int] = []
        lock = threading.Lock()

        def work(store: EtcdStore) -> None:
            for _ in range(10):
                value = store.add("counter", 1)
                with lock:
                    seen.append(value)

        threads = [threading.Thread(target=work, args=(s,)) for s in stores]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(seen) == list(range(1, 41))

    def test_a_blocking_wait_costs_a_few_requests_not_a_poll_loop(self, env: KVEnv) -> None:
        store = env.store()
        before = store.client.requests
        with pytest.raises(dist.DistStoreError):
            store.wait(["never"], timedelta(seconds=1.5))
        assert store.client.requests - before <= 3  # read, watch (, read after the watch timed out)


class TestStoreContractOnFake(StoreContract):
    @pytest.fixture
    def env(self, memory_env: KVEnv) -> KVEnv:
        return memory_env


# == what the fake shows best ======================================================================================


def test_an_add_whose_answer_was_lost_is_applied_once(memory_env: KVEnv) -> None:
    server = memory_env.new_client().server  # type: ignore[attr-defined]
    store = memory_env.store()
    store.add("n", 1)
    server.fail_after_apply = 1  # apply the next transaction, lose its answer; the client retries
    assert store.add("n", 1) == 2
    assert store.get("n") == b"2"


def test_an_outage_becomes_rendezvous_and_store_errors_with_a_hint(memory_env: KVEnv) -> None:
    client = memory_env.new_client()
    backend, store = memory_env.backend(client), memory_env.store(client)
    client.server.available = False  # type: ignore[attr-defined]
    with pytest.raises(RendezvousConnectionError, match="could not read the state of run 'run'.*etcd is running"):
        backend.get_state()
    with pytest.raises(RendezvousConnectionError, match="could not write"):
        backend.set_state(b"x")
    with pytest.raises(EtcdStoreConnectionError, match="etcd is running") as info:
        store.set("k", "v")
    assert isinstance(info.value, dist.DistNetworkError)


def test_a_writer_that_keeps_losing_backs_off_and_returns_the_state_after_the_pause(memory_env: KVEnv) -> None:
    winner = memory_env.backend()
    pauses: list[float] = []
    client = memory_env.new_client()

    def pause(seconds: float) -> None:
        pauses.append(seconds)
        winner.set_state(f"during pause {len(pauses)}".encode(), winner.get_state()[1])  # others keep writing

    loser = EtcdRendezvousBackend(client, "run", memory_env.prefix, 60, conflict_backoff=(0.01, 0.04), sleep=pause)
    _, stale, _ = winner.set_state(b"v1")
    winner.set_state(b"v2", stale)
    assert loser.set_state(b"mine", stale)[::2] == (b"v2", False) and pauses == [], "first loss: no pause"
    for expected_window in (0.01, 0.02, 0.04, 0.04):
        state, token, has_set = loser.set_state(b"mine", stale)
        assert not has_set and 0 <= pauses[-1] <= expected_window
        assert (state, token) == winner.get_state(), "the state as it is after the pause"
    assert loser.set_state(b"mine", token)[2] is True
    pauses.clear()
    loser.set_state(b"again", stale)
    assert pauses == [], "a successful write resets the backoff"


def test_lease_is_refreshed_after_a_third_of_the_ttl_and_regranted_when_lost() -> None:
    clock = FakeClock()
    server = MemoryEtcd(clock=clock)
    client = server.client()
    keeper = LeaseKeeper(client, ttl=30, clock=clock)
    first = keeper.current()
    requests = client.requests
    clock.advance(5)
    assert keeper.current() == first and client.requests == requests, "no request within a third of the TTL"
    clock.advance(10)
    assert keeper.current() == first and client.requests == requests + 1, "one keep-alive after a third"
    clock.advance(31)
    assert keeper.current() != first, "an expired lease is replaced"


def test_unreachable_endpoint_fails_after_the_retry_budget_naming_it() -> None:
    port = free_port()
    client = EtcdGatewayClient(EtcdOptions(parse_endpoints(f"127.0.0.1:{port}"), request_timeout=1, retry_timeout=1))
    started = time.monotonic()
    with pytest.raises(EtcdUnavailable, match=f"127.0.0.1:{port}.*within 1 s.*etcd is running"):
        client.get(b"/x")
    assert 0.9 < time.monotonic() - started < 3
    assert client.requests >= 3, "it retried"


def test_backoff_grows_exponentially_with_jitter_up_to_the_cap() -> None:
    backoff = Backoff(base=0.1, cap=1.0)
    delays = [backoff.next_delay() for _ in range(8)]
    assert 0.05 <= delays[0] <= 0.1 and 0.1 <= delays[1] <= 0.2
    assert all(0.5 <= d <= 1.0 for d in delays[4:])


@settings(max_examples=200, deadline=None)
@given(state=st.binary(max_size=300), position=st.integers(min_value=0), flip=st.integers(min_value=1, max_value=255))
def test_any_damaged_byte_of_a_stored_state_is_detected(state: bytes, position: int, flip: int) -> None:
    blob = bytearray(encode_state(state))
    assert decode_state(bytes(blob), "k") == state
    blob[position % len(blob)] ^= flip
    with pytest.raises(RendezvousStateError):
        decode_state(bytes(blob), "k")


@pytest.mark.parametrize("tolerant", [True, False], ids=["etcd-v3 handler", "plain torch handler"])
def test_after_an_outage_longer_than_the_heartbeat_window_live_agents_heartbeat_again(
        memory_env: KVEnv, monkeypatch: pytest.MonkeyPatch, tolerant: bool) -> None:
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    params = RendezvousParameters("etcd-v3", "unused", "orun", 2, 2, local_addr="127.0.0.1", join_timeout="20",
                                  last_call_timeout="1", keep_alive_interval="1", keep_alive_max_attempt="2")
    handlers, backends = [], []
    for _ in range(2):
        client = memory_env.new_client()
        backend = EtcdRendezvousBackend(client, "orun", memory_env.prefix, 60, LeaseKeeper(client, 60, memory_env.clock))
        store = EtcdStore(client, f"{memory_env.prefix}/orun")
        handlers.append((etcd_handler if tolerant else create_handler)(store, backend, params))
        backends.append(backend)
    server = backends[0].client.server  # type: ignore[attr-defined]
    try:
        rendezvous_together(handlers, timeout=20)
        server.available = False  # etcd away for longer than keep_alive_interval * keep_alive_max_attempt (2 s)
        time.sleep(2.5)
        server.available = True
        back = datetime.now(timezone.utc)
        deadline = time.monotonic() + (4 if tolerant else 3)
        fresh: list = []
        while time.monotonic() < deadline:
            state = pickle.loads(backends[0].get_state()[0])
            fresh = [n for n, beat in state.last_heartbeats.items() if beat > back]
            if len(fresh) == 2:
                break
            time.sleep(0.1)
        if tolerant:
            assert len(fresh) == 2 and len(state.participants) == 2 and state.complete, "both agents heartbeat again"
        else:
            assert fresh == [], "torch's handler drops every node, itself included, and stops heartbeating"
    finally:
        for h in handlers:
            h.shutdown()


def test_an_agent_dropped_from_its_running_round_puts_itself_back(
        memory_env: KVEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    params = RendezvousParameters("etcd-v3", "unused", "drun", 2, 2, local_addr="127.0.0.1", join_timeout="20",
                                  last_call_timeout="1", keep_alive_interval="1", keep_alive_max_attempt="3")
    client = memory_env.new_client()
    backend = EtcdRendezvousBackend(client, "drun", memory_env.prefix, 60)
    handlers = [etcd_handler(EtcdStore(memory_env.new_client(), f"{memory_env.prefix}/drun"),
                             EtcdRendezvousBackend(memory_env.new_client(), "drun", memory_env.prefix, 60), params)
                for _ in range(2)]
    try:
        rendezvous_together(handlers, timeout=20)
        # Another agent (here: the test) drops rank 1 from the complete round, as after an outage.
        bits, token = backend.get_state()
        state = pickle.loads(bits)
        victim = next(n for n, rank in state.participants.items() if rank == 1)
        del state.participants[victim]
        del state.last_heartbeats[victim]
        assert backend.set_state(pickle.dumps(state), token)[2]
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            state = pickle.loads(backend.get_state()[0])
            if state.participants.get(victim) == 1:
                break
            time.sleep(0.1)
        assert state.participants.get(victim) == 1 and state.round == 0, "back with its rank, same round"
        assert sorted(state.participants.values()) == [0, 1] and state.complete
    finally:
        for h in handlers:
            h.shutdown()


# == options ===================================================================================================


def params(endpoint: str = "127.0.0.1:2379", run_id: str = "run", **conf: str) -> RendezvousParameters:
    return RendezvousParameters("etcd-v3", endpoint, run_id, 1, 2, **conf)


def test_options_defaults_match_the_documented_table() -> None:
    options = parse_options(params())
    documented = {o.name: o.default for o in OPTIONS}
    for name in ("key_prefix", "ttl", "request_timeout", "retry_timeout", "connect_timeout", "read_timeout"):
        assert str(getattr(options, name)) == documented[name]
    assert options.user is None and options.cacert is None
    assert all(f"`{o.name}`" in markdown_table() for o in OPTIONS)
    assert markdown_table() in (ROOT / "README.md").read_text(), "README's rdzv_conf table is out of date"


def test_endpoints_accept_lists_schemes_default_port_and_ipv6() -> None:
    eps = parse_endpoints("a:1, https://b, [::1]:3,http://c:4/")
    assert [str(e) for e in eps] == ["http://a:1", "https://b:2379", "http://[::1]:3", "http://c:4"]
    assert str(parse_endpoints("a", tls=True)[0]) == "https://a:2379"


@pytest.mark.parametrize("endpoint, message", [
    ("", "needs --rdzv_endpoint"), ("grpc://a:1", "scheme 'grpc'"), ("a:99999", "port 99999"), ("a:b:c", "not HOST"),
])
def test_bad_endpoints_say_what_to_write(endpoint: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_endpoints(endpoint)


def test_bad_options_say_what_to_set(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'ttl' must be a positive"):
        parse_options(params(ttl="0"))
    with pytest.raises(ValueError, match="valid integer"):
        parse_options(params(retry_timeout="soon"))
    with pytest.raises(ValueError, match="'cacert' names .* not a readable file"):
        parse_options(params(cacert=str(tmp_path / "nope.pem")))
    (tmp_path / "c.pem").write_text("x")
    with pytest.raises(ValueError, match="'cert' and 'key' go together"):
        parse_options(params(cert=str(tmp_path / "c.pem")))
    with pytest.raises(ValueError, match="needs a password"):
        parse_options(params(user="alice"))
    with pytest.raises(ValueError, match="must start with '/'"):
        parse_options(params(key_prefix="relative"))


def test_tls_files_turn_on_https_and_password_file_is_read(tmp_path: Path) -> None:
    (tmp_path / "ca.pem").write_text("x")
    (tmp_path / "pw").write_text("s3cret\n")
    options = parse_options(params("h1,h2:2380", cacert=str(tmp_path / "ca.pem"), user="alice",
                                   password_file=str(tmp_path / "pw")))
    assert [str(e) for e in options.endpoints] == ["https://h1:2379", "https://h2:2380"]
    assert (options.user, options.password) == ("alice", "s3cret")
    assert "s3cret" not in repr(options)


def test_unknown_option_keys_are_named_in_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        parse_options(params(tll="5", join_timeout="10"))
    assert "tll" in caplog.text and "join_timeout" not in caplog.text.split("known keys")[0]


# == entry point ================================================================================================


def test_torchrun_finds_the_backend_through_its_entry_point() -> None:
    from importlib.metadata import entry_points

    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    from elastic_runner.rendezvous.plugin import create_handler as ours, handler_factory

    (ep,) = [e for e in entry_points(group="torchrun.handlers") if e.name == "etcd-v3"]
    assert ep.load() is handler_factory and handler_factory() is ours
    assert rendezvous_handler_registry._registry["etcd-v3"] is ours


def test_the_entry_point_module_imports_nothing_heavy() -> None:
    code = ("import sys, elastic_runner.rendezvous.plugin; "
            "print(any(m.startswith('torch') or m == 'etcd3gw' for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert out.stdout.strip() == "False", out.stderr
