"""Process group up and down, device choice, and the few collectives we use.

The process group and its collectives are here; the model's replication and gradient sync are in
:mod:`elastic_runner.training.parallel`. A world of size 1 still gets a (gloo, in-memory store)
process group so that the loop has one code path for every launch mode.

Process-group creation is guarded by a hard deadline: a worker whose peers
never arrive (a stale rendezvous, a half-dead node) would otherwise wait for
gloo's 30-minute default inside C++ where no Python exception can reach it.
When the deadline passes the worker logs what to check and exits, so torchrun
starts the next rendezvous round.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as tdist

from ..training.parallel import broadcast_coalesced
from .env import WorkerEnv
from .lifecycle import EXIT_PEER_TIMEOUT, exit_now
from .regroup import ReconfigureRefused, RegroupError, SameMembers, chosen_regroup, destroy_default_group

log = logging.getLogger(__name__)



class DistError(RuntimeError):
    """A device or process-group problem with a message the user can act on."""


class Deadline:
    """Ends the process if ``disarm()`` is not called within ``seconds``.

    Used around blocking native calls (store connect, gloo/NCCL init) that
    ignore Python signals and exceptions. ``os._exit`` is deliberate: the
    interpreter cannot unwind a thread stuck in C++.
    """

    def __init__(self, seconds: float, message: str, exit_code: int = EXIT_PEER_TIMEOUT,
                 on_expire: Callable[[], None] | None = None) -> None:
        self.seconds = seconds
        self.message = message
        self.exit_code = exit_code
        self.on_expire = on_expire
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="elastic-runner-deadline", daemon=True)

    def __enter__(self) -> "Deadline":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.disarm()

    def disarm(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        if self._done.wait(self.seconds):
            return
        log.critical(self.message)
        if self.on_expire is not None:
            try:
                self.on_expire()
            except Exception:  # noqa: BLE001 - we are exiting anyway
                log.exception("deadline hook failed")
        exit_now(self.exit_code, self.message)


def _first_reconfigurable(same: SameMembers, rank: int, wanted: str, wait_seconds: float) -> bool:
    """The round's first group, created reconfigurable; False where the backend refused that under
    ``recovery.regroup: auto`` (the caller creates the group as any other, and rebuilds recreate it)."""
    try:
        same.first(datetime.timedelta(seconds=wait_seconds))
        return True
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


def choose_device(env: WorkerEnv, requested: str = "auto") -> torch.device:
    if requested == "cpu":
        return torch.device("cpu")
    cuda = torch.cuda.is_available()
    if requested == "cuda" and not cuda:
        raise DistError("dist.device is 'cuda' but no CUDA device is available; set dist.device: auto or cpu")
    if cuda and requested in ("auto", "cuda"):
        count = torch.cuda.device_count()
        if env.local_rank >= count:
            raise DistError(
                f"LOCAL_RANK={env.local_rank} but this node has {count} CUDA device(s); "
                f"start at most {count} workers per node (--nproc_per_node={count} or 'gpu')"
            )
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


def choose_backend(device: torch.device, requested: str = "auto") -> str:
    if requested == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if requested == "nccl" and device.type != "cuda":
        raise DistError("dist.backend is 'nccl' but the device is the CPU; use dist.backend: gloo or auto")
    return requested


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


def job_store(env: WorkerEnv, timeout: datetime.timedelta) -> Any:
    """The job's TCPStore as ``env://`` would make it, except that rank 0 binds MASTER_PORT with ``SO_REUSEPORT``:
    the agent that offered the port still holds it that way (:mod:`elastic_runner.rendezvous.ports`), so that no
    other local user could take it meanwhile, and only a socket of the same user with the same option can share
    it. None where that is not possible here (the caller then uses ``env://``)."""
    from ..rendezvous.ports import reuseport_socket

    if env.master_addr is None or env.master_port is None:
        return None
    if env.rank != 0:
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
    # The store takes the listening socket over (and closes it with itself).
    return tdist.TCPStore(env.master_addr, env.master_port, env.world_size, True, timeout=timeout,
                          multi_tenant=True, master_listen_fd=sock.detach(), use_libuv=True)


@dataclass
class Dist:
    """The process group of one training attempt and its small collectives."""

    env: WorkerEnv
    device: torch.device
    backend: str
    #: The job's store, held for the process's life: a rebuilt group needs it, and on rank 0 it hosts it.
    store: Any = None
    #: In-process recovery (``recovery.in_process``): how this worker rebuilds its group with a failed peer's
    #: replacement (:class:`~elastic_runner.worker.regroup.SameMembers`); None: a failure ends the process.
    in_process: Any = None

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    # -- lifecycle -----------------------------------------------------------------

    @classmethod
    def up(cls, env: WorkerEnv, *, backend: str = "auto", device: str = "auto",
           timeout_seconds: float = 300.0, init_timeout_seconds: float = 30.0, in_process: bool = False,
           regroup_wait_seconds: float = 5.0, regroup: str = "recreate") -> "Dist":
        """The process group of this worker. ``in_process``: a failed peer is replaced and this worker rebuilds
        its group with the replacement (:meth:`rejoin`) the ``regroup`` way (``recovery.regroup``), waiting
        ``regroup_wait_seconds`` for it; a worker that *is* a replacement (``ELASTIC_RUNNER_REPLACES``) joins the
        group its predecessor's survivors rebuild."""
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
                store = job_store(env, timeout)
                if in_process and env.world_size > 1 and store is not None:
                    try:
                        method = chosen_regroup(regroup, chosen)
                    except RegroupError as exc:
                        raise DistError(str(exc)) from exc
                    same = SameMembers(store, env.rank, env.world_size, chosen, dev, timeout,
                                       datetime.timedelta(seconds=regroup_wait_seconds), method=method,
                                       agents=env.group_world_size)
                if same is not None and env.replaces is not None and env.rank != 0:
                    same.replace()  # the group the survivors rebuild for this process
                    joined = True
                elif same is not None and same.method == "reconfigure":
                    joined = _first_reconfigurable(same, env.rank, regroup, init_timeout_seconds)
                if not joined:
                    kwargs: dict[str, Any] = {"device_id": dev} if dev.type == "cuda" else {}
                    if store is not None:
                        kwargs["store"] = store
                    else:
                        kwargs["init_method"] = "env://"
                    tdist.init_process_group(chosen, rank=env.rank, world_size=env.world_size, timeout=timeout,
                                             **kwargs)
            dist = cls(env=env, device=dev, backend=chosen, store=store, in_process=same)
            if not joined:  # (a rebuilt group's join ends with one)
                # The first collective proves every peer is reachable, not just registered.
                dist.all_reduce_sum(torch.zeros(1, device=dev))
            if same is not None and same.generation == 0:
                same.formed()
        log.debug("process group up in %.3fs", time.monotonic() - started)
        return dist

    def abort(self) -> None:
        """Abort the process group from another thread (NCCL): only that returns the GPU stream of a
        collective stuck on a lost peer, so the main thread raises out of it."""
        try:
            from torch.distributed import distributed_c10d

            abort = getattr(distributed_c10d, "_abort_process_group", None)
            if abort is not None:
                abort()
        except Exception:  # noqa: BLE001 - we are ending the attempt anyway
            log.debug("process group abort failed", exc_info=True)

    def down(self) -> None:
        destroy_default_group()
        self.in_process = None
        self.store = None  # on rank 0 the job's store closes with the last reference (a kept worker's new round)

    def rejoin(self, deadline_seconds: float, leaving: Callable[[], bool] | None = None) -> float:
        """In-process recovery: rebuild the group with the failed peer's replacement (the survivors keep their
        process); seconds it took. Raises :class:`~elastic_runner.worker.regroup.RegroupError` when a member does
        not come, or ``leaving()`` says this worker's agent starts a new round; a rebuild stuck past
        ``deadline_seconds`` (a second failure inside it) ends the process."""
        if self.in_process is None:
            raise RegroupError("in-process recovery is off for this worker")
        message = (f"rank {self.rank}: the process group was not rebuilt within {deadline_seconds:g}s of a peer's "
                   "failure (dist.init_timeout_seconds); ending this worker so that every worker restarts")
        with Deadline(deadline_seconds, message):
            return self.in_process.survive(leaving=leaving)

    # -- collectives -----------------------------------------------------------------

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        tdist.all_reduce(tensor, op=tdist.ReduceOp.SUM)
        return tensor

    # Objects travel as JSON, never pickled: a rank accepts data from its peers, not code. (torch's
    # broadcast_object_list/all_gather_object unpickle whatever a peer sends; a peer is only as
    # trustworthy as the rendezvous that admitted it.) Tuples arrive as lists.

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``obj`` (JSON-able: numbers, strings, lists, dicts, None) from rank ``src`` to every rank."""
        device = self._object_device()
        data = json.dumps(obj, separators=(",", ":")).encode() if self.rank == src else b""
        size = torch.tensor([len(data)], dtype=torch.long, device=device)
        tdist.broadcast(size, src=src)
        buffer = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if self.rank == src
                  else torch.empty(int(size.item()), dtype=torch.uint8, device=device))
        tdist.broadcast(buffer, src=src)
        return json.loads(buffer.cpu().numpy().tobytes()) if self.rank != src else json.loads(data)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (JSON-able), in rank order."""
        device = self._object_device()
        data = json.dumps(obj, separators=(",", ":")).encode()
        sizes = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(self.world_size)]
        tdist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.long, device=device))
        longest = max(int(t.item()) for t in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8, device=device)
        if data:
            mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
        gathered = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(self.world_size)]
        tdist.all_gather(gathered, mine)
        return [json.loads(g[:int(n.item())].cpu().numpy().tobytes()) for g, n in zip(gathered, sizes)]

    def broadcast_tensor(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        tdist.broadcast(tensor, src=src)
        return tensor

    def broadcast_tensors(self, tensors: list[torch.Tensor], src: int = 0) -> None:
        """Overwrite ``tensors`` with ``src``'s, in one broadcast per dtype and device (coalesced)."""
        broadcast_coalesced(tensors, src)

    def barrier(self) -> None:
        self.all_reduce_sum(torch.zeros(1, device=self.device))

    def _object_device(self) -> torch.device:
        return self.device if self.backend == "nccl" else torch.device("cpu")
