"""The configuration's sections: one dataclass each, every field with its ``help`` text and
every section with a ``validate()`` that says what to set instead of a bad value.

The README's config reference is generated from these fields (``elastic-runner config --docs``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

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

        def kept(section: str) -> dict[str, Any]:
            return {k: v for k, v in d[section].items() if k not in RESUME_FREE.get(section, ())}

        parts = {
            "model": d["model"],
            "data": kept("data") | {"seed": d["run"]["seed"]},
            "optim": {"optim": d["optim"], "schedule": d["schedule"], "batch": kept("batch")},
        }
        return {
            name: hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]
            for name, value in parts.items()
        }


SECTIONS: dict[str, type] = typing.get_type_hints(Config)

#: Keys of the fingerprinted sections that may change between attempts of one run: they change
#: speed or memory use, not the mathematics (the data order, the gradient, the model).
RESUME_FREE: dict[str, frozenset[str]] = {
    "data": frozenset({"num_workers", "eval_batch_size"}),
    "batch": frozenset({"micro_size", "uneven"}),
}


def resume_free_keys() -> frozenset[str]:
    """:data:`RESUME_FREE` as dotted keys (``data.num_workers`` ...)."""
    return frozenset(f"{section}.{key}" for section, keys in RESUME_FREE.items() for key in keys)


