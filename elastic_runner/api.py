"""Bring an existing script: hand your own objects to :func:`fit`, get every guarantee.

A training script started by torchrun (or ``elastic-runner launch``) builds its model and datasets
as it always did and calls::

    import elastic_runner

    sys.exit(elastic_runner.fit(
        model, train_dataset, eval_data=test_dataset,
        loss=my_loss,                                   # fn(model, batch) -> losses [B] or (losses, weights)
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-4),
        config={"run": {"dir": "runs/x"}, "batch": {"global_size": 64}, "train": {"epochs": 3}},
    ))

``fit`` runs the same worker as ``python -m elastic_runner.train`` — snapshots on disk and in node
memory, resume from the newest after any restart, the elastic sampler (exactly once, constant global
batch), the peer watchdog, metrics, events, the audit — with these objects instead of the config's
import paths. The config (a YAML file, a mapping of sections, or ``None`` for the defaults) supplies
everything else; its ``data``/``model``/``optim`` names are not used (the snapshot records the
objects' classes and shapes instead, so that a changed model is refused on resume). Returns the
worker's exit status (:mod:`elastic_runner.lifecycle`).

:func:`load_model` rebuilds a run's built-in model from its snapshot's config and loads the newest
snapshot's weights, or loads them into the model you pass (a script's own model, or one named by an
import path: a snapshot never chooses code to run).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from .config import Config, ConfigError, ParallelConfig, load_config
from .training.compiling import unwrap_compiled, without_compile_prefix

Optimizer = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def fit(model: nn.Module, train_data: Any, *, loss: Callable[..., Any] | str = "cross_entropy",
        optimizer: Optimizer | None = None, eval_data: Any = None,
        metrics: Sequence[str | Callable[..., Any]] | None = None, collate: Callable[[list[Any]], Any] | None = None,
        schedule: Callable[[torch.optim.Optimizer, int], Any] | None = None,
        config: str | os.PathLike[str] | Mapping[str, Any] | Config | None = None, overrides: Sequence[str] = (),
        compile: bool | None = None,  # noqa: A002 - torch's own word for it
        parallel: str | Mapping[str, Any] | None = None) -> int:
    """Train ``model`` on ``train_data`` as an elastic, fault-tolerant job; see the module docstring.

    ``loss``: ``fn(model, batch)`` or a built-in name (``cross_entropy``, ``mse`` for (input,
    target) items). ``optimizer``: ``fn(parameters) -> Optimizer`` (default: the config's ``optim``
    section). ``metrics``: built-in names and ``fn(model, batch) -> {name: values [B]}``.
    ``schedule``: ``fn(optimizer, total_steps) -> LRScheduler`` (default: the config's ``schedule``).
    ``compile``: ``torch.compile`` the forward pass (default: the config's ``model.compile``). A model the script
    compiled itself (``torch.compile(model)``) is trained through its compiled wrapper, with the script's options,
    and saved as the plain model: snapshots load with or without compiling.
    ``parallel``: how the model is spread over the ranks (default: the config's ``parallel`` section): ``"ddp"``,
    ``"fsdp"``, ``"hsdp"``, or the section as a mapping, e.g. ``{"strategy": "fsdp", "wrap": ["Block"]}``. Under
    fsdp/hsdp pass ``optimizer`` as a function of the parameters (it is called with this rank's shards).
    """
    from .observe.logs import say
    from .env import EnvError, WorkerEnv
    from .lifecycle import EXIT_USAGE
    from .worker.process import run

    try:
        cfg = config if isinstance(config, Config) else load_config(config, list(overrides))
        env = WorkerEnv.from_environ()
        builtin_loss = loss if isinstance(loss, str) else None
        if builtin_loss is not None:
            cfg.model.loss = builtin_loss
            cfg.model.validate()
        if metrics is not None:
            cfg.eval.metrics = [m for m in metrics if isinstance(m, str)] or ["loss"]
            cfg.eval.validate()
        model, compiled = unwrap_compiled(model)
        if compile is not None:
            if not isinstance(compile, bool):
                raise ConfigError("fit(compile=...)", f"got {compile!r}", "Pass compile=True or compile=False")
            cfg.model.compile = compile
        if parallel is not None:
            cfg.parallel = parallel_section(parallel)
        if compiled is not None and compile is False:
            raise ConfigError("fit(compile=False)", "the model passed is compiled already (torch.compile)",
                              "Pass the plain model, or leave compile out")
    except (ConfigError, EnvError) as exc:
        say(f"elastic_runner: config error: {exc}")
        return EXIT_USAGE
    cfg.data.name = f"(script) {type(train_data).__qualname__}"
    cfg.model.name = f"(script) {type(model).__qualname__}"

    def make_workload() -> Any:
        from .workload.optim import build_optimizer, build_schedule
        from .workload.spec import Workload, identity_of
        from .workload.tasks import build_task

        fns = {getattr(m, "__qualname__", f"metric{i}"): m for i, m in enumerate(metrics or ()) if callable(m)}
        task = build_task(cfg.model, cfg.eval, loss=None if builtin_loss else loss,  # type: ignore[arg-type]
                          metric_fns=fns)  # type: ignore[arg-type]

        def make_optimizer(params: Iterable[nn.Parameter], lr_scale: float) -> torch.optim.Optimizer:
            if optimizer is None:
                return build_optimizer(cfg.optim, params, lr_scale)
            built = optimizer(params)
            if not isinstance(built, torch.optim.Optimizer):
                raise ConfigError("fit(optimizer=...)", f"returned {type(built).__name__}, not a torch.optim.Optimizer",
                                  "Pass a function parameters -> optimizer, e.g. lambda p: torch.optim.AdamW(p, lr=3e-4)")
            for group in built.param_groups:
                group["lr"] *= lr_scale
            return built

        def make_schedule(opt: torch.optim.Optimizer, total_steps: int) -> Any:
            return schedule(opt, total_steps) if schedule is not None else build_schedule(cfg.schedule, opt, total_steps)

        probe = optimizer([nn.Parameter(torch.zeros(1))]) if optimizer is not None else None
        return Workload(train=train_data, test=eval_data, model=model, task=task, make_optimizer=make_optimizer,
                        make_schedule=make_schedule, description=f"{type(train_data).__qualname__} "
                        f"({len(train_data)} samples)", collate=collate, identity=identity_of(model, train_data, probe),
                        compiled=compiled)

    return run(cfg, env, make_workload=make_workload)


def parallel_section(parallel: str | Mapping[str, Any]) -> ParallelConfig:
    """``fit(parallel=...)`` as the config's section, validated (a ConfigError naming ``fit(parallel=...)``)."""
    fields = {"strategy": parallel} if isinstance(parallel, str) else dict(parallel) if isinstance(parallel, Mapping) else None
    known = {f.name for f in dataclasses.fields(ParallelConfig)}
    if fields is None or not set(fields) <= known:
        raise ConfigError("fit(parallel=...)", f"got {parallel!r}",
                          f"Pass 'ddp', 'fsdp', 'hsdp', or a mapping of {', '.join(sorted(known))}")
    section = ParallelConfig(**fields)
    try:
        section.validate()
    except ConfigError as exc:
        raise ConfigError("fit(parallel=...)", str(exc), "See the parallel section of the configuration reference") from exc
    return section


def _built_to_fit(model_cfg: Any, build: dict[str, Any], weights: dict[str, Any], name: str) -> nn.Module:
    """The model a snapshot's config describes, built only once its shapes are seen to be those of the snapshot's
    weights: built first on the meta device (no memory), so that parameters read from the run directory (an
    unsigned snapshot's ``n_embd: 10**6``) cannot make this process allocate what the weights do not hold."""
    from .workload.models import build_model

    with torch.device("meta"):
        probe = build_model(model_cfg, **build)
    wanted = {k: tuple(v.shape) for k, v in unwrap_compiled(probe)[0].state_dict().items()}
    held = {k: tuple(v.shape) for k, v in without_compile_prefix(weights).items() if isinstance(v, torch.Tensor)}
    if wanted != held:
        differ = sorted(k for k in wanted.keys() | held.keys() if wanted.get(k) != held.get(k))[:3]
        raise ConfigError("load_model", f"the model {name}'s config describes does not have the shapes of its weights "
                          f"({', '.join(f'{k}: {wanted.get(k)} vs {held.get(k)}' for k in differ)})",
                          "The snapshot was changed or damaged; export another snapshot, or build the model and pass it")
    return build_model(model_cfg, **build)


def load_model(run_dir: str | os.PathLike[str], model: nn.Module | None = None, *,
               map_location: str | torch.device = "cpu", snapshot: str | None = None,
               trust_import_path: str | None = None) -> nn.Module:
    """The model of a run with the weights of its newest intact snapshot (or ``snapshot``), in eval mode.

    Without ``model`` a *built-in* model (``mlp``, ``cnn``, ``gpt``) is rebuilt from the snapshot's own config
    (for ``gpt`` with the vocabulary and block size the data had). Nothing read from a run directory chooses code
    to run: a model named by an import path is built only when the caller names that same path as one they trust
    (``trust_import_path="mypkg.models:Net"``, imported with the working directory on ``sys.path`` for the call
    only); otherwise build it yourself and pass it (``load_model(run_dir, Net())``), as for a script's own model.
    """
    from .config import config_from_dict
    from .config.imports import working_directory_on_path
    from .snapshot.cli import load_for_export
    from .snapshot.format import signing_key, signing_key_from_environment
    from .workload.models import BUILTIN

    with signing_key(signing_key_from_environment()):  # with the job's key: only snapshots signed with it
        ref, meta, state = load_for_export(str(run_dir), snapshot, map_location=map_location)
    if model is None:
        cfg = config_from_dict(meta.get("config", {}))
        build = meta.get("model_build")
        name = cfg.model.name
        if not build or name.startswith("(script)"):
            raise ConfigError("load_model", f"{ref.name} was trained from a script's own model ({name})",
                              "Build that model and pass it: load_model(run_dir, model)")
        if name in BUILTIN or name == "gpt":
            model = _built_to_fit(cfg.model, build, state["model"], ref.name)
        elif trust_import_path is not None and trust_import_path == name:
            with working_directory_on_path():
                model = _built_to_fit(cfg.model, build, state["model"], ref.name)
        else:
            offered = f" (you named {trust_import_path!r})" if trust_import_path is not None else ""
            raise ConfigError("load_model", f"{ref.name} names its model by an import path, read from the run "
                              f"directory{offered}, and a snapshot never chooses code to run",
                              "Build the model yourself and pass it: load_model(run_dir, model); or, for a model "
                              "class you wrote, pass the import path as you know it: load_model(run_dir, "
                              "trust_import_path='package.module:Class')")
    plain, _ = unwrap_compiled(model)
    try:
        plain.load_state_dict(without_compile_prefix(state["model"]))
    except RuntimeError as exc:
        raise ConfigError("load_model", f"the weights of {ref.name} do not fit this model: "
                          f"{str(exc).splitlines()[0]}", "Pass the model the run trained") from exc
    return model.to(map_location).eval()
