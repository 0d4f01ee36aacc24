"""The snapshot writer process: serialisation, SHA-256, fsync, publish and pruning off the training interpreter.

A background *thread* that serialises a state holds the interpreter for every record ``torch.save``
writes, so the training loop waits for it at each switch (measured: a snapshot every 10 steps cost a
small model 27 % of its throughput). This process does that work instead; the training process only
copies the tensors into a shared-memory arena (:mod:`.shm`) and sends the state's skeleton.

:class:`WriterProcess` is the training side: it starts a Python process running :func:`main`
with one end of a socket pair, sends jobs, and a thread reads the outcomes. The process dies with its
worker (``PR_SET_PDEATHSIG``, and the socket's end-of-file), so a killed worker leaves no writer behind.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from . import shm

log = logging.getLogger(__name__)

#: An outcome: ("ok", {meta, already_committed, prune_errors}) or ("error", {type, message, errno}).
Outcome = tuple[str, dict[str, Any]]


#: Not ``-m``: the package imports this module, and runpy warns about running a module already imported.
#: What comes before the imports must not wait for torch: die with the worker (PR_SET_PDEATHSIG = 1 with
#: SIGKILL = 9, and exit if it is gone already), so a worker killed while this process imports leaves nothing
#: behind; ignore Ctrl-C and stops, which reach the whole process group (the worker handles them, this
#: process ends with it). Then modules are looked up on the worker's own ``sys.path`` (argv[3]): the writer
#: runs the worker's elastic_runner, and the standard library keeps its place ahead of site-packages.
_ENTRY = """import ctypes, json, os, signal, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, 9)
except (OSError, AttributeError):
    pass  # elsewhere the socket's end-of-file ends the process after the job in flight
if os.getppid() != int(sys.argv[2]):
    os._exit(0)
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
sys.path[:] = json.loads(sys.argv[3])
from elastic_runner.snapshot.writer_process import main
main(sys.argv[1:3])
"""


#: The writer process's niceness (0-19): lower priority than training for the CPU.
NICE = 10


class WriterGone(RuntimeError):
    """The writer process is not running (it exited, or could not start)."""


class WriterProcess:
    """Training side of the writer process. One job at a time: :meth:`submit` sends it (and the arena's
    descriptor when the arena is new), ``on_outcome`` is called from the reader thread with its outcome,
    ``on_gone`` once if the process exits while a job is in flight or before."""

    def __init__(self, store_spec: dict[str, str], generation: int, keep_last: int, sharing: str,
                 on_outcome: Callable[[Outcome], None], on_gone: Callable[[str], None]) -> None:
        self._on_outcome = on_outcome
        self._on_gone = on_gone
        self._send_lock = threading.Lock()
        self._closing = False
        #: Set once the process has imported what it writes with; until then the worker writes itself.
        self.ready = threading.Event()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ)
        env["OMP_NUM_THREADS"] = "1"  # torch.save needs no thread pool; the cores are the training's
        # The worker may have found elastic_runner through a path it added itself: the writer gets the same
        # path, in the same order. Relative entries ("" for the current directory) are made absolute.
        path = [str(Path(entry or ".").resolve()) for entry in sys.path]
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _ENTRY, str(theirs.fileno()), str(os.getpid()), json.dumps(path)],
                pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL, close_fds=True)
        except OSError as exc:
            ours.close()
            raise WriterGone(f"could not start the snapshot writer process: {exc}") from exc
        finally:
            theirs.close()
        self.sock = ours
        shm.send(self.sock, {"store": store_spec, "generation": generation, "keep_last": keep_last, "sharing": sharing})
        self._reader = threading.Thread(target=self._read, name="snapshot-writer-reader", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None and not self._closing

    def submit(self, job: dict[str, Any], fd: int | None = None) -> None:
        try:
            with self._send_lock:
                shm.send(self.sock, job, fd)
        except OSError as exc:
            raise WriterGone(f"the snapshot writer process (pid {self.pid}) is gone: {exc}") from exc

    def _read(self) -> None:
        broken = None
        try:
            while True:
                try:
                    outcome, _ = shm.receive(self.sock)
                except (EOFError, OSError):
                    break
                if outcome == ("ready", {}):
                    self.ready.set()
                else:
                    self._on_outcome(outcome)
        except Exception as exc:  # noqa: BLE001 - an unreadable outcome: the process is of no further use
            broken = f"{type(exc).__name__}: {exc}"
            self._stop_after_error()
        if self._closing and broken is None:
            return
        if broken is not None:
            self._on_gone(f"an outcome from the snapshot writer process (pid {self.pid}) could not be handled "
                          f"({broken}); the process was stopped")
            return
        try:
            status = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            status = None
        why = ""
        if status == -signal.SIGKILL:
            why = " (SIGKILL: most often the kernel's out-of-memory killer; see `dmesg`)"
        elif status is not None:
            why = f" with status {status}"
        self._on_gone(f"the snapshot writer process (pid {self.pid}) exited{why}")

    def _stop_after_error(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)

    def kill(self) -> None:
        """End the process at once: a message to it may have been cut short (the worker is stopping)."""
        self._closing = True
        with contextlib.suppress(OSError):
            self.proc.kill()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the process after the job in flight (the caller has waited for it)."""
        self._closing = True
        try:
            self.sock.shutdown(socket.SHUT_WR)  # end of jobs: the process exits
        except OSError:
            pass
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.sock.close()
        self._reader.join(timeout=timeout)


