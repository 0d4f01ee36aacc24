"""Sharded models: FSDP2 over all ranks (``parallel.strategy: fsdp``) or sharded within a node and replicated
across nodes (``hsdp``), with the same exact gradient as the replicated path.

:func:`shard_model` makes every rank take rank 0's parameters and buffers (a script's model need not be
initialised identically on every rank; DDP's constructor does the same), then applies
``torch.distributed.fsdp.fully_shard`` to the wrap units (:func:`wrap_units`) and to the root, in place:
afterwards each parameter is a DTensor of which this rank holds one slice (``Shard(0)``; HSDP:
``(Replicate(), Shard(0))`` over a nodes × nproc_per_node mesh), and the optimizer built over
``model.parameters()`` holds only that slice's state.

The gradient is a SUM over the ranks, never an average: every FSDP unit is told to divide by 1 and to use
SUM for its reduce-scatter and all-reduce (``set_force_sum_reduction_for_comms``; gloo's AVG is silently
wrong in some torch builds, pytorch#162338). The loss each rank backpropagates is already scaled so that the
sum is the exact mean over the global batch (:mod:`.gradients`), so the step optimises the same number as
the replicated path, at any world size and micro-batching (up to the order of the additions).

Every rank runs every collective: a forward pass gathers parameters, a backward pass reduces gradients. A
rank without a sample in a micro-step therefore runs a *stand-in*: the model on one training item with its
loss times zero — the same collectives as its peers, a zero contribution to the sum. Its effect on buffers
(BatchNorm statistics) does not last: every step ends with every rank taking rank 0's buffers, and rank 0
always has a sample.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..config import ConfigError, ParallelConfig
from ..dist import broadcast_coalesced
from ..snapshot.shards import is_dtensor


def fsdp_available() -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule, fully_shard  # noqa: F401
    except ImportError:
        return False
    return hasattr(FSDPModule, "set_force_sum_reduction_for_comms")


def device_mesh(strategy: str, device: torch.device, world: int, local_world: int) -> Any:
    """fsdp: one dimension over all ranks; hsdp: (nodes, workers per node), sharded along the second."""
    from torch.distributed.device_mesh import init_device_mesh

    if strategy == "hsdp":
        check_nodes_even(world, local_world)
        return init_device_mesh(device.type, (world // local_world, local_world),
                                mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))


def wrap_units(model: nn.Module, wrap: str | list[str]) -> list[nn.Module]:
    """The modules sharded as one unit each (innermost first is not needed: FSDP2 takes them in any order)."""
    if wrap != "auto":
        wanted = set(wrap)
        units = [m for m in model.modules() if type(m).__name__ in wanted and m is not model]
        found = {type(m).__name__ for m in units}
        missing = sorted(wanted - found)
        if missing:
            present = sorted({type(m).__name__ for m in model.modules() if m is not model})
            raise ConfigError("parallel.wrap", f"the model has no module of class {', '.join(missing)}",
                              f"Name classes the model contains (it has: {', '.join(present[:20])}), or use auto")
        return units
    no_split = getattr(model, "_no_split_modules", None)  # HuggingFace's list of blocks not to split
    if no_split:
        names = set(no_split)
        return [m for m in model.modules() if type(m).__name__ in names and m is not model]
    from ..workload.gpt import GPT, Block

    if isinstance(model, GPT):
        return [m for m in model.modules() if isinstance(m, Block)]
    return [child for child in model.children() if any(True for _ in child.parameters())]


def shard_model(model: nn.Module, cfg: ParallelConfig, device: torch.device, world: int, local_world: int) -> Any:
    """Shard ``model`` in place (see the module docstring); returns the device mesh."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

    if cfg.offload and device.type != "cuda":
        raise ConfigError("parallel.offload", f"needs a CUDA device (this worker runs on {device.type})",
                          "Set parallel.offload: false on CPUs")
    units = wrap_units(model, cfg.wrap)
    mesh = device_mesh(cfg.strategy, device, world, local_world)
    if world > 1:
        broadcast_coalesced(list(model.parameters()) + list(model.buffers()), 0)
    options: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": cfg.reshard_after_forward}
    if cfg.mixed_precision == "bf16":
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if cfg.offload:
        options["offload_policy"] = CPUOffloadPolicy()
    for unit in units:
        fully_shard(unit, **options)
    # The root's parameters (embeddings, the last norm and head) are the first the backward pass needs: freeing them
    # after the forward pass would only gather them again at once (torchtitan and FSDP2's own default do the same).
    fully_shard(model, **(options | {"reshard_after_forward": False}))
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(1.0)
    return mesh


