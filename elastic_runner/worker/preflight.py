"""Start-up checks for launch setups known to fail (warnings, not errors).

Measured with torch 2.13 (see docs/getting-started.md, "Launching"): with the rendezvous TCP
store shared between agent and workers, a node joining a running job makes the
rank-0 agent fail with ``DistStoreError ... role_info`` and the job dies, and
restarted gloo workers can read the previous round's addresses and hang.
With ``keep_alive_max_attempt=2`` a joining node declared a live node dead and
both trained as rank 0 (split brain). A worker cannot fix its launcher, but it
can say clearly what to change.
"""

from __future__ import annotations

import logging
import os
from typing import Mapping

log = logging.getLogger(__name__)


def rendezvous_conf(environ: Mapping[str, str], parent_cmdline: list[str] | None = None) -> dict[str, str]:
    """The agent's --rdzv_conf: from elastic-runner launch, PET_RDZV_CONF, or the parent's command line."""
    raw = environ.get("ELASTIC_RUNNER_RDZV_CONF") or environ.get("PET_RDZV_CONF")
    if raw is None and parent_cmdline:
        for i, arg in enumerate(parent_cmdline):
            for flag in ("--rdzv_conf", "--rdzv-conf"):
                if arg.startswith(flag + "="):
                    raw = arg.split("=", 1)[1]
                elif arg == flag and i + 1 < len(parent_cmdline):
                    raw = parent_cmdline[i + 1]
    conf: dict[str, str] = {}
    for item in (raw or "").split(","):
        key, sep, value = item.partition("=")
        if sep:
            conf[key.strip()] = value.strip()
    return conf


def parent_cmdline() -> list[str] | None:
    """The command line of this worker's parent (the torchrun agent, or the zygote it forked from)."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as fh:
            return [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
    except OSError:
        return None


def largest_world_size(environ: Mapping[str, str], world_size: int, local_world_size: int,
                       cmdline: list[str] | None = None) -> int:
    """The most ranks this job may have: ``--nnodes`` MAX (from elastic-runner launch, PET_NNODES or the
    agent's command line) times the workers per node; the current world size if it cannot be told."""
    raw = environ.get("ELASTIC_RUNNER_NNODES") or environ.get("PET_NNODES")
    for i, arg in enumerate(cmdline or []):
        if raw is None and arg.startswith("--nnodes="):
            raw = arg.split("=", 1)[1]
        elif raw is None and arg == "--nnodes" and i + 1 < len(cmdline or []):
            raw = (cmdline or [])[i + 1]
    try:
        most = int((raw or "").split(":")[-1])
    except ValueError:
        return world_size
    return max(world_size, most * max(1, local_world_size))


def problems(environ: Mapping[str, str], torch_version: str, parent_cmdline: list[str] | None = None) -> list[str]:
    found: list[str] = []
    if "TORCHELASTIC_RUN_ID" not in environ:
        return found  # not under torchrun
    major_minor = tuple(int(p) for p in torch_version.split("+")[0].split(".")[:2] if p.isdigit())
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and major_minor >= (2, 4):
        found.append(
            f"torchrun shares its rendezvous TCP store with the workers (torch {torch_version}): a node joining "
            "the job can take it down (DistStoreError: wait timeout ... role_info) and restarts can hang in "
            "process-group creation. Start the job with 'elastic-runner launch', or set "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun."
        )
    conf = rendezvous_conf(environ, parent_cmdline)
    try:
        interval = float(conf.get("keep_alive_interval", 5))
        attempts = int(conf.get("keep_alive_max_attempt", 3))
    except ValueError:
        return found
    if attempts < 3 or interval * attempts < 3:
        found.append(
            f"rendezvous keep-alive settings keep_alive_interval={interval:g}, keep_alive_max_attempt={attempts} "
            "declare a node dead after fewer than 3 missed heartbeats or 3 s: a busy live node can be dropped and "
            "two groups then train as rank 0 on one run (split brain). Use keep_alive_max_attempt>=3 and "
            "keep_alive_interval*keep_alive_max_attempt>=3 (elastic-runner launch uses 1 and 3)."
        )
    return found


def warn_known_bad_setups(environ: Mapping[str, str] | None = None) -> list[str]:
    import torch

    env = os.environ if environ is None else environ
    found = problems(env, torch.__version__, parent_cmdline())
    for message in found:
        log.warning("known-bad launch setup: %s", message)
    return found
