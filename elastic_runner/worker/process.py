"""One worker process: logging, signals, the process group up and down, and the exit status.

:func:`run` is what ``python -m elastic_runner.train`` and :func:`elastic_runner.fit` both run once
they have a config and the worker's place in the job (:class:`~elastic_runner.env.WorkerEnv`).
The attempt itself is :class:`~elastic_runner.worker.attempt.Attempt`; how it ended, and so the exit
status, is decided in :mod:`elastic_runner.worker.ending`. With in-process recovery
(``recovery.in_process``) a process whose peer failed rebuilds its process group with the peer's
replacement and runs the next attempt itself, with the model it has
(the state machine of :mod:`elastic_runner.recovery.states` says where a process goes after each attempt; this
module carries it out).
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
from ..data.sources import KeptLoaders
from ..dist import Dist, destroy_default_group
from ..observe.logs import say, setup_logging
from ..snapshot import SnapshotError
from ..snapshot.format import set_signing_key, signing_key_from_environment
from ..object_client import prewarm
from . import group, standby
from .attempt import Attempt
from ..training import injected_faults
from ..training.gradients import NonFiniteRollback
from ..recovery.states import Broken, DeviceUnusable, State, after_failure
from .ending import ending_for
from ..env import REPLACES_VAR, WorkerEnv, say_finished, stop_announced
from ..lifecycle import (EXIT_OK, EXIT_PEER_LOST, EXIT_USAGE, StopRequest, die_with_parent, name_process,
                        process_start_time)
from .preflight import warn_known_bad_setups
from .run_dir import save_node_memory
from ..recovery.handover import Handover, HandoverError
from ..recovery.rebuild import AskedToPark, RegroupError

if TYPE_CHECKING:
    from ..workload.spec import Workload

log = logging.getLogger("elastic_runner.train")

#: How long a parked worker waits for its place in the new round: the round forms once the rendezvous counts a lost
#: node dead (its lease or heartbeats: seconds) and every agent is in it; past that its agent has given up on it.
PARK_WAIT_S = 120.0


def run(cfg: Config, env: WorkerEnv, make_workload: Callable[[], Workload] | None = None) -> int:
    """One worker process: ``make_workload`` builds what is trained (default: from ``cfg``); the exit status."""
    started_at = standby.placed_at() or process_start_time()
    setup_logging(cfg.logging.level, env.rank, env.world_size)
    files.set_sharing(cfg.snapshot.mode)  # every file the run writes: private unless the team shares
    try:
        set_signing_key(signing_key_from_environment())  # the job's key: snapshots signed, and only those taken
    except SnapshotError as exc:
        if env.local_rank == 0:
            say(f"elastic_runner: {exc}")
        return EXIT_USAGE
    # Only in a job the chaos tool started; before the process takes its worker's name, by which the tool finds it
    # and sends the hooks' signals (whose default action would end it).
    injected_faults.install()
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
    stop = StopRequest(lambda: stop_announced(os.getpid(), started)).install()
    stop.last_words = lambda: save_node_memory(cfg, env, stop.generation)
    if cfg.run.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    if env.rank == 0 and cfg.snapshot.dir and is_url(cfg.snapshot.dir):
        prewarm(cfg.snapshot.dir)  # rank 0 opens the attempt in the bucket: its client, while the group comes up
    dist: Dist | None = None
    loaders: KeptLoaders | None = None
    try:
        # Whatever the world size now: a node may join a worker that trains alone.
        keeping = keeps_its_process(cfg, env, make_workload)
        handover = Handover.from_environ(env.local_rank) if keeping else None
        # Its DataLoader workers live as long as it does: through every epoch and attempt.
        loaders = KeptLoaders() if keeping else None
        dist = _up(cfg, env, make_workload)
        if dist is None:
            return EXIT_PEER_LOST
        # A standby that took this worker's place built the workload ahead: the first attempt trains it.
        kept = standby.take(cfg) if make_workload is None else None
        skips: frozenset[int] = frozenset()  #: steps rolled back from in this process (train.on_nonfinite: rollback)
        while True:  # the recovery state machine (elastic_runner.recovery.states): training -> broken -> ...
            attempt = Attempt(cfg, env, dist, stop, started_at, make_workload, kept, park=handover, loaders=loaders,
                              skip_steps=skips)
            try:
                attempt.run()
                say_finished(env.local_rank)  # whatever happens to this process from here on, the job is done
                break
            except Exception as exc:
                broken = after_failure(exc, dist, stop_requested=stop.requested,
                                       ends_job=ending_for(exc, False).exit_code is not None)
                if broken.device_error is not None:
                    _device_unusable(env, broken.device_error, exc)
                if broken.target is State.EXIT:
                    raise
                kept = attempt.reusable()
                if isinstance(exc, NonFiniteRollback):
                    skips = skips | {exc.step}
                    if env.rank == 0:
                        say(f"elastic_runner: {exc}")
            # Out of the handler: the exception's traceback no longer holds the ended attempt (its gradient sync and
            # wrappers, which hold the old group), so the collector can free them before the group is rebuilt.
            del attempt
            # The agent may stop every worker meanwhile (another failed for good): that must not wait the rebuild.
            stop.between_attempts()
            if stop.requested:
                said = save_node_memory(cfg, env, stop.generation)
                log.info("stopped %s between two attempts (in-process recovery): %s", stop.description,
                         said or "nothing more to save")
                return EXIT_OK
            following = _recover(broken, cfg, env, dist, handover, stop)
            if isinstance(following, int):
                return following  # (a group given up on the way is down already: down() again is nothing)
            env, dist, started_at = following
        finished = ending_for(None, stop.requested).exit_code
        assert finished is not None
        return finished
    except BaseException as exc:
        ending = ending_for(exc, stop.requested)
        if ending.exit_code is None:
            raise
        if ending.stopped:
            log.info("stopped %s%s", stop.description,
                     " (peers stopped first)" if ending.peers_stopped_first else " after saving a snapshot"
                     if getattr(exc, "saved", True) else " without a snapshot: the gradient was not finite since the "
                     "last logging step (a resume meets that step again and rolls back)")
        elif ending.say and {"rank": True, "node": env.local_rank == 0, "job": env.rank == 0}[ending.said_by]:
            say(f"elastic_runner: {exc}")
        return ending.exit_code
    finally:
        stop.uninstall()
        if loaders is not None:
            loaders.close()
        if dist is not None:
            dist.down()


def _device_unusable(env: WorkerEnv, error: str, exc: BaseException) -> None:
    """The machine's exit for a process whose device failed: never kept; its agent starts a new one."""
    log.error("rank %d: this process's device is unusable (%s): the process is not kept through the recovery; "
              "its agent starts a new one", env.rank, error)
    raise DeviceUnusable(f"rank {env.rank}: the device is unusable ({error}); a new process takes this one's "
                         "place") from exc


