"""The etcd-v3 rendezvous backend and store, specified against the in-memory etcd.

``BackendContract`` and ``StoreContract`` are the contract suites (modelled on torch's
``RendezvousBackendTestMixin``, in ``elastic_runner.testing.contracts``); they hold no fixture of
their own. Here they run against ``MemoryEtcd``; tests/integration/test_etcd_backend.py and
test_etcd_store.py run the very same suites against a real etcd. The rest of this file covers what only a fake can show quickly or
deterministically: lost answers, outages, lease refresh on a fake clock, option parsing.
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

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

from elastic_runner.rendezvous.backend import EtcdRendezvousBackend, decode_state, encode_state
from elastic_runner.rendezvous.gateway import EtcdGatewayClient
from elastic_runner.rendezvous.handler import create_handler as etcd_handler
from elastic_runner.rendezvous.kv import Backoff, EtcdUnavailable, LeaseKeeper
from elastic_runner.rendezvous.options import OPTIONS, EtcdOptions, markdown_table, parse_endpoints, parse_options
from elastic_runner.rendezvous.store import EtcdStore, EtcdStoreConnectionError
from elastic_runner.testing.contracts import BackendContract, FakeClock, KVEnv, StoreContract, rendezvous_together
from elastic_runner.testing.localjob import free_port
from elastic_runner.testing.memory_etcd import MemoryEtcd


@pytest.fixture
def memory_env() -> KVEnv:
    clock = FakeClock()
    server = MemoryEtcd(clock=clock)
    return KVEnv(server.client, server.raw_put, clock.advance, clock, f"/test/{uuid.uuid4().hex[:8]}")


class TestBackendContractOnFake(BackendContract):
    @pytest.fixture
    def env(self, memory_env: KVEnv) -> KVEnv:
        return memory_env


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

    from elastic_runner.rendezvous.plugin import create_handler as ours
    from elastic_runner.torchrun_handlers import handler_factory

    (ep,) = [e for e in entry_points(group="torchrun.handlers") if e.name == "etcd-v3"]
    assert ep.load() is handler_factory and handler_factory() is ours
    assert rendezvous_handler_registry._registry["etcd-v3"] is ours


def test_the_entry_point_module_imports_nothing_heavy() -> None:
    code = ("import sys, elastic_runner.torchrun_handlers; "
            "print(any(m.startswith('torch') or m == 'etcd3gw' for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert out.stdout.strip() == "False", out.stderr


def test_a_scope_puts_a_runs_keys_apart_from_earlier_runs_under_the_same_id(monkeypatch: pytest.MonkeyPatch) -> None:
    from elastic_runner.rendezvous.options import SCOPE_VAR, parse_options

    monkeypatch.delenv(SCOPE_VAR, raising=False)
    assert parse_options(params(key_prefix="/jobs")).key_prefix == "/jobs"
    monkeypatch.setenv(SCOPE_VAR, "0b8e5c8e-6f7a-4f7e-9c55-3a1f0e8e2b1d")
    assert parse_options(params(key_prefix="/jobs")).key_prefix == "/jobs/scope/0b8e5c8e-6f7a-4f7e-9c55-3a1f0e8e2b1d"
    monkeypatch.setenv(SCOPE_VAR, "../x")
    with pytest.raises(ValueError, match=SCOPE_VAR):
        parse_options(params())
