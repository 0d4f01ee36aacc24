"""Start ``elastic_runner.train`` workers by forking a pre-imported zygote.

torchrun starts each worker as a new interpreter (``python -m ...``), so
every start and every restart pays the imports (about 5 s on a small CPU
machine, see :mod:`elastic_runner.agent.warm`). ``elastic-runner launch``
instead hands torch's agent a *function* entrypoint with the ``forkserver``
start method, whose server process preloads the worker's modules. The
server is started in the background as soon as the launcher starts, so it
warms up while the agent imports torch and joins the rendezvous.

Workers are then children of the zygote, not of the agent. They still die
with their agent: the zygote exits when the agent's end of its "alive" pipe
closes (each worker closes the copy the forkserver hands it), and each worker
asks for SIGKILL on its parent's death
(:func:`elastic_runner.lifecycle.die_with_parent`).
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.forkserver as forkserver
import os
import sys
import threading

log = logging.getLogger(__name__)

PRELOAD = ["elastic_runner.agent.warm"]
WORKER_MODULE = "elastic_runner.train"

_warming: threading.Thread | None = None


def start_warming() -> None:
    """Start the zygote now, in the background (idempotent)."""
    global _warming
    if _warming is not None:
        return
    forkserver.set_forkserver_preload(PRELOAD)
    _warming = threading.Thread(target=forkserver.ensure_running, name="zygote-warmup", daemon=True)
    _warming.start()


def is_worker_command(module: bool, script: str) -> bool:
    """True when the launched program is our worker (``-m elastic_runner.train``)."""
    return bool(module) and script == WORKER_MODULE


def worker_main(*argv: str) -> None:
    """The worker's entrypoint inside a forked process (same as ``python -m elastic_runner.train``).

    Only a run that *completed* returns normally: torch's process context then
    collects the return value and lets the worker exit once every worker is
    done. A worker that stopped on a signal, or failed, leaves at once with
    ``os._exit``: torch's agent does not collect return values while it is
    stopping the group (a returned worker would wait there until SIGKILL),
    and interpreter teardown only delays the restart. ``@record`` on the
    worker's ``main`` has already written the error file torchrun reports.
    """
    # ``python -m elastic_runner.train`` (a plain torchrun worker) has the working directory on
    # sys.path, so config import paths like 'mymodels:Net' find modules there; so does a zygote worker.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    # A child of the forkserver inherits its start method: every DataLoader iteration would start a
    # forkserver of its own (1.6 s, measured) instead of forking its workers as a plain worker does.
    multiprocessing.set_start_method("fork", force=True)
    # The forkserver hands every child its "alive" pipe (for children that use the forkserver in
    # turn) and exits only once every copy of it is closed. Kept, it would keep the zygote alive
    # after its agent died, and the zygote is the parent whose death kills this worker: both would
    # train on as orphans. Closed, the agent's death ends the zygote and the zygote's this worker.
    alive = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)
    if alive is not None:
        os.close(alive)
        forkserver._forkserver._forkserver_alive_fd = None
    from elastic_runner import lifecycle
    from elastic_runner.train import main

    sys.argv = [WORKER_MODULE, *argv]
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported by @record; exit without teardown
        lifecycle.exit_now(lifecycle.EXIT_FAILED)
    if code or lifecycle.stop_signal is not None:
        lifecycle.exit_now(int(code or 0))
