"""Rendezvous at scale: N simulated agents form a round, then lose one, on c10d and on etcd-v3.

Each simulated agent drives its own rendezvous handler, built as torchrun builds it, through
``next_rendezvous()``. No training, no workers. Backends (``--backends``, ``--etcd-protocols``):

- ``c10d``: torch's ``C10dRendezvousBackend`` and torch's ``create_handler``
  (``DynamicRendezvousHandler``); one ``TCPStore`` server (``is_master``, ``multi_tenant``) hosted by
  this main process (the host agent's role) and one ``TCPStore`` client per agent, as torchrun's c10d
  backend does across nodes. As ``elastic-runner launch`` and the torchrun hook do, every agent
  process installs :mod:`elastic_runner.agent.fast_rendezvous` (a re-formed round completes without
  the last call once every member of the previous round is back or dead; 0.1 s polls).
- ``etcd-v3``: our plugin, exactly as torchrun builds it
  (``elastic_runner.rendezvous.plugin.create_handler(RendezvousParameters("etcd-v3", ...))``, its own
  HTTP client per agent, connectivity check included) with the default lease protocol
  (:mod:`elastic_runner.rendezvous.leases`). ``etcd-v3 (state)`` is the same with ``protocol=state``:
  torch's ``DynamicRendezvousHandler`` over one state key in etcd (fast_rendezvous applies to it too,
  as in the agent). One local etcd is started here (``elastic_runner.testing.etcd_server``) unless
  ``--etcd-endpoint`` names one.

Agents run in P worker processes (``--processes``, default min(N, 16)), N/P agents each, one thread
per agent: one interpreter's GIL would serialise every client and hide the protocol's own cost.
Workers are spawned (not forked: torch), kept for the whole run (their rendezvous state is reset
between trials) and rebuilt after a failed trial (or Ctrl-C/SIGTERM: the children are ended, a local
etcd stopped, and what was measured is still reported). ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` is set in
every process (``elastic_runner.agent.launch.ENV_DEFAULTS``), so no rank 0 starts a TCPStore server of its own.

Scenarios (``--scenarios``), per backend and N, backend after backend for each N:

- ``form``: N fresh agents, ``min_nodes = max_nodes = N``: the round completes when the N-th agent
  has joined (no last call). Time: from this process's "go" (``time.monotonic()``; CLOCK_MONOTONIC is
  system-wide on Linux, so the workers' return stamps compare with it) until the last agent returned.
  Each agent stops its heartbeats when it returns (the round is measured, not keep-alive traffic).
- ``lose-one``: the membership change at scale. ``min_nodes = 1, max_nodes = N`` (``--lose-one-min
  N-1``: N-1); one agent (the victim) runs alone in an extra process. A first round forms (not
  reported: with min < max it may also wait ``--last-call-timeout``); heartbeats keep running.
  ``--settle`` seconds later the victim process is SIGKILLed (a node death: its heartbeat or lease
  simply stops) and at the same instant the N-1 survivors call ``next_rendezvous()`` again, as their
  agents would after their workers failed. Time: from the kill until every survivor returned with
  world size N-1. torch's handler (c10d, etcd-v3 state) cannot re-form the round before the victim's
  last heartbeat is older than the dead-node window ``keep_alive_interval * keep_alive_max_attempt``
  (3 s with launch's 1 s and 3); fast_rendezvous then completes it once every survivor is back. The
  lease protocol starts no round while a previous member's key is alive and not back, so it seals
  once the victim's liveness lease (TTL = the window) has expired and every survivor is back. At
  large N give both ``--last-call-timeout 30``: the first round then completes only with all N (a
  1 s last call closes c10d's first round of 256 with whoever got in). The table's note and each result's ``completed_by`` say which
  rule completed the round (the sealer's reason; fast_rendezvous's log line; nothing logged: torch's
  own last call). A last call that passes before every survivor is back seats only some of them:
  the trial fails (in a real job the rest would force one more round).

Every trial is validated: every agent returned without an error, ranks are exactly 0..N-1 (N-1 for
the survivors), one world size. A backend that fails (an error, a wrong world, no round within
``--timeout``) at some N is not tried at larger N in that scenario ("skipped" in the table).

Requests and KB per agent are counted from the agent's "go" to its own return (``lose-one``: of the
survivors, in the second round), averaged (JSON: also the maximum, e.g. the lease protocol's sealer):

- etcd-v3 and etcd-v3 (state): the agent's ``KVClient`` counters (``requests``: every HTTP request,
  retries, leases, watches and the store's reads included; ``bytes``: request and answer bodies as
  JSON on the wire, watch events included). Its keep-alive thread counts while the agent waits.
- c10d: the store calls of torch's rendezvous backend (``get``/``compare_set`` of the state), and as
  bytes the keys and base64 states passed to them and returned. The handler's other store calls
  (``MASTER_ADDR``/``MASTER_PORT`` of the round's bootstrap) and the TCP framing are not counted.

Caveats. Everything runs on this one machine: N agents, P interpreters, the c10d server and etcd
share its cores, so client work (HTTP, JSON, pickling a state of N nodes per attempt) competes with
the servers and stretches every round trip; real agents run on separate machines. Read the absolute
numbers as an upper bound and the growth with N as the result. fast_rendezvous keeps the previous
round's members in module globals, shared here by the agents of one process (they all hold the same
round). By default the torch handler's event records get a constant name: torch names each event
after its caller with ``inspect.stack()``, which costs milliseconds per call and, with many agents in
one process, dominates the run (``--torch-event-names`` keeps torch's behaviour). The protocols
themselves are unchanged.

    .venv/bin/python benchmarks/rendezvous_scale.py                         # N = 8, 32, 128 (a few minutes)
    .venv/bin/python benchmarks/rendezvous_scale.py --sizes 8,16 --etcd-protocols leases,state --out rdzv.json
    .venv/bin/python benchmarks/rendezvous_scale.py --sizes 256,1024 --scenarios lose-one --backends etcd-v3
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import platform
import resource
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for
from pathlib import Path
from typing import Any

import common  # puts the repository on sys.path
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.elastic.rendezvous import RendezvousParameters  # noqa: E402
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend  # noqa: E402

from elastic_runner.agent.launch import ENV_DEFAULTS  # noqa: E402

for _key, _value in ENV_DEFAULTS.items():  # as elastic-runner launch sets them, in every process
    os.environ[_key] = _value

C10D, LEASES, STATE = "c10d", "etcd-v3", "etcd-v3 (state)"
KEY_PREFIX = "/bench"
#: After the first wrong or failed agent, how long to wait for the others' outcome before giving up.
FAIL_GRACE = 3.0


def raise_nofile() -> None:
    """1,024 agents are 1,024+ sockets: soft limit of open files up to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass


