"""Typed run configuration: dataclass sections that validate themselves and say how to fix a mistake.

- ``root``        the whole :class:`~.root.Config`: its sections, the fingerprint a snapshot must match,
                  the keys a resume may change.
- ``training``    the sections that define the mathematics of a run (model, data, batch, optim, ...).
- ``operations``  the sections that define how it is operated (snapshots, audit, metrics, logging, dist).
- ``base``        what every section shares: the one-line error, field help.
- ``loader``      defaults < YAML file < ``--set`` overrides, then validation; the generated reference.
- ``imports``     ``package.module:callable`` references from a config.

Everything a caller needs is importable from here."""

from .loader import (
    add_overrides_option,
    coerce,
    config_from_dict,
    diff_configs,
    dump_yaml,
    load_config,
    parse_override,
    reference_markdown,
    write_effective_config,
)
from .root import (
    BUILTIN_LOSSES,
    BUILTIN_METRICS,
    RESUME_FREE,
    SECTIONS,
    AuditConfig,
    BatchConfig,
    Config,
    ConfigError,
    DataConfig,
    DistConfig,
    EvalConfig,
    LoggingConfig,
    MetricsConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    RecoveryConfig,
    RunConfig,
    ScheduleConfig,
    SnapshotConfig,
    TrainConfig,
    is_import_path,
    resume_free_keys,
)

__all__ = [
    "BUILTIN_LOSSES", "BUILTIN_METRICS", "RESUME_FREE", "SECTIONS", "AuditConfig", "BatchConfig", "Config",
    "ConfigError", "DataConfig", "DistConfig", "EvalConfig",
    "LoggingConfig", "MetricsConfig", "ModelConfig", "OptimConfig", "ParallelConfig", "RecoveryConfig", "RunConfig", "ScheduleConfig",
    "SnapshotConfig",
    "TrainConfig", "add_overrides_option", "coerce", "config_from_dict", "diff_configs", "dump_yaml", "is_import_path", "load_config",
    "parse_override", "reference_markdown", "resume_free_keys", "write_effective_config",
]
