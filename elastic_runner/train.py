"""The worker: ``python -m elastic_runner.train --config FILE [--set key=value ...]``.

Runs alone (world size 1), under ``torchrun --standalone``, or as part of a
multi-node elastic job; it reads its place in the job from the environment.
This module is the process: arguments, config, logging, signals, the process
group up and down, and the exit status. One training attempt is
:class:`elastic_runner.worker.attempt.Attempt`.

Exit status (:mod:`elastic_runner.worker.lifecycle`): 0 finished or stopped gracefully
(SIGTERM/SIGINT), 2 a configuration or resume problem (the message says what
to fix), 3 the gradient became NaN or inf, 4 finished but the final snapshot
could not be written (the state is kept in node memory), 75 peers did not arrive in time,
76 a peer was lost, 1 anything else.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Callable, Sequence

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from . import files
from .config import Config, ConfigError, load_config
from .observe.events import agent_stop_reason
from .observe.logs import say, setup_logging
from .snapshot import StaleWriterError
from .training.checkpointer import FinalSnapshotFailed, ResumeError, StopSnapshotFailed
from .training.gradients import NonFiniteGradient
from .training.loop import GracefulStop
from .worker.attempt import Attempt, RetryableSetupError, SetupError
from .worker.dist import Dist, DistError
from .worker.env import EnvError, WorkerEnv
from .worker.lifecycle import (
    EXIT_DIVERGED,
    EXIT_FAILED,
    EXIT_NOT_DURABLE,
    EXIT_OK,
    EXIT_USAGE,
    StopRequest,
    die_with_parent,
    name_process,
    process_start_time,
)
from .worker.preflight import warn_known_bad_setups

if TYPE_CHECKING:
    from .workload.spec import Workload

log = logging.getLogger("elastic_runner.train")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="elastic-runner train", description="Train from a YAML config (one worker).")
    parser.add_argument("--config", "-c", required=True, help="YAML config file, e.g. configs/quickstart.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set optim.lr=0.05 (repeatable; beats the file)")
    # torch.distributed.launch passed the local rank as an argument.
    parser.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


@record
def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        env = WorkerEnv.from_environ(legacy_local_rank=args.local_rank)
    except (ConfigError, EnvError) as exc:
        # Every worker of the node read the same file: the node's terminal shows the error once.
        if os.environ.get("LOCAL_RANK", "0") == "0":
            say(f"elastic_runner: config error: {exc}")
        return EXIT_USAGE
    return run(cfg, env)


def run(cfg: Config, env: WorkerEnv, make_workload: Callable[[], Workload] | None = None) -> int:
    """One worker process: ``make_workload`` builds what is trained (default: from ``cfg``)."""
    started_at = process_start_time()
    setup_logging(cfg.logging.level, env.rank, env.world_size)
    files.set_sharing(cfg.snapshot.mode)  # every file the run writes: private unless the team shares
    if env.under_torchrun:
        die_with_parent()
        name_process(env.rank, env.local_rank)
        if env.rank == 0:
            warn_known_bad_setups()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        # A worker forked from the zygote imported torch before the launcher chose this.
        torch.set_num_threads(int(threads))
    started = time.time()
    stop = StopRequest(lambda: agent_stop_reason(cfg.run.dir, os.getpid(), started)).install()
    if cfg.run.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    try:
        dist = Dist.up(env, backend=cfg.dist.backend, device=cfg.dist.device,
                       timeout_seconds=cfg.dist.timeout_seconds, init_timeout_seconds=cfg.dist.init_timeout_seconds)
    except DistError as exc:
        say(f"elastic_runner: {exc}")
        return EXIT_USAGE
    try:
        Attempt(cfg, env, dist, stop, started_at, make_workload).run()
        return EXIT_OK
    except GracefulStop:
        log.info("stopped %s after saving a snapshot", stop.description)
        return EXIT_OK
    except (ConfigError, ResumeError, SetupError) as exc:
        say(f"elastic_runner: {exc}")
        return EXIT_USAGE
    except NonFiniteGradient as exc:
        if env.rank == 0:  # every rank saw it; one line is enough
            say(f"elastic_runner: {exc}")
        return EXIT_DIVERGED
    except FinalSnapshotFailed as exc:
        say(f"elastic_runner: {exc}")
        return EXIT_NOT_DURABLE
    except (StaleWriterError, StopSnapshotFailed, RetryableSetupError) as exc:
        say(f"elastic_runner: {exc}")
        return EXIT_FAILED
    except Exception:
        if stop.requested:
            # Peers stopping at the same time broke our collective after we kept our
            # state: that is the stop we were asked for, not a failure.
            log.info("stopped %s (peers stopped first)", stop.description)
            return EXIT_OK
        raise
    finally:
        stop.uninstall()
        dist.down()


if __name__ == "__main__":
    sys.exit(main())
