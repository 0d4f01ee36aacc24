"""Shared benchmark machinery: the variants, their logs, and the timing rules.

Variants, all on the same model, data and batch, c10d rendezvous on loopback,
``--nnodes=1:4``, one worker per agent:

- ``torchrun-default``: benchmarks/baseline_ddp.py under plain torchrun with
  torch's defaults (the shared rendezvous store, last_call_timeout=30 s);
- ``torchrun-tuned``: the same script, tuned as an expert would:
  ``last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3``
  and ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``;
- ``elastic-runner``: ``elastic-runner launch -m elastic_runner.train`` with
  its defaults (snapshots every 50 steps like the baseline's checkpoints);
- ``elastic-runner-torchrun``: plain ``torchrun -m elastic_runner.train`` with torch's
  defaults and no variable set (the entry-point hook sets the agent up);
- ``elastic-runner-torchrun-tuned``: the same under the tuned torchrun flags.

"All ranks stepping" is the moment the last rank of the new attempt completed
its first optimizer step, as each program records it (baseline: its timing
lines; elastic_runner: its ``first_step`` events).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from elastic_runner.observe.events import EventFollower, read_events  # noqa: E402
from elastic_runner.testing.localjob import LocalJob  # noqa: E402

VARIANTS = ("torchrun-default", "torchrun-tuned", "elastic-runner", "elastic-runner-torchrun",
            "elastic-runner-torchrun-tuned")
#: The variants that run elastic_runner's worker (its events tell the timings).
OURS = ("elastic-runner", "elastic-runner-torchrun", "elastic-runner-torchrun-tuned")
#: Which torchrun baseline each of ours runs under the same torchrun settings.
SAME_SETTINGS = {"elastic-runner-torchrun": "torchrun-default", "elastic-runner-torchrun-tuned": "torchrun-tuned"}
TUNED_RDZV = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"


@dataclass
class Workload:
    """Model and data shared by the baseline script and the elastic_runner config."""

    data: str = "digits"
    model: str = "cnn"
    hidden: int = 64
    channels: int = 16
    depth: int = 2
    batch_per_rank: int = 16
    world: int = 2  #: global batch = batch_per_rank * world
    save_every: int = 50
    synthetic_size: int = 8192
    synthetic_shape: str = "3,32,32"
    optim: str = "sgd"
    lr: float = 0.05
    tokens_dir: str = ""  #: data "tokens": a prepared directory
    block_size: int = 64
    gpt: str = "4,4,128"  #: model "gpt": n_layer,n_head,n_embd
    workers: int = 0  #: data.num_workers
    augment: bool = False  #: fake_images: random crop and flip (and normalisation)

    @property
    def sample_unit(self) -> int:
        """Tokens per sample for a language model (rates in tokens/s), else 1."""
        return self.block_size if self.data == "tokens" else 1

    def config(self, path: Path, **overrides: Any) -> Path:
        import yaml

        params: dict[str, Any] = {"hidden": self.hidden}
        if self.model == "cnn":
            params["channels"] = self.channels
        elif self.model == "gpt":
            n_layer, n_head, n_embd = (int(v) for v in self.gpt.split(","))
            params = {"n_layer": n_layer, "n_head": n_head, "n_embd": n_embd}
        else:
            params["depth"] = self.depth
        data: dict[str, Any] = {"name": self.data}
        if self.data == "synthetic":
            data["params"] = {"size": self.synthetic_size, "shape": [int(s) for s in self.synthetic_shape.split(",")]}
        if self.data == "tokens":
            data |= {"path": self.tokens_dir, "params": {"block_size": self.block_size}}
        if self.data == "fake_images":
            side = int(self.synthetic_shape.split(",")[-1])
            data["params"] = {"size": self.synthetic_size, "num_classes": 10, "image_size": side, "noise": 0.7}
            data["augment"] = ([{"RandomCrop": {"size": side, "padding": 4}}, "RandomHorizontalFlip"] if self.augment
                               else []) + [{"Normalize": {"mean": [0.5] * 3, "std": [0.25] * 3}}]
            params = {}
        data["num_workers"] = self.workers
        optim: dict[str, Any] = {"name": self.optim, "lr": self.lr, "weight_decay": 0.0001}
        if self.optim == "sgd":
            optim["momentum"] = 0.9
        cfg = {
            "run": {"seed": 0},
            "data": data,
            "model": {"name": f"torchvision.models:{self.model}" if self.data == "fake_images" else self.model,
                      "params": params},
            "optim": optim,
            "batch": {"global_size": self.batch_per_rank * self.world},
            "train": {"epochs": 100000, "max_steps": 10**9, "eval_every_steps": 0},
            "snapshot": {"every_steps": self.save_every},
            "logging": {"every_steps": 50},
        }
        for key, value in overrides.items():
            section, _, name = key.partition(".")
            cfg.setdefault(section, {})[name] = value
        if self.model == "mlp":
            cfg["model"]["params"].pop("channels", None)
        if self.data == "tokens":
            cfg["data"].pop("test_fraction", None)
        path.write_text(yaml.safe_dump(cfg))
        return path

    def baseline_args(self, run_dir: Path, steps: int = 10**9, log_every: int = 1) -> list[str]:
        return [str(ROOT / "benchmarks" / "baseline_ddp.py"), "--run-dir", str(run_dir), "--data", self.data,
                "--log-every", str(log_every),
                "--model", self.model, "--hidden", str(self.hidden), "--channels", str(self.channels),
                "--depth", str(self.depth),
                "--batch-per-rank", str(self.batch_per_rank), "--save-every", str(self.save_every),
                "--lr", str(self.lr), "--optim", self.optim,
                "--synthetic-size", str(self.synthetic_size), "--synthetic-shape", self.synthetic_shape,
                "--tokens-dir", self.tokens_dir, "--block-size", str(self.block_size), "--gpt", self.gpt,
                "--workers", str(self.workers), "--steps", str(steps)] + (["--augment"] if self.augment else [])


def make_job(variant: str, workload: Workload, run_dir: Path, nnodes: str = "1:4", nproc_per_node: int = 1,
             steps: int = 10**9, log_every: int = 1, baseline_extra: list[str] | None = None,
             **cfg_overrides: Any) -> LocalJob:
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if variant == "elastic-runner":
        config = workload.config(run_dir / "config.yaml", **({"train.max_steps": steps} | cfg_overrides))
        return LocalJob(config=str(config), run_dir=str(run_dir), nnodes=nnodes, nproc_per_node=nproc_per_node,
                        launcher="elastic-runner", rdzv_conf=None, max_restarts=100, env=env)
    if variant in OURS:  # plain torchrun, nothing set: what the entry-point hook gives
        config = workload.config(run_dir / "config.yaml", **({"train.max_steps": steps} | cfg_overrides))
        return LocalJob(config=str(config), run_dir=str(run_dir), nnodes=nnodes, nproc_per_node=nproc_per_node,
                        launcher="torchrun", rdzv_conf=TUNED_RDZV if variant.endswith("-tuned") else None,
                        max_restarts=100, env=env, disable_shared_store=False)
    tuned = variant == "torchrun-tuned"
    return LocalJob(config="", run_dir=str(run_dir), nnodes=nnodes, nproc_per_node=nproc_per_node, launcher="torchrun",
                    rdzv_conf=TUNED_RDZV if tuned else None, max_restarts=100, env=env,
                    program=workload.baseline_args(run_dir, steps=steps, log_every=log_every) + (baseline_extra or []),
                    disable_shared_store=tuned)


# --------------------------------------------------------------------------- reading what happened


def timing_lines(run_dir: Path) -> list[dict[str, Any]]:
    """The baseline's timing records (all ranks, all restarts)."""
    out: list[dict[str, Any]] = []
    for path in (run_dir / "timing").glob("*.jsonl"):
        with open(path) as fh:
            for line in fh:
                if line.endswith("\n"):
                    out.append(json.loads(line))
    return out


