"""Process lifecycle: graceful-stop signals, exit statuses, leaving at once, parent death, start time.

Standard library only, so that the launcher, the agent and the zygote can use it without
importing the trainer (or torch).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import stat
import sys
import threading
import time
from types import FrameType
from typing import Callable

log = logging.getLogger(__name__)

# -- worker exit statuses (the only place they are defined) ------------------------------------------

#: Finished, or stopped gracefully on SIGTERM/SIGINT after saving a snapshot.
EXIT_OK = 0
#: Anything else; torchrun restarts the group.
EXIT_FAILED = 1
#: A configuration or resume problem: a restart would fail the same way, so our agent does not retry.
EXIT_USAGE = 2
#: The gradient became NaN or inf (train.on_nonfinite: stop): a restart would diverge the same way. Also: the
#: replicas kept differing after recovery.max_rollbacks rollbacks (a device that keeps corrupting its replica).
EXIT_DIVERGED = 3
#: Training finished, but its final snapshot could not be written (a full volume): the state is kept in
#: node memory and the worker said how to write it out. A restart would only fail to write it again.
EXIT_NOT_DURABLE = 4
#: The agent's, not a worker's: this node failed its health check before its first round (a device missing or
#: computing wrong, :mod:`elastic_runner.agent.health`) and left; the other nodes go on without it.
EXIT_UNHEALTHY = 5
#: An agent whose node was taken out of the job, or may not join it yet (``recovery.evict_stragglers``): not a failure
#: to restart, and not a success (a Kubernetes Job's podFailurePolicy ignores it: k8s/README.md).
EXIT_EXCLUDED = 6
#: Statuses our agent does not restart: every attempt would end the same way.
EXIT_FINAL = frozenset({EXIT_USAGE, EXIT_DIVERGED, EXIT_NOT_DURABLE})
#: Peers did not arrive within ``dist.init_timeout_seconds`` (process group or first collective).
EXIT_PEER_TIMEOUT = 75
#: The attempt ended because a peer died or hung; the state was kept for the next attempt.
EXIT_PEER_LOST = 76


def exit_now(code: int, message: str | None = None) -> None:
    """Leave at once with ``code``: one line to stderr, log handlers flushed, no interpreter teardown.

    For threads that must end a process whose main thread is stuck in native code (a collective, a
    process-group start) and for forked workers that must not run the parent's teardown.
    """
    if message:
        sys.stderr.write(f"elastic_runner: {message}\n")
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed pipe must not keep us alive
            pass
    os._exit(code)


PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
PR_SET_CHILD_SUBREAPER = 36


#: The signal that asked this process to stop (any StopRequest), for code that
#: must know how the worker ended (elastic_runner.agent.zygote).
stop_signal: str | None = None


class StopRequest:
    """Turns SIGTERM/SIGINT into a flag the training loop checks between steps.

    SIGTERM comes from torchrun when it stops workers and from Kubernetes on
    preemption; the loop then finishes the current step, saves a snapshot and
    exits 0 within torchrun's grace period. A second SIGINT (a person pressing
    Ctrl-C again) aborts at once.
    """

    def __init__(self, agent_reason: Callable[[], str | None] | None = None) -> None:
        #: False until the training loop starts: a stop before then has nothing to save and ends the
        #: process at once, also while the main thread is stuck in native code (a process group waiting for
        #: a peer that is gone), where no Python signal handler can run.
        self.training = False
        #: When a stop that ends the process at once came, for its last line.
        self.at_once_moment = "before training started"
        #: What such a stop leaves behind, for its last line (unless :attr:`last_words` saved something).
        self.at_once_note = "nothing to save"
        #: Called by a stop that ends the process at once, just before it ends: what it saved for the last line, or
        #: "" for nothing. The worker's writes what its node keeps in memory when nothing durable is as new
        #: (a preempted node's memory goes with it).
        self.last_words: Callable[[], str] | None = None
        #: The generation of this process's newest attempt, once its rank 0 claimed it (for :attr:`last_words`:
        #: a write of the process's own lineage passes the fence).
        self.generation: int | None = None
        self.signal_name: str | None = None
        #: Why the agent stopped this worker, when it announced it (a membership change, a failed
        #: sibling, its own shutdown); None for a SIGTERM from anyone else.
        self.agent_reason: str | None = None
        self.received_at: float | None = None
        self._agent_reason = agent_reason
        self._previous: dict[int, object] = {}
        self._previous_wakeup = -1
        self._pipe: tuple[int, int] | None = None

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def between_attempts(self) -> None:
        """In-process recovery: the ended attempt kept what it could and the next one is being prepared (its process
        group rebuilt in native code that may wait seconds for a peer): a stop now ends the process at once, as
        before training, until the next attempt's loop starts."""
        self.at_once_moment, self.at_once_note = "between two attempts (in-process recovery)", "nothing more to save"
        self.training = False

    def at_once_line(self, signal_name: str) -> str:
        """The last line of a stop by ``signal_name`` that ends the process at once, once :attr:`last_words` ran."""
        said = ""
        if self.last_words is not None:
            try:
                said = self.last_words()
            except Exception as exc:  # noqa: BLE001 - the stop must end the process whatever the save did
                said = f"{self.at_once_note} ({exc})"
        return f"received {signal_name} {self.at_once_moment}: {said or self.at_once_note}, stopping now"

    def install(self) -> "StopRequest":
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        # The interpreter's C-level handler writes each signal's number to this pipe at once, whatever the main
        # thread is doing; a thread of ours reads it (the Python handler above runs only between bytecodes).
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        try:
            self._previous_wakeup = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except ValueError:  # not the main thread: the Python handler alone
            os.close(read_fd)
            os.close(write_fd)
            return self
        self._pipe = (read_fd, write_fd)
        threading.Thread(target=self._watch_early, args=(read_fd,), name="elastic-runner-stop", daemon=True).start()
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()
        if self._pipe is not None:
            signal.set_wakeup_fd(self._previous_wakeup)
            os.close(self._pipe[1])  # the watcher reads EOF and ends
            self._pipe = None

    def _watch_early(self, read_fd: int) -> None:
        try:
            while data := os.read(read_fd, 64):
                stops = [n for n in data if n in (signal.SIGTERM, signal.SIGINT)]
                if stops and not self.training:
                    exit_now(EXIT_OK, self.at_once_line(signal.Signals(stops[0]).name))
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                os.close(read_fd)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signal_name == "SIGINT" and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if self.signal_name is None:
            global stop_signal
            stop_signal = name
            self.signal_name = name
            self.received_at = time.monotonic()
            if signum == signal.SIGTERM and self._agent_reason is not None:
                try:
                    self.agent_reason = self._agent_reason()
                except Exception:  # noqa: BLE001 - only the wording of one line depends on it
                    self.agent_reason = None
            if self.agent_reason:  # the worker's last line says it again, once the snapshot is kept
                log.debug("stopped by the agent (%s): finishing the current step, saving a snapshot and stopping",
                         self.agent_reason)
            else:
                log.warning("received %s: finishing the current step, saving a snapshot and stopping", name)

    @property
    def description(self) -> str:
        """How this stop came about, for the worker's last line: "by the agent (...)" or "on SIGTERM"."""
        return f"by the agent ({self.agent_reason})" if self.agent_reason else f"on {self.signal_name}"