class FSDPSync:
    """The :class:`~.parallel.GradientSync` of a sharded model: FSDP2 reduces the gradients itself during the
    backward pass (a sum, see the module docstring); ``stand_in`` runs a zero-loss forward and backward for a
    micro-step in which this rank has no sample."""

    averages_over = 1

    def __init__(self, model: nn.Module, stand_in: Callable[[nn.Module], torch.Tensor]) -> None:
        self.module = model
        self._stand_in = stand_in

    def begin_step(self) -> None:
        """FSDP2 keeps its own gradient buffers."""

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.module.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)  # type: ignore[operator]

    def empty_micro_step(self) -> None:
        (self._stand_in(self.module) * 0.0).backward()

    def finish(self) -> None:
        """FSDP2 waits for its last reduce-scatter at the end of the backward pass."""

    def close(self) -> None:
        pass


def compile_units(model: nn.Module) -> None:
    """``model.compile`` for a sharded model: each FSDP unit's ``forward`` compiled in place. Compiling the model as a
    whole compiles nothing: FSDP2's gathering hooks, which torch keeps out of compilation, sit inside every unit's
    call, and torch cannot go on after them there. Compiled per forward, the hooks run around the compiled code (a
    parent's forward is compiled in pieces between its units' calls), and the state keeps the plain model's keys."""
    from torch.distributed.fsdp import FSDPModule

    from .compiling import allow_recompiles

    allow_recompiles()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.forward = torch.compile(module.forward, dynamic=False)  # type: ignore[method-assign]


def global_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of every gradient over all ranks (for sharded gradients a collective; a plain tensor back)."""
    norm = torch.nn.utils.get_total_norm(grads)
    return norm.full_tensor() if is_dtensor(norm) else norm  # type: ignore[attr-defined,no-any-return]


def localize(state: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer, reader: Any) -> dict[str, Any]:
    """A loaded training state in this rank's layout: each model and optimizer tensor as the live one is laid out
    (this rank's slice of a sharded parameter, whole for a replicated one), from a sharded snapshot's parts or a
    replicated snapshot's whole tensors alike."""
    from ..snapshot.shards import place, whole

    live = model.state_dict()
    out = dict(state)
    out["model"] = {k: place(v, live.get(k), reader) for k, v in state["model"].items()}
    opt = state.get("optimizer")
    if isinstance(opt, dict) and isinstance(opt.get("state"), dict):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        out["optimizer"] = dict(opt) | {"state": {
            i: {name: place(v, params[i] if isinstance(i, int) and 0 <= i < len(params) else None, reader)
                for name, v in per_param.items()} if isinstance(per_param, dict) else per_param
            for i, per_param in opt["state"].items()}}
    return whole(out, reader)  # type: ignore[no-any-return]


def check_nodes_even(world: int, local_world: int) -> None:
    """hsdp's mesh is nodes x workers per node: every node must run as many workers."""
    if local_world < 1 or world % local_world:
        raise ConfigError("parallel.strategy", f"hsdp needs the same number of workers on every node; the world size "
                          f"{world} is not a multiple of this node's {local_world}",
                          "Start every node with the same --nproc_per_node, or use parallel.strategy: fsdp")


def check_shardable(cfg: Any, workload: Any, world: int, local_world: int) -> None:
    """What a sharded run cannot do, said before anything is written (exit status 2)."""
    if cfg.parallel.strategy == "hsdp":
        check_nodes_even(world, local_world)
    if not fsdp_available():
        import torch as _torch

        raise ConfigError("parallel.strategy", f"{cfg.parallel.strategy} needs FSDP2 (torch.distributed.fsdp."
                          f"fully_shard with set_force_sum_reduction_for_comms); this torch {_torch.__version__} lacks it",
                          "Install torch >= 2.10, or use parallel.strategy: ddp")
    norms = [type(m).__name__ for m in workload.model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if cfg.parallel.mixed_precision == "bf16" and norms:
        raise ConfigError("parallel.mixed_precision", f"bf16 with the model's BatchNorm layers ({norms[0]}): FSDP2 "
                          "casts their inputs to bfloat16 but not their float32 running statistics",
                          "Use parallel.mixed_precision: none (and train.precision: bf16 for autocast), or a model "
                          "without BatchNorm")
    if cfg.model.sync_batchnorm:
        raise ConfigError("model.sync_batchnorm", f"applies to parallel.strategy ddp, not {cfg.parallel.strategy}",
                          "Set model.sync_batchnorm: false")
