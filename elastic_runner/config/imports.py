"""Resolve ``package.module:callable`` references from the config.

Users plug in their own models, datasets, optimizers and schedules without
forking: ``model.name: torchvision.models:resnet18``. Every failure names the
config key, the reference and the likely fix.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import sys
from typing import Any, Callable, Iterator

from . import ConfigError, is_import_path


def resolve(reference: str, key: str) -> Callable[..., Any]:
    if not is_import_path(reference):
        raise ConfigError(key, f"{reference!r} is not an import path", "Write it as 'package.module:callable'")
    module_name, _, attr_path = reference.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or module_name
        hint = (
            "Install the 'vision' extra: pip install 'elastic-runner[vision]'"
            if missing.split(".")[0] == "torchvision"
            else f"Install the package that provides {missing!r} or fix the module name (is it on PYTHONPATH?)"
        )
        raise ConfigError(key, f"cannot import module {module_name!r} ({exc})", hint) from exc
    except Exception as exc:  # an import-time error inside the user's module
        raise ConfigError(
            key, f"importing {module_name!r} failed: {type(exc).__name__}: {exc}", "Fix the error in that module"
        ) from exc
    target: Any = module
    for part in attr_path.split("."):
        try:
            target = getattr(target, part)
        except AttributeError as exc:
            public = sorted(n for n in dir(module) if not n.startswith("_"))[:12]
            raise ConfigError(
                key, f"module {module_name!r} has no attribute {attr_path!r}",
                f"Check the name after ':'; the module defines e.g. {', '.join(public)}",
            ) from exc
    if not callable(target):
        raise ConfigError(key, f"{reference!r} is not callable", "Point at a class or function")
    return target


def call(factory: Callable[..., Any], kwargs: dict[str, Any], key: str, reference: str, *args: Any) -> Any:
    """Call a user factory; a bad keyword becomes a ConfigError naming ``key``."""
    try:
        inspect.signature(factory).bind(*args, **kwargs)
    except TypeError as exc:
        raise ConfigError(key, f"{reference} does not accept these arguments: {exc}", f"Fix the keys under {key}") from exc
    except ValueError:
        pass  # builtins without a signature: let the call itself decide
    return factory(*args, **kwargs)


def references(cfg: Any) -> list[tuple[str, str]]:
    """Every import path a config names, as (key, reference)."""
    found = [("data.name", cfg.data.name), ("data.sampler", cfg.data.sampler), ("data.collate", cfg.data.collate),
             ("model.name", cfg.model.name), ("model.loss", cfg.model.loss), ("optim.name", cfg.optim.name),
             ("schedule.name", cfg.schedule.name)]
    if isinstance(cfg.eval.metrics, list):
        found += [("eval.metrics", m) for m in cfg.eval.metrics]
    return [(key, ref) for key, ref in found if isinstance(ref, str) and is_import_path(ref)]


def check_references(cfg: Any) -> None:
    """Import every import path of ``cfg``; the first that does not import or is not callable raises."""
    for key, reference in references(cfg):
        resolve(reference, key)


@contextlib.contextmanager
def working_directory_on_path() -> Iterator[None]:
    """The working directory first on ``sys.path`` for the duration (import paths find a user's modules there, as
    in a worker), then ``sys.path`` as it was: nothing is left behind for the rest of the caller's process."""
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)
