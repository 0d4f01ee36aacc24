"""Contract suites for the etcd-v3 rendezvous: what every backend, store and ``KVClient`` must do.

``BackendContract`` (modelled on torch's ``RendezvousBackendTestMixin``) and ``StoreContract``
(``torch.distributed.Store`` semantics, as TCPStore has them) hold no fixture of their own: a
pytest class that inherits one and provides an ``env`` fixture returning a :class:`KVEnv` runs
the whole suite against that etcd. The project runs them against the in-memory fake
(:mod:`elastic_runner.testing.memory_etcd`) and against a real etcd server; anyone who writes
another ``KVClient`` can run them against theirs::

    from elastic_runner.testing.contracts import BackendContract, KVEnv

    class TestMyBackend(BackendContract):
        @pytest.fixture
        def env(self) -> KVEnv: ...
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters, RendezvousStateError

from ..rendezvous.backend import EtcdRendezvousBackend, decode_state, encode_state
from ..rendezvous.handler import create_handler as etcd_handler
from ..rendezvous.kv import KVClient, LeaseKeeper
from ..rendezvous.store import EtcdStore


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


def each_in_a_thread(calls: list[Callable[[], Any]], timeout: float) -> list[Any]:
    """Every call at once, each in a thread of its own (as agents are processes of their own); what each returned,
    or the exception it raised, in order (None: still running after ``timeout``)."""
    out: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            out[i] = calls[i]()
        except BaseException as exc:  # noqa: BLE001 - returned to the caller
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return out


def rendezvous_together(handlers: list[Any], timeout: float) -> list[Any]:
    """Every handler's ``next_rendezvous`` at once (each blocks until the round is complete)."""
    infos = each_in_a_thread([h.next_rendezvous for h in handlers], timeout)
    errors = [i for i in infos if isinstance(i, BaseException)]
    assert not errors and all(infos), f"the round did not form: {errors or infos}"
    return infos


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