try:
    _LIBC: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True)  # loaded before any fork
except OSError:  # pragma: no cover - not Linux
    _LIBC = None


def _prctl(option: int, arg: int | ctypes.c_char_p) -> bool:
    """Linux prctl(2) through the libc loaded at import (safe between fork and exec); False
    where it is unavailable or fails."""
    try:
        return _LIBC is not None and _LIBC.prctl(option, arg, 0, 0, 0) == 0
    except AttributeError:  # a libc without prctl
        return False


def become_subreaper() -> None:
    """Adopt orphaned descendants (instead of init), so that they can be found and reaped."""
    _prctl(PR_SET_CHILD_SUBREAPER, 1)


def child_dies_with_starter() -> None:
    """``preexec_fn`` for a child that must not outlive whoever started it (SIGKILL when it dies).

    Runs between fork and exec, so it only calls into libc (loaded at import). The kernel ties the
    signal to the starting *thread*: start such children from the thread that owns them.
    """
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this worker when its torchrun agent dies.

    torchrun starts workers in their own session, so a killed agent (node
    loss, OOM killer) leaves its workers running as orphans that hold ports,
    memory and GPU; this makes them follow their agent.
    """
    follow_parent(os.getppid())


def follow_parent(parent: int) -> None:
    """SIGKILL this process when ``parent`` (its parent's pid, read before the call or handed down by
    the parent itself) dies, including when it already has: re-parented to init or a subreaper."""
    if not _prctl(PR_SET_PDEATHSIG, signal.SIGKILL):
        log.debug("parent-death signal unavailable (errno %d)", ctypes.get_errno())
    elif os.getppid() != parent or os.getppid() == 1:
        # The parent died before we asked: follow it now.
        os.kill(os.getpid(), signal.SIGKILL)


class LoaderWorkersDieWithTrainer:
    """``worker_init_fn`` for DataLoader workers: they end with the training process that forked them, and keep none
    of its network sockets.

    torch's loader workers notice a dead parent only at their next poll (seconds). Forked after the process group was
    created, they hold copies of its sockets: while they live, a peer does not see this process close its connections
    (when it fails, or gives its group up to rebuild it in process), and a port the trainer listened on stays bound
    (the store's, the metrics server's) — loader workers kept across attempts would hold an old group's sockets for
    the rest of the run. Wraps the user's own ``worker_init_fn`` (called after): a dataset that needs a connection
    opens it in its worker, as it must anyway (a connection two processes share interleaves their requests)."""

    def __init__(self, then: Callable[[int], None] | None = None) -> None:
        self.trainer = os.getpid()
        self.then = then

    def __call__(self, worker_id: int) -> None:
        follow_parent(self.trainer)
        close_network_sockets()
        if self.then is not None:
            self.then(worker_id)


def close_network_sockets() -> int:
    """Close every IPv4/IPv6 socket this process has (this process's copies only: the trainer's stay open, since
    ``close`` is not ``shutdown``); the count closed. Unix-domain sockets, which multiprocessing uses, are left."""
    closed = 0
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:  # no procfs: nothing to find them by
        return 0
    for fd in fds:
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=fd)
        except OSError:  # the listing's own descriptor, gone by now, or not a socket Python can read
            continue
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.close()
            closed += 1
        else:
            sock.detach()
    return closed


def name_process(rank: int, local_rank: int) -> None:
    """Show the worker as ``er-r<RANK>-l<LOCAL_RANK>`` in ps/top (/proc/PID/comm).

    Workers forked from the zygote all share one command line and their
    environment block predates RANK, so this is how people and tools
    (elastic_runner.testing.localjob, the chaos tool) tell them apart.
    """
    _prctl(PR_SET_NAME, ctypes.c_char_p(f"er-r{rank}-l{local_rank}".encode()[:15]))


def name_standby() -> None:
    """Show a standby worker (:mod:`elastic_runner.worker.standby`) as ``er-standby`` until it takes a place."""
    _prctl(PR_SET_NAME, ctypes.c_char_p(b"er-standby"))


def gpu_driver() -> bool:
    """Whether a GPU driver is installed, told without a CUDA call (which would fix this process's devices, and
    spoil its forks, before ``CUDA_VISIBLE_DEVICES`` is set): NVIDIA's (its /proc entry or device files) or ROCm's
    (/dev/kfd). Without one no CUDA device can be there."""
    import glob

    return (os.path.exists("/proc/driver/nvidia/version") or bool(glob.glob("/dev/nvidia[0-9]*"))
            or os.path.exists("/dev/kfd"))


def proc_state(pid: int) -> str:
    """The one-letter state of a process in /proc (R, S, T, Z, ...); "" if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def process_start_time() -> float:
    """Wall-clock time at which this process was created (Linux, ~10 ms), else now."""
    try:
        with open("/proc/self/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
        age = uptime - start_ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - max(0.0, age)
    except (OSError, ValueError, IndexError):
        return time.time()
