"""Typed run configuration: YAML file < ``--set`` overrides < validation.

Every section is a dataclass whose fields carry a ``help`` string (the README's
config reference is generated from them, see ``elastic-runner config --docs``).
Loading never raises a traceback at the user: every problem becomes one
:class:`ConfigError` line that names where the value came from (the file or
the ``--set`` flag), the dotted key, what is wrong, and what to set instead.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

IMPORT_PATH_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


class ConfigError(ValueError):
    """A configuration problem, phrased as one line the user can act on."""

    def __init__(self, key: str, problem: str, fix: str, source: str = "") -> None:
        self.key = key
        self.problem = problem
        self.fix = fix
        self.source = source
        super().__init__(self._render())

    def _render(self) -> str:
        where = f"{self.source}: " if self.source else ""
        return f"{where}{self.key}: {self.problem}. {self.fix}"

    def with_source(self, source: str) -> "ConfigError":
        return ConfigError(self.key, self.problem, self.fix, source)


def _help(text: str, **kwargs: Any) -> Any:
    return field(metadata={"help": text}, **kwargs)


def is_import_path(value: str) -> bool:
    """True for ``package.module:callable`` references (user components)."""
    return bool(IMPORT_PATH_RE.match(value))


# --------------------------------------------------------------------------- sections


@dataclass
class RunConfig:
    dir: str = _help(
        "Directory for everything the run writes: snapshots, audit trail, event log, "
        "effective config. Shared by all nodes (a shared filesystem or PVC in production).",
        default="runs/default",
    )
    seed: int = _help("Seed for model init, data order and per-step randomness.", default=0)
    deterministic: bool = _help(
        "Use deterministic algorithms (torch.use_deterministic_algorithms, cuDNN "
        "deterministic). Needed for bitwise-reproducible GPU runs; slower.",
        default=False,
    )

    def validate(self) -> None:
        if not self.dir.strip():
            raise ConfigError("run.dir", "is empty", "Set run.dir to a directory path, e.g. runs/exp1")


@dataclass
class DataConfig:
    name: str = _help(
        "Dataset: digits (8x8 handwritten digits shipped with the package), synthetic, "
        "image_folder, cifar10, or an import path 'package.module:callable' returning "
        "a (train, test) pair or a train dataset.",
        default="digits",
    )
    path: str | None = _help(
        "Dataset directory (required for image_folder and cifar10).", default=None
    )
    params: dict[str, Any] = _help(
        "Keyword arguments for the dataset builder (synthetic: size, shape, num_classes, "
        "test_size; import paths: anything the callable accepts).",
        default_factory=dict,
    )
    test_fraction: float = _help(
        "Share of the digits dataset held out for evaluation.", default=0.2
    )
    shuffle: bool = _help("Shuffle the sample order every epoch (seeded).", default=True)
    partial_batch: Literal["drop", "partial"] = _help(
        "Last global batch of an epoch when the dataset size is not a multiple of "
        "batch.global_size: drop (skip those samples this epoch) or partial (one smaller "
        "step; the loss is still the exact mean over its samples). Samples are never repeated.",
        default="drop",
    )
    num_workers: int = _help(
        "DataLoader worker processes for file-backed datasets (in-memory datasets ignore it).",
        default=0,
    )
    eval_batch_size: int = _help("Per-rank batch size for evaluation.", default=256)
    sampler: str = _help(
        "Sample order: 'elastic' (exactly-once across restarts and world sizes) or an "
        "import path to a class with the same interface (for experiments and tests).",
        default="elastic",
    )

    def validate(self) -> None:
        builtin = {"digits", "synthetic", "image_folder", "cifar10"}
        if self.name not in builtin and not is_import_path(self.name):
            raise ConfigError(
                "data.name",
                f"unknown dataset {self.name!r}",
                f"Use one of {sorted(builtin)} or an import path like 'mypkg.data:build'",
            )
        if self.name in {"image_folder", "cifar10"}:
            if not self.path:
                raise ConfigError(
                    "data.path", f"is required for data.name={self.name}",
                    "Set data.path to the dataset directory",
                )
            if not Path(self.path).is_dir():
                raise ConfigError(
                    "data.path", f"directory {self.path!r} does not exist",
                    "Point data.path at an existing dataset directory",
                )
        if not 0.0 < self.test_fraction < 1.0:
            raise ConfigError(
                "data.test_fraction", f"got {self.test_fraction}, must be between 0 and 1",
                "Set data.test_fraction to e.g. 0.2",
            )
        if self.num_workers < 0:
            raise ConfigError(
                "data.num_workers", f"got {self.num_workers}, must be >= 0",
                "Set data.num_workers to 0 (load in the training process) or a positive count",
            )
        if self.eval_batch_size <= 0:
            raise ConfigError(
                "data.eval_batch_size", f"got {self.eval_batch_size}, must be positive",
                "Set data.eval_batch_size to e.g. 256",
            )
        if self.sampler != "elastic" and not is_import_path(self.sampler):
            raise ConfigError(
                "data.sampler", f"got {self.sampler!r}",
                "Use 'elastic' or an import path like 'mypkg.sampling:MySampler'",
            )


@dataclass
class ModelConfig:
    name: str = _help(
        "Model: mlp, cnn, or an import path such as 'torchvision.models:resnet18'.",
        default="cnn",
    )
    params: dict[str, Any] = _help(
        "Keyword arguments for the model constructor (mlp: hidden, depth, dropout; "
        "cnn: channels, hidden, dropout).",
        default_factory=dict,
    )
    loss: Literal["cross_entropy", "mse"] = _help(
        "Per-sample training loss.", default="cross_entropy"
    )

    def validate(self) -> None:
        if self.name not in {"mlp", "cnn"} and not is_import_path(self.name):
            raise ConfigError(
                "model.name", f"unknown model {self.name!r}",
                "Use mlp, cnn or an import path like 'torchvision.models:resnet18'",
            )


@dataclass
class OptimConfig:
    name: str = _help(
        "Optimizer: sgd, adamw, or an import path to a torch.optim.Optimizer subclass.",
        default="sgd",
    )
    lr: float = _help("Learning rate (peak rate when a warm-up schedule is used).", default=0.1)
    momentum: float = _help("SGD momentum.", default=0.9)
    weight_decay: float = _help("Weight decay.", default=0.0)
    params: dict[str, Any] = _help(
        "Extra keyword arguments for the optimizer (e.g. betas for adamw).",
        default_factory=dict,
    )
    grad_clip_norm: float | None = _help(
        "Clip the global gradient norm to this value before each step (null: off).",
        default=None,
    )

    def validate(self) -> None:
        if self.name not in {"sgd", "adamw"} and not is_import_path(self.name):
            raise ConfigError(
                "optim.name", f"unknown optimizer {self.name!r}",
                "Use sgd, adamw or an import path like 'torch.optim:RMSprop'",
            )
        if not self.lr > 0:
            raise ConfigError("optim.lr", f"got {self.lr}, must be positive", "Set optim.lr to e.g. 0.1")
        if self.momentum < 0:
            raise ConfigError("optim.momentum", f"got {self.momentum}, must be >= 0", "Set optim.momentum to e.g. 0.9")
        if self.weight_decay < 0:
            raise ConfigError(
                "optim.weight_decay", f"got {self.weight_decay}, must be >= 0", "Set optim.weight_decay to e.g. 0.0001"
            )
        if self.grad_clip_norm is not None and not self.grad_clip_norm > 0:
            raise ConfigError(
                "optim.grad_clip_norm", f"got {self.grad_clip_norm}, must be positive",
                "Set optim.grad_clip_norm to e.g. 1.0, or null to disable clipping",
            )


@dataclass
class ScheduleConfig:
    name: str = _help(
        "Learning-rate schedule: constant, step, cosine, or an import path to a callable "
        "(optimizer, total_steps, **params) -> LRScheduler.",
        default="constant",
    )
    warmup_steps: int = _help("Linear warm-up from 0 over this many steps.", default=0)
    step_size: int = _help("step: multiply the rate by gamma every step_size steps.", default=100)
    gamma: float = _help("step: decay factor.", default=0.1)
    min_lr_ratio: float = _help("cosine: final rate as a fraction of optim.lr.", default=0.0)
    params: dict[str, Any] = _help("Extra keyword arguments for an import-path schedule.", default_factory=dict)

    def validate(self) -> None:
        if self.name not in {"constant", "step", "cosine"} and not is_import_path(self.name):
            raise ConfigError(
                "schedule.name", f"unknown schedule {self.name!r}",
                "Use constant, step, cosine or an import path like 'mypkg.sched:build'",
            )
        if self.warmup_steps < 0:
            raise ConfigError("schedule.warmup_steps", f"got {self.warmup_steps}, must be >= 0", "Set it to 0 for no warm-up")
        if self.step_size <= 0:
            raise ConfigError("schedule.step_size", f"got {self.step_size}, must be positive", "Set schedule.step_size to e.g. 100")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError("schedule.min_lr_ratio", f"got {self.min_lr_ratio}, must be in [0, 1]", "Set it to e.g. 0.0")


@dataclass
class BatchConfig:
    global_size: int | None = _help(
        "Samples per optimizer step across all ranks. Kept constant when the world size "
        "changes: each rank takes its share and the loss is normalised by this size, so "
        "the gradient does not depend on the world size.",
        default=64,
    )
    per_rank_size: int | None = _help(
        "Alternative policy: samples per rank per step (the global batch then grows with "
        "the world size). Set global_size to null to use it.",
        default=None,
    )
    micro_size: int | None = _help(
        "Largest micro-batch one rank processes at once (memory bound). A larger share is "
        "split into gradient-accumulation micro-steps. null: no limit.",
        default=None,
    )
    scale_lr: Literal["none", "linear"] = _help(
        "With per_rank_size: 'linear' multiplies optim.lr by the world size "
        "(optim.lr is then the rate for one rank).",
        default="none",
    )
    uneven: Literal["weighted", "refuse"] = _help(
        "When the world size does not divide global_size: 'weighted' lets shares differ by "
        "one sample (the gradient is still the exact global mean); 'refuse' stops with the "
        "list of world sizes that divide it (use with batch-norm models).",
        default="weighted",
    )

    def validate(self) -> None:
        if (self.global_size is None) == (self.per_rank_size is None):
            raise ConfigError(
                "batch", "exactly one of batch.global_size and batch.per_rank_size must be set",
                "Set batch.global_size (constant optimisation, recommended) and batch.per_rank_size: null, or the reverse",
            )
        for key in ("global_size", "per_rank_size", "micro_size"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise ConfigError(
                    f"batch.{key}", f"got {value}, must be a positive integer",
                    f"Set batch.{key} to e.g. 64" + (" or null" if key != "global_size" else ""),
                )
        if self.scale_lr == "linear" and self.per_rank_size is None:
            raise ConfigError(
                "batch.scale_lr", "'linear' only applies with batch.per_rank_size",
                "Set batch.scale_lr: none, or use batch.per_rank_size",
            )


@dataclass
class TrainConfig:
    max_steps: int | None = _help("Stop after this many optimizer steps (counted from 1).", default=None)
    epochs: int | None = _help("Stop after this many epochs. With max_steps, whichever comes first.", default=None)
    eval_every_steps: int = _help("Evaluate on the test split every N steps (0: only at the end).", default=0)
    precision: Literal["fp32", "bf16", "fp16"] = _help(
        "Autocast dtype for forward passes. fp16 needs a GPU and uses a gradient scaler "
        "(saved in snapshots); bf16 works on CPU and recent GPUs.",
        default="fp32",
    )

    def validate(self) -> None:
        if self.max_steps is None and self.epochs is None:
            raise ConfigError(
                "train", "neither train.max_steps nor train.epochs is set",
                "Set train.epochs (e.g. 10) and/or train.max_steps (e.g. 1000)",
            )
        for key in ("max_steps", "epochs"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise ConfigError(f"train.{key}", f"got {value}, must be a positive integer", f"Set train.{key} to e.g. 10, or null")
        if self.eval_every_steps < 0:
            raise ConfigError("train.eval_every_steps", f"got {self.eval_every_steps}, must be >= 0", "Set it to 0 to evaluate only at the end")


@dataclass
class SnapshotConfig:
    every_steps: int = _help("Write a durable snapshot every N steps (0: off).", default=50)
    every_seconds: float = _help("Also write one when this many seconds passed since the last (0: off).", default=0.0)
    keep_last: int = _help("Complete snapshots to keep; older ones are deleted once a newer one is complete.", default=3)
    dir: str | None = _help("Where snapshots live (default: RUN_DIR/snapshots).", default=None)
    async_write: bool = _help(
        "Serialise and write in a background thread; the step only waits for the copy "
        "into host memory. At most one write is in flight.",
        default=True,
    )
    verify: bool = _help("Check each snapshot's SHA-256 before loading it.", default=True)
    allow_mismatch: bool = _help(
        "Resume even if the snapshot was written for a different model/data/optimizer "
        "config (e.g. to fine-tune). The differing keys are logged.",
        default=False,
    )
    in_memory: bool = _help(
        "When an attempt ends (a peer failed, torchrun restarts the group, SIGTERM), every "
        "surviving node keeps its newest step in shared memory (/dev/shm); the next start "
        "takes the newest step any node holds, so a failure with a survivor loses at most "
        "one step. Costs nothing during training.",
        default=True,
    )

    def validate(self) -> None:
        if self.every_steps < 0:
            raise ConfigError("snapshot.every_steps", f"got {self.every_steps}, must be >= 0", "Set it to e.g. 50, or 0 to disable")
        if self.every_seconds < 0:
            raise ConfigError("snapshot.every_seconds", f"got {self.every_seconds}, must be >= 0", "Set it to e.g. 300, or 0 to disable")
        if self.keep_last < 1:
            raise ConfigError("snapshot.keep_last", f"got {self.keep_last}, must be >= 1", "Set snapshot.keep_last to e.g. 3")


@dataclass
class AuditConfig:
    samples: bool = _help(
        "Append one JSON line per rank per step with the dataset indices it consumed "
        "(RUN_DIR/audit/); 'elastic-runner audit RUN_DIR' checks exactly-once delivery.",
        default=False,
    )


@dataclass
class MetricsConfig:
    port: int = _help(
        "Serve Prometheus /metrics on port + LOCAL_RANK (0: off).", default=0
    )
    bind: str = _help(
        "Address to bind: 'auto' is all interfaces inside Kubernetes (KUBERNETES_SERVICE_HOST "
        "set) and 127.0.0.1 elsewhere.",
        default="auto",
    )

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError("metrics.port", f"got {self.port}, must be 0..65535", "Set metrics.port to e.g. 9400, or 0 to disable")


@dataclass
class LoggingConfig:
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = _help("Log level.", default="INFO")
    every_steps: int = _help("One progress line every N steps.", default=10)
    format: Literal["text", "json"] = _help("Progress line format.", default="text")
    progress_bar: Literal["auto", "on", "off"] = _help(
        "Progress bar on rank 0: auto shows it only when stdout is a terminal.", default="auto"
    )

    def validate(self) -> None:
        if self.every_steps <= 0:
            raise ConfigError("logging.every_steps", f"got {self.every_steps}, must be positive", "Set logging.every_steps to e.g. 10")


@dataclass
class DistConfig:
    backend: Literal["auto", "gloo", "nccl"] = _help(
        "Process-group backend: auto picks nccl when the device is a GPU, gloo otherwise.",
        default="auto",
    )
    device: Literal["auto", "cpu", "cuda"] = _help(
        "auto: cuda:LOCAL_RANK when CUDA is available, else cpu.", default="auto"
    )
    timeout_seconds: float = _help("Timeout of one collective operation.", default=300.0)
    init_timeout_seconds: float = _help(
        "Process-group creation plus the first collective must finish within this time "
        "after a (re)start, or the attempt ends with a clear error instead of hanging.",
        default=30.0,
    )
    heartbeat_seconds: float = _help(
        "A peer whose heartbeat stops for this long (dead node, SIGSTOP, wedged process) "
        "ends the attempt on every rank, also with NCCL whose own timeout is minutes. 0: off.",
        default=5.0,
    )

    def validate(self) -> None:
        if self.heartbeat_seconds < 0:
            raise ConfigError("dist.heartbeat_seconds", f"got {self.heartbeat_seconds}, must be >= 0", "Set it to e.g. 5, or 0 to disable")
        for key in ("timeout_seconds", "init_timeout_seconds"):
            value = getattr(self, key)
            if not value > 0:
                raise ConfigError(f"dist.{key}", f"got {value}, must be positive", f"Set dist.{key} to e.g. 30")


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    snapshot: SnapshotConfig = field(default_factory=SnapshotConfig)
    audit: AuditConfig = field(default_factory=AuditConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    dist: DistConfig = field(default_factory=DistConfig)

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            validate = getattr(section, "validate", None)
            if validate is not None:
                validate()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def snapshot_dir(self) -> str:
        return self.snapshot.dir or os.path.join(self.run.dir, "snapshots")

    def fingerprint(self) -> dict[str, str]:
        """Hashes of the parts a snapshot must agree with to be resumed exactly.

        Split in three so a mismatch can say *what* changed: the model
        architecture, the data (order and content), the optimisation contract.
        Run length (max_steps, epochs), logging, snapshot cadence and metrics may
        change between restarts freely.
        """
        d = self.to_dict()
        parts = {
            "model": d["model"],
            "data": {k: v for k, v in d["data"].items() if k not in {"num_workers", "eval_batch_size"}}
            | {"seed": d["run"]["seed"]},
            # micro_size and the uneven policy change memory use, not the mathematics
            "optim": {"optim": d["optim"], "schedule": d["schedule"],
                      "batch": {k: v for k, v in d["batch"].items() if k not in {"micro_size", "uneven"}}},
        }
        return {
            name: hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]
            for name, value in parts.items()
        }


SECTIONS: dict[str, type] = typing.get_type_hints(Config)


# --------------------------------------------------------------------------- loading


def _resolve_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin is dict:
        return "mapping"
    if origin is list:
        return "list"
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
    return names.get(tp, getattr(tp, "__name__", str(tp)))


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; convert where lossless."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        concrete = [a for a in args if a is not type(None)]
        nullable = len(concrete) < len(args)
        if len(concrete) == 1:
            try:
                return coerce(value, concrete[0], key)
            except ConfigError as exc:
                if not nullable:
                    raise
                raise ConfigError(key, exc.problem + " or null", exc.fix + " (or null)") from None
        for arg in concrete:
            try:
                return coerce(value, arg, key)
            except ConfigError:
                continue
        raise ConfigError(key, f"got {value!r}, expected {_type_name(tp)}", f"Set {key} to {_type_name(tp)}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value in allowed:
            return value
        raise ConfigError(key, f"got {value!r}, expected one of {', '.join(map(str, allowed))}", f"Set {key} to one of {list(allowed)}")
    if origin is dict:
        if isinstance(value, dict):
            return dict(value)
        raise ConfigError(key, f"got {value!r}, expected a mapping", f"Write {key} as a YAML mapping, e.g. {{key: value}}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(key, f"got {value!r}, expected true or false", f"Set {key} to true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(key, f"got {value!r}, expected an integer", f"Set {key} to a whole number")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(key, f"got {value!r}, expected a number", f"Set {key} to a number")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(key, f"got {value!r}, expected a string", f"Set {key} to a string")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(key, f"got {value!r}, expected null", f"Set {key} to null")
    raise TypeError(f"unsupported config annotation {tp!r} for {key}")


def _suggest(name: str, choices: list[str]) -> str:
    import difflib

    close = difflib.get_close_matches(name, choices, n=1)
    return f"Did you mean {close[0]!r}? " if close else ""


def _apply(config: Config, key: str, value: Any, source: str) -> None:
    parts = key.split(".")
    if len(parts) == 1:
        if parts[0] not in SECTIONS:
            raise ConfigError(
                key, "unknown section",
                f"{_suggest(parts[0], list(SECTIONS))}Valid sections: {', '.join(SECTIONS)}", source,
            )
        raise ConfigError(key, "is a section, not a value", f"Set a key inside it, e.g. {key}.{dataclasses.fields(SECTIONS[key])[0].name}", source)
    section_name = parts[0]
    if section_name not in SECTIONS:
        raise ConfigError(
            key, f"unknown section {section_name!r}",
            f"{_suggest(section_name, list(SECTIONS))}Valid sections: {', '.join(SECTIONS)}", source,
        )
    section = getattr(config, section_name)
    hints = _resolve_hints(type(section))
    top_field = parts[1]
    if top_field not in hints:
        raise ConfigError(
            key, "unknown key",
            f"{_suggest(top_field, list(hints))}Valid keys in {section_name}: {', '.join(hints)}", source,
        )
    tp = hints[top_field]
    if len(parts) > 2:
        # Dotted override inside a free-form mapping, e.g. --set model.params.hidden=64.
        if typing.get_origin(tp) is not dict:
            raise ConfigError(key, f"{section_name}.{top_field} is not a mapping", f"Set {section_name}.{top_field} directly", source)
        target = getattr(section, top_field)
        for part in parts[2:-1]:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise ConfigError(key, f"{part} is not a mapping", "Override the enclosing key instead", source)
        target[parts[-1]] = value
        return
    try:
        setattr(section, top_field, coerce(value, tp, key))
    except ConfigError as exc:
        raise exc.with_source(source) from None


def _flatten(data: dict[str, Any], source: str) -> list[tuple[str, Any]]:
    items: list[tuple[str, Any]] = []
    for section_name, body in data.items():
        if not isinstance(section_name, str):
            raise ConfigError(str(section_name), "section names must be strings", "Use e.g. 'run:'", source)
        if section_name not in SECTIONS:
            raise ConfigError(
                section_name, "unknown section",
                f"{_suggest(section_name, list(SECTIONS))}Valid sections: {', '.join(SECTIONS)}", source,
            )
        if body is None:
            continue
        if not isinstance(body, dict):
            raise ConfigError(section_name, f"got {body!r}, expected a mapping of keys", f"Write {section_name}: followed by indented key: value lines", source)
        for key, value in body.items():
            items.append((f"{section_name}.{key}", value))
    return items


def parse_override(text: str) -> tuple[str, Any]:
    """``a.b=c`` → ("a.b", parsed c). Values are parsed as YAML scalars/flow."""
    if "=" not in text:
        raise ConfigError(text, "override has no '='", "Write overrides as --set section.key=value, e.g. --set optim.lr=0.05", f"--set {text}")
    key, raw = text.split("=", 1)
    key = key.strip()
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(key, f"cannot parse value {raw!r}: {exc.problem}", "Quote the value or fix its YAML syntax", f"--set {text}") from exc
    return key, value


def load_config(path: str | os.PathLike[str] | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults < YAML file < ``--set`` overrides, then validation.

    Raises :class:`ConfigError` (one line, with the source) on any problem.
    """
    config = Config()
    sources: dict[str, str] = {}
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text()
        except FileNotFoundError as exc:
            raise ConfigError("--config", f"file {source!r} not found", "Pass an existing YAML file, e.g. configs/quickstart.yaml") from exc
        except OSError as exc:
            raise ConfigError("--config", f"cannot read {source!r}: {exc.strerror}", "Check the path and its permissions") from exc
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise ConfigError("(file)", f"invalid YAML{where}: {getattr(exc, 'problem', exc)}", "Fix the YAML syntax", source) from exc
        if not isinstance(data, dict):
            raise ConfigError("(file)", "top level must be a mapping of sections", "Start the file with e.g. 'run:'", source)
        for key, value in _flatten(data, source):
            _apply(config, key, value, source)
            sources[key] = source
    for text in overrides:
        key, value = parse_override(text)
        _apply(config, key, value, f"--set {text}")
        sources[key] = f"--set {text}"
    try:
        config.validate()
    except ConfigError as exc:
        origin = sources.get(exc.key) or next(
            (src for k, src in sources.items() if k.startswith(exc.key + ".")), "defaults"
        )
        raise exc.with_source(origin) from None
    return config


