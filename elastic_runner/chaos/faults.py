"""The faults the chaos tool can inject into a local job, each by PID or path.

Every fault returns a one-line description of what it did, or raises
:class:`Skip` when the job's current shape does not allow it (e.g. no agent
may be removed without dropping below the minimum), so the run goes on.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..observe.events import EVENTS_DIR, EventFollower
from ..snapshot import LocalStore
from ..testing.localjob import Agent, LocalJob, Worker
from ..training.injected_faults import SLOW_OFF, SLOW_ON
from .scenario import FAULT_TYPES


class Skip(Exception):
    """The fault does not apply right now."""


@dataclass
class FaultContext:
    job: LocalJob
    rng: random.Random
    min_agents: int
    max_agents: int
    hang_seconds: float
    snapshot_dir: Path | None  #: None: the snapshots are in a bucket
    etcd: Any = None  #: elastic_runner.testing.etcd_server.EtcdServer when self-started
    fill_seconds: float = 8.0
    slow_seconds: float = 10.0
    #: The processes the last fault acted on, for the verdict (slow-node: the throttled workers' PIDs).
    targets: list[int] = field(default_factory=list)
    #: When the fault struck, where a fault prepares first (spare-takeover waits for its spare): the verdict's clock.
    struck_at: float | None = None
    #: Undo what a fault left behind (a filler file) when the run ends early; each runs once.
    cleanups: list[Callable[[], None]] = field(default_factory=list)
    #: Which slow-node fault slows each worker now (by pid): a fault's end lets go only the workers still its own.
    slowed: dict[int, object] = field(default_factory=dict)

    def close(self) -> None:
        while self.cleanups:
            self.cleanups.pop()()


#: fill-disk refuses a volume with more free space than this: it would fill the machine's disk, not a test volume.
FILL_MAX_FREE_BYTES = 2 << 30
#: What fill-disk leaves free: less than any snapshot, more than the filesystem needs to stay usable.
FILL_LEAVE_BYTES = 16 << 10
FILLER_NAME = ".chaos-fill"  #: + "-<ns>": one file per injection


def _removable_agents(ctx: FaultContext) -> list[Agent]:
    running = ctx.job.running_agents()
    if len(running) <= ctx.min_agents:
        raise Skip(f"only {len(running)} agent(s) running, the minimum is {ctx.min_agents}")
    # Losing the agent that hosts the c10d store loses a c10d job by design (use etcd-v3).
    candidates = [a for a in running if not a.hosts_store]
    if not candidates:
        raise Skip("only the c10d store's host agent could be removed")
    return candidates


def _random_worker(ctx: FaultContext, hook: int | None = None) -> Worker:
    """One of the running workers at random; with ``hook``, one that catches that signal (its chaos hooks armed)."""
    workers = ctx.job.workers()
    if not workers:
        raise Skip("no worker is running")
    if hook is not None:
        workers = [w for w in workers if catches(w.pid, hook)]
        if not workers:
            raise Skip("no running worker has armed its chaos hooks yet (each is starting)")
    return ctx.rng.choice(workers)


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` catches ``signum`` now (the ``SigCgt`` mask of its ``/proc`` status): a chaos job's
    worker once it armed its hooks (training.injected_faults). Sent before that, or once it exits, a hook's signal
    would end the process (the default action of SIGUSR1, SIGUSR2 and the real-time signals)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def kill_worker(ctx: FaultContext) -> str:
    w = _random_worker(ctx)
    ctx.job.signal_worker(w, signal.SIGKILL)
    return f"SIGKILL worker rank {w.rank} (pid {w.pid})"


def kill_agent(ctx: FaultContext) -> str:
    """The agent process alone, as the OOM killer or a crash ends it: its zygote, workers and their
    loader processes must follow it by themselves (the run's "no orphan processes" check)."""
    agent = ctx.rng.choice(_removable_agents(ctx))
    below = ctx.job.kill_agent(agent, signal.SIGKILL, with_workers=False)
    return f"SIGKILL agent {agent.index} (pid {agent.pid}) alone; its {len(below)} process(es) must follow it"


def kill_node(ctx: FaultContext) -> str:
    agent = ctx.rng.choice(_removable_agents(ctx))
    killed = ctx.job.kill_agent(agent, signal.SIGKILL, with_workers=True)
    gone = ""
    if ctx.job.separate_run_dirs:  # a node of its own: its disk and its memory go with it
        shutil.rmtree(ctx.job.node_run_dir(agent.index), ignore_errors=True)
        shutil.rmtree(ctx.job.memory_dir(agent.index), ignore_errors=True)
        gone = "; its run.dir and node memory deleted"
    return f"node loss: SIGKILL agent {agent.index} (pid {agent.pid}) and its {len(killed)} process(es){gone}"


def join(ctx: FaultContext) -> str:
    running = ctx.job.running_agents()
    if len(running) >= ctx.max_agents:
        raise Skip(f"already {len(running)} agents, the maximum is {ctx.max_agents}")
    agent = ctx.job.start_agent()
    return f"node join: started agent {agent.index} (pid {agent.pid})"


def hang(ctx: FaultContext) -> str:
    w = _random_worker(ctx)
    ctx.job.signal_worker(w, signal.SIGSTOP)
    ctx.targets = [w.pid]  # (a hung worker may be named a straggler: no false naming)

    def resume() -> None:
        time.sleep(ctx.hang_seconds)
        ctx.job.signal_worker(w, signal.SIGCONT)  # gone already if the agent killed it: fine

    threading.Thread(target=resume, daemon=True).start()
    return f"SIGSTOP worker rank {w.rank} (pid {w.pid}) for {ctx.hang_seconds:g}s"


def preempt(ctx: FaultContext) -> str:
    agent = ctx.rng.choice(_removable_agents(ctx))
    ctx.job.kill_agent(agent, signal.SIGTERM)
    return f"preemption: SIGTERM agent {agent.index} (pid {agent.pid})"


def restart_etcd(ctx: FaultContext) -> str:
    if ctx.etcd is None:
        raise Skip("no self-started etcd")
    ctx.etcd.restart(down_seconds=1.0)
    return f"etcd restarted on the same data dir ({ctx.etcd.endpoint})"


def corrupt_snapshot(ctx: FaultContext) -> str:
    if ctx.snapshot_dir is None:
        raise Skip("the snapshots are in a bucket: corrupt-snapshot damages a directory's (a damaged or planted "
                   "object in a bucket: tests/integration/test_object_store.py)")
    store = LocalStore(ctx.snapshot_dir)
    complete = store.complete()
    if len(complete) < 2:
        raise Skip("fewer than two disk snapshots: nothing to fall back to yet")
    newest = complete[-1]
    state = store.path(newest) / "state.pt"
    size = state.stat().st_size
    with open(state, "r+b") as fh:
        fh.truncate(max(1, size // 2))
    # Make the job need its disk snapshots: every worker at once, and every node's
    # memory copy gone too (a whole-job loss), so the loader must skip the damage.
    workers = ctx.job.workers()
    for w in workers:
        ctx.job.signal_worker(w, signal.SIGKILL)
    shutil.rmtree(ctx.job.memory_root(), ignore_errors=True)  # every agent's node memory
    return (f"truncated {newest.name}/state.pt to {size // 2} bytes, dropped the memory copies and SIGKILLed "
            f"all {len(workers)} workers")


def fill_disk(ctx: FaultContext) -> str:
    """The snapshot volume runs full for ``fill_seconds`` (another tenant's files, a log that grew): every
    durable write in that time fails, training must go on, and snapshots must resume once space is back."""
    volume = ctx.snapshot_dir
    if volume is None:
        raise Skip("the snapshots are in a bucket: there is no snapshot volume to fill")
    if not volume.is_dir():
        raise Skip(f"no snapshot directory yet ({volume})")
    if any(volume.glob(FILLER_NAME + "-*")):
        raise Skip("the snapshot volume is still full from the previous fill-disk")
    free = shutil.disk_usage(volume).free
    if free > FILL_MAX_FREE_BYTES:
        raise Skip(f"the snapshot volume has {free / 2**30:.1f} GiB free: filling it would fill this machine's "
                   "disk; put snapshot.dir on a small volume (e.g. a tmpfs) to inject fill-disk")
    filler = volume / f"{FILLER_NAME}-{time.time_ns()}"
    fd = os.open(filler, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600)
    try:
        # In steps: a snapshot written meanwhile takes space, and one failed allocation would undo it all.
        chunk = 1 << 20
        while (room := shutil.disk_usage(volume).free - FILL_LEAVE_BYTES) > 0:
            try:
                os.posix_fallocate(fd, os.fstat(fd).st_size, min(chunk, room))
            except OSError:
                if chunk <= 64 << 10:
                    break
                chunk //= 4
    finally:
        os.close(fd)
    left = shutil.disk_usage(volume).free
    if left > 1 << 20:
        filler.unlink(missing_ok=True)
        raise Skip(f"could not fill the snapshot volume ({left / 2**20:.1f} MB still free)")
    done = threading.Event()

    def release() -> None:
        if not done.is_set():
            done.set()
            timer.cancel()
            filler.unlink(missing_ok=True)

    timer = threading.Timer(ctx.fill_seconds, release)
    timer.daemon = True
    ctx.cleanups.append(release)
    timer.start()
    size = filler.stat().st_size
    return f"filled the snapshot volume ({size / 2**20:.1f} MB, {left // 1024} KB left) for {ctx.fill_seconds:g}s"


#: Held while a slow-node fault starts or ends (its timer's thread or the chaos tool's): whose each worker is, and
#: each on and off, change together.
_SLOWING = threading.Lock()


def slow_node(ctx: FaultContext) -> str:
    """One node's workers' compute slowed to a quarter of its speed for ``slow_seconds`` (a throttled GPU, a CPU
    quota, a noisy neighbour): nothing fails, the job slows to their pace, and they must be named stragglers.

    Asked of the workers themselves (:data:`~elastic_runner.training.injected_faults.SLOW_ON`, then ``SLOW_OFF``):
    each step's compute is stretched to four times its length and its wait for the gradient sync is left alone, as
    a slow device does. A throttle from outside could not tell the two apart: stops on wall time landed in the
    collectives as often as in the steps (the 2026-12-06 soak: 6 of 50 slow nodes ran 1.0-1.9x their peers), and
    stops after a worker had run CPU time still landed late on a loaded machine, where the throttle's own poll
    waited for a core (2026-12-07: 4 of 75 ran 1.1-1.6x)."""
    if SLOW_ON is None or SLOW_OFF is None:
        raise Skip("this system has no real-time signals to ask a worker to slow down by")
    on, off = SLOW_ON, SLOW_OFF
    running = ctx.job.running_agents()
    if len(running) < 2:
        raise Skip("one node: a slow node needs a faster one to be told from")
    agent = ctx.rng.choice(running)
    workers = [w for w in ctx.job.workers(agent) if catches(w.pid, on)]
    if not workers:
        raise Skip(f"agent {agent.index} has no worker running with its chaos hooks armed")
    pids = [w.pid for w in workers]
    ctx.targets = pids
    ended = False
    mine = object()

    def release() -> None:
        nonlocal ended
        timer.cancel()
        with _SLOWING:
            if ended:
                return
            ended = True
            for w in workers:  # gone already if a recovery replaced it: fine (its replacement was never slowed)
                if ctx.slowed.get(w.pid) is mine:  # (not if a later slow-node slows it now: that one ends it)
                    del ctx.slowed[w.pid]
                    if catches(w.pid, off):
                        ctx.job.signal_worker(w, off)

    timer = threading.Timer(ctx.slow_seconds, release)
    timer.daemon = True
    ctx.cleanups.append(release)
    with _SLOWING:
        for w in workers:
            ctx.slowed[w.pid] = mine
            ctx.job.signal_worker(w, on)
    timer.start()
    return (f"slowed agent {agent.index}'s {len(workers)} worker(s) (ranks {[w.rank for w in workers]}, pids {pids}) "
            f"to a quarter of their compute for {ctx.slow_seconds:g}s")


def corrupt_param(ctx: FaultContext) -> str:
    """One worker's replica gets one bit of a parameter flipped at its next step boundary (a device's silent
    corruption; elastic_runner.training.injected_faults): nothing fails, and its fingerprint must give it away."""
    if len(ctx.job.workers()) < 2:
        raise Skip("one worker: no replica to compare its fingerprint with")
    w = _random_worker(ctx, hook=signal.SIGUSR2)
    ctx.targets = [w.pid]
    ctx.job.signal_worker(w, signal.SIGUSR2)
    return f"asked worker rank {w.rank} (pid {w.pid}) to flip a bit of its replica's largest parameter"


#: Seconds a spare-takeover waits for its new agent to wait as a spare (an agent's start: imports, the zygote).
SPARE_WAIT_S = 120.0


def spare_takeover(ctx: FaultContext) -> str:
    """Start one agent more than the round's maximum, wait until it waits as a spare, then lose a seated node: the
    spare must take its place in the next round, the world size unchanged (the verdict checks it)."""
    running = ctx.job.running_agents()
    if len(running) < ctx.max_agents:
        raise Skip(f"{len(running)} agent(s) running, the maximum is {ctx.max_agents}: a new agent would join, not "
                   "wait as a spare")
    # (No minimum to keep: the spare takes the lost node's seat, so a job of --nnodes N:N can lose one too.)
    seated = [a for a in running if not a.hosts_store and ctx.job.workers(a)]
    if not seated:
        raise Skip("no seated agent but the c10d store's host could be lost")
    spare = ctx.job.start_agent()
    if not wait_until_spare(ctx.job, spare):
        raise Skip(f"agent {spare.index} (pid {spare.pid}) did not wait as a spare within {SPARE_WAIT_S:g} s "
                   f"({'it exited' if not spare.running() else 'it may have found a free seat'})")
    victim = ctx.rng.choice([a for a in seated if a.running()] or seated)
    ctx.struck_at = time.time()
    killed = ctx.job.kill_agent(victim, signal.SIGKILL, with_workers=True)
    ctx.targets = [spare.pid]
    return (f"spare takeover: agent {spare.index} (pid {spare.pid}) waited as a spare; node loss: SIGKILL agent "
            f"{victim.index} (pid {victim.pid}) and its {len(killed)} process(es)")


def wait_until_spare(job: LocalJob, spare: Agent, timeout: float = SPARE_WAIT_S) -> bool:
    """Wait until agent ``spare`` says it waits as a spare (its ``agent_spare_waiting`` event: the round is full);
    False when it exits first or ``timeout`` is up. Reads only that agent's event file, and only what it appended."""
    follower = EventFollower(job.node_run_dir(spare.index), pattern=f"{EVENTS_DIR}/agent-*-{spare.pid}.jsonl")
    deadline = time.monotonic() + timeout
    while spare.running() and time.monotonic() < deadline:
        if any(e["kind"] == "agent_spare_waiting" for e in follower.read_new()):
            return True
        time.sleep(0.1)
    return False


def nan_batch(ctx: FaultContext) -> str:
    """One worker's loss of its next step is made NaN (a corrupt record in a corpus; elastic_runner.training.
    injected_faults): with train.on_nonfinite: rollback the job must roll back and skip that step's batch."""
    w = _random_worker(ctx, hook=signal.SIGUSR1)
    ctx.targets = [w.pid]
    ctx.job.signal_worker(w, signal.SIGUSR1)
    return f"asked worker rank {w.rank} (pid {w.pid}) to make its loss of its next step NaN"


FAULTS: dict[str, Callable[[FaultContext], str]] = {
    "kill-worker": kill_worker,
    "kill-agent": kill_agent,
    "kill-node": kill_node,
    "join": join,
    "hang": hang,
    "preempt": preempt,
    "restart-etcd": restart_etcd,
    "corrupt-snapshot": corrupt_snapshot,
    "fill-disk": fill_disk,
    "slow-node": slow_node,
    "corrupt-param": corrupt_param,
    "nan-batch": nan_batch,
    "spare-takeover": spare_takeover,
}
# scenario.py validates names without importing the fault machinery; keep the two lists one.
assert tuple(FAULTS) == FAULT_TYPES, "elastic_runner.chaos.scenario.FAULT_TYPES must list FAULTS"
