"""``elastic-runner launch``: torchrun with defaults that suit elastic jobs.

Same flags as ``torchrun`` (and the same ``PET_*`` environment variables,
which Kubernetes manifests use); everything is passed through to torch's own
launcher. What it changes, each overridable:

- ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with torch's shared rendezvous
  store, a node joining a running job makes the rank-0 agent fail with
  ``DistStoreError ... role_info`` and take the job down, and restarted gloo
  workers can read the previous round's addresses and hang. Workers then use
  their own store on rank 0's node. Set it to 0 to get torch's behaviour.
- ``--max-restarts=100`` unless set (torchrun: 0, where the first failed worker ends the job): a failed worker
  replaced in process counts one restart too.
- ``OMP_NUM_THREADS`` unless set: the node's cores (its CPU affinity, capped by a cgroup CPU quota) divided by
  its processes, said once; torchrun sets 1 with a four-line banner, which starves a CPU worker of its cores.
- Rendezvous settings (``--rdzv_conf``, only keys you did not set):
  ``last_call_timeout=1`` (torch: 30 s): once the minimum number of nodes is
  present, wait 1 s for more instead of 30 before starting; a node that comes
  later joins through one extra round. ``keep_alive_interval=1``,
  ``keep_alive_max_attempt=3``: a dead node is dropped from the rendezvous
  after 3 s instead of 15 s; fewer than 3 s risks split brain (a live but
  busy node declared dead).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    import argparse

log = logging.getLogger(__name__)

HELP_PREAMBLE = """\
torchrun with what an elastic job needs; every torchrun flag and PET_* variable works as in torchrun.

With -m elastic_runner.train as the program, launch adds (plain torchrun gets the same through the
package's torchrun hook, except the --rdzv-conf and --max-restarts defaults):
  - --max-restarts=100 unless set (torchrun: 0, the first failed worker ends the job).
  - OMP_NUM_THREADS unless set: the node's cores divided by its processes (torchrun: 1).
  - TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 unless set: with torch's shared store a node that joins
    a running job takes it down.
  - --rdzv-conf defaults for keys you did not set: last_call_timeout=1 (torch: 30 s),
    keep_alive_interval=1, keep_alive_max_attempt=3 (a dead node is dropped after 3 s, not 15 s).
  - Workers forked from a pre-imported zygote (restart in milliseconds, not a new interpreter),
    early completion of a round once every node of the last one is back or dead, stopped workers
    killed instead of waited for, config errors and NaN gradients not retried, no orphaned
    processes when the agent dies, agent metrics on ELASTIC_RUNNER_AGENT_METRICS_PORT.
  - Exit status: the worker's 2 (config/resume error) or 3 (diverged) as is; 128+N when stopped by
    signal N; 1 for any other failure.

Opt out per part: ELASTIC_RUNNER_ZYGOTE=0, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=0, or set the
--rdzv-conf keys yourself. torchrun's options follow.
"""

RDZV_DEFAULTS: dict[str, str] = {
    "last_call_timeout": "1",
    "keep_alive_interval": "1",
    "keep_alive_max_attempt": "3",
}

ENV_DEFAULTS: dict[str, str] = {
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
}

#: launch's restart budget where the user sets none: an elastic job outlives many faults (torchrun's default is 0).
MAX_RESTARTS_DEFAULT = 100


def available_cores() -> int:
    """The cores this node's processes may use: the CPU affinity, capped by a cgroup v2 CPU quota (a container's
    limit, which the affinity does not show)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def local_processes(nproc_per_node: str) -> int | None:
    """How many workers ``--nproc-per-node`` starts on this node, as torchrun resolves it (None: a value only torch
    knows how to count)."""
    if nproc_per_node.isdigit():
        return int(nproc_per_node)
    if nproc_per_node == "cpu":
        return available_cores()
    if nproc_per_node in ("gpu", "auto"):
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count()
        return available_cores() if nproc_per_node == "auto" else None
    return None


