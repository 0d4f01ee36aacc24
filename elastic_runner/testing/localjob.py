"""A local elastic job of several torchrun agents on loopback.

Shared by the chaos tool, the benchmarks and the tests: start agents (plain
``torchrun`` or ``elastic-runner launch``), find their workers, inject faults
by PID, and clean up everything that was started (and only that), also when
the caller fails.

torchrun starts each worker in its own session, so signalling an agent's
process group does not reach its workers. We find workers as the agent's
children in ``/proc`` and read their RANK from ``/proc/PID/environ``. This
process makes itself a *child subreaper*, so a worker orphaned by a killed
agent is re-parented to us and can still be found and reaped.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from ..lifecycle import become_subreaper, child_dies_with_starter, proc_state


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            kids.append(int(entry.name))
    return kids


def descendants(pid: int) -> list[int]:
    out: list[int] = []
    stack = [pid]
    while stack:
        for child in _children(stack.pop()):
            out.append(child)
            stack.append(child)
    return out


def process_env(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


_COMM = re.compile(r"^er-r(\d+)-l(\d+)$")


def worker_identity(pid: int) -> tuple[int, int] | None:
    """(rank, local_rank) of a worker process, from its name or its environment."""
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None
    if m := _COMM.match(comm):
        return int(m.group(1)), int(m.group(2))
    env = process_env(pid)
    if "RANK" in env and "TORCHELASTIC_RUN_ID" in env:
        return int(env["RANK"]), int(env.get("LOCAL_RANK", "0"))
    return None


def alive(pid: int) -> bool:
    return proc_state(pid) not in ("", "Z")


@dataclass
class Worker:
    pid: int
    rank: int
    local_rank: int
    agent: "Agent"


@dataclass
class Agent:
    index: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    started_at: float
    stopped: bool = False
    hosts_store: bool = False  #: hosts the c10d rendezvous store: losing it loses a c10d job

    @property
    def pid(self) -> int:
        return self.proc.pid

    def running(self) -> bool:
        return self.proc.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


@dataclass
class LocalJob:
    """Agents of one elastic job; use as a context manager so cleanup always runs."""

    config: str
    run_dir: str
    overrides: Sequence[str] = ()
    nnodes: str = "1:2"
    nproc_per_node: int = 1
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str | None = None
    rdzv_conf: str | None = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"
    max_restarts: int = 10
    launcher: str = "torchrun"  #: "torchrun" or "elastic-runner" (elastic-runner launch)
    env: dict[str, str] = field(default_factory=dict)
    log_dir: str | None = None
    #: Instead of elastic_runner.train: a script and its arguments (benchmark baselines).
    program: list[str] | None = None
    #: Instead of the command built from the fields above: an agent's whole command line as a user types it (a
    #: README's example), its first word a console script of this interpreter's environment, run in ``cwd``.
    argv: list[str] | None = None
    cwd: str | None = None
    #: Set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (False: torch's default, for baselines).
    disable_shared_store: bool = True
    monitor_interval: float = 0.1
    #: Give every agent its own node-memory directory (ELASTIC_RUNNER_SHM_DIR), as separate
    #: machines would have: losing a node then loses its memory copy too.
    separate_node_memory: bool = True
    #: Give every agent its own run.dir (``RUN_DIR/node-<index>``), as machines without a shared filesystem have
    #: (snapshots then in a bucket: snapshot.dir s3://...).
    separate_run_dirs: bool = False
    agents: list[Agent] = field(default_factory=list)
    _orphans: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        become_subreaper()
        if self.rdzv_endpoint is None and self.rdzv_backend == "c10d":
            self.rdzv_endpoint = f"127.0.0.1:{free_port()}"
        Path(self.log_dir or self.run_dir).mkdir(parents=True, exist_ok=True)

    def __enter__(self) -> "LocalJob":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- starting ---------------------------------------------------------------------------

    def command(self, index: int = 0) -> list[str]:
        if self.argv is not None:
            return [str(Path(sys.executable).with_name(self.argv[0])), *self.argv[1:]]
        if self.launcher == "torchrun":
            cmd = [sys.executable, "-m", "torch.distributed.run"]
        else:
            cmd = [sys.executable, "-m", "elastic_runner", "launch"]
        cmd += [
            f"--nnodes={self.nnodes}", f"--nproc_per_node={self.nproc_per_node}",
            f"--rdzv_backend={self.rdzv_backend}", f"--rdzv_endpoint={self.rdzv_endpoint}",
            f"--rdzv_id={self.rdzv_id}", f"--max_restarts={self.max_restarts}",
            f"--monitor_interval={self.monitor_interval:g}",
        ]
        conf = [c for c in (self.rdzv_conf or "").split(",") if c]
        if self.rdzv_backend == "c10d" and not any(c.startswith("is_host=") for c in conf):
            # On one machine every agent "matches" the endpoint host and they race to
            # bind it; the first agent started while none runs hosts, as on a real cluster.
            # Losing it loses a c10d job (the reason for the etcd-v3 backend).
            conf.append(f"is_host={'false' if self.running_agents() else 'true'}")
        if conf:
            cmd.append(f"--rdzv_conf={','.join(conf)}")
        if self.program is not None:
            return cmd + list(self.program)
        cmd += ["-m", "elastic_runner.train", "--config", self.config, "--set", f"run.dir={self.node_run_dir(index)}"]
        for item in self.overrides:
            cmd += ["--set", item]
        return cmd

    def start_agent(self, node_name: str | None = None) -> Agent:
        """Start one more agent (a node); ``node_name``: the name it goes by (default ``node-<index>``, as separate
        machines each have their own: what an exclusion is recorded under)."""
        index = len(self.agents)
        log_path = Path(self.log_dir or self.run_dir) / f"agent-{index}.log"
        # Every agent of a local job shares this machine's cores; the agent divides them among its own workers
        # only, and oversubscribed OpenMP threads spin-wait each other: 15x slower on 2 cores with one worker per
        # agent. (A user's own command line runs with the user's environment.)
        threads = {} if self.argv is not None else {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        env = os.environ | {"PYTHONUNBUFFERED": "1"} | threads | self.env
        if node_name is not None or "ELASTIC_RUNNER_NODE_NAME" not in env:
            env["ELASTIC_RUNNER_NODE_NAME"] = node_name or f"node-{index}"
        if self.separate_node_memory:
            env["ELASTIC_RUNNER_SHM_DIR"] = str(self.memory_dir(index))
        if self.disable_shared_store:
            env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        else:
            env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
        fh = open(log_path, "ab")
        command = self.command(index)
        fh.write(f"$ {shlex.join(command)}\n".encode())
        fh.flush()
        proc = subprocess.Popen(command, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=self.cwd,
                                start_new_session=True, stdin=subprocess.DEVNULL, preexec_fn=child_dies_with_starter)
        fh.close()
        agent = Agent(index=index, proc=proc, log_path=log_path, started_at=time.time(),
                      hosts_store=any(a.startswith("--rdzv_conf=") and "is_host=true" in a for a in command))
        self.agents.append(agent)
        return agent

    def node_run_dir(self, index: int) -> str:
        """The run.dir agent ``index`` gives its workers (see separate_run_dirs)."""
        return str(Path(self.run_dir) / f"node-{index}") if self.separate_run_dirs else self.run_dir

    @property
    def rdzv_id(self) -> str:
        return f"job-{Path(self.run_dir).name}"

    def memory_root(self) -> Path:
        base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        return base / f"elastic-runner-localjob-{os.getpid()}-{id(self):x}"

    def memory_dir(self, index: int) -> Path:
        """The node-memory directory of agent ``index`` (see separate_node_memory)."""
        return self.memory_root() / f"agent-{index}"

    # -- looking -------------------------------------------------------------------------------

    def workers(self, agent: Agent | None = None) -> list[Worker]:
        found = []
        for a in ([agent] if agent else self.agents):
            if not a.running():
                continue
            # Workers are the agent's children under torchrun and the zygote's
            # children under elastic-runner launch: look at all descendants.
            for pid in descendants(a.pid):
                identity = worker_identity(pid)
                if identity is not None and alive(pid):
                    found.append(Worker(pid, identity[0], identity[1], a))
        return sorted(found, key=lambda w: w.rank)

    def wait_for_workers(self, count: int, timeout: float, agent: Agent | None = None) -> list[Worker]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.workers(agent)
            if len(found) >= count:
                return found
            time.sleep(0.05)
        raise TimeoutError(f"expected {count} workers within {timeout:.0f}s, found {len(self.workers(agent))}\n{self.logs_tail()}")

    def running_agents(self) -> list[Agent]:
        return [a for a in self.agents if a.running()]

    def logs_tail(self, lines: int = 40) -> str:
        out = []
        for a in self.agents:
            text = a.log_text().splitlines()[-lines:]
            out.append(f"--- agent {a.index} (pid {a.pid}, exit {a.proc.poll()}) ---\n" + "\n".join(text))
        return "\n".join(out)

    # -- faults -----------------------------------------------------------------------------------

    def signal_worker(self, worker: Worker, sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker.pid, sig)

    def kill_agent(self, agent: Agent, sig: int = signal.SIGKILL, with_workers: bool = True) -> list[int]:
        """Kill an agent (node loss when SIGKILL, preemption when SIGTERM)."""
        workers = descendants(agent.pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(agent.pid, sig)
        if sig == signal.SIGKILL:
            agent.stopped = True
            if with_workers:
                for pid in workers:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            else:
                self._orphans.update(workers)
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.proc.wait(timeout=10)
        return workers

    # -- ending -------------------------------------------------------------------------------------

    def wait(self, timeout: float) -> list[int | None]:
        deadline = time.monotonic() + timeout
        for a in self.agents:
            remaining = max(0.1, deadline - time.monotonic())
            try:
                a.proc.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"agents still running after {timeout:.0f}s\n{self.logs_tail()}") from None
        return [a.proc.returncode for a in self.agents]

    def leftover_processes(self) -> list[int]:
        """Processes we started (or inherited as subreaper) that are still alive."""
        pids = set()
        for a in self.agents:
            if a.running():
                pids.add(a.pid)
                pids.update(descendants(a.pid))
        pids.update(p for p in self._orphans if alive(p))
        pids.update(p for p in _children(os.getpid()) if alive(p) and worker_identity(p) is not None)
        return sorted(p for p in pids if alive(p))

    def reap_orphans(self) -> int:
        """Collect the exit statuses of dead orphans re-parented to us (we are their subreaper); the
        agents' own statuses stay with their Popen. A long chaos run kills hundreds of process trees:
        unreaped, each would stay a zombie until the end. Returns how many were collected."""
        ours = {a.pid for a in self.agents}
        dead = [pid for pid in _children(os.getpid()) if pid not in ours and proc_state(pid) == "Z"]
        _reap(set(dead), block=False)
        return len(dead)

    def close(self) -> None:
        for a in self.agents:
            if a.running():
                for pid in descendants(a.pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(a.pid, signal.SIGKILL)
        for a in self.agents:
            with contextlib.suppress(subprocess.TimeoutExpired):
                a.proc.wait(timeout=10)
        # A killed process takes a moment to go (freeing its memory), and the zygote's workers
        # become our children only once the zygote is gone: look again until none is left.
        seen = set(self._orphans)
        deadline = time.monotonic() + 10
        while (leftovers := self.leftover_processes()) and time.monotonic() < deadline:
            seen.update(leftovers)
            for pid in leftovers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            _reap(seen, block=False)
            time.sleep(0.05)
        _reap(seen)
        shutil.rmtree(self.memory_root(), ignore_errors=True)


def _reap(pids: set[int], block: bool = True) -> None:
    """Collect exit statuses of re-parented orphans (we are their subreaper)."""
    for pid in pids:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, 0 if block else os.WNOHANG)
