"""Start ``elastic_runner.train`` workers by forking a pre-imported zygote.

torchrun starts each worker as a new interpreter (``python -m ...``), so
every start and every restart pays the imports (about 5 s on a small CPU
machine, see :mod:`elastic_runner.agent.warm`). ``elastic-runner launch``
instead hands torch's agent a *function* entrypoint with the ``forkserver``
start method, whose server process preloads the worker's modules. The
server is forked from the agent once the agent has imported torch (it then
imports only ``torch._dynamo`` and the trainer, and no second interpreter
competes with the agent for the CPU while it joins the rendezvous), or, where
that is not possible, started as a new interpreter in the background.

Workers are then children of the zygote, not of the agent. They still die
with their agent: the zygote exits when the agent's end of its "alive" pipe
closes (each worker closes the copy the forkserver hands it), and each worker
asks for SIGKILL on its parent's death
(:func:`elastic_runner.lifecycle.die_with_parent`).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing
import multiprocessing.forkserver as forkserver
import os
import sys
import threading
import time
from typing import Any, Sequence

log = logging.getLogger(__name__)

PRELOAD = ["elastic_runner.agent.warm"]
#: Preloaded too when the workers compile their model (``model.compile``): torch.compile's code generator (0.85 s
#: of imports here, which every restarted worker would pay again; nothing else pays it).
COMPILE_PRELOAD = ["elastic_runner.agent.warm_compile"]
#: Preloaded too when the snapshots live in a bucket (``snapshot.dir: s3://...``): its client library.
OBJECT_STORE_PRELOAD = ["elastic_runner.agent.warm_object_store"]
WORKER_MODULE = "elastic_runner.train"

_warming: threading.Thread | None = None
#: Seconds an agent waits, before it takes part in the rendezvous, for its zygote (forked from the agent: not on a
#: machine whose agent initialised CUDA, where the zygote starts as a new interpreter and nothing is waited for) to have
#: imported the workers' modules: a node that joins a running job then starts its workers as soon as the round is
#: sealed, and the others train on while it warms up instead of waiting for it in the new round.
WARM_WAIT_S = 60.0
#: The agent's end of the pipe the forked zygote writes to once it has imported what it preloads (None: not forked,
#: or already waited for).
_ready_fd: int | None = None


def start_warming(compiled: bool = False, object_store: bool = False) -> None:
    """Start the zygote now (idempotent): forked from this process when it has imported torch already
    (:func:`fork_zygote`), else a new interpreter, warming in the background. ``compiled``: the workers compile
    their model (:data:`COMPILE_PRELOAD`); ``object_store``: their snapshots are in a bucket
    (:data:`OBJECT_STORE_PRELOAD`)."""
    global _warming
    if _warming is not None:
        return
    preload = PRELOAD + (COMPILE_PRELOAD if compiled else []) + (OBJECT_STORE_PRELOAD if object_store else [])
    forkserver.set_forkserver_preload(preload)
    if "torch" in sys.modules and fork_zygote(preload):
        _warming = threading.current_thread()
        return
    _warming = threading.Thread(target=forkserver.ensure_running, name="zygote-warmup", daemon=True)
    _warming.start()


def wait_warm(timeout: float = WARM_WAIT_S) -> bool:
    """Wait up to ``timeout`` seconds for the forked zygote to have imported what its workers need; True once it has
    (or where there is no forked zygote to wait for). A node that joins a running job waits for this before it
    enters a rendezvous round: the others train on meanwhile, instead of waiting in the new round for its workers."""
    global _ready_fd
    if _ready_fd is None:
        return True
    import select

    poller = select.poll()
    poller.register(_ready_fd, select.POLLIN)
    answered = bool(poller.poll(max(0.0, timeout) * 1000))
    said = os.read(_ready_fd, 1) if answered else b""
    os.close(_ready_fd)
    _ready_fd = None
    if answered and said != b"1":
        log.warning("the worker zygote ended while it imported the workers' modules; the workers' start will say why")
    return answered


def _fork_supported() -> bool:
    """The forkserver internals :func:`fork_zygote` fills in are the ones this Python has (3.8-3.13)."""
    import inspect

    server = forkserver._forkserver
    try:
        params = list(inspect.signature(forkserver.main).parameters)
    except (TypeError, ValueError):
        return False
    return (params == ["listener_fd", "alive_r", "preload", "main_path", "sys_path"]
            and all(hasattr(server, a) for a in ("_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid"))
            and not hasattr(server, "_forkserver_authkey")
            and server._forkserver_pid is None and threading.active_count() == 1)


def _fork_poisoned() -> bool:
    """True where a child forked from this process could not use this machine's GPUs ("Cannot re-initialize CUDA
    in forked subprocess"): this process has asked the CUDA driver something. torchrun's agent does so itself on a
    machine with a GPU (``LaunchConfig.__post_init__``: ``torch.cuda.is_available()`` in 2.11,
    ``torch.accelerator`` in 2.14), before our handler runs. Without a GPU (a CUDA build on a CPU machine) it does
    not matter: the workers never use CUDA."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda._is_compiled() or not _gpu_device_nodes():
        return False
    return _child_in_bad_fork(torch)


