"""The worker's process group brought up, and rebuilt in its process: the job's store, the deadline, and in-process
recovery's regrouping wired into the ground floor's :class:`~elastic_runner.dist.Dist`."""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time
from typing import Any, Callable

import torch
import torch.distributed as tdist

from ..dist import Deadline, Dist, DistError, choose_backend, choose_device, destroy_default_group
from ..env import WorkerEnv
from ..lifecycle import EXIT_PEER_TIMEOUT, exit_now
from ..snapshot.format import current_signing_key
from ..recovery import liveness
from ..recovery.rebuild import (ARRIVAL_POLLS, AskedToPark, ReconfigureRefused, RegroupError, chosen_regroup,
                                first_collective, leaves_when_asked)
from ..recovery.regroup import SameMembers

log = logging.getLogger(__name__)


def _first_reconfigurable(same: SameMembers, rank: int, wanted: str, wait_seconds: float,
                          leaving: Callable[[], bool] | None = None) -> bool:
    """The round's first group, created reconfigurable; False where the backend refused that under
    ``recovery.regroup: auto`` (the caller creates the group as any other, and rebuilds recreate it)."""
    try:
        same.first(datetime.timedelta(seconds=wait_seconds), leaving)
        return True
    except AskedToPark:
        raise
    except ReconfigureRefused as exc:
        if wanted == "reconfigure":
            raise DistError(f"recovery.regroup: {exc}. Use auto (reconfigure where it is possible, else recreate) "
                            "or recreate") from exc
        log.warning("recovery.regroup auto: %s; the process group is recreated on a peer's failure instead", exc)
        same.regroup.method = "recreate"
        return False
    except RegroupError as exc:  # a peer gone, or the store with rank 0's worker: as the start's deadline would
        failed = f"rank {rank}: {exc}; ending this attempt so torchrun can start a new rendezvous round"
        log.critical(failed)
        exit_now(EXIT_PEER_TIMEOUT, failed)
        raise  # not reached: exit_now ends the process


def _import_dynamo_first() -> None:
    """Import ``torch._dynamo`` before any process group exists.

    The optimizer and DDP import it lazily anyway; imported while a group is up, it keeps a
    reference to that group forever, so destroy_process_group cannot stop gloo's threads, and
    a thread still alive during interpreter shutdown now and then aborts the process
    (pytorch/pytorch#190489): a worker that ended cleanly (exit 0, or 2 for a usage error) is
    reported as killed by SIGABRT and torchrun restarts it. Workers forked from the zygote
    (elastic_runner.agent.warm) have it already.
    """
    import torch._dynamo  # noqa: F401


def _until_listening(address: str, port: int, timeout: datetime.timedelta, leaving: Callable[[], bool]) -> None:
    """Until something listens at ``address:port`` (rank 0's worker hosts the job's store there), or ``timeout``
    (the caller's client then fails as it would have); :class:`AskedToPark` as soon as ``leaving()`` says so. It
    looks with a plain connection, as often as a member looks for the others' arrival (:data:`ARRIVAL_POLLS`): torch's
    client cannot be asked anything while it retries, and warns with a stack trace at each attempt."""
    started = time.monotonic()
    deadline = started + timeout.total_seconds()
    while time.monotonic() < deadline:
        if leaving():
            raise AskedToPark("rank 0's worker to open the job's store")
        try:
            socket.create_connection((address, port), timeout=0.1).close()
            return
        except OSError:
            waited = time.monotonic() - started
            time.sleep(next(poll for until, poll in ARRIVAL_POLLS if waited < until))


