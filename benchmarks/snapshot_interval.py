"""snapshot.every_steps: auto against fixed intervals, on simulated failure traces.

A job of ``--work-hours`` of steps; whole-job losses arrive as a Poisson process (mean ``--mtbf``
hours); a loss rolls the job back to its last durable snapshot and costs ``--restart`` seconds; every
snapshot costs ``C`` seconds of training. Waste = (wall time - useful work) / wall time, the mean over
``--seeds`` traces, for fixed intervals and for ``auto`` (elastic_runner.snapshot.interval, with a prior
that can be wrong by a factor: it learns the rate from the losses it sees). The same traces for every
policy (seeded).

    .venv/bin/python benchmarks/snapshot_interval.py --out results/snapshot_interval.json
"""

from __future__ import annotations

import argparse
import random
import statistics
from typing import Any

from common import write_json  # noqa: F401 - sets up the import path

from elastic_runner.snapshot.interval import AutoInterval


def simulate(policy: int | str, cost_s: float, step_s: float, mtbf_s: float, work_s: float, restart_s: float,
             seed: int, prior_mtbf_s: float) -> float:
    """Waste fraction of one trace."""
    rng = random.Random(seed)
    wall, done, since_snapshot = 0.0, 0.0, 0.0
    next_loss = rng.expovariate(1 / mtbf_s)
    auto = AutoInterval(prior_mtbf_s=prior_mtbf_s, run_started=0.0, clock=lambda: wall) if policy == "auto" else None
    if auto is not None:
        auto.step_times.extend([step_s] * 3)
    interval = policy if isinstance(policy, int) else auto.current  # type: ignore[union-attr]
    steps_since = 0
    while done < work_s:
        wall += step_s
        done += step_s
        since_snapshot += step_s
        steps_since += 1
        if wall >= next_loss:  # the whole job is lost: back to the last snapshot
            done -= since_snapshot
            since_snapshot, steps_since = 0.0, 0
            wall += restart_s
            next_loss = wall + rng.expovariate(1 / mtbf_s)
            if auto is not None:
                auto.losses += 1
            continue
        if steps_since >= interval:
            wall += cost_s
            since_snapshot, steps_since = 0.0, 0
            if auto is not None:
                auto.snapshot_cost(0.0, cost_s)
                interval = auto.steps()
            if wall >= next_loss:
                continue
    return (wall - work_s) / wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work-hours", type=float, default=48.0)
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--restart", type=float, default=60.0, help="seconds a whole-job loss costs besides the redone work")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    fixed = [10, 50, 200, 1000, 5000]
    cases = [  # (snapshot cost s, step s, true MTBF h, prior MTBF h)
        (0.5, 0.1, 24.0, 24.0), (0.5, 0.1, 2.0, 24.0), (5.0, 0.5, 6.0, 24.0), (30.0, 1.0, 6.0, 24.0),
        (30.0, 1.0, 1.0, 24.0), (5.0, 0.5, 24.0, 2.0),
    ]
    rows: list[dict[str, Any]] = []
    for cost, step, mtbf_h, prior_h in cases:
        waste: dict[str, float] = {}
        for policy in [*fixed, "auto"]:
            waste[str(policy)] = statistics.mean(
                simulate(policy, cost, step, mtbf_h * 3600, args.work_hours * 3600, args.restart, seed, prior_h * 3600)
                for seed in range(args.seeds))
        best = min((v, k) for k, v in waste.items() if k != "auto")
        rows.append({"cost_s": cost, "step_s": step, "mtbf_h": mtbf_h, "prior_mtbf_h": prior_h,
                     "waste": {k: round(v, 5) for k, v in waste.items()}, "best_fixed": best[1],
                     "auto_vs_best_fixed": round(waste["auto"] / best[0], 3) if best[0] > 0 else None,
                     "auto_vs_default_50": round(waste["auto"] / waste["50"], 3) if waste["50"] > 0 else None})
        print(f"C={cost:>5} s step={step:>4} s MTBF={mtbf_h:>5} h prior={prior_h:>5} h: " +
              " ".join(f"{k}:{v:.4f}" for k, v in waste.items()) +
              f"  auto/best fixed ({best[1]}) = {rows[-1]['auto_vs_best_fixed']}", flush=True)
    write_json(args.out, {"benchmark": "snapshot_interval", "work_hours": args.work_hours, "seeds": args.seeds,
                          "restart_s": args.restart, "cases": rows})


if __name__ == "__main__":
    main()