def _gpu_device_nodes() -> bool:
    """Whether this machine has a GPU driver, told from its files (:func:`elastic_runner.lifecycle.gpu_driver`):
    asking the driver itself would be the very call that spoils a fork."""
    from elastic_runner.lifecycle import gpu_driver

    return gpu_driver()


def _child_in_bad_fork(torch: Any) -> bool:
    """torch keeps "the driver was asked" in C++ and tells only a forked child (``_is_in_bad_fork``): ask one."""
    pid = os.fork()
    if pid == 0:
        os._exit(3 if torch.cuda._is_in_bad_fork() else 0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) != 0


def fork_zygote(preload: list[str] = PRELOAD) -> bool:
    """Start the zygote as a fork of this agent, which has imported torch already; False (nothing done)
    where this Python's forkserver differs or this process runs other threads.

    A new interpreter imports torch again (1.3 s of CPU here) at the very moment the agent imports it and
    joins the rendezvous: on a node that joins a running job the two competed for the same cores, and
    the agent reached the rendezvous in 3 s instead of 1.5 s. Forked, the zygote imports only what torch
    did not bring (``torch._dynamo``, the trainer). What ``ensure_running`` does, with ``os.fork`` in
    place of a new interpreter: the child keeps only the listener, its end of the "alive" pipe, the
    resource tracker and stdio, exactly the descriptors a spawned server gets.
    """
    import socket
    from multiprocessing import connection, resource_tracker, util

    if not _fork_supported():
        return False
    if _fork_poisoned():
        log.debug("this agent initialised the CUDA driver: the zygote starts as a new interpreter")
        return False
    resource_tracker.ensure_running()
    listener = socket.socket(socket.AF_UNIX)
    address = connection.arbitrary_address("AF_UNIX")
    listener.bind(address)
    if not util.is_abstract_socket_namespace(address):
        os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the zygote
        code = 0
        try:
            keep = {0, 1, 2, listener.fileno(), alive_r, ready_w,
                    getattr(resource_tracker._resource_tracker, "_fd", None)}
            for name in os.listdir("/proc/self/fd"):
                if int(name) not in keep:
                    try:
                        os.close(int(name))
                    except OSError:
                        pass
            # The agent's "[agent]" handler must not follow into its workers (they set up their own).
            ours = logging.getLogger("elastic_runner")
            ours.handlers.clear()
            ours.propagate, ours.level = True, logging.NOTSET
            for name in preload:  # what forkserver.main would import first, then say so
                with contextlib.suppress(ImportError):
                    __import__(name)
            try:
                os.write(ready_w, b"1")
            except OSError:
                pass  # the agent stopped waiting: nothing to tell
            finally:
                os.close(ready_w)  # never into the workers
            forkserver.main(listener.fileno(), alive_r, [])
        except SystemExit:
            pass  # the agent is gone (the "alive" pipe closed): the normal end
        except BaseException:  # noqa: BLE001 - never return into the agent's code in this process
            code = 1
        finally:
            os._exit(code)
    global _ready_fd
    os.close(alive_r)
    os.close(ready_w)
    _ready_fd = ready_r
    listener.close()
    server = forkserver._forkserver
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
    log.debug("zygote forked from the agent (pid %d)", pid)
    return True


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
    _as_worker()
    from elastic_runner.worker.main import main
    from elastic_runner import lifecycle

    sys.argv = [WORKER_MODULE, *argv]
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported by @record; exit without teardown
        lifecycle.exit_now(lifecycle.EXIT_FAILED)
    if code or lifecycle.stop_signal is not None:
        lifecycle.exit_now(int(code or 0))