# --------------------------------------------------------------------------- worker processes (the agents)


class CountingC10dBackend(C10dRendezvousBackend):
    """torch's c10d backend, counting its store calls and their payload bytes (keys, states, answers)."""

    def __init__(self, store: dist.Store, run_id: str) -> None:
        self.requests = 0
        self.bytes = 0
        self._count_lock = threading.Lock()
        super().__init__(store, run_id)

    def _call_store(self, store_op: str, *args: Any, **kwargs: Any) -> Any:
        result = super()._call_store(store_op, *args, **kwargs)
        size = sum(len(a) for a in args if isinstance(a, (str, bytes)))
        size += len(result) if isinstance(result, (str, bytes)) else 0
        with self._count_lock:
            self.requests += 1
            self.bytes += size
        return result


class Agent:
    """One simulated agent: its handler and whatever counts its requests and bytes."""

    def __init__(self, spec: dict[str, Any]) -> None:
        conf = {"join_timeout": str(spec["timeout"]), "last_call_timeout": str(spec["last_call"]),
                "keep_alive_interval": str(spec["interval"]), "keep_alive_max_attempt": str(spec["attempts"])}
        self.variant = spec["variant"]
        self.client: Any = None
        if self.variant == C10D:
            from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

            params = RendezvousParameters("c10d", spec["endpoint"], spec["run_id"], spec["min"], spec["max"],
                                          local_addr="127.0.0.1", **conf)
            host, port = spec["endpoint"].rsplit(":", 1)
            store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=spec["timeout"]))
            backend = CountingC10dBackend(store, spec["run_id"])
            self.handler: Any = create_handler(store, backend, params)
            self.counter: Any = backend
        else:
            from elastic_runner.rendezvous.plugin import create_handler

            protocol = "state" if self.variant == STATE else "leases"
            params = RendezvousParameters("etcd-v3", spec["endpoint"], spec["run_id"], spec["min"], spec["max"],
                                          local_addr="127.0.0.1", key_prefix=KEY_PREFIX, protocol=protocol, **conf)
            self.handler = create_handler(params)  # what torchrun calls
            # the lease handler's client; for protocol=state CheckedStates(EtcdRendezvousBackend) holds it
            self.client = self.handler._client if protocol == "leases" \
                else self.handler._state_holder._backend.backend.client
            self.counter = self.client

    def counts(self) -> tuple[int, int]:
        return self.counter.requests, self.counter.bytes

    def stop_heartbeats(self) -> None:
        if self.variant == LEASES:
            self.handler._stop_watcher()
            self.handler._heartbeat.stop()
        else:  # torch's handler (c10d, etcd-v3 state)
            self.handler._stop_heartbeats()

    def close(self) -> None:
        """Stop every thread of the handler that sends, give its leases back, close its client."""
        h = self.handler
        try:
            if self.variant == LEASES:
                h._stop_watcher()
                h._heartbeat.release()  # stops the keep-alive thread, revokes the liveness lease
                keeper = h._leases
            else:
                h._stop_heartbeats()
                keeper = h._state_holder._backend.backend.leases if self.variant == STATE else None
            if keeper is not None and keeper._id:
                self.client.revoke_lease(keeper._id)
        except AttributeError:
            raise  # the handler changed: this benchmark must follow it, not skip the clean-up silently
        except Exception:  # noqa: BLE001, S110 - best effort; the main deletes the run's keys
            pass
        if self.client is not None:
            self.client.close()


