"""The agent's worker processes, kept when one of them fails: the agent side of in-process recovery.

torch's :class:`~torch.distributed.elastic.multiprocessing.api.MultiprocessContext` follows an all-or-nothing
policy: its poll joins the processes through ``torch.multiprocessing``'s ``ProcessContext.join``, which terminates
every other worker of the node as soon as one exits with a failure (SIGTERM, then SIGKILL after 30 s), and then
closes them all. A survivor cannot be kept that way. :class:`KeepingContext` reports a failed worker without
touching its siblings, and :meth:`KeepingContext.replace` starts a new process for that local rank (with the same
or a changed environment) inside the same context, so that torch's agent goes on monitoring, stopping and
shutting down every worker as before.

Only for function entrypoints (the zygote's; both ``elastic-runner launch`` and plain ``torchrun -m
elastic_runner.train`` use one). The private torch names it relies on are checked by
:data:`elastic_runner.torch_patches.KEEPING_WORKERS`.
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
        from .zygote import standby_main

        context = multiprocessing.get_context(self.start_method)
        theirs, ours = context.Pipe(duplex=True)
        process = context.Process(target=standby_main, args=(theirs, min(self.args), self._wrap_args()),
                                  daemon=False, name="elastic-runner-standby")
        process.start()
        theirs.close()
        self._standby = (process, ours)
        log.debug("standby worker started (pid %s)", process.pid)
        return int(process.pid)

    def standby_ready(self) -> tuple[int, bool, float] | None:
        """Once the standby has finished building (asked without waiting): its pid, whether it built the workload
        (False: the worker it becomes builds it) and the seconds it took; None before, and after the one answer."""
        if self._standby is None:
            return None
        process, conn = self._standby
        try:
            if not conn.poll():
                return None
            built, seconds = conn.recv()
        except (OSError, EOFError, ValueError):
            return None
        return int(process.pid), bool(built), float(seconds)

    def standby_lost(self) -> int | None:
        """The exit status of a standby that ended without taking a place (killed, out of memory), once; None while
        it runs, and where there is none."""
        if self._standby is None or self._standby[0].is_alive():
            return None
        (process, conn), self._standby = self._standby, None
        conn.close()
        process.join(1)
        return process.exitcode if process.exitcode is not None else -1

    def _take_standby(self, local_rank: int, error_file: str) -> Any | None:
        """The standby, given ``local_rank``'s place (its environment as the context has it now); None where there
        is none, or it is gone (a new process takes the place)."""
        standby, self._standby = self._standby, None
        if standby is None:
            return None
        process, send = standby
        try:
            if not process.is_alive():
                raise BrokenPipeError("the standby has exited")
            send.send((local_rank, self.envs[local_rank], error_file))
        except (OSError, ValueError) as exc:
            log.info("the standby worker (pid %s) cannot take local rank %d's place (%s): a new process does",
                     process.pid, local_rank, exc)
            _end(process)
            return None
        finally:
            send.close()
        return process

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
        process = self._take_standby(local_rank, error_file)
        from_standby = process is not None
        if process is None:
            # torch's two wrappers, as MultiprocessContext._start nests them: the outer one writes a traceback for
            # the parent, the inner one sets the environment, redirects the output and hands back the result.
            process = multiprocessing.get_context(self.start_method).Process(
                target=sys.modules[SPAWN]._wrap,
                args=(sys.modules[ELASTIC_MP]._wrap, local_rank, self._wrap_args(), error_file), daemon=False)
            process.start()
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
        super()._close(death_sig, timeout)


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
