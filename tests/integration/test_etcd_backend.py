"""The etcd-v3 rendezvous backend against a real etcd: the contract, the factory, and its errors."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable

import pytest
from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from elastic_runner.testing.localjob import free_port
from elastic_runner.rendezvous.backend import create_backend, decode_state
from elastic_runner.testing.etcd_server import EtcdServer
from elastic_runner.rendezvous.plugin import create_handler

from elastic_runner.testing.contracts import BackendContract, KVEnv

from ..unit.test_etcd_fake import params
from .conftest import Certs, gateway_client

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