@dataclass
class Attempt:
    started: float  #: first process of the attempt up
    world_size: int
    all_stepping: float | None  #: last rank's first step
    resumed_step: int | None


def attempts(variant: str, run_dir: Path, events: EventFollower | None = None) -> list[Attempt]:
    """Training attempts (one per restart) in time order (``events``: follow the run in a poll loop)."""
    found: list[Attempt] = []
    if variant in OURS:
        gens: dict[int, dict[str, Any]] = {}
        for e in (events.read() if events is not None else read_events(run_dir)):
            g = e.get("generation")
            if g is None or e.get("role") == "agent":
                continue
            info = gens.setdefault(g, {"first": {}, "resume": None, "starts": []})
            if e["kind"] == "start":
                info["starts"].append(e)
                info["world"] = e["world_size"]
            elif e["kind"] == "first_step":
                info["first"][e["rank"]] = e["time"]
            elif e["kind"] == "snapshot_loaded":
                info["resume"] = e["step"]
        earlier_pids: set[Any] = set()
        for g in sorted(gens):
            info = gens[g]
            if not info["starts"]:
                continue
            # An attempt starts with its newest process; a process kept from an earlier attempt (in-process
            # recovery) starts it when the attempt does.
            info["start"] = min(e["time"] if e.get("pid") in earlier_pids else e["process_start"]
                                for e in info["starts"])
            earlier_pids |= {e.get("pid") for e in info["starts"]}
            done = len(info["first"]) >= info["world"]
            found.append(Attempt(info["start"], info["world"], max(info["first"].values()) if done else None,
                                 info["resume"]))
        return found
    by_pid: dict[int, dict[str, Any]] = {}
    for r in timing_lines(run_dir):
        info = by_pid.setdefault(r["pid"], {"world": r["world_size"], "resume": None, "first": None, "up": None})
        if r["kind"] == "pg_up":
            info["up"] = r["time"]
        elif r["kind"] == "resume":
            info["resume"] = r["step"]
        elif r["kind"] == "first_step":
            info["first"] = r["time"]
    # Processes of one attempt come up together: cluster by pg_up time.
    procs = sorted((i for i in by_pid.values() if i["up"] is not None), key=lambda i: i["up"])
    groups: list[list[dict[str, Any]]] = []
    for p in procs:
        if groups and p["up"] - groups[-1][0]["up"] < 1.0 and len(groups[-1]) < p["world"]:
            groups[-1].append(p)
        else:
            groups.append([p])
    for group in groups:
        world = group[0]["world"]
        firsts = [p["first"] for p in group if p["first"] is not None]
        found.append(Attempt(min(p["up"] for p in group), world,
                             max(firsts) if len(firsts) >= world else None, group[0]["resume"]))
    return found


