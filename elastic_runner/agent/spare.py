"""A node that waits as a spare: agents started beyond ``--nnodes``' maximum.

A round that is full has no seat for one more node. torch's c10d rendezvous puts such a node on its redundancy list,
the etcd-v3 lease protocol lets it wait without a deadline (:mod:`elastic_runner.rendezvous.leases`); either way it
takes the place of the next node that is lost or leaves, in the round that replaces it, so the world size, the global
batch's split and the data shares stay as they were. Its agent is warm while it waits (the zygote has imported torch
and the worker), and with ``recovery.in_process`` and ``recovery.standby`` so are its workers (:class:`WarmSeat`):
one standby per local rank reads the config, opens the datasets and builds the model while the node waits, and
takes its place when the node is seated, so the round that replaces a lost node waits for no worker's start.
Its workers load the state from a survivor's node memory (a broadcast), as any new node's do.

:class:`SpareWait` reports it: one line and an ``agent_spare_waiting`` event (the round's ``max_nodes`` and this
node's ``local_world_size``: the full world it waits beside is their product; the ``elastic_runner_agent_spare``
gauge) when the node starts to wait, and how long it waited in the round's ``agent_rendezvous`` event
(``spare_s``).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import time
from typing import Any, Callable, Iterator

from torch.distributed.elastic.multiprocessing.api import SignalException

from .. import torch_patches
from ..torch_patches import KEEPING_WORKERS, SEATED_SPARES, usable
from . import fast_rendezvous
from .worker_context import KeepingContext, SeatStandbys

log = logging.getLogger(__name__)


class SpareWait:
    """Watches one rendezvous call of this agent for the node waiting as a spare."""

    def __init__(self, handler: Any, notify: Callable[..., None], clock: Callable[[], float] = time.monotonic,
                 local_world_size: int = 1, on_wait: Callable[[int], None] | None = None) -> None:
        self._notify = notify
        self._on_wait = on_wait  #: called with the round's ``max_nodes`` when the node starts to wait
        self._local_world_size = local_world_size  #: this node's workers: the ranks it brings to the full round
        self._clock = clock
        self.since: float | None = None  #: when this node started to wait as a spare (None: it did not)
        if hasattr(handler, "on_spare"):  # the etcd-v3 lease protocol says so itself; torch's through our patch
            handler.on_spare = self.waits
        else:
            fast_rendezvous.on_spare = self.waits

    def waits(self, max_nodes: int) -> None:
        """The handler found the round full; reported once per rendezvous call."""
        if self.since is not None:
            return
        self.since = self._clock()
        log.info("The rendezvous round is full (%d nodes, --nnodes' maximum): this node waits as a spare and takes "
                 "the place of the next node that is lost or leaves.", max_nodes)
        self._notify("spare_waiting", max_nodes=max_nodes, local_world_size=self._local_world_size)
        if self._on_wait is not None:
            self._on_wait(max_nodes)

    def fields(self) -> dict[str, float]:
        """The round's event's fields: how long this node waited as a spare, if it did."""
        return {} if self.since is None else {"spare_s": round(self._clock() - self.since, 3)}


class WarmSeat:
    """A spare's workers, started while it waits: one standby per local rank (:class:`SeatStandbys`), each building
    the workload with the environment its worker will have (its local rank; the world of the full round it waits
    beside), handed its place by the process context of the round that seats the node (:meth:`seating`).

    What they build is a new process's workload, as a standby's is (:mod:`elastic_runner.worker.standby`): the state
    comes from a survivor's node memory and replaces it whole. A standby that ends while the node waits makes the
    node start them again at its next wait; one that ends by the seat leaves its place to a new process.
    """

    def __init__(self, wanted: bool = True) -> None:
        self.wanted = wanted  #: the workers' ``recovery.in_process`` and ``recovery.standby``
        self._standbys: SeatStandbys | None = None

    def waits(self, spec: Any, max_nodes: int, start_method: str, busy: Callable[[], bool] = lambda: False) -> None:
        """This node starts to wait as a spare: start its workers' standbys, where wanted and possible (not for a
        binary's workers, nor while ``busy()``: this node's own workers still run or are being handed over); a
        failure costs only the head start."""
        if not self.wanted or not callable(spec.entrypoint):
            return
        try:
            if busy() or not (usable(KEEPING_WORKERS, log) and usable(SEATED_SPARES, log)):
                return
            self.start(spec, max_nodes, start_method)
        except SignalException:
            raise
        except Exception as exc:  # noqa: BLE001 - its workers start when it is seated, as without standbys
            log.warning("This spare's workers could not be started ahead (%s: %s); they start when it is seated.",
                        type(exc).__name__, exc)
            self.close()

    def start(self, spec: Any, max_nodes: int, start_method: str) -> list[int]:
        """Start the standbys for the workers of ``spec`` (torch's ``WorkerSpec``: its entrypoint, arguments, local
        world size) unless they run; their pids (empty where they ran already)."""
        from torch.distributed.elastic.utils import macros

        if self._standbys is not None and self._standbys.alive():
            return []
        self.close()
        local = spec.local_world_size
        args = {r: tuple(macros.substitute(list(spec.args), str(r))) for r in range(local)}
        envs = {r: {"LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(local), "WORLD_SIZE": str(max_nodes * local)}
                for r in range(local)}
        self._standbys = SeatStandbys(spec.entrypoint, args, envs, start_method, getattr(spec, "numa_options", None))
        pids = self._standbys.pids()
        log.info("This spare's %d worker(s) build their workload while it waits (standbys: pids %s).", local, pids)
        return pids

    @contextlib.contextmanager
    def seating(self, notify: Callable[..., None]) -> Iterator[None]:
        """While inside, torch's agent starting the round's workers hands the standbys their places (where they
        were started for these workers) instead of starting processes; ``notify`` hears ``spare_seated`` (how many
        workers, how many had built their workload by the seat, and the longest build's seconds)."""
        standbys, self._standbys = self._standbys, None
        if standbys is None:
            yield
            return
        module = importlib.import_module(torch_patches.LOCAL_AGENT)
        original = module.start_processes
        if getattr(original, "__module__", "") != torch_patches.ELASTIC_MP_PACKAGE:
            # Another hand-over holds the name (kept_round's: this node's own workers take the places).
            standbys.close()
            yield
            return

        def seated(**kwargs: Any) -> Any:
            if isinstance(kwargs.get("entrypoint"), str):  # a binary's workers: torch's context, new processes
                standbys.close()
                return original(**kwargs)
            context = KeepingContext(**kwargs)
            built, seconds = standbys.built()
            if context.seat(standbys):
                log.info("This spare's workers take their places: %d of %d built their workload ahead (%.2fs).",
                         built, len(kwargs["args"]), seconds)
                notify("spare_seated", workers=len(kwargs["args"]), built=built, build_s=round(seconds, 3))
            try:
                context.start()
            except Exception:
                context.close()
                raise
            return context

        module.start_processes = seated
        try:
            yield
        finally:
            module.start_processes = original
            standbys.close()  # (each took its place, or the start failed: none is left waiting)

    def close(self) -> None:
        """End the standbys (the agent stops, or its node will not be seated with them)."""
        standbys, self._standbys = self._standbys, None
        if standbys is not None:
            standbys.close()
