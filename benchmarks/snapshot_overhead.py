"""Snapshot overhead: step throughput with a snapshot every N steps vs none.

For a small model (the quickstart CNN, ~0.3 MB of state) and a ~100 MB one (an
MLP of 3x2048 hidden units: 12.7 M parameters plus SGD momentum), one worker
(snapshots are rank 0's business), the baseline's synchronous ``torch.save``
against elastic_runner's asynchronous writer, each with snapshots off and on,
interleaved ``--repeats`` times. Also reports how long a save blocked the
training step and how long the whole write took.

    .venv/bin/python benchmarks/snapshot_overhead.py --repeats 2 --out results/snapshots.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from common import scratch_dir, Workload, make_job, median, read_events, steady_rate, timing_lines, write_json

MODELS: dict[str, Workload] = {
    "small": Workload(batch_per_rank=32, world=1),
    "100MB": Workload(model="mlp", hidden=2048, depth=3, batch_per_rank=32, world=1),
}


def one_run(variant: str, workload: Workload, workdir: Path, every: int, steps: int, skip: int) -> dict[str, Any]:
    run_dir = workdir / f"{variant}-{every}-{time.time_ns()}"
    save = every or 10**9
    if variant == "elastic-runner":
        job = make_job(variant, workload, run_dir, nnodes="1:1", steps=steps, **{"snapshot.every_steps": every})
    else:
        workload = Workload(**{**workload.__dict__, "save_every": save})
        job = make_job(variant, workload, run_dir, nnodes="1:1", steps=steps, log_every=10)
    try:
        job.start_agent()
        job.wait(timeout=900)
    finally:
        job.close()
    rate = steady_rate(variant, run_dir, skip, workload.batch_per_rank)
    if variant == "elastic-runner":
        saves = [e for e in read_events(run_dir) if e["kind"] == "snapshot_saved" and e["step"] >= skip]
        blocking = [e["blocking_s"] for e in saves]
        write = [e["write_s"] for e in saves]
    else:
        blocking = write = [r["seconds"] for r in timing_lines(run_dir) if r["kind"] == "save" and r["step"] >= skip]
    return {"rate": rate, "blocking_s": blocking, "write_s": write}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--every", type=int, default=10, help="snapshot every N steps")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--skip", type=int, default=20)
    p.add_argument("--models", default="small,100MB")
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    with scratch_dir(args.workdir, "er-bench-snapshots-") as workdir:
        result: dict[str, Any] = {}
        for model in args.models.split(","):
            workload = MODELS[model]
            runs: dict[str, list[dict[str, Any]]] = {}
            for _ in range(args.repeats):
                for variant in ("torchrun-tuned", "elastic-runner"):
                    for every in (0, args.every):
                        key = f"{'baseline' if variant != 'elastic-runner' else 'elastic-runner'}/{'on' if every else 'off'}"
                        runs.setdefault(key, []).append(one_run(variant, workload, workdir, every, args.steps, args.skip))
                        print(model, key, runs[key][-1]["rate"], flush=True)
            summary: dict[str, Any] = {}
            for who in ("baseline", "elastic-runner"):
                off = median([r["rate"] for r in runs[f"{who}/off"] if r["rate"]])
                on = median([r["rate"] for r in runs[f"{who}/on"] if r["rate"]])
                blocking = [b for r in runs[f"{who}/on"] for b in r["blocking_s"]]
                write = [w for r in runs[f"{who}/on"] for w in r["write_s"]]
                summary[who] = {
                    "samples_per_s_off": off, "samples_per_s_on": on,
                    "throughput_ratio_on_vs_off": round(on / off, 3) if on and off else None,
                    "save_blocking_ms_median": round(1000 * statistics.median(blocking), 1) if blocking else None,
                    "save_write_ms_median": round(1000 * statistics.median(write), 1) if write else None,
                }
            result[model] = summary
        write_json(args.out, {"benchmark": "snapshot_overhead", "every": args.every, "steps": args.steps,
                              "repeats": args.repeats, "models": result})


if __name__ == "__main__":
    main()
