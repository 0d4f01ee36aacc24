"""Does a snapshot fit this configuration: which keys differ, and whether model, data and optimizer match.

A snapshot carries the config it was written with and a fingerprint of its model, data and
optimisation sections (and, for a script's own objects, their classes and shapes). A resume with
a different model or data is refused (:class:`ResumeError`, with the key and the fix) unless
``snapshot.allow_mismatch`` says to resume anyway; keys in the resume-free set (logging, snapshots,
metrics...) may change freely.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ..config import Config, diff_configs, resume_free_keys
from ..printable import printable
from ..snapshot import Loaded

log = logging.getLogger(__name__)


class ResumeError(RuntimeError):
    """The snapshot cannot be resumed with this configuration."""


@dataclass
class Compatibility:
    differing: list[str]
    model_ok: bool
    data_ok: bool
    optim_ok: bool

    @property
    def exact(self) -> bool:
        return self.model_ok and self.data_ok and self.optim_ok


def compatibility(meta: dict[str, Any], cfg: Config, identity: dict[str, Any] | None = None) -> Compatibility:
    theirs = meta.get("fingerprint", {})
    ours = cfg.fingerprint(identity)
    saved_cfg = meta.get("config", {})
    current = cfg.to_dict()
    sections = ("model", "data", "optim", "schedule", "batch")
    free = resume_free_keys()
    differing = [k for k in diff_configs({s: saved_cfg.get(s, {}) for s in sections}, {s: current[s] for s in sections})
                 if k not in free]
    if saved_cfg.get("run", {}).get("seed") != cfg.run.seed:
        differing.append("run.seed")
    differing += [f"the script's {part} ({printable(meta.get('script', {}).get(part), 80)} -> {value})"
                  for part, value in (identity or {}).items() if meta.get("script", {}).get(part) != value]
    return Compatibility(differing=differing, model_ok=theirs.get("model") == ours["model"],
                         data_ok=theirs.get("data") == ours["data"], optim_ok=theirs.get("optim") == ours["optim"])


def check_compatible(loaded: Loaded, cfg: Config, identity: dict[str, Any] | None = None) -> Compatibility:
    compat = compatibility(loaded.meta, cfg, identity)
    if compat.exact:
        return compat
    keys = ", ".join(compat.differing) or "the config fingerprint"
    if not cfg.snapshot.allow_mismatch:
        raise ResumeError(
            f"snapshot {loaded.ref.name} in {cfg.snapshot_dir} was written with a different configuration "
            f"({keys} differ). To resume it anyway (e.g. fine-tuning) set snapshot.allow_mismatch: true; "
            "to start from scratch, use a new run.dir"
        )
    log.warning("resuming %s although %s differ (snapshot.allow_mismatch: true)", loaded.ref.name, keys)
    return compat