# -- the process itself ---------------------------------------------------------------------------------------


def _error(exc: BaseException) -> dict[str, Any]:
    code = None
    cause: BaseException | None = exc
    while cause is not None and code is None:
        code = getattr(cause, "errno", None)
        cause = cause.__cause__
    return {"type": type(exc).__name__, "message": str(exc), "errno": code}


def serve(sock: socket.socket) -> None:
    """Write each job's state, publish it, prune, and answer with the outcome, until the socket closes."""
    from ..files import set_sharing
    from .format import set_signing_key, signing_key_from_environment
    from .publish import write_and_publish
    from .object_store import store_from_spec
    from .store import SnapshotRef

    shm.send(sock, ("ready", {}))
    init, _ = shm.receive(sock)
    set_sharing(init["sharing"])
    set_signing_key(signing_key_from_environment())  # the worker's environment: the same key as the worker's
    store = store_from_spec(init["store"])
    arena: shm.Arena | None = None
    while True:
        try:
            job, fd = shm.receive(sock)
        except EOFError:
            return
        if fd is not None:
            if arena is not None:
                arena.close()
            arena = shm.Arena(job["arena_size"], fd=fd)
            arena.release_fd()
        started = time.perf_counter()
        try:
            if arena is None:
                raise RuntimeError("a job came before its arena")
            state = shm.rebuild(job["skeleton"], arena)
            ref = SnapshotRef(generation=init["generation"], step=job["step"])
            done = write_and_publish(store, init["generation"], init["keep_last"], ref, state, job["meta"])
            del state  # views of the arena: gone before the arena may be replaced
            outcome: Outcome = ("ok", {"meta": done.meta, "already_committed": done.already_committed,
                                       "prune_errors": done.prune_errors, "seconds": done.seconds_since(started)})
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the worker, which reports it
            outcome = ("error", _error(exc))
        shm.send(sock, outcome)


def main(argv: list[str]) -> None:
    """The process's body, once ``_ENTRY`` has tied it to the worker: argv = [socket fd, worker pid]."""
    fd = int(argv[0])
    # Background work: on a node whose cores all train, the scheduler runs this when training waits.
    with contextlib.suppress(OSError):
        os.nice(NICE)
    with socket.socket(fileno=fd) as sock:
        try:
            serve(sock)
        except (EOFError, BrokenPipeError, ConnectionResetError):
            pass  # the worker is gone
