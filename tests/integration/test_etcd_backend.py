"""The etcd-v3 rendezvous backend against a real etcd: the contract, the factory, and its errors."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import pytest
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousParameters

from elastic_runner.rendezvous.backend import create_backend, decode_state
from elastic_runner.rendezvous.options import DEFAULT_KEY_PREFIX
from elastic_runner.rendezvous.plugin import create_handler
from elastic_runner.testing.contracts import BackendContract, KVEnv
from elastic_runner.testing.etcd_server import EtcdServer
from elastic_runner.testing.localjob import free_port

from ..unit.test_etcd_fake import params
from ..unit.test_lease_rendezvous import together as at_once
from .etcd_support import Certs, gateway_client

pytestmark = pytest.mark.timeout(60)


class TestBackendContractOnEtcd(BackendContract):
    @pytest.fixture
    def env(self, etcd_env: KVEnv) -> KVEnv:
        return etcd_env


def test_factory_lays_out_state_and_store_under_the_prefix(etcd_server: EtcdServer) -> None:
    backend, store = create_backend(params(etcd_server.endpoint, "layout", key_prefix="/jobs", ttl="120"))
    backend.set_state(b"s")
    store.set("k", "v")
    admin = gateway_client(etcd_server)
    state, _ = admin.get(b"/jobs/layout/state")
    value, _ = admin.get(b"/jobs/layout/store/k")
    assert state is not None and decode_state(state.value, backend.key) == b"s"
    assert value is not None and value.value == b"v"
    assert state.lease == value.lease != 0, "one lease per agent for state and store"


def test_handler_is_created_through_the_plugin(etcd_server: EtcdServer) -> None:
    handler = create_handler(params(etcd_server.endpoint, "plugin"))
    assert handler.get_backend() == "etcd-v3" and handler.get_run_id() == "plugin"


def test_a_dead_endpoint_in_the_list_is_skipped(etcd_server: EtcdServer) -> None:
    dead = f"127.0.0.1:{free_port()}"
    backend, _ = create_backend(params(f"{dead},{etcd_server.endpoint}", "failover", connect_timeout="10"))
    assert backend.set_state(b"x")[2] is True


def test_unreachable_etcd_fails_within_connect_timeout_naming_the_endpoint() -> None:
    port = free_port()
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match=f"127.0.0.1:{port}.*within 2 s.*etcd is running") as info:
        create_backend(params(f"127.0.0.1:{port}", connect_timeout="2", request_timeout="1"))
    assert time.monotonic() - started < 6
    assert info.value.__cause__ is not None, "wrapped from the client error"


def test_operations_ride_out_an_etcd_restart(etcd_factory: Callable[..., EtcdServer]) -> None:
    server = etcd_factory()
    backend, store = create_backend(params(server.endpoint, "restart", retry_timeout="20"))
    _, token, _ = backend.set_state(b"before")
    server.kill()
    restarter = threading.Timer(1.5, server.start)
    restarter.start()
    try:
        started = time.monotonic()
        assert backend.set_state(b"after", token)[:3:2] == (b"after", True)  # blocks through the outage
        assert time.monotonic() - started > 1.0
        store.set("k", "v")
        assert store.get("k") == b"v"
    finally:
        restarter.join()


def test_an_outage_longer_than_retry_timeout_is_a_connection_error(etcd_factory: Callable[..., EtcdServer]) -> None:
    server = etcd_factory()
    backend, _ = create_backend(params(server.endpoint, "outage", retry_timeout="2", request_timeout="1"))
    backend.set_state(b"x")
    server.kill()
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match="could not read the state.*within 2 s"):
        backend.get_state()
    assert time.monotonic() - started < 5


# -- authentication ---------------------------------------------------------------------------------------


def password_file(tmp_path: Path, password: str) -> str:
    path = tmp_path / "pw"
    path.write_text(password + "\n")
    path.chmod(0o600)
    return str(path)


def test_auth_with_the_right_password_works_over_https(auth_server: EtcdServer, certs: Certs,
                                                      tmp_path: Path) -> None:
    backend, store = create_backend(params(auth_server.endpoint, user="root", cacert=certs.ca,
                                           password_file=password_file(tmp_path, "s3cret")))
    assert backend.set_state(b"x")[2] is True
    assert store.add("n", 2) == 2


def test_a_wrong_password_is_a_clear_connection_error(auth_server: EtcdServer, certs: Certs,
                                                      tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match="rejected user 'root'.*password"):
        create_backend(params(auth_server.endpoint, user="root", cacert=certs.ca,
                              password_file=password_file(tmp_path, "wrong")))
    assert time.monotonic() - started < 5, "not retried: a wrong password does not heal"


def test_missing_credentials_say_that_etcd_requires_them(auth_server: EtcdServer, certs: Certs) -> None:
    with pytest.raises(RendezvousConnectionError, match="requires authentication.*user=NAME"):
        create_backend(params(auth_server.endpoint, cacert=certs.ca))


def test_a_password_never_goes_over_plain_http_unless_to_a_loopback_test_etcd(
        loopback_auth_server: EtcdServer, tmp_path: Path) -> None:
    pw = password_file(tmp_path, "s3cret")
    with pytest.raises(ValueError, match="plain http.*cacert.*insecure_loopback_auth=true"):
        create_backend(params(loopback_auth_server.endpoint, user="root", password_file=pw))
    backend, _ = create_backend(params(loopback_auth_server.endpoint, user="root", password_file=pw,
                                       insecure_loopback_auth="true"))
    assert backend.set_state(b"x")[2] is True


# -- TLS ------------------------------------------------------------------------------------------------------


def test_mutual_tls_works_with_the_right_files(tls_server: EtcdServer, certs: Certs) -> None:
    backend, store = create_backend(params(tls_server.endpoint, cacert=certs.ca, cert=certs.client_cert,
                                           key=certs.client_key))
    assert backend.set_state(b"x")[2] is True
    store.set("k", "v")
    assert store.get("k") == b"v"


@pytest.mark.parametrize("case", ["wrong CA", "no client certificate", "plain http"])
def test_a_tls_mismatch_is_a_clear_connection_error(tls_server: EtcdServer, certs: Certs, case: str) -> None:
    conf = {"wrong CA": dict(cacert=certs.other_ca, cert=certs.client_cert, key=certs.client_key),
            "no client certificate": dict(cacert=certs.ca),
            "plain http": {}}[case]
    endpoint = tls_server.endpoint if case != "plain http" else f"http://{tls_server.endpoint}"
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match="TLS") as info:
        create_backend(params(endpoint, connect_timeout="5", **conf))
    assert "cacert" in str(info.value)
    assert time.monotonic() - started < 5, "not retried: a TLS mismatch does not heal"


# -- the lease protocol (protocol=leases, the default) on a real etcd ------------------------------------------------


def lease_agents(endpoint: str, run_id: str, n: int, max_nodes: int = 3, **conf: str) -> list[Any]:
    """``n`` agents of a job of 1 to ``max_nodes`` nodes (a 3 s heartbeat window, as under elastic-runner launch)."""
    settings = {"keep_alive_interval": "1", "keep_alive_max_attempt": "3", "last_call_timeout": "30",
                "join_timeout": "40", **conf}
    return [create_handler(RendezvousParameters("etcd-v3", endpoint, run_id, 1, max_nodes, local_addr="127.0.0.1",
                                                **settings))
            for _ in range(n)]


def together(handlers: list[Any], timeout: float = 30) -> list[Any]:
    out = at_once(handlers, timeout)
    assert not any(isinstance(o, BaseException) for o in out), out
    return out


def a_newcomer_is_seen_and_seated(agents: list[Any], newcomer: Any, within: float) -> None:
    """A node joins a running round: every member's watch reports it waiting, and the next round seats all."""
    box: list[Any] = []
    thread = threading.Thread(target=lambda: box.append(newcomer.next_rendezvous()), daemon=True)
    thread.start()
    deadline = time.monotonic() + within
    while not all(a.num_nodes_waiting() for a in agents) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(a.num_nodes_waiting() for a in agents), "the members' watches show the waiting node"
    infos = together(agents)
    thread.join(10)
    assert sorted(i.rank for i in infos + box) == list(range(len(agents) + 1))
    agents.append(newcomer)


