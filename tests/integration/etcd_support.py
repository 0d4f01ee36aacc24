"""Helpers the etcd integration tests import by name: a gateway client for a test server, and the test PKI's paths."""

from __future__ import annotations

from dataclasses import dataclass

from elastic_runner.rendezvous.gateway import EtcdGatewayClient
from elastic_runner.rendezvous.options import EtcdOptions, parse_endpoints
from elastic_runner.testing.etcd_server import EtcdServer


def gateway_client(server: EtcdServer, **kwargs: object) -> EtcdGatewayClient:
    kwargs.setdefault("request_timeout", 5)
    kwargs.setdefault("retry_timeout", 10)
    return EtcdGatewayClient(EtcdOptions(parse_endpoints(server.url), **kwargs))  # type: ignore[arg-type]


@dataclass(frozen=True)
class Certs:
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    other_ca: str  #: a CA that signed nothing here (for mismatch tests)
