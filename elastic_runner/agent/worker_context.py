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
:data:`elastic_runner.agent.torch_patches.KEEPING_WORKERS`.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import sys
import tempfile
from typing import Any

from torch.distributed.elastic.multiprocessing.api import MultiprocessContext, ProcessFailure, RunProcsResult

from .torch_patches import ELASTIC_MP, SPAWN

log = logging.getLogger(__name__)


class KeepingContext(MultiprocessContext):
    """A :class:`MultiprocessContext` whose failed workers are reported one at a time, the others left running.

    ``keep_survivors`` False: torch's behaviour exactly (the agent falls back to a full restart).
    """

    keep_survivors = True

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

    def replace(self, local_rank: int, env: dict[str, str] | None = None) -> int:
        """Start a new process for ``local_rank`` (whose process has exited), with ``env`` as its environment if
        given; its pid. Its result, failure and shutdown are the context's as for the process it replaces."""
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
        args = (self.entrypoint, self.args, self.envs, self.stdouts, self.stderrs, self._ret_vals,
                self._worker_finished_event, self._numa_options)
        # torch's two wrappers, as MultiprocessContext._start nests them: the outer one writes a traceback for the
        # parent, the inner one sets the environment, redirects the output and hands back the result.
        process = multiprocessing.get_context(self.start_method).Process(
            target=sys.modules[SPAWN]._wrap, args=(sys.modules[ELASTIC_MP]._wrap, local_rank, args, error_file),
            daemon=False)
        process.start()
        self._pc.sentinels.pop(old.sentinel, None)
        self._pc.processes[local_rank] = process
        self._pc.error_files[local_rank] = error_file
        self._pc.sentinels[process.sentinel] = local_rank
        log.debug("local rank %d: pid %s replaced by pid %s", local_rank, old.pid, process.pid)
        return int(process.pid)


def _new_error_file() -> str:
    """Where a process's traceback goes if it raises: a path that does not exist yet (as ``start_processes``
    gives each process: the file is only created by a failure)."""
    handle = tempfile.NamedTemporaryFile(prefix="pytorch-errorfile-", suffix=".pickle", delete=False)
    handle.close()
    os.unlink(handle.name)
    return handle.name


def as_keeping(context: Any) -> KeepingContext | None:
    """``context`` (what torch's ``start_processes`` returned) as a :class:`KeepingContext`: a function-entrypoint
    context only changes its class (nothing of its state differs); None for any other (a binary entrypoint's
    ``SubprocessContext``), which keeps torch's all-or-nothing policy."""
    if type(context) is MultiprocessContext:
        context.__class__ = KeepingContext
    return context if isinstance(context, KeepingContext) else None