def _recover(broken: Broken, cfg: Config, env: WorkerEnv, dist: Dist, handover: Handover | None,
             stop: StopRequest) -> tuple[WorkerEnv, Dist, float] | int:
    """The process out of ``broken`` (:mod:`elastic_runner.recovery.states`) to its next attempt: that attempt's env,
    its group and its start; or the exit status where the machine ends in ``exit`` instead."""
    if broken.target is State.TRAINING:  # a step rolled back: the same group, the same members
        return env, dist, time.time()
    cause = broken.why
    lost: tuple[int, ...] = ()
    if broken.target is State.REJOIN:
        try:
            seconds = group.rejoin(dist, cfg.dist.init_timeout_seconds,
                                   leaving=handover.requested if handover is not None else None)
            if handover is not None and handover.requested():  # asked while the rebuild ran in native code
                raise AskedToPark("its group to be rebuilt with the replacement")
            # This worker's start in the next attempt (its start-up figures, goodput's "worker start and
            # restore"): now, not its process's start long ago; the replacement's start is earlier.
            started_at = time.time()
            if handover is not None:
                handover.busy()  # until the next attempt's loop: it cannot park while it builds
            log.warning("rank %d: a peer failed (%s); this worker kept its process and rebuilt the process "
                        "group with its replacement in %.3fs (in process, %s)", env.rank, cause, seconds,
                        dist.in_process.method if dist.in_process is not None else "?")
            return env, dist, started_at
        except RegroupError as regroup_failed:
            if handover is None:
                say(f"elastic_runner: rank {env.rank}: {regroup_failed}; every worker restarts")
                return EXIT_PEER_LOST
            cause, lost = f"{cause}; {regroup_failed}", regroup_failed.lost_agents
    if handover is None:  # (a park request comes only through a hand-over)
        return EXIT_PEER_LOST
    new_env, new_dist, placed_at = _park(cfg, env, dist, handover, stop, cause, lost)
    if new_dist is None:
        return EXIT_OK if stop.requested else EXIT_PEER_LOST
    return new_env, new_dist, placed_at


