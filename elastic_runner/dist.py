"""The process group of one training attempt and the few collectives we use: the ground floor.

Training, evaluation, the Checkpointer and the observers type against :class:`Dist` and call its collectives; the
worker brings it up (:func:`elastic_runner.worker.group.up`: the job's store, in-process recovery's regrouping, a
deadline) and rebuilds it. The model's replication and gradient sync are in :mod:`elastic_runner.training.parallel`.
A world of size 1 still gets a (gloo, in-memory store) process group so that the loop has one code path for every
launch mode.

Process-group creation is guarded by a hard deadline (:class:`Deadline`): a worker whose peers never arrive (a stale
rendezvous, a half-dead node) would otherwise wait for gloo's 30-minute default inside C++ where no Python exception
can reach it. When the deadline passes the worker logs what to check and exits, so torchrun starts the next
rendezvous round.
"""

from __future__ import annotations

import gc
import json
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as tdist

from .env import WorkerEnv
from .lifecycle import EXIT_PEER_TIMEOUT, exit_now

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


def destroy_default_group() -> None:
    """Destroy the default process group, if any; a failure is logged, never raised (teardown after a failure must
    not mask it)."""
    # Objects in reference cycles (a worker's DDP model after an exception) hold the group
    # until the collector runs: free them first, or gloo's threads outlive the group
    # (see _import_dynamo_first for why that matters).
    if tdist.is_initialized():
        gc.collect()
        try:
            tdist.destroy_process_group()
        except Exception:  # noqa: BLE001 - teardown after a failure must not mask it
            log.debug("destroy_process_group failed", exc_info=True)


def broadcast_coalesced(tensors: list[torch.Tensor], src: int = 0, group: Any = None) -> None:
    """Overwrite ``tensors`` with rank ``src``'s, in one broadcast per dtype and device."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t.detach())
    for same in by_kind.values():
        flat = _flatten_dense_tensors(same)
        tdist.broadcast(flat, src=src, group=group)
        if tdist.get_rank() != src:
            torch._foreach_copy_(same, list(_unflatten_dense_tensors(flat, same)))


@dataclass
class Dist:
    """The process group of one training attempt and its small collectives."""

    env: WorkerEnv
    device: torch.device
    backend: str
    #: The job's store, held for the process's life: a rebuilt group needs it, and on rank 0 it hosts it.
    store: Any = None
    #: In-process recovery (``recovery.in_process``): how this worker rebuilds its group with a failed peer's
    #: replacement (:class:`~elastic_runner.recovery.regroup.SameMembers`, set by :func:`~elastic_runner.worker.group.up`);
    #: None: a failure ends the process.
    in_process: Any = None

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    # -- lifecycle -----------------------------------------------------------------

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