def job_store(env: WorkerEnv, timeout: datetime.timedelta, leaving: Callable[[], bool] | None = None) -> Any:
    """The job's TCPStore as ``env://`` would make it, except that rank 0 binds MASTER_PORT with ``SO_REUSEPORT``:
    the agent that offered the port still holds it that way (:mod:`elastic_runner.rendezvous.ports`), so that no
    other local user could take it meanwhile, and only a socket of the same user with the same option can share
    it. None where that is not possible here (the caller then uses ``env://``). ``leaving``: another rank's
    wait for rank 0's store ends in :class:`AskedToPark` as soon as it says so."""
    from ..rendezvous.ports import reuseport_socket

    if env.master_addr is None or env.master_port is None:
        return None
    if env.rank != 0:
        if leaving is not None:
            _until_listening(env.master_addr, env.master_port, timeout, leaving)
        # (rank 0's worker may end between the look and the connect: torch's client then retries in native code)
        with leaves_when_asked(leaving, "its client connects to rank 0's store"):
            return tdist.TCPStore(env.master_addr, env.master_port, env.world_size, False, timeout=timeout,
                                  multi_tenant=True)
    try:
        sock = reuseport_socket(env.master_port)
    except OSError as exc:
        log.debug("MASTER_PORT %s cannot be bound with SO_REUSEPORT (%s); env:// binds it", env.master_port, exc)
        return None
    try:
        sock.listen(512)
    except OSError as exc:
        sock.close()
        log.debug("MASTER_PORT %s cannot be listened on (%s); env:// binds it", env.master_port, exc)
        return None
    # The store takes the listening socket over (and closes it with itself). A worker that may be asked to leave does
    # not wait in here for the others to connect (native code): it waits for their arrival in the group's start.
    return tdist.TCPStore(env.master_addr, env.master_port, env.world_size, True, timeout=timeout,
                          multi_tenant=True, master_listen_fd=sock.detach(), use_libuv=True,
                          wait_for_workers=leaving is None)


def up(env: WorkerEnv, *, backend: str = "auto", device: str = "auto",
       timeout_seconds: float = 300.0, init_timeout_seconds: float = 30.0, in_process: bool = False,
       regroup_wait_seconds: float = 5.0, regroup: str = "recreate", leaving: Callable[[], bool] | None = None) -> Dist:
    """The process group of this worker. ``in_process``: a failed peer is replaced and this worker rebuilds
    its group with the replacement (:func:`rejoin`) the ``regroup`` way (``recovery.regroup``), waiting
    ``regroup_wait_seconds`` for it; a worker that *is* a replacement (``ELASTIC_RUNNER_REPLACES``) joins the
    group its predecessor's survivors rebuild. ``leaving`` (a kept worker placed in a new round): while this worker
    waits for the round's other ranks, :class:`~elastic_runner.recovery.rebuild.AskedToPark` as soon as it says so
    (its agent starts yet another round), with no group left behind."""
    try:
        return _up(env, backend, device, timeout_seconds, init_timeout_seconds, in_process, regroup_wait_seconds,
                   regroup, leaving)
    except AskedToPark as exc:
        waiting_for = exc.waiting_for
    # Out of the handler, and raised anew: the first one's traceback holds the abandoned round's store (rank 0's
    # listens still) and its group, which must close now: the worker parks for another round.
    destroy_default_group()  # (the reconfigurable first group begins as a group of one)
    raise AskedToPark(waiting_for)


