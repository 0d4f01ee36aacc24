"""Process lifecycle: graceful-stop signals, parent death, process start time."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import time
from types import FrameType

log = logging.getLogger(__name__)

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

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self.received_at: float | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def install(self) -> "StopRequest":
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signal_name == "SIGINT" and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if self.signal_name is None:
            global stop_signal
            stop_signal = name
            self.signal_name = name
            self.received_at = time.monotonic()
            log.warning("received %s: finishing the current step, saving a snapshot and stopping", name)


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
    if not _prctl(PR_SET_PDEATHSIG, signal.SIGKILL):
        log.debug("parent-death signal unavailable (errno %d)", ctypes.get_errno())
    elif os.getppid() == 1:
        # The agent died before we asked: follow it now.
        os.kill(os.getpid(), signal.SIGKILL)


def name_process(rank: int, local_rank: int) -> None:
    """Show the worker as ``er-r<RANK>-l<LOCAL_RANK>`` in ps/top (/proc/PID/comm).

    Workers forked from the zygote all share one command line and their
    environment block predates RANK, so this is how people and tools
    (elastic_runner.localjob, the chaos tool) tell them apart.
    """
    _prctl(PR_SET_NAME, ctypes.c_char_p(f"er-r{rank}-l{local_rank}".encode()[:15]))


#: Worker exit statuses. Here (standard library only) so that the launcher and the agent can
#: use them without importing the trainer: 2 tells the agent that a restart cannot help.
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


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
