"""Choose the snapshot to resume from, check it fits, and restore it.

Rank 0 chooses (newest intact snapshot by generation, then step) and
broadcasts the choice; every rank then loads that one snapshot itself with
``map_location`` set to its own device, so a state saved from ``cuda:0`` lands
on ``cuda:LOCAL_RANK`` or the CPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from .config import Config, diff_configs
from .dist import Dist
from .events import EventLog, read_events
from .snapshot import Loaded, LocalStore, SnapshotError, SnapshotRef, find_newest, load_exact, read_meta
from .snapshot.format import load_state_bytes
from .snapshot.memory import MemoryTier

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


def compatibility(meta: dict[str, Any], cfg: Config) -> Compatibility:
    theirs = meta.get("fingerprint", {})
    ours = cfg.fingerprint()
    saved_cfg = meta.get("config", {})
    current = cfg.to_dict()
    sections = ("model", "data", "optim", "schedule", "batch")
    differing = [
        k for k in diff_configs({s: saved_cfg.get(s, {}) for s in sections}, {s: current[s] for s in sections})
        if k not in ("data.num_workers", "data.eval_batch_size")
    ]
    if saved_cfg.get("run", {}).get("seed") != cfg.run.seed:
        differing.append("run.seed")
    return Compatibility(
        differing=differing,
        model_ok=theirs.get("model") == ours["model"],
        data_ok=theirs.get("data") == ours["data"],
        optim_ok=theirs.get("optim") == ours["optim"],
    )


def check_compatible(loaded: Loaded, cfg: Config) -> Compatibility:
    compat = compatibility(loaded.meta, cfg)
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


#: Memory-tier bytes travel in pieces of this size (a GPU needs only one piece at a time).
BROADCAST_CHUNK = 64 << 20


def select_snapshot(dist: Dist, store: LocalStore, cfg: Config, events: EventLog,
                    memory: MemoryTier | None = None, run_uid: str = "") -> Loaded | None:
    """The newest state anywhere: a node's memory tier or the disk; everyone loads the same.

    Ranks report what their node keeps in memory; rank 0 compares the newest of
    those with the newest intact disk snapshot by (generation, step). A memory
    copy counts only if it belongs to this run (its run id) and to a generation
    this run has issued. It is read and verified by its holder and its bytes
    broadcast, so the other nodes need neither a copy nor the shared filesystem.
    Everything is loaded to CPU memory; ``load_state_dict`` then copies it onto
    each rank's own device, so no device needs room for a second copy.
    """
    ours = cfg.fingerprint()
    local = memory.newest(dist.rank) if memory is not None else None
    candidates = [c for c in dist.all_gather_object(local) if c is not None]

    decision: tuple[str, Any, Any] | None = None
    loaded: Loaded | None = None
    if dist.rank == 0:
        issued = store.newest_generation()
        usable = [c for c in candidates
                  if c.fingerprint == ours and c.run_uid == run_uid and c.generation <= issued]
        best_memory = max(usable, key=lambda c: (c.generation, c.step, -c.rank), default=None)
        complete = store.complete()
        newest_disk = complete[-1] if complete else None
        if best_memory is None or (newest_disk is not None and newest_disk > best_memory.ref):
            loaded = find_newest(
                store, map_location="cpu", verify=cfg.snapshot.verify,
                on_rejected=lambda ref, why: events.emit("snapshot_rejected", snapshot=ref.name, reason=why),
            )
        if best_memory is not None and (loaded is None or best_memory.ref > loaded.ref):
            decision, loaded = ("memory", best_memory.rank, best_memory.ref), None
        elif loaded is not None:
            decision = ("disk", 0, loaded.ref)
    decision = dist.broadcast_object(decision)
    if decision is None:
        return None
    tier, holder, ref = decision
    if tier == "disk":
        if loaded is None:
            loaded = load_exact(store, ref, map_location="cpu", verify=cfg.snapshot.verify)
        loaded.tier = "disk"
        return loaded
    result = _broadcast_memory_snapshot(dist, memory, holder, ref)
    if result is None:
        # The holder could not read its copy: every rank falls back to the disk together.
        return select_snapshot(dist, store, cfg, events, memory=None, run_uid=run_uid)
    return result


def _broadcast_memory_snapshot(dist: Dist, memory: MemoryTier | None, holder: int, ref: SnapshotRef) -> Loaded | None:
    data = b""
    meta: dict[str, Any] = {}
    if dist.rank == holder:
        assert memory is not None
        try:
            data = memory.read_bytes(ref)
            meta = read_meta(memory.store.path(ref))
        except SnapshotError as exc:
            log.error("the in-memory snapshot %s is unusable (%s); falling back to disk", ref.name, exc)
            data = b""
    n, meta = dist.broadcast_object((len(data), meta), src=holder)
    if n == 0:
        return None
    buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8) if dist.rank == holder else torch.empty(n, dtype=torch.uint8)
    for start in range(0, n, BROADCAST_CHUNK):
        piece = buffer[start:start + BROADCAST_CHUNK]
        if dist.backend == "nccl":
            on_device = piece.to(dist.device)
            dist.broadcast_tensor(on_device, src=holder)
            piece.copy_(on_device.cpu())
        else:
            dist.broadcast_tensor(piece, src=holder)
    state = load_state_bytes(buffer.numpy().tobytes(), ref.name, "cpu")
    return Loaded(ref, meta, state, tier="memory")


def furthest_step_reached(run_dir: str, before_generation: int) -> int:
    """The highest step any earlier attempt reported: the loss bound for steps recomputed."""
    furthest = 0
    for event in read_events(run_dir):
        if event.get("generation", before_generation) < before_generation and isinstance(event.get("step"), int):
            furthest = max(furthest, event["step"])
    return furthest


def restore(loaded: Loaded, compat: Compatibility, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            scheduler: Any, scaler: Any, sampler: Any, state: Any) -> list[str]:
    """Apply a loaded snapshot; returns the parts that were skipped (allow_mismatch)."""
    s = loaded.state
    skipped: list[str] = []
    try:
        model.load_state_dict(s["model"])
    except RuntimeError as exc:
        raise ResumeError(
            f"snapshot {loaded.ref.name} does not fit this model: {str(exc).splitlines()[0]} "
            "(the architecture changed; use a new run.dir or export and fine-tune explicitly)"
        ) from exc
    if compat.optim_ok:
        optimizer.load_state_dict(s["optimizer"])
        scheduler.load_state_dict(s["scheduler"])
        if scaler is not None and s.get("scaler"):
            scaler.load_state_dict(s["scaler"])
    else:
        skipped.append("optimizer/schedule state (optimisation config changed)")
    if compat.data_ok:
        try:
            sampler.load_state_dict(s["sampler"])
        except ValueError as exc:
            raise ResumeError(
                f"snapshot {loaded.ref.name} does not fit this dataset: {exc}. The data changed under the same "
                "config; restore it, or set snapshot.allow_mismatch: true to restart the epoch"
            ) from exc
    else:
        skipped.append("data position (data config changed: the epoch restarts)")
    state.load_state_dict(s["train"])
    return skipped
