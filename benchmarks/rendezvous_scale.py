"""Rendezvous at scale: N simulated agents against one real etcd, and the same against torch's c10d.

Each simulated agent is a thread that drives its own ``DynamicRendezvousHandler`` (torch's protocol,
the same code torchrun runs) through ``next_rendezvous()`` with ``min_nodes = max_nodes = N``, so a
round completes as soon as the N-th agent has joined (no last-call wait). No training, no workers.

- etcd-v3: every agent has its own HTTP client, backend and store, built by the plugin's factory
  exactly as torchrun builds them (connectivity check included), against one local etcd started
  here (``elastic_runner.testing.etcd_server``) unless ``--etcd-endpoint`` names one.
- c10d: torch's backend; one ``TCPStore`` server in this process (the host agent's role) and one
  ``TCPStore`` client per agent, which is what torchrun's c10d backend does across nodes.

Reported per (backend, N): seconds from the common start until every agent has returned from
``next_rendezvous()``, and requests per agent: for etcd-v3 every HTTP request the agent's client
sent (state reads and CAS writes, store, lease, watches, retries); for c10d the store calls of the
rendezvous backend (``get``/``compare_set`` of the state; the handler's own few store calls are not
counted). Both backends rewrite one shared state blob with compare-and-swap, so the number of
attempts grows with N² while agents race; the numbers show where each backend stops being practical.

All agents share this machine's cores and one Python interpreter (GIL), so client-side work (HTTP
requests, pickling a state of N nodes per attempt) competes with the server and stretches every
read-modify-write. Real agents run on separate machines; read the absolute numbers as an upper bound
and the growth with N as the result. By default the handler's event records get a constant name:
torch names each event after its caller with ``inspect.stack()``, which costs milliseconds per call
and, with hundreds of agents in one process, dominates the run for both backends
(``--torch-event-names`` keeps torch's behaviour). The protocol itself is unchanged.

    .venv/bin/python benchmarks/rendezvous_scale.py                       # N = 8, 16, 32, 64 (a few minutes)
    .venv/bin/python benchmarks/rendezvous_scale.py --sizes 8,16,32,64,128,256 --out rdzv.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import tempfile
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import common  # noqa: F401 - puts the repository on sys.path

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters  # noqa: E402
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend  # noqa: E402
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler  # noqa: E402

from elastic_runner.launch import ENV_DEFAULTS  # noqa: E402
from elastic_runner.testing.localjob import free_port  # noqa: E402
from elastic_runner.rendezvous.backend import create_backend, run_prefix  # noqa: E402
from elastic_runner.testing.etcd_server import EtcdServer  # noqa: E402
from elastic_runner.rendezvous.handler import create_handler as etcd_handler  # noqa: E402

for _key, _value in ENV_DEFAULTS.items():  # as elastic-runner launch sets them
    os.environ.setdefault(_key, _value)


class CountingC10dBackend(C10dRendezvousBackend):
    """torch's c10d backend, counting its store calls."""

    def __init__(self, store: dist.Store, run_id: str) -> None:
        self.calls = 0
        super().__init__(store, run_id)

    def _call_store(self, store_op: str, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return super()._call_store(store_op, *args, **kwargs)


def rdzv_params(endpoint: str, run_id: str, n: int, timeout: int, conf: dict[str, str]) -> RendezvousParameters:
    return RendezvousParameters("etcd-v3", endpoint, run_id, n, n, local_addr="127.0.0.1",
                                join_timeout=str(timeout), last_call_timeout="1", **conf)


def build_etcd_agents(endpoint: str, n: int, timeout: int, conf: dict[str, str]
                      ) -> tuple[list[RendezvousHandler], Callable[[], int], Callable[[], None]]:
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    params = rdzv_params(endpoint, run_id, n, timeout, {"key_prefix": "/bench", **conf})
    handlers, clients = [], []
    for _ in range(n):
        backend, store = create_backend(params)  # what the plugin does for torchrun
        clients.append(backend.client)
        handlers.append(etcd_handler(store, backend, params))

    def cleanup() -> None:
        clients[0].delete_prefix((run_prefix("/bench", run_id) + "/").encode())
        for c in clients:
            c.close()

    return handlers, lambda: sum(c.requests for c in clients), cleanup


def build_c10d_agents(n: int, timeout: int, conf: dict[str, str]
                      ) -> tuple[list[RendezvousHandler], Callable[[], int], Callable[[], None]]:
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True, timeout=timedelta(seconds=timeout),
                           wait_for_workers=False)
    params = rdzv_params(f"127.0.0.1:{port}", run_id, n, timeout, conf)
    params.backend = "c10d"
    handlers, backends = [], []
    for _ in range(n):
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout))
        backend = CountingC10dBackend(store, run_id)
        backends.append(backend)
        handlers.append(create_handler(store, backend, params))

    def cleanup() -> None:
        nonlocal server  # the agents' stores need their server until the trial ends
        server = None

    return handlers, lambda: sum(b.calls for b in backends), cleanup


