"""The agent's worker processes, kept when one of them fails: the agent side of in-process recovery.

torch's :class:`~torch.distributed.elastic.multiprocessing.api.MultiprocessContext` follows an all-or-nothing
policy: its poll joins the processes through ``torch.multiprocessing``'s ``ProcessContext.join``, which terminates
every other worker of the node as soon as one exits with a failure (SIGTERM, then SIGKILL after 30 s), and then
closes them all. A survivor cannot be kept that way. :class:`KeepingContext` reports a failed worker without
touching its siblings, and :meth:`KeepingContext.replace` starts a new process for that local rank (with the same
or a changed environment) inside the same context, so that torch's agent goes on monitoring, stopping and
shutting down every worker as before.

A node that waits as a spare starts its workers ahead too (:class:`SeatStandbys`): one standby per local rank,
which builds the workload while the node has no seat; the context of the round that seats it hands them their
places (:meth:`KeepingContext.seat`) instead of starting processes.

Only for function entrypoints (the zygote's; both ``elastic-runner launch`` and plain ``torchrun -m
elastic_runner.train`` use one). The private torch names it relies on are checked by
:data:`elastic_runner.torch_patches.KEEPING_WORKERS` and :data:`~elastic_runner.torch_patches.SEATED_SPARES`.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import os
import shutil
import sys
import tempfile
import uuid
from typing import Any

from torch.distributed.elastic.multiprocessing.api import MultiprocessContext, ProcessFailure, RunProcsResult

from ..torch_patches import ELASTIC_MP, SPAWN

log = logging.getLogger(__name__)


class KeepingContext(MultiprocessContext):
    """A :class:`MultiprocessContext` whose failed workers are reported one at a time, the others left running.

    ``keep_survivors`` False: torch's behaviour exactly (the agent falls back to a full restart).
    """

    keep_survivors = True
    #: The node's standby worker (:mod:`elastic_runner.worker.standby`) and the agent's end of its pipe, if started.
    _standby: tuple[Any, Any] | None = None
    #: A spare's standbys, handed the places when this context starts (:meth:`seat`), instead of new processes.
    _seated: SeatStandbys | None = None

    def _poll(self) -> RunProcsResult | None:
        if self.keep_survivors and self._pc is not None:
            for local_rank, process in enumerate(self._pc.processes):
                if process.exitcode in (None, 0) or process.sentinel not in self._pc.sentinels:
                    continue
                # Reported once: torch's own join would find it again, and terminate the others.
                del self._pc.sentinels[process.sentinel]
                return RunProcsResult(
                    failures={local_rank: ProcessFailure(local_rank=local_rank, pid=process.pid,
                                                         exitcode=process.exitcode,
                                                         error_file=self.error_files[local_rank])},
                    stdouts=self.stdouts, stderrs=self.stderrs)
        return super()._poll()

    def _wrap_args(self) -> tuple[Any, ...]:
        """torch's inner ``_wrap``'s arguments after the local rank, as ``MultiprocessContext._start`` gives them."""
        return (self.entrypoint, self.args, self.envs, self.stdouts, self.stderrs, self._ret_vals,
                self._worker_finished_event, self._numa_options)

    def start_standby(self) -> int | None:
        """Start the node's standby worker (unless one runs): a process forked with the workers' command line that
        builds their workload and waits for a failed worker's place (:meth:`replace` gives it one); its pid, or
        None where one runs already or the context has no worker to take the command line from."""
        if self._pc is None or not self.args or (self._standby is not None and self._standby[0].is_alive()):
            return None
        self._standby = _start_standby(self.start_method, min(self.args), self._wrap_args())
        return int(self._standby[0].pid)

    def standby_ready(self) -> tuple[int, bool, float] | None:
        """Once the standby has finished building (asked without waiting): its pid, whether it built the workload
        (False: the worker it becomes builds it) and the seconds it took; None before, and after the one answer."""
        if self._standby is None:
            return None
        process, conn = self._standby
        answer = _built_answer(conn)
        return None if answer is None else (int(process.pid), *answer)

    def standby_lost(self) -> int | None:
        """The exit status of a standby that ended without taking a place (killed, out of memory), once; None while
        it runs, and where there is none."""
        if self._standby is None or self._standby[0].is_alive():
            return None
        (process, conn), self._standby = self._standby, None
        conn.close()
        process.join(1)
        return process.exitcode if process.exitcode is not None else -1

    def _give_place(self, standby: tuple[Any, Any] | None, local_rank: int, error_file: str) -> Any | None:
        """``standby``, given ``local_rank``'s place (its environment and output as the context has them now); None
        where there is none, or it is gone (a new process takes the place)."""
        if standby is None:
            return None
        process, send = standby
        try:
            if not process.is_alive():
                raise BrokenPipeError("the standby has exited")
            send.send((local_rank, self.envs[local_rank], error_file, self.stdouts[local_rank],
                       self.stderrs[local_rank]))
        except (OSError, ValueError) as exc:
            log.info("the standby worker (pid %s) cannot take local rank %d's place (%s): a new process does",
                     process.pid, local_rank, exc)
            _end(process)
            return None
        finally:
            send.close()
        return process

    def _new_process(self, local_rank: int, error_file: str) -> Any:
        """A new process for ``local_rank``, started as ``MultiprocessContext._start`` starts each: torch's two
        wrappers, the outer one writing a traceback for the parent, the inner one setting the environment,
        redirecting the output and handing back the result."""
        process = multiprocessing.get_context(self.start_method).Process(
            target=sys.modules[SPAWN]._wrap,
            args=(sys.modules[ELASTIC_MP]._wrap, local_rank, self._wrap_args(), error_file), daemon=False)
        process.start()
        return process

    def seat(self, standbys: SeatStandbys) -> bool:
        """Before :meth:`start`: the workers are ``standbys`` (started while this node had no seat, with this
        context's command line), not new processes; their result queues and "finished" event become this
        context's. False (``standbys`` ended, nothing changed) where they were started for other workers."""
        if self._pc is not None or standbys.args != self.args or standbys.entrypoint is not self.entrypoint:
            log.info("the spare's standbys were started for other workers than this round's: new processes start")
            standbys.close()
            return False
        self._ret_vals, self._worker_finished_event = standbys.ret_vals, standbys.finished
        self._seated = standbys
        return True

    def _start(self) -> None:
        seated, self._seated = self._seated, None
        if seated is None:
            super()._start()
            return
        processes: list[Any] = []
        error_files: list[str] = []
        try:
            for local_rank in range(self.nprocs):
                error_file = _new_error_file()
                process = self._give_place(seated.take(local_rank), local_rank, error_file)
                processes.append(process if process is not None else self._new_process(local_rank, error_file))
                error_files.append(error_file)
        except BaseException:
            # (a stop signal, a fork that failed) torch's close knows no process yet: those placed or started end here
            for process in processes:
                _end(process)
            raise
        finally:
            seated.close()  # (nothing left to close once each took its place)
        self._pc = sys.modules[SPAWN].ProcessContext(processes, error_files)
        log.debug("the spare's standbys took their places: pids %s", [p.pid for p in processes])

    def replace(self, local_rank: int, env: dict[str, str] | None = None) -> tuple[int, bool]:
        """Start ``local_rank`` again (its process has exited): the standby takes its place if one runs, else a new
        process; with ``env`` as its environment if given. Its pid, and whether it was the standby. Its result,
        failure and shutdown are the context's as for the process it replaces."""
        if self._pc is None:
            raise RuntimeError("the worker context has not been started")
        old = self._pc.processes[local_rank]
        if old.is_alive():
            raise RuntimeError(f"local rank {local_rank} (pid {old.pid}) is still running; it cannot be replaced")
        if env is not None:
            self.envs[local_rank] = dict(env)
        # The failure it replaces was reported already; its record must not pass for the new process's.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.error_files[local_rank])
        error_file = _new_error_file()
        standby, self._standby = self._standby, None
        process = self._give_place(standby, local_rank, error_file)
        from_standby = process is not None
        if process is None:
            process = self._new_process(local_rank, error_file)
        self._pc.sentinels.pop(old.sentinel, None)
        self._pc.processes[local_rank] = process
        self._pc.error_files[local_rank] = error_file
        self._pc.sentinels[process.sentinel] = local_rank
        log.debug("local rank %d: pid %s replaced by pid %s%s", local_rank, old.pid, process.pid,
                  " (the standby)" if from_standby else "")
        return int(process.pid), from_standby

    def _close(self, death_sig: Any, timeout: int = 30) -> None:
        standby, self._standby = self._standby, None
        if standby is not None:  # it holds nothing: no signal to handle, no state to keep
            standby[1].close()
            _end(standby[0])
        seated, self._seated = self._seated, None
        if seated is not None:
            seated.close()
        super()._close(death_sig, timeout)


class SeatStandbys:
    """The standbys of a node that has no seat yet (a spare: :class:`elastic_runner.agent.spare.WarmSeat`), one per
    local rank, started with the workers' command line (``args``, ``entrypoint``) and ``envs`` (what the node's
    workers will have of their environment: their local rank, the world they will join). Each builds the workload
    while the node waits; the context of the round that seats the node hands them its workers' places
    (:meth:`KeepingContext.seat`). They are started with result queues and a "finished" event of their own, which
    that context takes over: torch's process context reads each worker's result from the queue it started it with.
    """

    def __init__(self, entrypoint: Any, args: dict[int, tuple[Any, ...]], envs: dict[int, dict[str, str]],
                 start_method: str, numa_options: Any = None) -> None:
        context = multiprocessing.get_context(start_method)
        self.entrypoint, self.args = entrypoint, args
        self.ret_vals = {local_rank: context.SimpleQueue() for local_rank in args}
        self.finished = context.Event()
        no_redirect = {local_rank: "" for local_rank in args}  # each is given its own at its place
        wrap_args = (entrypoint, args, envs, no_redirect, dict(no_redirect), self.ret_vals, self.finished,
                     numa_options)
        self._standbys: dict[int, tuple[Any, Any]] = {}
        self._answers: dict[int, tuple[bool, float]] = {}  #: each one's (built, seconds), once it said
        try:
            for local_rank in sorted(args):
                self._standbys[local_rank] = _start_standby(start_method, local_rank, wrap_args)
        except BaseException:
            self.close()
            raise

    def pids(self) -> list[int]:
        return [int(process.pid) for process, _ in self._standbys.values()]

    def alive(self) -> bool:
        """Every standby still runs (one that ended — killed, out of memory — makes the spare start them again)."""
        return bool(self._standbys) and all(process.is_alive() for process, _ in self._standbys.values())

    def built(self) -> tuple[int, float]:
        """How many have finished building the workload (asked without waiting), and the longest build's seconds;
        each one's answer is read once."""
        for local_rank, (_, conn) in self._standbys.items():
            if local_rank not in self._answers and (answer := _built_answer(conn)) is not None:
                self._answers[local_rank] = answer
        built = [seconds for done, seconds in self._answers.values() if done]
        return len(built), max(built, default=0.0)

    def take(self, local_rank: int) -> tuple[Any, Any] | None:
        """``local_rank``'s standby and the agent's end of its pipe, now the caller's; None where there is none."""
        return self._standbys.pop(local_rank, None)

    def close(self) -> None:
        """End every standby that took no place."""
        standbys, self._standbys = self._standbys, {}
        for process, conn in standbys.values():
            conn.close()
            _end(process)


def _built_answer(conn: Any) -> tuple[bool, float] | None:
    """What a standby said on ``conn`` once it finished building (:func:`~elastic_runner.agent.zygote.standby_main`):
    whether it built the workload, and in how many seconds; None before (asked without waiting), or if it is gone."""
    try:
        if not conn.poll():
            return None
        built, seconds = conn.recv()
    except (OSError, EOFError, ValueError):
        return None
    return bool(built), float(seconds)


def _start_standby(start_method: str, template_rank: int, wrap_args: tuple[Any, ...]) -> tuple[Any, Any]:
    """A standby worker (:func:`elastic_runner.agent.zygote.standby_main`) that builds with local rank
    ``template_rank``'s environment, and the agent's end of its pipe."""
    from .zygote import standby_main

    context = multiprocessing.get_context(start_method)
    theirs, ours = context.Pipe(duplex=True)
    process = context.Process(target=standby_main, args=(theirs, template_rank, wrap_args), daemon=False,
                              name="elastic-runner-standby")
    process.start()
    theirs.close()
    log.debug("standby worker started (pid %s)", process.pid)
    return process, ours


def _end(process: Any) -> None:
    """SIGKILL a standby (it trains nothing) and reap it."""
    with contextlib.suppress(ProcessLookupError, AttributeError, ValueError):
        process.kill()
        process.join(5)


_error_dir: list[str] = []  #: this agent's private directory for the error files of the workers it starts itself


def _new_error_file() -> str:
    """Where a process's traceback goes if it raises: a path that does not exist yet (as ``start_processes``
    gives each process: the file is only created by a failure), in a directory only this user can enter. torch
    unpickles the file when the worker exits non-zero: a name in a shared ``/tmp`` that another local user could
    create first would let them plant the pickle (torch's own are in a ``mkdtemp`` directory too)."""
    if not _error_dir:
        private = tempfile.mkdtemp(prefix="elastic-runner-errors-")  # mode 0700
        atexit.register(shutil.rmtree, private, True)
        _error_dir.append(private)
    return os.path.join(_error_dir[0], f"errorfile-{uuid.uuid4().hex}.pickle")


def as_keeping(context: Any) -> KeepingContext | None:
    """``context`` (what torch's ``start_processes`` returned) as a :class:`KeepingContext`: a function-entrypoint
    context only changes its class (nothing of its state differs); None for any other (a binary entrypoint's
    ``SubprocessContext``), which keeps torch's all-or-nothing policy."""
    if type(context) is MultiprocessContext:
        context.__class__ = KeepingContext
    return context if isinstance(context, KeepingContext) else None