def config_from_dict(data: dict[str, Any]) -> Config:
    """Rebuild a :class:`Config` from :meth:`Config.to_dict` output (e.g. a snapshot)."""
    config = Config()
    for key, value in _flatten(data, "(snapshot)"):
        _apply(config, key, value, "(snapshot)")
    return config


def dump_yaml(config: Config) -> str:
    return yaml.safe_dump(config.to_dict(), sort_keys=False)


def write_effective_config(config: Config, run_dir: str) -> Path:
    """Write the config the run actually uses (atomic replace)."""
    target = Path(run_dir) / "config.yaml"
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".config.yaml.{os.getpid()}.tmp")
    tmp.write_text("# effective configuration (defaults < file < --set)\n" + dump_yaml(config))
    os.replace(tmp, target)
    return target


def reference_markdown() -> str:
    """The config reference table for the README, generated from the field docs."""
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for section_name, cls in SECTIONS.items():
        hints = _resolve_hints(cls)
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                default = f.default
            else:
                default = f.default_factory()  # type: ignore[misc]
            shown = yaml.safe_dump(default, default_flow_style=True).strip().removesuffix("...").strip()
            lines.append(
                f"| `{section_name}.{f.name}` | {_type_name(hints[f.name])} | `{shown}` | {f.metadata.get('help', '')} |"
            )
    return "\n".join(lines)


def diff_configs(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two config dicts."""
    keys: list[str] = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        dotted = f"{prefix}{k}"
        if isinstance(va, dict) and isinstance(vb, dict) and prefix.count(".") < 1:
            keys.extend(diff_configs(va, vb, dotted + "."))
        elif va != vb:
            keys.append(dotted)
    return keys