def _as_worker() -> None:
    """What a process forked from the zygote needs before it runs the worker's code."""
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
    # What the zygote imported (torch and the trainer: most of the heap) lives as long as the worker: the collector
    # need not walk it again. A full collection, which a survivor of in-process recovery runs to free the ended
    # attempt's group, then takes milliseconds instead of ~0.15 s (measured on this CPU).
    gc.freeze()


def standby_main(conn: Any, template_rank: int, wrap_args: tuple[Any, ...]) -> None:
    """A standby worker (:mod:`elastic_runner.worker.standby`): builds the workers' workload ahead, with the
    environment of local rank ``template_rank``, says on ``conn`` whether it did and in how many seconds, then waits
    there for a place: ``(local_rank, env, error_file, stdout, stderr)`` (the last two: where the context redirects
    that rank's output, "" for nowhere). Given one, it runs as torch's process context runs that local rank's worker
    (``wrap_args``: the context's arguments to torch's inner ``_wrap``, after the local rank), so that its result,
    output and failure are that worker's; the agent's end of ``conn`` closed without a place, it exits."""
    from elastic_runner.torch_patches import ELASTIC_MP, SPAWN
    from elastic_runner import lifecycle
    from elastic_runner.worker import standby

    lifecycle.die_with_parent()  # the zygote, which dies with its agent
    lifecycle.name_standby()
    _as_worker()
    entrypoint, args, envs = wrap_args[0], wrap_args[1], wrap_args[2]
    os.environ.update(envs[template_rank])
    began = time.monotonic()
    # Only our worker's command line says (in its config) what to build.
    cfg = worker_config(args[template_rank]) if entrypoint is worker_main else None
    built = cfg is not None and standby.prepare(cfg)
    with contextlib.suppress(OSError):  # the agent may have given it a place, and closed its end, already
        conn.send((built, time.monotonic() - began))
    try:
        local_rank, env, error_file, stdout, stderr = conn.recv()
    except (EOFError, OSError):
        lifecycle.exit_now(0)
    standby.placed()
    conn.close()
    envs[local_rank] = env
    wrap_args[3][local_rank], wrap_args[4][local_rank] = stdout, stderr
    sys.modules[SPAWN]._wrap(sys.modules[ELASTIC_MP]._wrap, local_rank, wrap_args, error_file)


def worker_config(worker_args: Sequence[str]) -> Any:
    """The config the workers will load (``--config`` and ``--set`` of their command line, read as the worker reads
    them: ``--set a=1 b=2`` and ``--set=a=1`` too), or None if it does not load (the workers then say why)."""
    import argparse

    from elastic_runner.config import ConfigError, add_overrides_option, load_config

    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    parser.add_argument("--config", "-c", default=None)
    add_overrides_option(parser)
    try:
        parsed, _ = parser.parse_known_args(list(worker_args))
    except (argparse.ArgumentError, SystemExit):  # (the workers' own parser says what is wrong, and exits 2)
        return None
    if parsed.config is None:
        return None
    try:
        return load_config(parsed.config, list(parsed.overrides))
    except (ConfigError, OSError) as exc:
        log.debug("the workers' config does not load here: %s", exc)
        return None