def set_worker_threads(argv: Sequence[str], environ: Any = None) -> None:
    """``OMP_NUM_THREADS`` for each worker, unless set: this node's cores shared by its processes (torchrun sets 1
    for several workers, with a banner, and one thread leaves a CPU worker most of its cores idle). Said once."""
    from .adopt import flag_value

    environ = os.environ if environ is None else environ
    if "OMP_NUM_THREADS" in environ:
        return
    given = flag_value(list(argv), "nproc_per_node") or environ.get("PET_NPROC_PER_NODE", "1")
    processes = local_processes(given)
    if processes is None or processes < 2:
        return  # one worker: torch's own default (the physical cores) is right
    cores = available_cores()
    environ["OMP_NUM_THREADS"] = str(max(1, cores // processes))
    log.info("OMP_NUM_THREADS=%s for each of this node's %d workers (%d cores); set OMP_NUM_THREADS to choose",
             environ["OMP_NUM_THREADS"], processes, cores)


def restart_budget_given(argv: Sequence[str], environ: Any = None) -> bool:
    from .adopt import flag_value

    environ = os.environ if environ is None else environ
    return flag_value(list(argv), "max_restarts") is not None or "PET_MAX_RESTARTS" in environ


def merge_rdzv_conf(given: str, defaults: dict[str, str] = RDZV_DEFAULTS) -> str:
    """Add our defaults for keys the user did not set; keep the user's order and values."""
    items = [kv for kv in (given or "").split(",") if kv.strip()]
    present = {kv.split("=", 1)[0].strip() for kv in items}
    items += [f"{k}={v}" for k, v in defaults.items() if k not in present]
    return ",".join(items)


def parser() -> argparse.ArgumentParser:
    """torchrun's own parser, introduced by what launch adds (``elastic-runner launch --help``)."""
    import argparse

    from torch.distributed.run import get_args_parser

    p = get_args_parser()
    p.prog = "elastic-runner launch"
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = HELP_PREAMBLE
    return p


def apply_defaults(argv: Sequence[str]) -> "object":
    """Parse torchrun's flags (and PET_* variables) and apply our defaults."""
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    args = parser().parse_args(list(argv))
    if args.rdzv_backend != "static" or args.standalone:
        args.rdzv_conf = merge_rdzv_conf(args.rdzv_conf)
    if not restart_budget_given(argv):
        args.max_restarts = MAX_RESTARTS_DEFAULT
    return args


def main(argv: Sequence[str] | None = None) -> int:
    from .adopt import flag_value, name_agent, names_our_worker

    argv = list(sys.argv[1:] if argv is None else argv)
    zygote_wanted = os.environ.get("ELASTIC_RUNNER_ZYGOTE", "1") != "0" and names_our_worker(argv)
    # Set before the zygote starts: forked workers inherit the zygote's environment.
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    os.environ["ELASTIC_RUNNER_RDZV_CONF"] = merge_rdzv_conf(flag_value(argv, "rdzv_conf") or os.environ.get("PET_RDZV_CONF", ""))
    name_agent()
    # Workers forked from the zygote see neither our command line nor torchrun's: tell them the node range.
    os.environ["ELASTIC_RUNNER_NNODES"] = flag_value(argv, "nnodes") or os.environ.get("PET_NNODES", "1")
    from .terminal import agent_exit_status, log_to_stderr

    log_to_stderr()
    set_worker_threads(argv)
    args = apply_defaults(argv)
    # The same preamble as torch.distributed.run.run().
    import uuid

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher import api as launcher_api
    from torch.distributed.run import config_from_args, parse_min_max_nnodes

    from .adopt import adopt

    if args.standalone:
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    elif args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None:
        if parse_min_max_nnodes(args.nnodes)[1] == 1:
            args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    config, cmd, cmd_args = config_from_args(args)
    entrypoint, worker_args, finish = adopt(launcher_api, config, cmd, cmd_args, zygote_wanted)
    try:
        launcher_api.elastic_launch(config=config, entrypoint=entrypoint)(*worker_args)
    except SignalException as exc:
        code = agent_exit_status(exc)  # (this node excluded: its status of its own)
        if code is not None:
            return code
        # SIGTERM/SIGINT: workers were stopped (and saved a snapshot). Never exit 0 on a
        # signal: Kubernetes' Job success rule relies on 0 meaning "training complete".
        log.warning("stopped by %s", signal.Signals(exc.sigval).name)
        return 128 + int(exc.sigval)
    except Exception as exc:
        code = agent_exit_status(exc)
        if code is not None:
            return code
        if isinstance(exc, ChildFailedError):
            log.error("%s", exc)
            return 1
        raise
    finally:
        finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
