"""``torch.compile`` for the model's forward pass, with the state kept the plain model's.

The step calls a compiled module, but everything that reads or writes state (snapshots, the gradient sync's
hooks, the optimizer, ``load_model``) sees the plain model: ``torch.compile`` returns a wrapper whose own
``state_dict`` prefixes every key with ``_orig_mod.``, so a snapshot taken through it would not load into the
same model uncompiled. A model a user's script compiled itself (``fit(torch.compile(model))``) is unwrapped the
same way and its compiled wrapper, with the user's own options, is the one called.

Compiled here with ``dynamic=False``: one static graph per input shape. With dynamic shapes torch switches a
graph to a dynamic one the second time a shape changes (an epoch's short last batch), so the kernels an
uninterrupted run uses after its first epoch end differ from those of a run resumed after that point, and the
sums they compute can differ in the last bit. Static graphs are the same whatever came before: a resumed
compiled run ends with exactly the model of an uninterrupted one. A job sees a few shapes (the micro-batch and
an epoch's remainder at each world size, the same for evaluation): :data:`RECOMPILE_LIMIT` keeps torch from
falling back to uncompiled code after its default of 8, which would again make the result depend on the
history.

Compiled code is cached on the node (:func:`use_private_cache`): a worker that replaces a failed one finds the
kernels its predecessor generated and only traces the model again. The cache holds pickled objects that torch
loads, so it lives in a directory only this user can write, never in a shared one.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from torch import nn

from ..config import ConfigError
from ..files import private_dir

#: Distinct input shapes a compiled frame may see before torch runs it uncompiled (torch's default: 8).
RECOMPILE_LIMIT = 64
CACHE_VAR = "TORCHINDUCTOR_CACHE_DIR"


def unwrap_compiled(model: nn.Module) -> tuple[nn.Module, nn.Module | None]:
    """``(plain model, compiled wrapper or None)`` for a module that ``torch.compile`` may have wrapped."""
    inner = getattr(model, "_orig_mod", None)
    if isinstance(inner, nn.Module) and type(model).__name__ == "OptimizedModule":
        return inner, model
    return model, None


def without_compile_prefix(state: dict[str, Any]) -> dict[str, Any]:
    """A model state saved through a compiled wrapper (every key ``_orig_mod.``-prefixed: written by a script that
    saved its compiled model itself, or by elastic_runner before compiled models were unwrapped) as the plain model's."""
    prefix = "_orig_mod."
    if state and all(key.startswith(prefix) for key in state):
        return {key[len(prefix):]: value for key, value in state.items()}
    return state


def compiled_forward(model: nn.Module, enabled: bool, given: nn.Module | None = None) -> nn.Module:
    """The module a step calls: ``given`` (a user's own compiled wrapper of ``model``), else ``model`` compiled
    when ``enabled``, else ``model`` itself."""
    if given is None and not enabled:
        return model
    import torch

    allow_recompiles()
    if given is not None:
        return given
    return torch.compile(model, dynamic=False)  # type: ignore[return-value]


def allow_recompiles() -> None:
    """Up to :data:`RECOMPILE_LIMIT` shapes per compiled frame before torch runs it uncompiled (module docstring)."""
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):  # renamed in torch 2.6; either is the same setting
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(int(getattr(dynamo_config, name)), RECOMPILE_LIMIT))
            break


def use_private_cache(environ: Any = os.environ) -> Path:
    """Point torch's compile cache at a directory of this user's only (unless ``TORCHINDUCTOR_CACHE_DIR`` names
    another one: then the user chose it). torch's default, ``/tmp/torchinductor_<user>``, is taken as it is found:
    another local user could have made it first and planted what torch then loads. (Importing ``torch._dynamo``
    writes that default into the variable, so the default is recognised by its value.)"""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = environ.get(CACHE_VAR)
    if chosen and os.path.realpath(chosen) != os.path.realpath(default_cache_dir()):
        return Path(chosen)
    root = Path(tempfile.gettempdir()) / f"elastic-runner-{os.getuid()}"
    try:
        path = private_dir(private_dir(root) / "compile-cache")
    except OSError as exc:
        raise ConfigError("model.compile", f"the compile cache cannot be kept private: {exc}",
                          f"Remove it, or set {CACHE_VAR} to a directory of yours") from exc
    environ[CACHE_VAR] = str(path)
    return path
