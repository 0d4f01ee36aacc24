"""A plain ``torchrun -m elastic_runner.train`` gets what ``elastic-runner launch`` gives.

Most jobs are started by plain torchrun (the project's own one-line usage, Kubeflow, people's
scripts), which knows nothing of us. The one code of ours torch runs in its agent is the
``torchrun.handlers`` entry point (``etcd-v3``): torch loads every such entry point while
``torch.distributed.elastic.rendezvous`` is imported, which torchrun does first thing, before it parses
its arguments. :func:`install` runs there and, only when

- this process is torchrun itself (``torchrun`` or ``python -m torch.distributed.run``; never a worker,
  never ``elastic-runner launch``, which sets itself up), and
- the program it starts is elastic_runner's worker (``-m elastic_runner.train``; any other program,
  torchrun's behaviour is left exactly as it is), and
- ``ELASTIC_RUNNER_TORCHRUN_HOOK`` is not ``0`` (the opt-out),

it applies ``launch``'s set-up (:mod:`elastic_runner.agent.adopt`): ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
unless set (torch's shared store makes a joining node take the job down), the zygote, faster rounds,
our agent, agent metrics. torch's ``launch_agent`` is wrapped once ``torch.distributed.launcher.api``
has been imported (a finder on ``sys.meta_path`` that removes itself), because at the moment the entry
point runs that module is not loaded yet. What launch adds beyond this — its ``--rdzv_conf`` defaults —
stays launch's: under plain torchrun, torchrun's flags are the user's.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import os
import sys
from types import ModuleType
from typing import Any, Callable, Sequence

OPT_OUT = "ELASTIC_RUNNER_TORCHRUN_HOOK"
TARGET = "torch.distributed.launcher.api"

_installed = False


def is_torchrun_process(argv0: str, main: ModuleType | None) -> bool:
    spec = getattr(main, "__spec__", None)
    return os.path.basename(argv0) == "torchrun" or getattr(spec, "name", None) == "torch.distributed.run"


def install(argv: Sequence[str] | None = None, environ: dict[str, str] | Any = None) -> bool:
    """Adopt this torchrun agent if it runs elastic_runner's worker (idempotent); True if it did."""
    global _installed
    environ = os.environ if environ is None else environ
    if _installed:
        return True
    if environ.get(OPT_OUT, "1") == "0" or not is_torchrun_process(sys.argv[0], sys.modules.get("__main__")):
        return False
    from .adopt import flag_value, names_our_worker
    from .launch import ENV_DEFAULTS

    args = list(sys.argv[1:] if argv is None else argv)
    if not names_our_worker(args):
        return False
    _installed = True
    for key, value in ENV_DEFAULTS.items():
        environ.setdefault(key, value)
    from .adopt import name_agent
    from .launch import set_worker_threads
    from .terminal import log_to_stderr

    log_to_stderr()
    set_worker_threads(args, environ)  # before torchrun sets 1 for every worker (it reads the variable later)
    name_agent(environ)
    # Zygote workers see neither torchrun's command line nor a fresh environment: what preflight reads.
    environ.setdefault("ELASTIC_RUNNER_RDZV_CONF", flag_value(args, "rdzv_conf") or environ.get("PET_RDZV_CONF", ""))
    environ.setdefault("ELASTIC_RUNNER_NNODES", flag_value(args, "nnodes") or environ.get("PET_NNODES", "1"))
    if TARGET in sys.modules:
        _wrap(sys.modules[TARGET])
    else:
        sys.meta_path.insert(0, _AfterImport(TARGET, _wrap))
    return True


def _wrap(api: ModuleType) -> None:
    original = api.launch_agent
    if getattr(original, "__elastic_runner__", False):
        return

    def launch_agent(config: Any, entrypoint: Any, args: list[Any], *more: Any, **options: Any) -> Any:
        from .adopt import adopt
        from .terminal import agent_exit_status, log_to_stderr

        log_to_stderr()
        if getattr(config, "max_restarts", None) == 0:
            logging.getLogger(__name__).warning(
                "torchrun's --max-restarts is 0 (its default): the first worker that fails ends the job, in-process "
                "recovery included. Add --max-restarts=100 (elastic-runner launch sets it)")
        zygote_wanted = os.environ.get("ELASTIC_RUNNER_ZYGOTE", "1") != "0"
        entrypoint, args, finish = adopt(api, config, entrypoint, args, zygote_wanted)
        try:
            return original(config, entrypoint, args, *more, **options)
        except Exception as exc:
            code = agent_exit_status(exc)
            if code is None:
                raise  # torchrun prints its failure table or traceback, as it always has
            raise SystemExit(code) from None
        finally:
            finish()

    launch_agent.__elastic_runner__ = True  # type: ignore[attr-defined]
    launch_agent.__wrapped__ = original  # type: ignore[attr-defined]
    api.launch_agent = launch_agent


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``then(module)`` right after ``name`` is first imported, then steps aside."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader, then = spec.loader, self.then

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
                return loader.create_module(spec)

            def exec_module(self, module: ModuleType) -> None:
                loader.exec_module(module)  # type: ignore[union-attr]
                then(module)

        spec.loader = _Loader()
        return spec
