"""Typed run configuration: dataclass sections (:mod:`.sections`) and their loading from YAML and
``--set`` overrides (:mod:`.loader`). Everything a caller needs is importable from here."""

from .loader import (
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
    "LoggingConfig", "MetricsConfig", "ModelConfig", "OptimConfig", "RunConfig", "ScheduleConfig", "SnapshotConfig",
    "TrainConfig", "coerce", "config_from_dict", "diff_configs", "dump_yaml", "is_import_path", "load_config",
    "parse_override", "reference_markdown", "resume_free_keys", "write_effective_config",
]