class HowCompleted(logging.Handler):
    """Why a round completed, per agent thread, from the log lines that say so: the lease protocol's
    sealer ("sealed round R with K node(s) (why)") and fast_rendezvous ("... completing without the
    last call"). torch's own completions (max_nodes, last call) log nothing at INFO."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.by_thread: dict[int, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.endswith(".leases") and "sealed round" in record.msg and record.args:
            self.by_thread[record.thread or 0] = str(record.args[-1])  # type: ignore[index]
        elif record.name.endswith(".fast_rendezvous") and "without the last call" in record.msg:
            self.by_thread[record.thread or 0] = "previous round accounted for (fast_rendezvous)"

    def take(self) -> str | None:
        return self.by_thread.pop(threading.get_ident(), None)


def capture_completions() -> HowCompleted:
    how = HowCompleted()
    for name in ("elastic_runner.rendezvous.leases", "elastic_runner.agent.fast_rendezvous"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        logger.propagate = False  # INFO lines only to the capture; errors still to stderr
        shown = logging.StreamHandler()
        shown.setLevel(logging.ERROR)
        logger.addHandler(shown)
        logger.addHandler(how)
    return how


def worker_main(index: int, parent: int, commands: Connection, results: Connection, torch_event_names: bool) -> None:
    """A worker process: builds agents, runs their ``next_rendezvous()`` on "go", reports each return.

    Commands (dicts): build (spec, count), arm (stop_heartbeats), go, cleanup, exit. Replies: built,
    armed, one "agent" message per agent that returned, cleaned, or error."""
    from elastic_runner.lifecycle import follow_parent

    follow_parent(parent)  # never outlive the benchmark
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the main process ends us
    raise_nofile()
    logging.basicConfig(level=logging.ERROR, format=f"[worker {index}] %(levelname)s %(name)s: %(message)s")
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    from elastic_runner.agent import fast_rendezvous

    how = capture_completions()
    fast = fast_rendezvous.install()  # as elastic-runner launch and the torchrun hook do in every agent process
    if not torch_event_names:
        dynamic_rendezvous.get_method_name = lambda depth=2: "rendezvous"  # see the module docstring
    send_lock = threading.Lock()

    def send(msg: dict[str, Any]) -> None:
        with send_lock:
            results.send(msg)

    agents: list[Agent] = []
    go = threading.Event()

    def run_agent(i: int, agent: Agent, start: threading.Event, stop_heartbeats: bool) -> None:
        start.wait()
        how.take()
        r0, b0 = agent.counts()
        rank = world = error = None
        try:
            info = agent.handler.next_rendezvous()
            done = time.monotonic()
            r1, b1 = agent.counts()
            rank, world = info.rank, info.world_size
            if stop_heartbeats:
                agent.stop_heartbeats()
        except Exception as exc:  # noqa: BLE001 - reported
            done = time.monotonic()
            r1, b1 = agent.counts()
            error = f"{type(exc).__name__}: {exc}"[:400]
        logged = how.take()  # the sealer's or fast_rendezvous's log line in this thread
        record = getattr(agent.handler, "seated_in", None)  # the lease protocol's round record says it to all
        send({"cmd": "agent", "worker": index, "agent": i, "done": done, "rank": rank, "world": world,
              "error": error, "requests": r1 - r0, "bytes": b1 - b0,
              "completed_by": getattr(record, "reason", None) or logged})

    def close_all() -> None:
        for a in agents:
            a.close()
        agents.clear()

    while True:
        try:
            msg = commands.recv()
        except (EOFError, OSError):
            os._exit(0)  # the main is gone
        cmd = msg["cmd"]
        try:
            if cmd == "build":
                close_all()
                fast_rendezvous.set_previous_participants(())  # no previous round from an earlier trial
                began = time.monotonic()
                for _ in range(msg["count"]):
                    agents.append(Agent(msg["spec"]))
                send({"cmd": "built", "worker": index, "seconds": time.monotonic() - began, "fast_rendezvous": fast})
            elif cmd == "arm":
                go = threading.Event()
                for i, agent in enumerate(agents):
                    threading.Thread(target=run_agent, args=(i, agent, go, msg["stop_heartbeats"]), daemon=True,
                                     name=f"agent-{index}-{i}").start()
                send({"cmd": "armed", "worker": index})
            elif cmd == "go":
                go.set()
            elif cmd == "cleanup":
                close_all()
                send({"cmd": "cleaned", "worker": index})
            elif cmd == "exit":
                close_all()
                # Not a normal interpreter exit: C++ destructors of TCPStore clients that threads still use
                # (a failed trial) would abort with "terminate called without an active exception".
                os._exit(0)
        except Exception as exc:  # noqa: BLE001 - reported to the main
            send({"cmd": "error", "worker": index, "error": f"{cmd}: {type(exc).__name__}: {exc}"[:400]})


# --------------------------------------------------------------------------- the main process


class TrialFailed(Exception):
    pass


class Worker:
    """A spawned worker process and its two one-way pipes."""

    def __init__(self, ctx: Any, index: int, torch_event_names: bool) -> None:
        self.index = index
        command_end, self.commands = ctx.Pipe(duplex=False)
        self.results, result_end = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=worker_main, name=f"rdzv-worker-{index}", daemon=True,
                                args=(index, os.getpid(), command_end, result_end, torch_event_names))
        self.proc.start()
        command_end.close()  # the child's ends: closed here so that a dead child reads as EOF
        result_end.close()

    def send(self, msg: dict[str, Any]) -> None:
        try:
            self.commands.send(msg)
        except (BrokenPipeError, OSError) as exc:
            raise TrialFailed(f"worker process {self.index} is gone ({exc})") from exc

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)

    def stop(self, grace: float = 5.0) -> None:
        """Ask to exit, then SIGTERM, then SIGKILL; only this process, by its PID."""
        try:
            self.commands.send({"cmd": "exit"})
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(grace)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(3)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(3)
        for conn in (self.commands, self.results):
            conn.close()


class Pool:
    """Worker processes kept across trials."""

    def __init__(self, torch_event_names: bool) -> None:
        self.ctx = multiprocessing.get_context("spawn")  # torch and fork do not mix
        self.torch_event_names = torch_event_names
        self.workers: list[Worker] = []
        self.extras: list[Worker] = []
        self._next = 0

    def _start(self) -> Worker:
        self._next += 1
        return Worker(self.ctx, self._next, self.torch_event_names)

    def take(self, k: int) -> list[Worker]:
        while len(self.workers) < k:
            self.workers.append(self._start())
        return self.workers[:k]

    def extra(self) -> Worker:
        """A worker for one trial only (the victim)."""
        worker = self._start()
        self.extras.append(worker)
        return worker

    def drop_extras(self) -> None:
        for w in self.extras:
            w.stop(grace=2.0)
        self.extras.clear()

    def close(self) -> None:
        for w in self.workers + self.extras:
            try:
                w.commands.send({"cmd": "exit"})
            except (BrokenPipeError, OSError):
                pass
        for w in self.workers + self.extras:
            w.stop(grace=5.0)
        self.workers.clear()
        self.extras.clear()


def replies(workers: list[Worker], cmd: str, deadline: float) -> dict[int, dict[str, Any]]:
    """One ``cmd`` reply from each worker, or TrialFailed."""
    pending = {w.results: w for w in workers}
    got: dict[int, dict[str, Any]] = {}
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TrialFailed(f"no '{cmd}' from worker(s) {sorted(w.index for w in pending.values())} in time")
        for conn in wait_for(list(pending), timeout=left):
            worker = pending[conn]  # type: ignore[index]
            try:
                msg = conn.recv()  # type: ignore[union-attr]
            except (EOFError, OSError) as exc:
                raise TrialFailed(f"worker process {worker.index} died (exit {worker.proc.exitcode})") from exc
            if msg["cmd"] == "error":
                raise TrialFailed(f"worker {worker.index}: {msg['error']}")
            if msg["cmd"] == cmd:
                got[worker.index] = msg
                del pending[conn]
    return got


def agent_returns(workers: list[Worker], expected: int, world: int, deadline: float
                  ) -> tuple[list[dict[str, Any]], str | None]:
    """Every agent's return (until ``expected`` came back, one failed, or the deadline), and what failed."""
    pending = {w.results: w for w in workers}
    got: list[dict[str, Any]] = []
    failure: str | None = None
    give_up = deadline
    while len(got) < expected and pending:
        left = give_up - time.monotonic()
        if left <= 0:
            failure = failure or f"timeout: {len(got)} of {expected} agents returned"
            break
        for conn in wait_for(list(pending), timeout=left):
            worker = pending[conn]  # type: ignore[index]
            try:
                msg = conn.recv()  # type: ignore[union-attr]
            except (EOFError, OSError):
                failure = failure or f"worker process {worker.index} died (exit {worker.proc.exitcode})"
                del pending[conn]
                continue
            if msg["cmd"] == "error":
                failure = failure or f"worker {worker.index}: {msg['error']}"
            elif msg["cmd"] == "agent":
                got.append(msg)
                if msg["error"]:
                    failure = failure or msg["error"]
                elif msg["world"] != world:
                    failure = failure or (f"an agent returned in a world of {msg['world']}, not {world} (a last "
                                          "call passed before every agent had joined?)")
            if failure is not None:
                give_up = min(give_up, time.monotonic() + FAIL_GRACE)
    if failure is None and len(got) < expected:
        failure = f"{len(got)} of {expected} agents returned"
    return got, failure