def furthest_completed_step(variant: str, run_dir: Path, before: float) -> int:
    if variant in OURS:
        best = 0
        events = read_events(run_dir)
        # Only the attempts running at the fault: a recovery faster than the 1 s of slack below would
        # otherwise count the next attempt's first steps as lost.
        running = {e.get("generation") for e in events if e["kind"] == "start" and e["time"] <= before}
        for e in events:
            if e.get("generation") in running and e["time"] <= before + 1.0 \
                    and e["kind"] in ("progress", "failure", "kept_in_memory", "stop") and isinstance(e.get("step"), int):
                best = max(best, e["step"])
        # progress is logged every N steps; survivors report their exact step on failure
        return best
    return max((r["step"] for r in timing_lines(run_dir)
                if r["time"] <= before + 0.5 and r["kind"] in ("step", "first_step")), default=0)


def wait_stepping(variant: str, run_dir: Path, after: float, world: int, timeout: float) -> tuple[float | None, Attempt | None]:
    """Seconds from ``after`` until an attempt started after it has all ``world`` ranks stepping."""
    deadline = time.monotonic() + timeout
    events = EventFollower(run_dir)
    while time.monotonic() < deadline:
        for a in attempts(variant, run_dir, events):
            if a.started > after - 0.5 and a.world_size == world and a.all_stepping is not None and a.all_stepping > after:
                return a.all_stepping - after, a
        time.sleep(0.1)
    return None, None


def steady_rate(variant: str, run_dir: Path, skip_steps: int, global_batch: int) -> float | None:
    """Samples/s between the first logged step >= skip_steps and the last logged step (one attempt)."""
    if variant in OURS:
        points = [(e["step"], e["time"]) for e in read_events(run_dir) if e["kind"] == "progress" and e.get("rank") == 0]
    else:
        points = [(r["step"], r["time"]) for r in timing_lines(run_dir) if r["kind"] == "step" and r["rank"] == 0]
    points = sorted(p for p in points if p[0] >= skip_steps)
    if len(points) < 2 or points[-1][1] <= points[0][1]:
        return None
    return (points[-1][0] - points[0][0]) * global_batch / (points[-1][1] - points[0][1])


def median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def write_json(path: str | None, data: dict[str, Any]) -> None:
    text = json.dumps(data, indent=2, default=str)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
    print(text)


@contextlib.contextmanager
def scratch_dir(given: str | None, prefix: str) -> Iterator[Path]:
    """The benchmark's run directories: ``--workdir`` if given (kept, to look at the logs), else a private
    temporary directory removed at the end (a throughput run leaves ~1 GB of snapshots and logs)."""
    if given:
        Path(given).mkdir(parents=True, exist_ok=True)
        yield Path(given)
        return
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