def _up(cfg: Config, env: WorkerEnv, make_workload: Callable[[], Workload] | None,
        leaving: Callable[[], bool] | None = None) -> Dist | None:
    """The process group of ``env``'s place; None for a replacement whose survivors did not come (the caller exits
    76: another replacement would wait the same way, so every worker restarts). ``leaving``: see
    :func:`.group.up` (:class:`AskedToPark` passes through)."""
    try:
        return group.up(env, backend=cfg.dist.backend, device=cfg.dist.device,
                        timeout_seconds=cfg.dist.timeout_seconds,
                        init_timeout_seconds=cfg.dist.init_timeout_seconds,
                        in_process=in_process_wanted(cfg, env, make_workload),
                        regroup_wait_seconds=cfg.dist.heartbeat_seconds or cfg.dist.init_timeout_seconds,
                        # A sharded model's device mesh makes its groups from the first one: those are made anew.
                        regroup="recreate" if cfg.parallel.sharded else cfg.recovery.regroup, leaving=leaving)
    except AskedToPark:
        raise
    except RegroupError as exc:
        # (their agents restarted them for a new round, or they failed again; an ordinary failure would make its
        # agent replace it again and again)
        say(f"elastic_runner: rank {env.rank}: {exc}; every worker restarts")
        destroy_default_group()  # (a group of its own may be up) no gloo thread may outlive the interpreter
        return None


def _park(cfg: Config, env: WorkerEnv, dist: Dist, handover: Handover, stop: StopRequest,
          cause: str, lost_agents: tuple[int, ...] = ()) -> tuple[WorkerEnv, Dist | None, float]:
    """The membership changes (a node joins or was lost): give the process group up, wait for this worker's place in
    the agent's new round (:mod:`.handover`), and bring the group up there. The model, optimizer and compiled code
    stay; the next attempt resumes from the newest step every rank can have, resharded for the new world size.
    ``lost_agents``: the group ranks of the round's agents this worker saw silent (its agent counts them out of the
    next round). While the group comes up in the new round (its new peers may still be starting), its agent can ask
    it to park again, for the round after: it gives that group up and waits for its next place. The new env, its
    group and when this worker took its place (its start in the next attempt); dist None where no place came (the
    agent stopped this worker, or gave up on keeping it)."""
    started = time.monotonic()
    # Rank 0's store stays up until this worker has its place: a peer still finishing a long step must not see it go
    # (its watchdog would end it) before its own agent asks it to park.
    held = dist.store
    dist.down()
    log.info("rank %d: %s; waiting for this worker's place in the agent's next round (in process)", env.rank, cause)
    lost = (env.group_world_size, lost_agents) if lost_agents else None
    while True:
        try:
            place = handover.park(PARK_WAIT_S, stopped=lambda: stop.requested, lost_agents=lost)
        except HandoverError as exc:
            say(f"elastic_runner: rank {env.rank}: {exc}; every worker restarts")
            return env, None, time.time()
        placed_at = time.time()
        held = None  # (the old round's store may go now)
        if place is None:
            if not stop.requested:
                say(f"elastic_runner: rank {env.rank}: no place in a new round within {PARK_WAIT_S:g}s of parking "
                    "(in-process recovery); every worker restarts")
            return env, None, placed_at
        os.environ.pop(REPLACES_VAR, None)  # this process replaces nobody in the new round
        os.environ.update(place)
        new = WorkerEnv.from_environ()
        setup_logging(cfg.logging.level, new.rank, new.world_size)
        name_process(new.rank, new.local_rank)
        # It can park again while its group comes up: the round's new peers may still be starting when a node joins
        # or is lost again, and its agent then asks it to park for the round after (instead of starting a new process).
        handover.ready()
        try:
            rebuilt = _up(cfg, new, None, leaving=handover.requested)
        except AskedToPark as exc:
            log.info("rank %d: %s; parking again for the round after", new.rank, exc)
            env, lost = new, None
            continue
        if rebuilt is not None and handover.requested():  # asked while the group's start ran in native code
            log.info("rank %d: its agent asked it to park as its group came up; parking again for the round after",
                     new.rank)
            rebuilt.down()
            env, lost = new, None
            continue
        handover.busy()  # until the next attempt's loop: it cannot park while it resumes
        break
    if rebuilt is not None:
        log.warning("rank %d: the membership changed (%s); this worker kept its process and is rank %d of %d in the "
                    "new round after %.3fs (in process)", env.rank, cause, new.rank, new.world_size,
                    time.monotonic() - started)
    return new, rebuilt, placed_at


def keeps_its_process(cfg: Config, env: WorkerEnv, make_workload: Callable[[], Workload] | None) -> bool:
    """Whether this worker keeps its process through a recovery (``recovery.in_process``): only under our agent
    (which replaces a failed worker and hands kept ones their places; torch's own restarts every worker) and for a
    model built from the config (a script's model object would carry the abandoned step into the next attempt)."""
    return cfg.in_process and env.agent_id is not None and make_workload is None


def in_process_wanted(cfg: Config, env: WorkerEnv, make_workload: Callable[[], Workload] | None) -> bool:
    """Whether this worker rebuilds its group with a failed peer's replacement: it keeps its process and has peers."""
    return keeps_its_process(cfg, env, make_workload) and env.world_size > 1