def validate(got: list[dict[str, Any]], n: int) -> str | None:
    ranks = sorted(r["rank"] for r in got)
    worlds = {r["world"] for r in got}
    if len(got) != n:
        return f"{len(got)} of {n} agents returned"
    if ranks != list(range(n)):
        return f"ranks are not 0..{n - 1} (duplicates or gaps: {ranks[:8]}...)"
    if worlds != {n}:
        return f"world sizes {sorted(worlds)}, expected {n}"
    return None


def split(n: int, parts: int) -> list[int]:
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def summary(got: list[dict[str, Any]], since: float) -> dict[str, Any]:
    done = [r["done"] for r in got]
    reqs = [r["requests"] for r in got]
    kbs = [r["bytes"] / 1024 for r in got]
    return {"seconds": round(max(done) - since, 3), "first_return_seconds": round(min(done) - since, 3),
            "requests_per_agent": round(statistics.mean(reqs), 1), "requests_max": max(reqs),
            "kb_per_agent": round(statistics.mean(kbs), 1), "kb_max": round(max(kbs), 1),
            "completed_by": sorted({r["completed_by"] for r in got if r["completed_by"]})}


class Trial:
    def __init__(self, pool: Pool, variant: str, scenario: str, n: int, args: argparse.Namespace,
                 etcd_endpoint: str | None) -> None:
        self.pool, self.variant, self.scenario, self.n, self.args = pool, variant, scenario, n, args
        self.etcd_endpoint = etcd_endpoint
        self.run_id = f"bench-{uuid.uuid4().hex[:8]}"
        self.server: Any = None

    def spec(self, min_nodes: int, endpoint: str) -> dict[str, Any]:
        a = self.args
        return {"variant": self.variant, "endpoint": endpoint, "run_id": self.run_id, "min": min_nodes, "max": self.n,
                "timeout": a.timeout, "last_call": a.last_call_timeout, "interval": a.keep_alive_interval,
                "attempts": a.keep_alive_max_attempt}

    def run(self) -> dict[str, Any]:
        n, a = self.n, self.args
        losing = self.scenario == "lose-one"
        survivors = n - 1 if losing else n
        procs = min(survivors, a.processes)
        result: dict[str, Any] = {"backend": self.variant, "scenario": self.scenario, "nodes": n, "ok": False,
                                  "status": "failed", "processes": procs + (1 if losing else 0), "error": None}
        if self.variant == C10D:
            self.server = dist.TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, wait_for_workers=False,
                                        timeout=timedelta(seconds=a.timeout))
            endpoint = f"127.0.0.1:{self.server.port}"
        else:
            assert self.etcd_endpoint is not None
            endpoint = self.etcd_endpoint
        workers = self.pool.take(procs)
        victim = self.pool.extra() if losing else None
        everyone = workers + ([victim] if victim else [])
        spec = self.spec((n - 1 if a.lose_one_min == "N-1" else 1) if losing else n, endpoint)
        began = time.monotonic()
        for w, count in zip(workers, split(survivors, procs)):
            w.send({"cmd": "build", "spec": spec, "count": count})
        if victim is not None:
            victim.send({"cmd": "build", "spec": spec, "count": 1})
        built = replies(everyone, "built", began + 300 + n)  # 16 interpreters importing torch on 2 cores: ~30 s
        result["setup_seconds"] = round(time.monotonic() - began, 2)
        result["fast_rendezvous"] = all(m["fast_rendezvous"] for m in built.values())

        # Round 1: everyone at once.
        for w in everyone:
            w.send({"cmd": "arm", "stop_heartbeats": not losing})
        replies(everyone, "armed", time.monotonic() + 60)
        t_go = time.monotonic()
        for w in everyone:
            w.send({"cmd": "go"})
        got, failure = agent_returns(everyone, n, n, t_go + a.timeout + 30)
        failure = failure or validate(got, n)
        if failure is not None:
            result["error"] = ("first round: " if losing else "") + failure
            if got:
                result["returned"] = len(got)
            return result
        if not losing:
            result.update(summary(got, t_go), ok=True, status="ok")
            return result
        first = summary(got, t_go)
        result["round1_seconds"] = first["seconds"]
        result["round1_requests_per_agent"] = first["requests_per_agent"]

        # Round 2: the victim dies; the survivors rejoin at that instant.
        assert victim is not None
        time.sleep(a.settle)
        for w in workers:
            w.send({"cmd": "arm", "stop_heartbeats": False})
        replies(workers, "armed", time.monotonic() + 60)
        t_kill = time.monotonic()
        os.kill(victim.proc.pid, signal.SIGKILL)
        for w in workers:
            w.send({"cmd": "go"})
        got, failure = agent_returns(workers, survivors, survivors, t_kill + a.timeout + 30)
        victim.proc.join(5)
        failure = failure or validate(got, survivors)
        if failure is not None:
            result["error"] = "after the loss: " + failure
            if got:
                result["returned"] = len(got)
            return result
        result.update(summary(got, t_kill), ok=True, status="ok")
        return result

    def cleanup(self, healthy: bool) -> bool:
        """Close every agent (or end the workers when the trial failed); delete the run's etcd keys."""
        ok = healthy
        if healthy:
            workers = [w for w in self.pool.workers if w.proc.is_alive()]
            try:
                for w in workers:
                    w.send({"cmd": "cleanup"})
                replies(workers, "cleaned", time.monotonic() + 120)
            except TrialFailed:
                ok = False
        self.pool.drop_extras()
        if not ok:  # threads may still be blocked in a rendezvous: start afresh
            self.pool.close()
        self.server = None  # the agents' stores are closed or their processes gone
        return ok


