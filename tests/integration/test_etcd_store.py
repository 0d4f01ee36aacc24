"""The etcd c10d store against a real etcd: the store contract, and counters shared by processes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from elastic_runner.testing.contracts import KVEnv, StoreContract
from elastic_runner.testing.etcd_server import EtcdServer

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]


class TestStoreContractOnEtcd(StoreContract):
    @pytest.fixture
    def env(self, etcd_env: KVEnv) -> KVEnv:
        return etcd_env


ADDER = textwrap.dedent("""
    import sys
    from elastic_runner.rendezvous.gateway import EtcdGatewayClient
    from elastic_runner.rendezvous.options import EtcdOptions, parse_endpoints
    from elastic_runner.rendezvous.store import EtcdStore

    url, prefix, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    store = EtcdStore(EtcdGatewayClient(EtcdOptions(parse_endpoints(url))), prefix)
    store.wait(["go"])  # start together for maximal contention
    print(" ".join(str(store.add("counter", 1)) for _ in range(count)), flush=True)
""")


def test_concurrent_adds_from_four_processes_are_each_counted_once(etcd_server: EtcdServer, tmp_path: Path) -> None:
    from elastic_runner.rendezvous.gateway import EtcdGatewayClient
    from elastic_runner.rendezvous.options import EtcdOptions, parse_endpoints
    from elastic_runner.rendezvous.store import EtcdStore

    prefix = f"/test/adders-{tmp_path.name}"
    procs: list[subprocess.Popen[str]] = []
    try:
        for _ in range(4):
            procs.append(subprocess.Popen([sys.executable, "-c", ADDER, etcd_server.url, prefix, "25"],
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                          start_new_session=True))
        EtcdStore(EtcdGatewayClient(EtcdOptions(parse_endpoints(etcd_server.url))), prefix).set("go", "1")
        outputs = [p.communicate(timeout=45) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outputs]
    values = sorted(int(v) for out, _ in outputs for v in out.split())
    assert values == list(range(1, 101)), "every add applied exactly once, each process saw distinct values"
