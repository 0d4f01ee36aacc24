"""What an adopted agent (``launch`` or plain torchrun) prints on the terminal, and what it keeps quiet.

A failure the job recovers from is told once, by rank 0 of the new attempt
(:mod:`elastic_runner.observe.failure_story`). torch's process context also logs every failed worker at ERROR
with the traceback of its own polling loop (``ProcessExitedException``), which says nothing about
the failure and buries the story; it goes to DEBUG here (``ELASTIC_RUNNER_AGENT_LOGLEVEL=DEBUG``
shows it), the agent's event log keeps the rank, pid and exit status. A failure that ends the job
for good because restarting cannot help (a config error, a diverged gradient) was already printed
by the worker in one line: the agent adds no ``worker_main FAILED`` table and exits with the
worker's status. A rendezvous that cannot start (no etcd at the endpoint, a bad ``--rdzv-conf``) is one
line that says what to check, with no chained tracebacks (they go to DEBUG).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from ..lifecycle import EXIT_FINAL

log = logging.getLogger("elastic_runner.agent")

#: The logger of torch's worker process contexts (``torch.distributed.elastic.multiprocessing.api``).
TORCH_PROCESS_LOGGER = "torch.distributed.elastic.multiprocessing.api"


def log_to_stderr() -> None:
    """Our agent-side messages next to torchrun's (it only configures its own loggers)."""
    logger = logging.getLogger("elastic_runner")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s [agent] %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.setLevel(os.environ.get("ELASTIC_RUNNER_AGENT_LOGLEVEL", "INFO"))
        logger.propagate = False


class WorkerFailureToDebug(logging.Filter):
    """Moves torch's "failed (exitcode: N) local_rank: ..." records (and their traceback) and its
    "Closing process N via signal SIGTERM" (the worker says why it stops) to our DEBUG log."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(("failed (exitcode", "Closing process")):
            return True
        log.debug("torch: " + str(record.msg), *(record.args or ()), exc_info=record.exc_info)  # type: ignore[arg-type]
        return False


_filter = WorkerFailureToDebug()


def quiet_handled_failures() -> None:
    """Install :class:`WorkerFailureToDebug` on torch's process-context logger (idempotent)."""
    logger = logging.getLogger(TORCH_PROCESS_LOGGER)
    if _filter not in logger.filters:
        logger.addFilter(_filter)


def final_exit_code(exc: Any) -> int | None:
    """The exit status to end with when every failure in torch's ``ChildFailedError`` is one that
    restarting cannot fix (:data:`elastic_runner.lifecycle.EXIT_FINAL`); None otherwise."""
    failures = getattr(exc, "failures", None)
    if not failures:
        return None
    codes = {f.exitcode for f in failures.values()}
    _, first = exc.get_first_failure()  # the root cause; its siblings may have been stopped for it
    return first.exitcode if first.exitcode in EXIT_FINAL and codes <= EXIT_FINAL | {-15, 143} else None


def agent_exit_status(exc: BaseException) -> int | None:
    """How an adopted agent (``launch`` or plain torchrun) ends on ``exc``, once it has said what it must:
    the final status of workers that restarting cannot fix (they printed their one line; torch's failure
    table would only bury it), 1 after one line for a start-up failure that says what to fix, or None:
    torch reports it, as it always has."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if isinstance(exc, ChildFailedError):
        return final_exit_code(exc)
    excluded = getattr(exc, "exit_status", None)  # this node left, or may not join yet (.exclusion)
    if isinstance(excluded, int) and isinstance(getattr(exc, "line", None), str):
        print(exc.line, file=sys.stderr)  # type: ignore[attr-defined]
        return excluded
    line = startup_error_line(exc)
    if line is None:
        return None
    print(line, file=sys.stderr)
    return 1


def startup_error_line(exc: BaseException) -> str | None:
    """One line for a start-up failure whose message already says what to fix; None for anything else
    (torch's traceback is then the best help there is)."""
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError

    from ..rendezvous.backend import EtcdRendezvousStartError
    from ..rendezvous.rounds import RendezvousRefusedError

    if isinstance(exc, (EtcdRendezvousStartError, RendezvousRefusedError)):
        log.debug("rendezvous start-up failure", exc_info=exc)
        return f"elastic-runner: {exc}"
    if isinstance(exc, RendezvousClosedError):
        # A node that arrives after the job's agents closed the rendezvous (a replacement pod started as the
        # job finished, or an old --rdzv-id). Not 0: it cannot tell a finished job from a failed one, and a
        # Job's success rule counts a pod that exits 0 as a finished run.
        log.debug("rendezvous closed", exc_info=exc)
        return ("elastic-runner: the job's rendezvous is closed: its agents have ended it (the run finished, failed "
                "or was shut down), so this node has nothing to join. To start a new run, use a new --rdzv-id.")
    return None
