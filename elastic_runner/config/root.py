"""The whole configuration: its sections, the fingerprint a snapshot must match, and which keys
may change between attempts of one run."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import typing
from dataclasses import dataclass, field
from typing import Any

from .base import ConfigError, is_import_path
from .operations import (
    AuditConfig,
    DistConfig,
    LoggingConfig,
    MetricsConfig,
    ParallelConfig,
    RecoveryConfig,
    SnapshotConfig,
)
from .training import (
    BUILTIN_LOSSES,
    BUILTIN_METRICS,
    BatchConfig,
    DataConfig,
    EvalConfig,
    ModelConfig,
    OptimConfig,
    RunConfig,
    ScheduleConfig,
    TrainConfig,
)

__all__ = [
    "BUILTIN_LOSSES", "BUILTIN_METRICS", "AuditConfig", "BatchConfig", "Config", "EvalConfig", "ConfigError", "DataConfig", "DistConfig", "LoggingConfig",
    "MetricsConfig", "ModelConfig", "OptimConfig", "ParallelConfig", "RecoveryConfig", "RESUME_FREE", "RunConfig", "SECTIONS", "ScheduleConfig",
    "SnapshotConfig", "TrainConfig", "is_import_path", "resume_free_keys",
]


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    snapshot: SnapshotConfig = field(default_factory=SnapshotConfig)
    audit: AuditConfig = field(default_factory=AuditConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            validate = getattr(section, "validate", None)
            if validate is not None:
                validate()
        if self.data.sources is not None and len(self.data.sources) > 1 and self.train.epochs is not None:
            raise ConfigError("train.epochs", "cannot say how long a mixture trains: each of data.sources runs its "
                              "own epochs, at its own weight", "Set train.max_steps instead (and train.epochs: null)")
        if self.data.sources is not None and self.data.sampler != "elastic":
            raise ConfigError("data.sampler", "applies to data.name's datasets: data.sources are sampled by their "
                              "mixture", "Remove data.sampler")
        if self.recovery.regroup == "reconfigure" and self.parallel.sharded:
            raise ConfigError("recovery.regroup", f"reconfigure is for replicated models, and parallel.strategy is "
                              f"{self.parallel.strategy} (its device mesh's groups are made anew with the model)",
                              "Use auto or recreate")

        if self.recovery.evict_stragglers and not (self.parallel.strategy == "ddp"
                                                   and self.dist.gradient_sync == "ordered"):
            raise ConfigError("recovery.evict_stragglers", f"needs ranks that can be named stragglers, and under "
                              f"parallel.strategy {self.parallel.strategy} with dist.gradient_sync "
                              f"{self.dist.gradient_sync} a slow rank cannot be told from one that waits for it",
                              "Use parallel.strategy: ddp with dist.gradient_sync: ordered, or set it to false")

        every = self.recovery.fingerprint_every_steps
        if isinstance(every, int) and not isinstance(every, bool) and not self.replicas_bitwise:
            why = ("under dist.gradient_sync: ddp, replicas are not bitwise identical across restarts (torch's "
                   "reducer sums in its own bucket order), so a difference would name a healthy rank"
                   if self.parallel.strategy == "ddp" else
                   "fsdp's shards have no replica to compare with (each rank holds the only copy of its shard)")
            raise ConfigError("recovery.fingerprint_every_steps", f"got {every}: {why}",
                              "Use parallel.strategy: ddp with dist.gradient_sync: ordered or hsdp (its shards' "
                              "replicas on the other nodes are compared), or set it to auto or null")

    @property
    def replicas_bitwise(self) -> bool:
        """Whether replicas are bitwise the same after every step (what fingerprints compare): every rank's whole
        state under ddp with the ordered sum; under hsdp each shard and its copies on the other nodes (one all-reduce
        across the nodes gives every copy the same gradient, and the same update follows)."""
        return (self.parallel.strategy == "ddp" and self.dist.gradient_sync == "ordered") or \
            self.parallel.strategy == "hsdp"

    @property
    def fingerprints(self) -> bool:
        """Whether replicas' fingerprints are compared (``recovery.fingerprint_every_steps``)."""
        return self.recovery.fingerprint_every_steps is not None and self.replicas_bitwise

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def in_process(self) -> bool:
        """Whether a recovery keeps the workers' processes: ``recovery.in_process``, where auto means a replicated
        model."""
        wanted = self.recovery.in_process
        return not self.parallel.sharded if wanted == "auto" else bool(wanted)

    @property
    def snapshot_dir(self) -> str:
        return self.snapshot.dir or os.path.join(self.run.dir, "snapshots")

    def fingerprint(self, identity: dict[str, Any] | None = None) -> dict[str, str]:
        """Hashes of the parts a snapshot must agree with to be resumed exactly.

        Split in three so a mismatch can say *what* changed: the model
        architecture, the data (order and content), the optimisation contract.
        Run length (max_steps, epochs), logging, snapshot cadence and metrics may
        change between restarts freely. ``identity`` adds what no config section
        describes (a script's own model, data and optimizer, see elastic_runner.api).
        """
        d = self.to_dict()
        extra = identity or {}

        def kept(section: str) -> dict[str, Any]:
            return {k: v for k, v in d[section].items() if k not in RESUME_FREE.get(section, ())}

        parts = {
            "model": kept("model") | ({"script": extra["model"]} if "model" in extra else {}),
            "data": kept("data") | {"seed": d["run"]["seed"]} | ({"script": extra["data"]} if "data" in extra else {}),
            "optim": {"optim": d["optim"], "schedule": d["schedule"], "batch": kept("batch")}
            | ({"script": extra["optim"]} if "optim" in extra else {}),
        }
        return {
            name: hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]
            for name, value in parts.items()
        }


SECTIONS: dict[str, type] = typing.get_type_hints(Config)

#: Keys of the fingerprinted sections that may change between attempts of one run: they change
#: speed or memory use, not the mathematics (the data order, the gradient, the model).
RESUME_FREE: dict[str, frozenset[str]] = {
    "model": frozenset({"compile"}),
    "data": frozenset({"num_workers", "eval_batch_size"}),
    "batch": frozenset({"micro_size", "uneven"}),
}


def resume_free_keys() -> frozenset[str]:
    """:data:`RESUME_FREE` as dotted keys (``data.num_workers`` ...)."""
    return frozenset(f"{section}.{key}" for section, keys in RESUME_FREE.items() for key in keys)


