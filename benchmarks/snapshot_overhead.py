"""Snapshot overhead: step throughput with a snapshot every N steps vs none.

For a small model (the quickstart CNN, ~0.3 MB of state) and a ~100 MB one (an
MLP of 3x2048 hidden units: 12.7 M parameters plus SGD momentum), one worker
(snapshots are rank 0's business), the baseline's synchronous ``torch.save``
against elastic_runner's asynchronous writer (``snapshot.writer: process`` and
``thread``, see ``--writers``), each with snapshots off and on, interleaved
``--repeats`` times. Also reports how long a save blocked the training step and
how long the whole write took.

    .venv/bin/python benchmarks/snapshot_overhead.py --repeats 2 --out results/snapshots.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from common import Workload, make_job, median, read_events, scratch_dir, steady_rate, timing_lines, write_json

MODELS: dict[str, Workload] = {
    "small": Workload(batch_per_rank=32, world=1),
    "100MB": Workload(model="mlp", hidden=2048, depth=3, batch_per_rank=32, world=1),
}
#: (steps, warm-up steps) per model: ~10 s of steady state each, and a warm-up that outlasts the writer
#: process's start (it starts with the first snapshot and imports torch; saves go through a thread until then).
STEPS = {"small": (1800, 700), "100MB": (200, 80)}


def one_run(variant: str, workload: Workload, workdir: Path, every: int, steps: int, skip: int,
            writer: str = "process") -> dict[str, Any]:
    run_dir = workdir / f"{variant}-{writer}-{every}-{time.time_ns()}"
    save = every or 10**9
    if variant == "elastic-runner":
        job = make_job(variant, workload, run_dir, nnodes="1:1", steps=steps,
                       **{"snapshot.every_steps": every, "snapshot.writer": writer})
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
    p.add_argument("--steps", type=int, default=None, help="steps per run (default: per model, see STEPS)")
    p.add_argument("--skip", type=int, default=None, help="warm-up steps left out (default: per model)")
    p.add_argument("--models", default="small,100MB")
    p.add_argument("--writers", default="process,thread",
                   help="snapshot.writer values to measure, each against the same baseline runs")
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    with scratch_dir(args.workdir, "er-bench-snapshots-") as workdir:
        result: dict[str, Any] = {}
        writers = [w.strip() for w in args.writers.split(",") if w.strip()]
        for model in args.models.split(","):
            workload = MODELS[model]
            steps, skip = args.steps or STEPS[model][0], args.skip or STEPS[model][1]
            runs: dict[str, list[dict[str, Any]]] = {}
            for _ in range(args.repeats):  # interleaved: drift on a shared machine hits every variant alike
                # Without snapshots the writer makes no difference: one elastic-runner "off" run per repeat.
                plan = [("torchrun-tuned", "baseline/off", 0, ""), ("torchrun-tuned", "baseline/on", args.every, ""),
                        ("elastic-runner", "elastic-runner/off", 0, "process")]
                plan += [("elastic-runner", f"elastic-runner-{w}/on", args.every, w) for w in writers]
                for variant, key, every, writer in plan:
                    runs.setdefault(key, []).append(one_run(variant, workload, workdir, every, steps, skip,
                                                            writer or "process"))
                    print(model, key, runs[key][-1]["rate"], flush=True)
            summary: dict[str, Any] = {"steps": steps, "skip": skip}
            for who in ["baseline"] + [f"elastic-runner-{w}" for w in writers]:
                off_key = "baseline/off" if who == "baseline" else "elastic-runner/off"
                off = median([r["rate"] for r in runs[off_key] if r["rate"]])
                on = median([r["rate"] for r in runs[f"{who}/on"] if r["rate"]])
                blocking = [b for r in runs[f"{who}/on"] for b in r["blocking_s"]]
                write = [w for r in runs[f"{who}/on"] for w in r["write_s"]]
                # This machine's speed drifts by tens of percent within minutes: each repeat's "on" run against
                # the "off" run of the same repeat (run just before it), then the median of those ratios.
                pairs = [a["rate"] / b["rate"] for a, b in zip(runs[f"{who}/on"], runs[off_key]) if a["rate"] and b["rate"]]
                summary[who] = {
                    "samples_per_s_off": off, "samples_per_s_on": on,
                    "throughput_ratio_on_vs_off": median(pairs),
                    "throughput_ratios_by_repeat": [round(r, 3) for r in pairs],
                    "save_blocking_ms_median": round(1000 * statistics.median(blocking), 1) if blocking else None,
                    "save_blocking_ms_max": round(1000 * max(blocking), 1) if blocking else None,
                    "save_write_ms_median": round(1000 * statistics.median(write), 1) if write else None,
                }
            result[model] = summary
        write_json(args.out, {"benchmark": "snapshot_overhead", "every": args.every, "writers": writers,
                              "repeats": args.repeats, "models": result})


if __name__ == "__main__":
    main()
