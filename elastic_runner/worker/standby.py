"""A standby worker: a process that is ready before a worker fails (in-process recovery, ``recovery.standby``).

With in-process recovery the survivors of a failed worker keep their process and wait for its replacement; a new
process would make them wait for its whole start (the config read, the datasets and the model built, on a GPU a
CUDA context, a compiled model traced). The agent therefore keeps one *standby* per node
(:meth:`elastic_runner.agent.worker_context.KeepingContext.start_standby`), forked from the zygote with the
workers' command line and no rank. It builds what a worker builds before it joins the process group
(:func:`prepare`) and waits; when a worker of the node fails the agent hands it that worker's place, and the worker
it becomes trains what it built (:func:`take`) instead of building it again.

What it builds is the workload of a new process: the resumed state replaces the model's whole state (parameters and
buffers) and every step seeds the random generators again, so nothing it did while it waited reaches the training.
Whatever fails here is left to the worker it becomes, which builds again and reports the error as any worker would.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import Config
    from ..workload.spec import Workload

log = logging.getLogger(__name__)

#: What the standby built: the config it read and the workload of that config.
_prepared: tuple[Config, Workload] | None = None
#: When this standby took a worker's place (wall clock): the worker's start, for its start-up figures.
_placed_at: float | None = None


def prepare(cfg: Config) -> bool:
    """Build the workload of ``cfg`` (the workers' config) ahead, held here for :func:`take`; False (nothing held)
    where that fails or the config does not want a standby."""
    global _prepared
    from ..workload.spec import from_config

    _prepared = None
    if not (cfg.in_process and cfg.recovery.standby):
        return False
    try:
        workload = from_config(cfg)
        if cfg.model.compile or workload.compiled is not None:
            _trace_compiled(cfg, workload)
    except Exception:  # noqa: BLE001 - the worker it becomes builds again and says what is wrong
        log.debug("the standby could not build the workload ahead", exc_info=True)
        return False
    _prepared = (cfg, workload)
    return True


def _trace_compiled(cfg: Config, workload: Workload) -> None:
    """Run the compiled model's forward and backward once on the first items, as a step of this world size would
    (its micro-batch, precision, training mode, deterministic algorithms): torch keeps the traced graphs for the
    model, and the worker this standby becomes finds them instead of tracing on its first step (~1.2 s for a small
    model on this CPU; minutes for a large one). Only a replicated model on the CPU: a sharded one is compiled
    unit by unit after its sharding, and a GPU's graphs are the device's (the model is not on it yet)."""
    import contextlib
    import os

    import torch

    from ..data.layout import layout_for
    from ..lifecycle import gpu_driver
    from ..data.sources import collate_items
    from ..training.compiling import compiled_forward, use_private_cache
    from ..training.step import AUTOCAST

    # (Asked without a CUDA call: one would fix this process's devices before its place sets CUDA_VISIBLE_DEVICES.)
    if cfg.parallel.sharded or (cfg.dist.device != "cpu" and torch.cuda._is_compiled() and gpu_driver()):
        return
    if cfg.run.deterministic:
        torch.use_deterministic_algorithms(True)  # as the worker sets it: torch's graphs are guarded on it
    use_private_cache()
    model = workload.model
    model.train()
    size = min(layout_for(cfg.batch, int(os.environ.get("WORLD_SIZE", "1"))).micro_size, workload.num_train)
    batch = collate_items(workload.train, list(range(size)), workload.collate)
    forward = compiled_forward(model, cfg.model.compile, workload.compiled)
    dtype = AUTOCAST.get(cfg.train.precision)
    with torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext():
        losses, _ = workload.task.compute_loss(forward, batch, size)
    losses.sum().backward()
    for param in model.parameters():
        param.grad = None


def take(cfg: Config) -> Workload | None:
    """The workload this process built as a standby, once, if it was built from ``cfg`` (the config the worker
    read on taking its place: a file edited in between is the edited one); None otherwise."""
    global _prepared
    prepared, _prepared = _prepared, None
    if prepared is None:
        return None
    if prepared[0] != cfg:
        log.info("the config changed since this standby read it: the workload is built again")
        return None
    return prepared[1]


def placed() -> None:
    """This standby takes a worker's place now."""
    global _placed_at
    _placed_at = time.time()


def placed_at() -> float | None:
    """When this process, a standby, took a worker's place; None for a worker started as one."""
    return _placed_at