def _up(env: WorkerEnv, backend: str, device: str, timeout_seconds: float, init_timeout_seconds: float,
        in_process: bool, regroup_wait_seconds: float, regroup: str, leaving: Callable[[], bool] | None) -> Dist:
    dev = choose_device(env, device)
    chosen = choose_backend(dev, backend)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        if os.environ.get("ELASTIC_RUNNER_CUDA_SYNC_DEBUG"):  # a diagnosis (docs/development.md)
            # torch then warns (or raises) at every operation that makes the host wait for the device, once per
            # call site: where a step waits that should not.
            mode = os.environ["ELASTIC_RUNNER_CUDA_SYNC_DEBUG"]
            torch.cuda.set_sync_debug_mode(int(mode) if mode.isdigit() else mode)  # warn | error | 1 | 2
    timeout = datetime.timedelta(seconds=timeout_seconds)
    message = (
        f"rank {env.rank}: process group ({chosen}, world size {env.world_size}, "
        f"master {env.master_addr}:{env.master_port}) was not ready within "
        f"dist.init_timeout_seconds={init_timeout_seconds:g}s; a peer did not arrive or is stuck. "
        "Ending this attempt so torchrun can start a new rendezvous round. If nodes are just "
        "slow to start, raise dist.init_timeout_seconds."
    )
    _import_dynamo_first()
    started = time.monotonic()
    same, joined = None, False
    with Deadline(init_timeout_seconds, message):
        if env.world_size == 1 and env.master_port is None:
            tdist.init_process_group(chosen, store=tdist.HashStore(), rank=0, world_size=1, timeout=timeout)
            store = None
        else:
            if env.master_addr is None or env.master_port is None:
                raise DistError(
                    f"WORLD_SIZE={env.world_size} but MASTER_ADDR/MASTER_PORT are not set; "
                    "launch with torchrun (or elastic-runner launch)"
                )
            store = job_store(env, timeout, leaving)
            if in_process and env.world_size > 1 and store is not None:
                try:
                    method = chosen_regroup(regroup, chosen)
                except RegroupError as exc:
                    raise DistError(str(exc)) from exc
                same = SameMembers(store, env.rank, env.world_size, chosen, dev, timeout,
                                   datetime.timedelta(seconds=regroup_wait_seconds), method=method,
                                   agents=env.group_world_size, key=current_signing_key(),
                                   context=f"{env.master_addr}:{env.master_port}", master_addr=env.master_addr,
                                   alive_port=liveness.port_from_environment(), agent_id=env.agent_id or "",
                                   asks_rank0_agent=env.local_rank == 0)
            if same is not None and env.replaces is not None and env.rank != 0:
                same.replace()  # the group the survivors rebuild for this process
                joined = True
            elif same is not None and same.method == "reconfigure":
                joined = _first_reconfigurable(same, env.rank, regroup, init_timeout_seconds, leaving)
            if not joined and same is not None:
                same.arrive_first(datetime.timedelta(seconds=init_timeout_seconds), leaving)
            if not joined:
                kwargs: dict[str, Any] = {"device_id": dev} if dev.type == "cuda" else {}
                if store is not None:
                    kwargs["store"] = store
                else:
                    kwargs["init_method"] = "env://"
                with leaves_when_asked(leaving, "the round's process group starts"):
                    tdist.init_process_group(chosen, rank=env.rank, world_size=env.world_size, timeout=timeout,
                                             **kwargs)
        dist = Dist(env=env, device=dev, backend=chosen, store=store, in_process=same)
        if not joined:  # (a rebuilt group's join ends with one)
            # The first collective proves every peer is reachable, not just registered.
            with leaves_when_asked(leaving, "the round's first collective"):
                first_collective(dev)
        if same is not None and same.generation == 0:
            same.formed()
    log.debug("process group up in %.3fs", time.monotonic() - started)
    return dist



def rejoin(dist: Dist, deadline_seconds: float, leaving: Callable[[], bool] | None = None) -> float:
    """In-process recovery: rebuild the group with the failed peer's replacement (the survivors keep their
    process); seconds it took. Raises :class:`~elastic_runner.recovery.rebuild.RegroupError` when a member does
    not come, or ``leaving()`` says this worker's agent starts a new round; a rebuild stuck past
    ``deadline_seconds`` (a second failure inside it) ends the process."""
    if dist.in_process is None:
        raise RegroupError("in-process recovery is off for this worker")
    message = (f"rank {dist.rank}: the process group was not rebuilt within {deadline_seconds:g}s of a peer's "
               "failure (dist.init_timeout_seconds); ending this worker so that every worker restarts")
    with Deadline(deadline_seconds, message):
        return dist.in_process.survive(leaving=leaving)