def test_lease_rounds_reform_after_a_restart_lose_a_node_and_take_a_new_one(etcd_server: EtcdServer) -> None:
    run_id = f"leases-{uuid.uuid4().hex[:6]}"
    agents = lease_agents(etcd_server.endpoint, run_id, 3)
    try:
        assert sorted(i.rank for i in together(agents)) == [0, 1, 2]
        started = time.monotonic()
        assert sorted(i.world_size for i in together(agents)) == [3, 3, 3]
        assert time.monotonic() - started < 0.9, "everyone of the previous round is back: no last call"

        dead = agents.pop()
        dead._heartbeat.stop()  # the node dies: no more lease refreshes; etcd expires its key within the 3 s window
        dead._stop_watcher()
        started = time.monotonic()
        assert sorted(i.world_size for i in together(agents)) == [2, 2]
        assert 1.0 < time.monotonic() - started < 8, "waited for the dead node's lease, not for the 30 s last call"

        a_newcomer_is_seen_and_seated(agents, lease_agents(etcd_server.endpoint, run_id, 1)[0], within=10)
    finally:
        for a in agents:
            a.shutdown()
    admin = gateway_client(etcd_server)
    try:
        nodes, _ = admin.get_prefix(f"{DEFAULT_KEY_PREFIX}/{run_id}/rdzv/node/".encode())
        assert nodes == [], "shutdown revokes each agent's liveness lease"
    finally:
        admin.close()


def test_lease_protocol_members_stay_alive_through_an_etcd_restart(etcd_factory: Callable[..., EtcdServer]) -> None:
    """etcd renews every lease when it comes back (a new leader), so an outage longer than the heartbeat window
    drops nobody; the members' watches reconnect and still see a node that joins afterwards."""
    server = etcd_factory()
    agents = lease_agents(server.endpoint, "restart", 2, retry_timeout="30", last_call_timeout="2")
    try:
        together(agents)
        server.kill()
        time.sleep(4.5)  # longer than the 3 s window
        server.start()
        time.sleep(2.0)
        assert [a.num_nodes_waiting() for a in agents] == [0, 0], "nobody was counted dead, nothing re-formed"
        admin = gateway_client(server)
        try:
            nodes, _ = admin.get_prefix(f"{DEFAULT_KEY_PREFIX}/restart/rdzv/node/".encode())
            assert len(nodes) == 2
        finally:
            admin.close()
        # the reconnected watches see a node that joins afterwards
        a_newcomer_is_seen_and_seated(agents, lease_agents(server.endpoint, "restart", 1, last_call_timeout="2")[0],
                                      within=15)
    finally:
        for a in agents:
            a.shutdown()
