"""The run directory at the start of an attempt: rank 0 claims the next generation, every rank learns how it went.

Claiming a generation fences every older attempt's snapshot writer (:mod:`elastic_runner.snapshot.store`);
rank 0 also sweeps what older attempts left half-written and writes the effective config. A problem
that cannot pass (permissions, a file where the directory should be) stops every rank with one line
(:class:`~elastic_runner.worker.ending.SetupError`, exit 2); an I/O error may pass and retries the attempt.
With snapshots in a bucket, :func:`record_sync` starts the upload of the node's records (:mod:`..observe.records`).
A stop that ends a worker before it can save from its live state leaves the node's memory copy in the run's
snapshots (:func:`save_node_memory`).
"""

from __future__ import annotations

import errno
import logging
import os
from typing import Any

from ..config import Config, write_effective_config
from ..files import makedirs
from ..observe.records import RecordSync, own_records, records_url
from ..snapshot import LocalStore, SnapshotError, open_store
from ..snapshot.memory import memory_base, memory_key
from ..snapshot.persist import persist_newest
from ..snapshot.store import SnapshotUnavailableError, StoreAccessError
from ..dist import Dist
from .ending import RetryableSetupError, SetupError
from ..env import WorkerEnv

log = logging.getLogger("elastic_runner.train")

# errno values that mean "this run directory cannot work" rather than "try again".
_PERMANENT_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST, errno.ENAMETOOLONG}


def record_sync(cfg: Config, env: WorkerEnv, store: Any, generation: int) -> RecordSync | None:
    """With snapshots in a bucket, the node's records go there too (:mod:`~elastic_runner.observe.records`): the
    node's first worker uploads the whole run.dir every ``snapshot.records_every_seconds``; every worker uploads its
    own files once more when it ends."""
    if store.is_local:
        return None
    try:
        if env.local_rank == 0:
            fresh = f"gen-{generation:06d}-rank-"  # this attempt's files: none in the bucket yet
            return RecordSync(cfg.run.dir, records_url(store.location), every_s=cfg.snapshot.records_every_seconds,
                              fresh=lambda relative: relative.rsplit("/", 1)[-1].startswith(fresh)).start()
        return RecordSync(cfg.run.dir, records_url(store.location), wanted=own_records(generation, env.rank))
    except Exception as exc:  # noqa: BLE001 - records are not worth a failed attempt; the snapshots still go
        log.warning("the run's records will not be uploaded to %s: %s", store.location, exc)
        return None


def prepare_run_dir(cfg: Config, env: WorkerEnv, dist: Dist) -> tuple[LocalStore, int, str]:
    """Rank 0 claims the generation and writes the effective config; all ranks learn the outcome."""
    # With an object store, run.dir is this node's own: it holds the staging copies and the read cache.
    store = open_store(cfg.snapshot_dir, local=os.path.join(cfg.run.dir, ".objects"))
    outcome: tuple[str, Any, str] = ("ok", 0, "")
    if dist.rank == 0:
        try:
            if os.path.exists(cfg.run.dir) and not os.path.isdir(cfg.run.dir):
                raise NotADirectoryError(errno.ENOTDIR, "it exists and is not a directory")
            makedirs(cfg.run.dir)
            if not os.access(cfg.run.dir, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, f"not writable by uid {os.getuid()}")
            store.ensure()
            run_uid = store.run_uid()
            generation = store.claim_generation({"world_size": env.world_size, "run_id": env.run_id,
                                                 "restart_count": env.restart_count})
            store.sweep(generation)
            write_effective_config(cfg, cfg.run.dir)
            outcome = ("ok", generation, run_uid)
        except (OSError, SnapshotError) as exc:
            cause = exc if isinstance(exc, OSError) else exc.__cause__
            permanent = isinstance(exc, StoreAccessError) or not isinstance(exc, SnapshotUnavailableError) and (
                not isinstance(cause, OSError) or cause.errno in _PERMANENT_ERRNOS)
            fix = ("" if isinstance(exc, StoreAccessError) else  # says what to fix itself
                   "; choose another run.dir (or remove that file)" if isinstance(cause, NotADirectoryError) else
                   "; fix its permissions or choose another run.dir" if permanent else
                   "; the agent starts the next attempt" if env.under_torchrun and env.restart_count < env.max_restarts
                   else "; no restart is left to try again (--max-restarts): run the job again once it is reachable")
            remote = isinstance(exc, SnapshotError) and not store.is_local
            where = f"snapshot.dir {cfg.snapshot_dir!r}" if remote else f"run.dir {cfg.run.dir!r}"
            message = f"cannot prepare {where}: {exc}{fix}"
            outcome = ("usage" if permanent else "retry", message, "")
    status, value, run_uid = dist.broadcast_object(outcome)
    if status == "usage":
        raise SetupError(value)
    if status == "retry":
        raise RetryableSetupError(value)
    return store, int(value), run_uid


def save_node_memory(cfg: Config, env: WorkerEnv, generation: int | None) -> str:
    """A stop that ends this worker at once (before its attempt trains, or between two attempts, parked for a new
    round): the node's newest in-memory state written into the run's snapshots when nothing durable there is as new,
    by the node's first worker (:func:`~elastic_runner.snapshot.persist.persist_newest`; ``generation``: the
    worker's own, once its attempt knows it). A stop is how a node is preempted, and its memory goes with it. What
    it did, for the worker's last line ("": nothing to say)."""
    if not env.is_local_leader:
        return ""
    location = cfg.snapshot_dir
    root = memory_base() / memory_key(location)
    if not root.is_dir() or not LocalStore(root).complete():
        return ""
    try:
        done = persist_newest(open_store(location, local=os.path.join(cfg.run.dir, ".objects")), root,
                              job_ended=False, own_generation=generation)
    except (OSError, SnapshotError) as exc:
        return f"the node's newest state in memory could not be saved ({exc})"
    if done.written:
        return f"saved step {done.step} from node memory to {done.to} ({done.snapshot})"
    if done.durable_already:
        return ""
    return f"the node's step {done.step} in memory was not saved: {done.why}"
