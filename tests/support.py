"""Plain helpers the tests share: paths, configs, small volumes, and running and watching real processes.

Fixtures live in the ``conftest.py`` files; anything a test imports by name lives here."""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.context
import os
import re
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import pytest
import torch
import yaml

from elastic_runner.observe.audit import latest_step
from elastic_runner.observe.events import read_events
from elastic_runner.testing.localjob import LocalJob, free_port

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "configs" / "quickstart.yaml"


class Clock:
    """A wall clock that moves only when a test moves it (``clock.now += 601``)."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


#: What a process of :func:`rank_context` finds imported: torch, dynamo and FSDP take ~3 s to import here, and the
#: tests that run ranks in processes of their own start ~130 of them.
RANK_PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor",
                "elastic_runner.training.sharding", "elastic_runner.training.step"]


def forkserver_context(preload: list[str]) -> multiprocessing.context.ForkServerContext:
    """multiprocessing's forkserver context, its server having imported exactly ``preload``. There is one server per
    test process: one already running with another preload (another test's) is stopped first, so that each test
    gets the server it asks for (the zygote check of ``test_launch.py`` needs its own). A process forked from it
    starts in the parent's working directory and ``sys.path`` of that moment, and with the server's environment: the
    environment of when the server started, which a test that changes it for its processes passes in their
    arguments instead."""
    from multiprocessing import forkserver

    server = forkserver._forkserver  # (private, as multiprocessing's own tests use it: there is no public stop)
    if server._forkserver_pid is not None and server._preload_modules != preload:
        server._stop()
    forkserver.set_forkserver_preload(preload)  # read when the server starts
    return multiprocessing.get_context("forkserver")


def rank_context() -> multiprocessing.context.ForkServerContext:
    """A context whose processes start in a fraction of a second instead of importing torch again: the forkserver's
    server imported :data:`RANK_PRELOAD` once and has run nothing (no step, no process group), so each process starts
    as a worker forked from the launcher's zygote does (which also imported torch and nothing more)."""
    return forkserver_context(RANK_PRELOAD)


def start_ranks(target: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> None:
    """``target(rank, *args)`` in ``nprocs`` processes of :func:`rank_context`, as
    ``torch.multiprocessing.start_processes`` runs them (a rank's exception is raised here)."""
    import torch.multiprocessing as mp

    rank_context()
    mp.start_processes(target, args=args, nprocs=nprocs, start_method="forkserver")


def mount_small_volume(path: Path, size: str) -> None:
    """A small tmpfs at ``path`` (a real ENOSPC when it is full); skips the test where mounting needs root."""
    path.mkdir(parents=True, exist_ok=True)
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                                 capture_output=True, text=True)
    except OSError as exc:
        pytest.skip(f"a small tmpfs cannot be mounted here (no mount command: {exc})")
    if mounted.returncode != 0:
        pytest.skip(f"a small tmpfs cannot be mounted here (needs root): {mounted.stderr.strip()}")


def unmount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


def write_config(path: Path, **sections: dict) -> Path:
    """A quickstart-derived config with some sections replaced/extended."""
    data = yaml.safe_load(QUICKSTART.read_text())
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    path.write_text(yaml.safe_dump(data))
    return path


def python() -> str:
    return sys.executable


def torchrun_standalone(config: Path | str, run_dir: Path, nproc: int = 2, overrides: Sequence[str] = (),
                        timeout: float = 120, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           f"--rdzv_endpoint=127.0.0.1:{free_port()}",
           "-m", "elastic_runner.train", "--config", str(config), "--set", f"run.dir={run_dir}"]
    for item in overrides:
        cmd += ["--set", item]
    env = os.environ | {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONUNBUFFERED": "1"} | (extra_env or {})
    return run_bounded(cmd, timeout, env)


def run_bounded(cmd: Sequence[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run a command in its own session; on timeout kill its whole session (workers included)."""
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        from elastic_runner.testing.localjob import descendants

        for pid in descendants(proc.pid) + [proc.pid]:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        out, _ = proc.communicate()
        raise AssertionError(f"command timed out after {timeout}s: {' '.join(cmd)}\n{out[-5000:]}") from None
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, "")


def events(run_dir: Path, kind: str | None = None) -> list[dict[str, Any]]:
    return [e for e in read_events(run_dir) if kind is None or e["kind"] == kind]


def of_agent(event: dict[str, Any], agent: Any) -> bool:
    """Whether a worker's ``event`` came from a worker of ``agent`` (a LocalJob's): its ``agent`` field names the
    agent by host and pid (``agent-<host>-<pid>``)."""
    return event["agent"].rsplit("-", 2)[1] == str(agent.pid)


def audited_step(run_dir: Path) -> int:
    """Highest step any rank has started, from the audit trail (cheap to poll)."""
    return latest_step(run_dir)


def job_step(job: Any) -> int:
    """:func:`audited_step` of a LocalJob, over every node's own run.dir where they have one each."""
    if getattr(job, "separate_run_dirs", False):
        return max((latest_step(p) for p in Path(job.run_dir).glob("node-*")), default=0)
    return audited_step(job.run_dir)


def wait_for_step(run_dir: Path, step: int, timeout: float, job: Any = None) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reached = audited_step(run_dir)
        if reached >= step:
            return reached
        time.sleep(0.02)
    detail = job.logs_tail() if job is not None else ""
    raise AssertionError(f"run did not reach step {step} within {timeout}s (at {audited_step(run_dir)})\n{detail}")


def exported_model(run_dir: Path, tmp: Path) -> dict[str, torch.Tensor]:
    from elastic_runner.snapshot.cli import export

    out = tmp / f"export-{Path(run_dir).name}-{time.monotonic_ns()}.pt"
    export(str(run_dir), str(out))
    return torch.load(out, weights_only=True)


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"tensors differ: {different}"


def end_events(run_dir: Path) -> list[dict[str, Any]]:
    """The `end` events of the final generation (one per rank)."""
    ends = [e for e in events(run_dir, "end") if e.get("status") == "finished"]
    if not ends:
        return []
    final = max(e["generation"] for e in ends)
    return [e for e in ends if e["generation"] == final]


def c10d_rendezvous_state(endpoint: str, run_id: str) -> Any:
    """torch's rendezvous state as the agents keep it in the c10d store at ``endpoint`` (None if none yet)."""
    import base64
    import pickle
    from datetime import timedelta

    import torch.distributed as dist

    host, port = endpoint.rsplit(":", 1)
    try:
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))
    except dist.DistNetworkError as exc:
        raise AssertionError(f"no rendezvous store at {endpoint}: the agent that hosts it has ended") from exc
    key = "torch.rendezvous." + run_id
    if not store.check([key]):
        return None
    raw = store.get(key)
    try:
        return pickle.loads(base64.b64decode(raw))
    except Exception:  # torch's "no state yet" sentinel
        return None


def wait_until_blocked(pid: int, still_s: float = 0.5, timeout: float = 30.0) -> None:
    """Wait until process ``pid``'s main thread is blocked: asleep and running no CPU time for ``still_s`` (a
    collective that waits for a stopped peer). A worker's other threads (its heartbeat, a snapshot's writer) may run."""
    stat = Path(f"/proc/{pid}/task/{pid}/stat")

    def sample() -> tuple[str, int]:
        fields = stat.read_text().rsplit(")", 1)[1].split()
        return fields[0], int(fields[11]) + int(fields[12])  # state, utime + stime (clock ticks)

    deadline = time.monotonic() + timeout
    still_since, last = time.monotonic(), sample()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = sample()
        if now[0] not in ("S", "D") or now[1] != last[1]:
            still_since = time.monotonic()
        elif time.monotonic() - still_since >= still_s:
            return
        last = now
    raise AssertionError(f"process {pid}'s main thread did not block within {timeout:g} s (state {last[0]})")


def stop_workers_at_step(job: Any, step: int, count: int, timeout: float = 90,
                         replacing: Sequence[Any] = ()) -> tuple[list[Any], int]:
    """Stop (SIGSTOP) the job's ``count`` workers as soon as some rank has started ``step``; return
    them and the step reached. Between checks they run for a few milliseconds only, so the job stops
    within a step or two of ``step`` however fast this machine trains: waiting for the step and then
    stopping lets a fast job run on for as long as the test process takes to react (on a loaded CI
    machine, long enough to finish a short run). ``replacing``: workers just killed; their successors
    are the ones stopped (call this right after the kill: waiting for the restart first and then
    stopping leaves the same free-running window). Let them go with :func:`continue_workers`."""
    import signal

    deadline = time.monotonic() + timeout
    gone = {w.pid for w in replacing}
    while True:
        workers = [w for w in job.wait_for_workers(count, timeout=max(0.1, deadline - time.monotonic()))
                   if w.pid not in gone]
        if len(workers) >= count:
            break
        time.sleep(0.005)
    while True:
        for w in workers:
            job.signal_worker(w, signal.SIGSTOP)
        reached = job_step(job)
        if reached >= step:
            return workers, reached
        continue_workers(job, workers)
        if time.monotonic() > deadline:
            raise AssertionError(f"run did not reach step {step} within {timeout}s (at {reached})\n{job.logs_tail()}")
        time.sleep(0.005)


def continue_workers(job: Any, workers: Sequence[Any]) -> None:
    import signal

    for w in workers:
        job.signal_worker(w, signal.SIGCONT)


def kill_a_random_worker(job: Any, seed: int, steps: int, count: int = 4, timeout: float = 240) -> tuple[Any, int]:
    """SIGKILL one of the job's ``count`` workers, chosen by ``seed``, at a step chosen by ``seed`` between 30 and
    ``steps - 40`` (the others go on); returns the victim and the step the workers had reached."""
    import random
    import signal

    at = random.Random(seed).randint(30, steps - 40)
    workers, reached = stop_workers_at_step(job, at, count=count, timeout=timeout)
    victim = random.Random(f"{seed}-victim").choice(workers)
    job.signal_worker(victim, signal.SIGKILL)
    continue_workers(job, [w for w in workers if w is not victim])
    return victim, reached


def kill_worker_at_step(job: Any, step: int, rank: int = 1, count: int = 2, timeout: float = 120) -> Any:
    """SIGKILL the worker of ``rank`` once the job's ``count`` workers reached ``step`` (the others go on);
    returns the victim."""
    import signal

    workers, _ = stop_workers_at_step(job, step, count=count, timeout=timeout)
    victim = next(w for w in workers if w.rank == rank)
    job.signal_worker(victim, signal.SIGKILL)
    continue_workers(job, [w for w in workers if w is not victim])
    return victim


def start_agent_while_paused(job: Any, at_step: int, count: int, timeout: float = 90,
                             replacing: Sequence[Any] = ()) -> Any:
    """Once the c10d job has reached ``at_step``, start one more agent while its ``count`` workers
    are stopped, and let them go once the new agent waits to join. However fast this machine trains,
    the job cannot finish before the new agent arrives (its start-up takes seconds). ``replacing``: as
    for :func:`stop_workers_at_step`."""
    paused, _ = stop_workers_at_step(job, at_step, count, timeout, replacing=replacing)

    def waiting() -> bool:
        state = c10d_rendezvous_state(job.rdzv_endpoint, job.rdzv_id)
        return state is not None and bool(state.wait_list)

    return start_agent_until_waiting(job, paused, waiting, timeout)


def start_agent_until_waiting(job: Any, paused: Sequence[Any], waiting: Callable[[], bool], timeout: float = 90) -> Any:
    """Start one more agent while ``paused`` workers are stopped; let them go once the new agent is about to
    join: its event log appears (our agent writes it just before it creates its rendezvous handler) or it is
    in the rendezvous' wait list. Not later: the running agent sees a waiting node within 0.2 s and stops its
    group for the join, and it SIGKILLs workers that are stopped (SIGSTOP) instead of letting them save."""
    try:
        agent = job.start_agent()
        log = Path(job.node_run_dir(agent.index)) / "events" / f"agent-{socket.gethostname()}-{agent.pid}.jsonl"
        deadline = time.monotonic() + timeout
        asked = 0.0
        while not log.exists():
            # The store only every 0.2 s: each look is a new connection to the rank-0 agent's store, and
            # dozens a second starved its heartbeats for seconds (a joining node then saw it dead).
            if time.monotonic() - asked >= 0.2:
                asked = time.monotonic()
                if waiting():
                    break
            assert time.monotonic() < deadline, f"the new agent never joined the wait list\n{job.logs_tail()}"
            time.sleep(0.02)
        return agent
    finally:
        continue_workers(job, paused)


STORY = re.compile(r": rank 1 \(node \S+, pid (\d+)\) was killed by SIGKILL at step (\d+) → recovered (?:in process )?in "
                   r"(\d+\.\d+) s "
                   r"at world size 2, resumed step (\d+) from memory, (\d+) steps lost")


def assert_told_once(job: Any, victim_pid: int) -> None:
    """The failure story, once, by rank 0 of the new attempt, on the terminal (the agents' output), and no
    traceback of a failure that was handled."""
    told = [m for a in job.agents for m in STORY.finditer(a.log_text())]
    assert len(told) == 1, "the failure story, once\n" + job.logs_tail()
    pid, at_step, _, resumed, lost = (int(float(x)) for x in told[0].groups())
    assert pid == victim_pid and resumed + lost == at_step, told[0].group(0)
    assert_no_tracebacks(job)


def told(job: Any, pattern: str) -> list[re.Match[str]]:
    """Every match of ``pattern`` on the job's terminals (the agents' output, workers included)."""
    return [m for a in job.agents for m in re.finditer(pattern, a.log_text())]


def assert_no_tracebacks(job: Any) -> None:
    """A failure the job recovered from leaves no traceback on the terminal (torch's included)."""
    for word in ("Traceback", "ProcessExitedException"):
        assert not told(job, word), f"{word} on the terminal\n" + job.logs_tail()


def capture(step: int) -> Callable[[], tuple[dict[str, Any], dict[str, Any]]]:
    """What a Checkpointer hands its writers and keeper: a tiny state at ``step`` and its metadata."""
    return lambda: ({"model": {"w": torch.full((4,), float(step))}}, {"fingerprint": {"model": "m"}, "run_uid": "run-a"})


def run_uninterrupted(config: Path | str, run_dir: Path, agents: int = 2, nproc: int = 1, timeout: float = 300,
                      **job: Any) -> Path:
    """A job of ``agents`` agents of ``nproc`` workers each run to its end without a fault (the reference a faulted
    run is compared with); its run directory."""
    ran = LocalJob(config=str(config), run_dir=str(run_dir), nnodes=f"{agents}:{agents}", nproc_per_node=nproc, **job)
    try:
        for _ in range(agents):
            ran.start_agent()
        assert ran.wait(timeout=timeout) == [0] * agents, ran.logs_tail()
    finally:
        ran.close()
    return run_dir


def context_result(context: Any, timeout: float = 60) -> Any:
    """What torch's process ``context`` reports first (a failure, or every worker done), polled without blocking."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = context.wait(0)
        if result is not None:
            return result
        time.sleep(0.05)
    raise AssertionError("the context never reported")


def wait_for_world(run_dir: Path, size: int, after: float, job: Any, timeout: float = 90) -> None:
    """Wait until an attempt at world ``size`` starts after ``after`` (wall clock)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(e["world_size"] == size and e["time"] > after for e in events(run_dir, "start")):
            return
        time.sleep(0.05)
    pytest.fail(f"no attempt at world size {size} within {timeout:.0f}s\n" + job.logs_tail())


def beating_agents(store: Any, group_ranks: Sequence[int], key: bytes | None = None) -> list[Any]:
    """Agents' beats (:class:`elastic_runner.agent.beat.AgentBeat`, signed with ``key``) into the job's ``store`` (a
    TCPStore), one per group rank, each beating already; close them when done."""
    from elastic_runner.agent.beat import AgentBeat

    beats = [AgentBeat(key=key) for _ in group_ranks]
    for beat, group_rank in zip(beats, group_ranks):
        beat.follow("127.0.0.1", store.port, group_rank)
    deadline = time.monotonic() + 10
    while not all(beat.beats > 1 for beat in beats):
        assert time.monotonic() < deadline, "the agents never beat"
        time.sleep(0.01)
    return beats


def job_key_file(directory: Path) -> Path:
    """A job's key (``--rdzv_conf auth_key_file=...``) in ``directory``, private as the docs ask."""
    path = directory / "job.key"
    path.write_text("b" * 64 + "\n")
    path.chmod(0o600)
    return path


@contextmanager
def fast_rendezvous_installed() -> Iterator[None]:
    """elastic_runner.agent.fast_rendezvous installed in this process (it patches torch's module), undone after."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    from elastic_runner.agent import fast_rendezvous as fr

    handler = dr.DynamicRendezvousHandler
    saved = (dr._RendezvousJoinOp, dr._delay, handler.next_rendezvous, handler._start_heartbeats, fr._installed)
    had_count_out = hasattr(handler, "count_out")
    fr._installed = False
    assert fr.install(), "fast_rendezvous.install() refused this torch"
    try:
        yield
    finally:
        dr._RendezvousJoinOp, dr._delay, handler.next_rendezvous, handler._start_heartbeats, fr._installed = saved
        if not had_count_out:
            delattr(handler, "count_out")  # (install adds it: torch's class has none)
        fr.set_previous_participants([])


@contextmanager
def store_server() -> Iterator[subprocess.Popen[bytes]]:
    """A job's store (a TCPStore server) in a process of its own on a free port of 127.0.0.1 (``.port``), holding
    ``"k"`` = ``b"v"``: a test can SIGSTOP it, as a machine that vanished without resetting its connections. Ended
    (continued, then killed) on the way out."""
    import signal

    from elastic_runner.lifecycle import child_dies_with_starter

    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", (
        "import datetime, sys, time\n"
        "from torch.distributed import TCPStore\n"
        f"store = TCPStore('127.0.0.1', {port}, is_master=True, timeout=datetime.timedelta(seconds=30), "
        "wait_for_workers=False)\n"
        "store.set('k', 'v')\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n")], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, preexec_fn=child_dies_with_starter)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == b"ready", "the store did not start"
        server.port = port  # type: ignore[attr-defined]
        yield server
    finally:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(server.pid, sig)
            except ProcessLookupError:
                pass
        server.wait(10)


def tcp_sockets(pid: int) -> list[tuple[str, int, int]]:
    """Process ``pid``'s TCP sockets as (state, local port, remote port), from Linux's /proc; the state as the kernel
    writes it: ``0A`` listening, ``01`` established."""
    inodes = set()
    with contextlib.suppress(OSError):  # (descriptors come and go while they are read; the process may end)
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if len(fields) > 9 and fields[9] in inodes:
                found.append((fields[3], int(fields[1].rsplit(":", 1)[1], 16), int(fields[2].rsplit(":", 1)[1], 16)))
    return found
