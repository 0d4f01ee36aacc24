"""Counts what in a training step would make the host wait for a GPU, on the CPU (issue 49).

A CPU tensor read costs nothing, so a host synchronisation on a GPU — ``.item()``, ``bool(tensor)``, a copy to the
host, ``nonzero`` — goes unnoticed on the machines the tests run on. This probe runs one worker
(``python -m tests.sync_probe OUT.json -- <elastic_runner.train arguments>``; ``{rank}`` in OUT is the worker's rank) with every step and every
between-steps call of the loop wrapped in a counter:

- a ``TorchDispatchMode`` that sees every operator that reads a tensor's values into the host on any device:
  ``_local_scalar_dense`` (``item``, ``float``, ``int``, ``bool`` of a tensor), ``is_nonzero``, ``nonzero``,
  ``masked_select``, ``unique`` and the like;
- ``Tensor.tolist``, ``Tensor.numpy`` and ``Tensor.__array__``, which read a tensor's memory without an operator.

Reads of host data are not syncs, and are left out: a batch as the loader collated it, before it is moved to the
device (calls from the data room, ``elastic_runner/data/``), an optimizer's step counters, which torch keeps on the
host by design (unless ``capturable``), and the index tensors torch builds from Python lists to place a DTensor's
shard (``torch/distributed/tensor/_utils.py``): reading one never waits for a GPU. Each count is kept with its call site (the first frame
in ``elastic_runner/``), per step, with what the step did besides training (logged, snapshotted, evaluated). Only
the training thread counts: a snapshot writer's thread reads the host copies the step handed it.
"""

from __future__ import annotations

import json
import sys
import threading
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
#: Operators whose result depends on a tensor's values on the host: on a GPU each waits for the device.
SYNCING = {aten._local_scalar_dense, aten.is_nonzero, aten.nonzero, aten.masked_select, aten.unique_consecutive,
           aten._unique2, aten.unique_dim, aten.repeat_interleave, aten.nonzero_static}


#: torch's own code that reads tensors it made from host data (see the module docstring).
HOST_READS_IN_TORCH = ("/torch/distributed/tensor/_utils.py",)


def in_host_code() -> bool:
    return any(frame.filename.endswith(HOST_READS_IN_TORCH) for frame in traceback.extract_stack()[-8:])


def call_site() -> str:
    """The innermost frame of elastic_runner's own code (not the probe's, not torch's)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/elastic_runner/" in frame.filename:
            return f"{frame.filename.split('/elastic_runner/', 1)[1]}:{frame.lineno} ({frame.name})"
    return "?"


class Counting(TorchDispatchMode):
    def __init__(self, into: Counter[str], optimizer: Any) -> None:
        super().__init__()
        self.into, self.optimizer = into, optimizer

    def on_host(self, tensor: Any) -> bool:
        """An optimizer's step counter, which torch keeps on the host (its state is made at the first step)."""
        return any(state.get("step") is tensor for state in self.optimizer.state.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if func._overloadpacket in SYNCING and not (args and self.on_host(args[0])) and not in_host_code():
            site = call_site()
            if not site.startswith("data/"):
                self.into[f"{func._overloadpacket.__name__} at {site}"] += 1
        return func(*args, **(kwargs or {}))


_active: list[tuple[Counter[str], int]] = []  #: the step being counted: its counts, and its thread


def _reading(name: str, original: Any) -> Any:
    def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if _active and threading.get_ident() == _active[-1][1]:  # the training thread's (a writer's is its own)
            site = call_site()
            if not site.startswith("data/"):
                _active[-1][0][f"Tensor.{name} at {site}"] += 1
        return original(self, *args, **kwargs)
    return read


def install(out: Path) -> None:
    from elastic_runner.training.loop import Trainer

    for name in ("tolist", "numpy", "__array__"):
        setattr(torch.Tensor, name, _reading(name, getattr(torch.Tensor, name)))
    steps: list[dict[str, Any]] = []

    def counted(part: str, method: Any) -> Any:
        def run(self: Trainer, plan: Any, *args: Any) -> Any:
            counts: Counter[str] = Counter()
            _active.append((counts, threading.get_ident()))
            try:
                with Counting(counts, self.parts.optimizer):
                    return method(self, plan, *args)
            finally:
                _active.pop()
                step = self.parts.state.step
                every = self.cfg
                record = {"step": step, "part": part, "syncs": dict(counts),
                          "logged": step % every.logging.every_steps == 0 or step >= self.total_steps,
                          "snapshot": bool(every.snapshot.every_steps) and step % every.snapshot.every_steps == 0,
                          "evaluated": bool(every.train.eval_every_steps) and step % every.train.eval_every_steps == 0}
                steps.append(record)
                out.write_text(json.dumps(steps))
        return run

    Trainer.train_step = counted("train_step", Trainer.train_step)  # type: ignore[method-assign]
    Trainer.after_step = counted("after_step", Trainer.after_step)  # type: ignore[method-assign]


def main() -> int:
    import os

    out = Path(sys.argv[1].replace("{rank}", os.environ.get("RANK", "0")))
    install(out)
    from elastic_runner.train import main as train

    return train(sys.argv[3:] if sys.argv[2:3] == ["--"] else sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