def delete_run_keys(endpoint: str, run_ids: list[str]) -> None:
    from elastic_runner.rendezvous.backend import create_backend, run_prefix

    backend, _ = create_backend(RendezvousParameters("etcd-v3", endpoint, "bench-cleanup", 1, 1,
                                                     key_prefix=KEY_PREFIX, connect_timeout="5"))
    try:
        for run_id in run_ids:
            backend.client.delete_prefix((run_prefix(KEY_PREFIX, run_id) + "/").encode())
    finally:
        backend.client.close()


def markdown(results: list[dict[str, Any]], variants: list[str]) -> str:
    by = {(r["backend"], r["scenario"], r["nodes"]): r for r in results}
    keys = sorted({(r["nodes"], r["scenario"]) for r in results}, key=lambda k: (k[0], k[1] != "form"))
    head = ["N", "scenario"] + [f"{v} s" for v in variants] + [f"requests/agent {v}" for v in variants] \
        + [f"KB/agent {v}" for v in variants]
    rows = ["| " + " | ".join(head) + " |", "|" + "---:|" * 2 + "---:|" * (3 * len(variants))]

    def cell(r: dict[str, Any] | None, key: str) -> str:
        if r is None:
            return "—"
        if r["status"] != "ok":
            return r["status"]
        return f"{r[key]:.2f}" if key == "seconds" else str(r[key])

    for n, scenario in keys:
        found = [by.get((v, scenario, n)) for v in variants]
        cells = [cell(r, "seconds") for r in found] + [cell(r, "requests_per_agent") for r in found] \
            + [cell(r, "kb_per_agent") for r in found]
        rows.append(f"| {n} | {scenario} | " + " | ".join(cells) + " |")
    how: dict[str, set[str]] = {}
    for r in results:
        if r["scenario"] == "lose-one" and r["status"] == "ok":
            how.setdefault(r["backend"], set()).update(r["completed_by"] or ["not logged: torch's last call"])
    if how:
        rows += ["", "How the round after the loss completed: " + "; ".join(
            f"{v}: {', '.join(sorted(how[v]))}" for v in variants if v in how) + "."]
    return "\n".join(rows)


