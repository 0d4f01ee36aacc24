"""``elastic-runner snapshot inspect|export|gc``: look into a run's snapshots; free node memory."""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from ..files import UnsafeDirectoryError, write_file_atomically
from .format import load_snapshot, parse_meta, read_verified_bytes, set_signing_key, signing_key_from_environment
from .loader import find_newest
from .shards import check_part_sizes, verify_parts
from ..config.locations import is_url
from .object_store import open_store
from .store import META, STATE, SnapshotError, SnapshotRef, SnapshotStore


def snapshot_dir_of(run_dir: str) -> str:
    """RUN_DIR/snapshots, or snapshot.dir from the run's effective config (a bucket's URL is its own location)."""
    if is_url(run_dir):
        return run_dir
    root = Path(run_dir)
    if (root / "generations").is_dir() or any(SnapshotRef.parse(p.name) for p in root.glob("step-*")):
        return str(root)  # already a snapshot directory
    cfg_path = root / "config.yaml"
    if cfg_path.is_file():
        try:
            cfg = yaml.safe_load(cfg_path.read_bytes()[:1 << 20]) or {}
            custom = (cfg.get("snapshot") or {}).get("dir")
        except (OSError, yaml.YAMLError, ValueError, RecursionError, AttributeError) as exc:
            raise SnapshotError(f"{cfg_path} is not a run's config ({type(exc).__name__}); give the snapshot "
                                "directory itself (RUN_DIR/snapshots, or the bucket's URL)") from exc
        if isinstance(custom, str) and custom:
            return custom
        if custom:
            raise SnapshotError(f"{cfg_path}: snapshot.dir is {type(custom).__name__}, not a path or URL; give the "
                                "snapshot directory itself (RUN_DIR/snapshots, or the bucket's URL)")
    return str(root / "snapshots")


def inspect(run_dir: str, verify: bool = False) -> dict[str, Any]:
    location = snapshot_dir_of(run_dir)
    store = open_store(location)
    if not is_url(location) and not Path(location).is_dir():
        raise SnapshotError(f"no snapshot directory at {location}; is {run_dir!r} a run directory (run.dir)?")
    now = time.time()
    entries = []
    damaged: list[str] = []  # marked complete but failing a check, or moved aside by a run (corrupt-*)
    for ref in store.complete():
        entry: dict[str, Any] = {"name": ref.name, "step": ref.step, "generation": ref.generation, "complete": True}
        try:
            # The marker and a listing of sizes: on a bucket, nothing else is downloaded unless --verify asks.
            marker, sizes = store.describe(ref)
            meta = parse_meta(ref.name, marker)
            entry |= {
                "epoch": meta.get("epoch"), "consumed_samples": meta.get("consumed"),
                "world_size": meta.get("world_size"), "world_size_history": meta.get("world_history"),
                "size_bytes": meta.get("size_bytes"), "age_seconds": round(now - meta.get("written_at", now), 1),
                "sha256": meta.get("sha256"),
            }
            # Sizes always (a torn or replaced state.pt shows), checksums with --verify (reads, or downloads, it all).
            size = sizes.get(STATE)
            if size != meta["size_bytes"]:
                raise SnapshotError(f"state.pt has {size if size is not None else 'no'} bytes, the marker says "
                                    f"{meta['size_bytes']} (torn or replaced)")
            if "sharded" in meta:  # every rank's part there with its size (and with --verify its checksum)
                check_part_sizes(ref.name, meta, sizes)
                parts = meta["sharded"]["parts"]
                entry["parts"] = len(parts)
                # The snapshot's size is its parts' too: state.pt holds only what every rank shares.
                entry["size_bytes"] = meta["size_bytes"] + sum(int(part["size_bytes"]) for part in parts)
            if verify:
                local = store.path(ref)
                if "sharded" in meta:
                    verify_parts(local, meta, True)
                read_verified_bytes(local, parse_meta(ref.name, (local / META).read_bytes()), True)
                entry["verified"] = True
        except SnapshotError as exc:
            entry |= {"complete": False, "error": str(exc)}
            damaged.append(ref.name)
        entries.append(entry)
    for name in store.incomplete():
        entries.append({"name": name, "complete": False, "error": "incomplete (no completion marker or still being written)"})
    for name in store.corrupt():
        entries.append({"name": name, "complete": False,
                        "error": store.corrupt_reason(name) or "moved aside as corrupt"})
        damaged.append(name)
    good = [e for e in entries if e["complete"]]
    latest = max(good, key=lambda e: (e["generation"], e["step"])) if good else None
    return {
        "run_dir": run_dir, "snapshot_dir": location, "newest_generation": store.newest_generation(),
        "damaged": damaged,
        "latest": latest["name"] if latest else None,
        "step": latest["step"] if latest else None, "epoch": latest.get("epoch") if latest else None,
        "consumed_samples": latest.get("consumed_samples") if latest else None,
        "generation": latest["generation"] if latest else None,
        "world_size_history": latest.get("world_size_history") if latest else None,
        "size_bytes": latest.get("size_bytes") if latest else None,
        "age_seconds": latest.get("age_seconds") if latest else None,
        "snapshots": entries,
    }


