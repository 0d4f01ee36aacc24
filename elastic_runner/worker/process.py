"""One worker process: logging, signals, the process group up and down, and the exit status.

:func:`run` is what ``python -m elastic_runner.train`` and :func:`elastic_runner.fit` both run once
they have a config and the worker's place in the job (:class:`~elastic_runner.worker.env.WorkerEnv`).
The attempt itself is :class:`~elastic_runner.worker.attempt.Attempt`; how it ended, and so the exit
status, is decided in :mod:`elastic_runner.worker.ending`.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Callable

import torch

from .. import files
from ..config import Config
from ..config.locations import is_url
from ..observe.events import agent_stop_reason
from ..observe.logs import say, setup_logging
from ..snapshot import SnapshotError
from ..snapshot.format import set_signing_key, signing_key_from_environment
from ..snapshot.object_client import prewarm
from .attempt import Attempt
from .dist import Dist
from .ending import ending_for
from .env import WorkerEnv
from .lifecycle import EXIT_USAGE, StopRequest, die_with_parent, name_process, process_start_time
from .preflight import warn_known_bad_setups

if TYPE_CHECKING:
    from ..workload.spec import Workload

log = logging.getLogger("elastic_runner.train")


def run(cfg: Config, env: WorkerEnv, make_workload: Callable[[], Workload] | None = None) -> int:
    """One worker process: ``make_workload`` builds what is trained (default: from ``cfg``); the exit status."""
    started_at = process_start_time()
    setup_logging(cfg.logging.level, env.rank, env.world_size)
    files.set_sharing(cfg.snapshot.mode)  # every file the run writes: private unless the team shares
    try:
        set_signing_key(signing_key_from_environment())  # the job's key: snapshots signed, and only those taken
    except SnapshotError as exc:
        if env.local_rank == 0:
            say(f"elastic_runner: {exc}")
        return EXIT_USAGE
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
    if env.rank == 0 and cfg.snapshot.dir and is_url(cfg.snapshot.dir):
        prewarm(cfg.snapshot.dir)  # rank 0 opens the attempt in the bucket: its client, while the group comes up
    dist: Dist | None = None
    try:
        dist = Dist.up(env, backend=cfg.dist.backend, device=cfg.dist.device,
                       timeout_seconds=cfg.dist.timeout_seconds, init_timeout_seconds=cfg.dist.init_timeout_seconds)
        Attempt(cfg, env, dist, stop, started_at, make_workload).run()
        return ending_for(None, stop.requested).exit_code  # type: ignore[return-value]
    except BaseException as exc:
        ending = ending_for(exc, stop.requested)
        if ending.exit_code is None:
            raise
        if ending.stopped:
            log.info("stopped %s%s", stop.description,
                     " (peers stopped first)" if ending.peers_stopped_first else " after saving a snapshot")
        elif ending.say and (env.rank == 0 or not ending.say_on_rank0_only):
            say(f"elastic_runner: {exc}")
        return ending.exit_code
    finally:
        stop.uninstall()
        if dist is not None:
            dist.down()
