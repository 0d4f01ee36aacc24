"""Steady-state throughput: elastic_runner (every feature on) vs the baseline DDP script.

No faults. One agent with two workers, the same model, data and global batch,
``--steps`` steps, the rate measured between step ``--skip`` and the end (so
start-up is excluded). Variants run interleaved, ``--repeats`` times each, and
medians are compared, because this machine's speed drifts with other load:

- ``baseline``: benchmarks/baseline_ddp.py under tuned torchrun, checkpoint every 50 steps;
- ``elastic-runner``: defaults (snapshot every 50 steps, in-memory tier, peer watchdog);
- ``elastic-runner-bare``: snapshots, memory tier and watchdog off — the cost of those features.

    .venv/bin/python benchmarks/throughput.py --repeats 3 --out results/throughput.json
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from common import Workload, make_job, median, steady_rate, write_json

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "baseline": ("torchrun-tuned", {}),
    "elastic-runner": ("elastic-runner", {}),
    "elastic-runner-bare": ("elastic-runner", {"snapshot.every_steps": 0, "snapshot.in_memory": False,
                                               "dist.heartbeat_seconds": 0}),
}


def one_run(name: str, workload: Workload, workdir: Path, steps: int, skip: int) -> float | None:
    variant, overrides = VARIANTS[name]
    run_dir = workdir / f"{name}-{time.time_ns()}"
    job = make_job(variant, workload, run_dir, nnodes="1:1", nproc_per_node=2, steps=steps, log_every=50, **overrides)
    try:
        job.start_agent()
        job.wait(timeout=900)
    finally:
        job.close()
    return steady_rate(variant, run_dir, skip, workload.batch_per_rank * workload.world)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--skip", type=int, default=100, help="steps excluded as warm-up")
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    # A step of tens of milliseconds (3x32x32 images, 32-channel CNN): per-step overheads
    # are measured against real work, not against a 1 ms toy step.
    workload = Workload(data="synthetic", synthetic_shape="3,32,32", channels=32, hidden=128)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="er-bench-throughput-"))
    rates: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.repeats):
        for name in VARIANTS:
            rate = one_run(name, workload, workdir, args.steps, args.skip)
            if rate is not None:
                rates[name].append(round(rate, 1))
            print(f"{name}: {rates[name]}", flush=True)
    med = {name: median(values) for name, values in rates.items()}
    base = med.get("baseline")
    ratios = {}
    if base:
        for name in ("elastic-runner", "elastic-runner-bare"):
            if med.get(name):
                ratios[f"{name}_vs_baseline"] = round(med[name] / base, 3)
    if med.get("elastic-runner") and med.get("elastic-runner-bare"):
        ratios["features_on_vs_off"] = round(med["elastic-runner"] / med["elastic-runner-bare"], 3)
    write_json(args.out, {"benchmark": "throughput", "samples_per_s": rates, "median_samples_per_s": med,
                          "ratios": ratios, "steps": args.steps, "skip": args.skip, "repeats": args.repeats})


if __name__ == "__main__":
    main()