def load_for_export(run_dir: str, name: str | None = None, map_location: Any = "cpu") -> tuple[SnapshotRef, dict[str, Any], dict[str, Any]]:
    """The newest intact snapshot of a run (or the one named), read-only: (ref, meta, state)."""
    store = open_store(snapshot_dir_of(run_dir))
    if name is not None:
        ref = SnapshotRef.parse(name)
        if ref is None:
            raise SnapshotError(f"{name!r} is not a snapshot name (step-NNNNNNNNN-gen-NNNNNN)")
        meta, state = load_snapshot(store.path(ref), map_location=map_location)
        return ref, meta, state
    loaded = find_newest_readonly(store, map_location)
    if loaded is None:
        raise SnapshotError(f"no intact snapshot in {store.location}")
    return loaded


def export(run_dir: str, out: str, name: str | None = None) -> dict[str, Any]:
    """Write the newest intact snapshot's plain model state_dict to ``out``."""
    import torch

    ref, meta, state = load_for_export(run_dir, name)
    target = Path(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(state["model"], buffer)
    write_file_atomically(target, buffer.getvalue())
    return {"snapshot": ref.name, "step": ref.step, "out": str(target), "tensors": len(state["model"])}


def find_newest_readonly(store: SnapshotStore, map_location: Any = "cpu") -> tuple[SnapshotRef, dict[str, Any], dict[str, Any]] | None:
    """Like the loader, but never moves anything aside (inspection must not change a run)."""
    for ref in reversed(store.complete()):
        try:
            meta, state = load_snapshot(store.path(ref), map_location=map_location)
        except SnapshotError as exc:
            print(f"elastic-runner: skipping {ref.name}: {exc}", file=sys.stderr)
            continue
        return ref, meta, state
    return None


def persist(run_dir: str, shm_dir: str | None = None) -> dict[str, Any]:
    """Write this node's in-memory copy of the run's newest state into its snapshot directory, when it is
    newer than every durable snapshot there (a final snapshot that could not be written, a volume that
    was full). Checked before (checksum, and that it belongs to this run) and after the copy
    (:func:`~.persist.persist_newest`)."""
    from .memory import memory_base, memory_key
    from .persist import persist_newest

    location = snapshot_dir_of(run_dir)
    done = persist_newest(open_store(location), memory_base(shm_dir) / memory_key(location), job_ended=True)
    if not done.written:
        return {"snapshot": done.snapshot, "step": done.step, "written": False, "why": done.why}
    return {"snapshot": done.snapshot, "step": done.step, "written": True, "to": done.to}


def parse_age(text: str) -> float:
    """``30m``, ``24h``, ``7d``, ``90s`` or a number of seconds -> seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86_400}
    raw = text.strip().lower()
    try:
        value = float(raw[:-1]) * units[raw[-1]] if raw and raw[-1] in units else float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise SnapshotError(f"--older-than {text!r} is not an age; write e.g. 30m, 24h or 7d")
    return value


def gc(older_than: str, dry_run: bool, shm_dir: str | None) -> int:
    from .memory import collect_garbage

    decisions = collect_garbage(shm_dir, older_than_s=parse_age(older_than), dry_run=dry_run)
    for d in decisions:
        verb = ("would remove" if dry_run else "removed") if d.remove else "kept"
        print(f"{verb} {d.path} ({d.size_bytes / 1e6:.1f} MB): {d.why}")
    freed = sum(d.size_bytes for d in decisions if d.remove)
    kept = [d for d in decisions if not d.remove]
    print(f"{'would free' if dry_run else 'freed'} {freed / 1e6:.1f} MB in {len(decisions) - len(kept)} "
          f"run director{'y' if len(decisions) - len(kept) == 1 else 'ies'}; kept {len(kept)}")
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        set_signing_key(signing_key_from_environment())  # with the job's key, only snapshots signed with it count
        if args.snapshot_cmd == "gc":
            return gc(args.older_than, args.dry_run, args.shm_dir)
        if args.snapshot_cmd == "persist":
            print(json.dumps(persist(args.run_dir, args.shm_dir)))
            return 0
        if args.snapshot_cmd == "inspect":
            summary = inspect(args.run_dir, verify=args.verify)
            print(json.dumps(summary, indent=2))
            if summary["damaged"]:
                print(f"elastic-runner: damaged snapshot(s): {', '.join(summary['damaged'])} (see 'error')", file=sys.stderr)
                return 1
        else:
            print(json.dumps(export(args.run_dir, args.out, args.snapshot)))
    except SnapshotError as exc:
        print(f"elastic-runner: {exc}", file=sys.stderr)
        return 1
    except UnsafeDirectoryError as exc:
        print(f"elastic-runner: {exc}", file=sys.stderr)
        return 2
    return 0


__all__ = ["export", "find_newest", "inspect", "run"]