def run_trial(backend: str, n: int, timeout: int, endpoint: str | None, conf: dict[str, str]) -> dict[str, Any]:
    built = time.monotonic()
    if backend == "etcd-v3":
        assert endpoint is not None
        handlers, requests, cleanup = build_etcd_agents(endpoint, n, timeout, conf)
    else:
        handlers, requests, cleanup = build_c10d_agents(n, timeout, conf)
    setup_seconds = time.monotonic() - built
    before = requests()
    start = threading.Barrier(n + 1)
    done: list[float] = [0.0] * n
    errors: list[str] = []
    ranks: list[int] = [-1] * n

    def agent(i: int) -> None:
        start.wait()
        try:
            info = handlers[i].next_rendezvous()
            ranks[i] = info.rank
            handlers[i]._stop_heartbeats()  # measure the round, not the keep-alive traffic after it
        except Exception as exc:  # noqa: BLE001 - reported in the result
            errors.append(f"{type(exc).__name__}: {exc}"[:300])
        done[i] = time.monotonic()

    threads = [threading.Thread(target=agent, args=(i,), daemon=True, name=f"agent-{i}") for i in range(n)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.monotonic()
    for t in threads:
        t.join(timeout + 30)
    seconds = max(done) - t0 if all(done) else float("nan")
    used = requests() - before
    ok = not errors and sorted(ranks) == list(range(n))
    try:
        cleanup()
    except Exception:  # noqa: BLE001, S110 - best effort
        pass
    return {"backend": backend, "nodes": n, "ok": ok, "seconds": round(seconds, 3),
            "requests_per_agent": round(used / n, 1), "setup_seconds": round(setup_seconds, 2),
            "error": errors[0] if errors else None}


def markdown(results: list[dict[str, Any]]) -> str:
    by = {(r["backend"], r["nodes"]): r for r in results}
    sizes = sorted({r["nodes"] for r in results})
    rows = ["| N | c10d time (s) | etcd-v3 time (s) | c10d backend calls/agent | etcd-v3 requests/agent |",
            "|---:|---:|---:|---:|---:|"]

    def cell(r: dict[str, Any] | None, key: str) -> str:
        if r is None:
            return "—"
        return str(r[key]) if r["ok"] else "failed"

    for n in sizes:
        c, e = by.get(("c10d", n)), by.get(("etcd-v3", n))
        rows.append(f"| {n} | {cell(c, 'seconds')} | {cell(e, 'seconds')} | {cell(c, 'requests_per_agent')} | "
                    f"{cell(e, 'requests_per_agent')} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="8,16,32,64", help="comma-separated agent counts (default: 8,16,32,64)")
    parser.add_argument("--backends", default="c10d,etcd-v3", help="which backends, in order (default: both)")
    parser.add_argument("--timeout", type=int, default=300, help="join timeout per trial in seconds (default 300)")
    parser.add_argument("--etcd-endpoint", default=None, help="use this etcd instead of starting one")
    parser.add_argument("--keep-alive-interval", type=int, default=5,
                        help="rdzv keep_alive_interval (torch's default 5; elastic-runner launch uses 1)")
    parser.add_argument("--out", default=None, help="write the JSON here (default: stdout)")
    parser.add_argument("--torch-event-names", action="store_true",
                        help="keep torch's inspect.stack() event naming (slow with many agents in one process)")
    args = parser.parse_args(argv)
    if not args.torch_event_names:
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous

        dynamic_rendezvous.get_method_name = lambda depth=2: "rendezvous"  # see the module docstring
    logging.basicConfig(level=logging.ERROR)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    conf = {"keep_alive_interval": str(args.keep_alive_interval), "keep_alive_max_attempt": "3"}

    server: EtcdServer | None = None
    endpoint = args.etcd_endpoint
    results: list[dict[str, Any]] = []
    started = time.time()
    try:
        if "etcd-v3" in backends and endpoint is None:
            server = EtcdServer(Path(tempfile.mkdtemp(prefix="rdzv-bench-")) / "etcd").start()
            endpoint = server.endpoint
        given_up: set[str] = set()
        for n in sizes:
            for backend in backends:
                if backend in given_up:
                    continue
                result = run_trial(backend, n, args.timeout, endpoint, conf)
                results.append(result)
                print(f"{backend:8s} N={n:5d} ok={result['ok']} {result['seconds']:8.2f} s "
                      f"{result['requests_per_agent']:9.1f} req/agent {result['error'] or ''}", file=sys.stderr,
                      flush=True)
                if not result["ok"]:
                    given_up.add(backend)  # a larger N will not succeed either
    finally:
        if server is not None:
            server.stop()
    report = {
        "benchmark": "rendezvous_scale",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                    "platform": platform.platform()},
        "settings": {"sizes": sizes, "backends": backends, "join_timeout": args.timeout, "min_nodes=max_nodes": True,
                     "last_call_timeout": 1, **conf, "torch_event_names": args.torch_event_names,
                     "etcd": endpoint if args.etcd_endpoint else "local, started here"},
        "results": results,
        "table": markdown(results),
        "wall_seconds": round(time.time() - started, 1),
    }
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    else:
        print(text)
    print(report["table"], file=sys.stderr)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
