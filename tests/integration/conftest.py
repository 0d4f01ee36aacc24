"""Real servers for the integration tests: one etcd per session, plus TLS/auth variants on demand.

The session's etcd listens on free loopback ports with its data in a temporary directory and is
stopped at the end, also when tests fail. If ``etcd`` is missing, the set-up installs Debian's
``etcd-server`` (as root, non-interactively); otherwise these tests are skipped with the reason.
Tests that restart or break a server start their own (``etcd_factory``), so the shared one stays
healthy for the rest of the session.
"""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator

import pytest

from elastic_runner.rendezvous.kv import KVClient, Put
from elastic_runner.testing.contracts import KVEnv
from elastic_runner.testing.etcd_server import EtcdServer, ServerTLS

from .etcd_support import Certs, gateway_client


@pytest.fixture(scope="session")
def etcd_server(etcd_binary: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """The session's etcd (do not restart or reconfigure it; use ``etcd_factory`` for that)."""
    server = EtcdServer(tmp_path_factory.mktemp("etcd") / "data", binary=etcd_binary)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def etcd_factory(etcd_binary: str, tmp_path: Path) -> Iterator[Callable[..., EtcdServer]]:
    """Start extra etcd servers for one test; all are stopped after it."""
    servers: list[EtcdServer] = []

    def make(**kwargs: object) -> EtcdServer:
        server = EtcdServer(tmp_path / f"etcd-{len(servers)}", binary=etcd_binary, **kwargs)  # type: ignore[arg-type]
        servers.append(server)
        return server.start()

    yield make
    for server in servers:
        server.kill()


@pytest.fixture
def etcd_env(etcd_server: EtcdServer) -> Iterator[KVEnv]:
    """The contract suites' view of the real server: a fresh key prefix per test."""
    clients: list[KVClient] = []

    def new_client() -> KVClient:
        clients.append(gateway_client(etcd_server))
        return clients[-1]

    admin = new_client()

    def raw_put(key: bytes, value: bytes) -> None:
        admin.txn((), [Put(key, value)])

    yield KVEnv(new_client, raw_put, time.sleep, time.monotonic, f"/test/{uuid.uuid4().hex[:8]}")
    for c in clients:
        c.close()


# -- TLS ------------------------------------------------------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    if not shutil.which("openssl"):
        pytest.skip("openssl is not installed; it creates the test certificates")
    d = tmp_path_factory.mktemp("certs")
    for ca in ("ca", "other-ca"):
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={ca}",
                 "-keyout", f"{ca}-key.pem", "-out", f"{ca}.pem", cwd=d)
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}-key.pem",
                 "-out", f"{name}.csr", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca-key.pem", "-CAcreateserial",
                 "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=d)
    return Certs(str(d / "ca.pem"), str(d / "server.pem"), str(d / "server-key.pem"), str(d / "client.pem"),
                 str(d / "client-key.pem"), str(d / "other-ca.pem"))


@pytest.fixture
def tls_server(etcd_factory: Callable[..., EtcdServer], certs: Certs) -> EtcdServer:
    """etcd on https that demands client certificates signed by ``certs.ca``."""
    return etcd_factory(tls=ServerTLS(certs.server_cert, certs.server_key, certs.ca, client_cert_auth=True,
                                      client_cert=certs.client_cert, client_key=certs.client_key))


@pytest.fixture
def auth_server(etcd_factory: Callable[..., EtcdServer], certs: Certs) -> EtcdServer:
    """etcd with authentication on, over https (passwords never go over http); user ``root`` / password
    ``s3cret``. Clients need ``cacert=certs.ca``."""
    server = etcd_factory(tls=ServerTLS(certs.server_cert, certs.server_key, certs.ca))
    server.enable_auth("root", "s3cret")
    return server


@pytest.fixture
def loopback_auth_server(etcd_factory: Callable[..., EtcdServer]) -> EtcdServer:
    """etcd with authentication on plain http, on loopback: what ``insecure_loopback_auth=true`` is for."""
    server = etcd_factory()
    server.enable_auth("root", "s3cret")
    return server