def code_revision() -> dict[str, Any]:
    """The commit measured, and whether the rendezvous code differs from it (work in progress)."""
    import subprocess

    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=common.ROOT, capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"),
                "uncommitted_changes": bool(git("status", "--porcelain", "--", "elastic_runner"))}
    except (OSError, subprocess.SubprocessError):
        return {}


def interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="8,32,128", help="comma-separated agent counts (default: 8,32,128)")
    parser.add_argument("--scenarios", default="form,lose-one", help="form, lose-one or both (default: both)")
    parser.add_argument("--backends", default="c10d,etcd-v3", help="c10d, etcd-v3 or both, in order (default: both)")
    parser.add_argument("--etcd-protocols", default="leases",
                        help="etcd-v3 protocols to measure: leases (reported as 'etcd-v3'), state "
                             "('etcd-v3 (state)') or both (default: leases)")
    parser.add_argument("--processes", type=int, default=16,
                        help="worker processes the agents are spread over: min(N, this) (default 16); lose-one "
                             "adds one for the victim")
    parser.add_argument("--timeout", type=int, default=300, help="join timeout per round in seconds (default 300)")
    parser.add_argument("--last-call-timeout", type=int, default=1,
                        help="rdzv last_call_timeout (default 1; only lose-one, min < max, can wait it)")
    parser.add_argument("--keep-alive-interval", type=int, default=1,
                        help="rdzv keep_alive_interval (default 1 as elastic-runner launch; torch's is 5)")
    parser.add_argument("--keep-alive-max-attempt", type=int, default=3,
                        help="rdzv keep_alive_max_attempt (default 3, as torch and elastic-runner launch)")
    parser.add_argument("--lose-one-min", choices=("1", "N-1"), default="1",
                        help="lose-one: min_nodes (default 1; N-1 keeps a last call from sealing the round after "
                             "the loss before every survivor is back)")
    parser.add_argument("--settle", type=float, default=2.0,
                        help="lose-one: seconds between the first round and the kill (default 2)")
    parser.add_argument("--etcd-endpoint", default=None, help="use this etcd instead of starting one")
    parser.add_argument("--out", default=None, help="write the JSON here (default: stdout)")
    parser.add_argument("--torch-event-names", action="store_true",
                        help="keep torch's inspect.stack() event naming (slow with many agents in one process)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    raise_nofile()
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    protocols = [p.strip() for p in args.etcd_protocols.split(",") if p.strip()]
    for name, given, known in (("scenario", scenarios, ("form", "lose-one")), ("backend", backends, (C10D, LEASES)),
                               ("etcd protocol", protocols, ("leases", "state"))):
        unknown = [g for g in given if g not in known]
        if unknown:
            parser.error(f"unknown {name}(s) {unknown}; choose from {list(known)}")
    if "lose-one" in scenarios and min(sizes) < 2:
        parser.error("lose-one needs N >= 2")
    variants: list[str] = []
    for b in backends:
        variants += [C10D] if b == C10D else [LEASES if p == "leases" else STATE for p in protocols]

    server: Any = None
    endpoint = args.etcd_endpoint
    pool = Pool(args.torch_event_names)
    results: list[dict[str, Any]] = []
    run_ids: list[str] = []
    started = time.time()
    interrupted = False
    signal.signal(signal.SIGTERM, interrupt)  # like Ctrl-C: end the workers and etcd, report what was measured
    try:
        if any(v != C10D for v in variants) and endpoint is None:
            from elastic_runner.testing.etcd_server import EtcdServer

            server = EtcdServer(Path(tempfile.mkdtemp(prefix="rdzv-bench-")) / "etcd").start()
            endpoint = server.endpoint
        given_up: set[tuple[str, str]] = set()
        for n in sizes:
            for scenario in scenarios:
                for variant in variants:
                    if (variant, scenario) in given_up:
                        results.append({"backend": variant, "scenario": scenario, "nodes": n, "ok": False,
                                        "status": "skipped", "error": "failed at a smaller N"})
                        continue
                    trial = Trial(pool, variant, scenario, n, args, endpoint)
                    if variant != C10D:
                        run_ids.append(trial.run_id)
                    result: dict[str, Any] | None = None
                    trial_began = time.monotonic()
                    try:
                        result = trial.run()
                    except TrialFailed as exc:
                        result = {"backend": variant, "scenario": scenario, "nodes": n, "ok": False,
                                  "status": "failed", "error": str(exc)}
                    finally:  # also on Ctrl-C: a failed or interrupted trial ends its worker processes
                        trial.cleanup(healthy=result is not None and result["ok"])
                    result["trial_seconds"] = round(time.monotonic() - trial_began, 1)
                    results.append(result)
                    print(f"{variant:16s} {scenario:8s} N={n:5d} {result['status']:6s} "
                          f"{result.get('seconds', float('nan')):8.2f} s "
                          f"{result.get('requests_per_agent', float('nan')):8.1f} req/agent "
                          f"{result.get('kb_per_agent', float('nan')):8.1f} KB/agent "
                          f"{','.join(result.get('completed_by') or [])} {result['error'] or ''}",
                          file=sys.stderr, flush=True)
                    if not result["ok"]:
                        given_up.add((variant, scenario))  # a larger N will not succeed either
    except KeyboardInterrupt:
        interrupted = True
        print("interrupted: stopping the worker processes", file=sys.stderr, flush=True)
    finally:
        pool.close()
        if args.etcd_endpoint and run_ids:  # a local etcd goes with its data
            try:
                delete_run_keys(args.etcd_endpoint, run_ids)
            except Exception as exc:  # noqa: BLE001 - only tidiness
                print(f"could not delete the benchmark's etcd keys: {exc}", file=sys.stderr)
        if server is not None:
            server.stop()
            shutil.rmtree(server.data_dir.parent, ignore_errors=True)
    report = {
        "benchmark": "rendezvous_scale",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                    "platform": platform.platform()},
        "code": code_revision(),
        "settings": {"sizes": sizes, "scenarios": scenarios, "backends": variants, "processes": args.processes,
                     "join_timeout": args.timeout, "last_call_timeout": args.last_call_timeout,
                     "keep_alive_interval": args.keep_alive_interval,
                     "keep_alive_max_attempt": args.keep_alive_max_attempt,
                     "window_seconds": args.keep_alive_interval * args.keep_alive_max_attempt,
                     "form": "min_nodes = max_nodes = N", "lose-one": f"min_nodes = {args.lose_one_min}, max_nodes = N",
                     "settle_seconds": args.settle, "torch_event_names": args.torch_event_names,
                     "env": dict(ENV_DEFAULTS),
                     "etcd": endpoint if args.etcd_endpoint else "local, started here"},
        "results": results,
        "table": markdown(results, variants),
        "wall_seconds": round(time.time() - started, 1),
    }
    if interrupted:
        report["interrupted"] = True
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    else:
        print(text)
    print(report["table"], file=sys.stderr)
    if interrupted:
        return 130
    return 0 if all(r["ok"] for r in results if r["status"] != "skipped") else 1


if __name__ == "__main__":
    sys.exit(main())
