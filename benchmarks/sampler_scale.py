"""Sampler scale: what the epoch order costs a process at 10^6 to 10^10 samples, feistel against legacy randperm.

For each order (``--orders``) and dataset size N (``--sizes``), a fresh interpreter (this script with
``--child``) builds an :class:`~elastic_runner.data.sampler.ElasticSampler` of N samples and global batch G
(``--global-batch``, one rank) and measures:

- ``rss_mb``: the increase of the process's peak resident memory (``ru_maxrss``) over all that follows,
  against the peak after the imports and a warm-up plan on a 1,000-sample sampler (so neither the
  interpreter, torch, numpy nor their first-call set-up counts);
- ``first_plan_ms``: the first ``plan_at(0, 0)`` of an epoch (randperm: materialises the epoch's order);
- ``step_plan_ms``: the median (and p99) time to plan a step, over ``--steps`` consecutive steps after it;
- ``resume_ms``: a resume in the middle of an epoch: construct a new sampler, ``load_state_dict`` with
  ``consumed`` = N/2 rounded down to the batch, plan the first step (the first sampler is dropped before).

The randperm order runs only up to ``--legacy-max`` samples (its epoch is an int64 tensor of N entries, and
``torch.randperm`` needs as much again while it runs: 10^9 samples would need ~16 GB). It is measured as
:class:`~elastic_runner.data.order.RandpermOrder` keeps it (a tensor). The order ``before`` is the sampler as it was
before the epoch order became a function (``--before``, a git revision: its ``data/sampler.py``, loaded as it was),
which kept the same order as a list of Python ints; also only up to ``--legacy-max``.

    .venv-vision/bin/python benchmarks/sampler_scale.py                          # 10^6 .. 10^10, a minute or so
    .venv-vision/bin/python benchmarks/sampler_scale.py --sizes 1e6,1e12 --legacy-max 0 --out results/sampler.json
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: kilobytes


def sampler_before(revision: str) -> Any:
    """``ElasticSampler`` of ``data/sampler.py`` at ``revision``: the baseline, loaded from git as it was."""
    import importlib.util
    import tempfile

    source = subprocess.run(["git", "show", f"{revision}:elastic_runner/data/sampler.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "sampler_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("sampler_before", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules["sampler_before"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    cls = module.ElasticSampler

    def build(num_samples: int, global_batch: int, order: str | None = None) -> Any:
        return cls(num_samples, global_batch)
    return build


def measure(order: str, num_samples: int, global_batch: int, steps: int, before: str = "") -> dict[str, Any]:
    """One (order, N), in this process: see the module docstring."""
    from elastic_runner.data.sampler import ElasticSampler

    if order == "before":
        ElasticSampler = sampler_before(before)  # noqa: N806 - the same name, the old class
    warm = ElasticSampler(1000, min(global_batch, 1000), order=order)
    warm.plan_at(0, 0)
    del warm
    gc.collect()
    before = _peak_rss_bytes()

    t0 = time.perf_counter()
    sampler = ElasticSampler(num_samples, global_batch, order=order)
    first = sampler.plan_at(0, 0)
    first_s = time.perf_counter() - t0
    assert first is not None and len(first.indices) == global_batch

    step_s = []
    for k in range(1, steps + 1):
        t = time.perf_counter()
        plan = sampler.plan_at(0, (k * global_batch) % (num_samples - global_batch + 1))
        step_s.append(time.perf_counter() - t)
        assert plan is not None
    state = sampler.state_dict()
    del sampler, plan, first
    gc.collect()

    consumed = (num_samples // 2) // global_batch * global_batch
    t0 = time.perf_counter()
    resumed = ElasticSampler(num_samples, global_batch)  # built as a run builds it: the state says the order
    resumed.load_state_dict(dict(state, consumed=consumed))
    plan = next(resumed.plans())
    resume_s = time.perf_counter() - t0
    assert plan.start == consumed and getattr(resumed, "order_kind", "before") == order

    step_s.sort()
    return {
        "order": order, "num_samples": num_samples, "global_batch": global_batch, "steps": steps,
        "rss_mb": round((_peak_rss_bytes() - before) / 2**20, 1),
        "first_plan_ms": round(first_s * 1e3, 3),
        "step_plan_ms": round(statistics.median(step_s) * 1e3, 3),
        "step_plan_mean_ms": round(statistics.fmean(step_s) * 1e3, 3),
        "step_plan_p99_ms": round(step_s[min(len(step_s) - 1, int(0.99 * len(step_s)))] * 1e3, 3),
        "resume_ms": round(resume_s * 1e3, 3),
    }


def run_child(order: str, num_samples: int, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", order, str(num_samples),
           "--global-batch", str(args.global_batch), "--steps", str(args.steps), "--before", args.before]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"order": order, "num_samples": num_samples, "error": f"no result within {args.timeout} s"}
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["?"])[-1]
        return {"order": order, "num_samples": num_samples, "error": f"exit {done.returncode}: {tail}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def markdown(results: list[dict[str, Any]]) -> str:
    lines = ["| order | N | peak RSS increase (MB) | first plan (ms) | step plan, median (ms) | mean (ms) | p99 (ms) "
             "| resume mid-epoch (ms) |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        n = f"{r['num_samples']:.0e}".replace("+0", "").replace("+", "")
        if "error" in r:
            lines.append(f"| {r['order']} | {n} | {r['error']} | | | | | |")
        elif r.get("skipped"):
            lines.append(f"| {r['order']} | {n} | skipped (> --legacy-max) | | | | | |")
        else:
            lines.append(f"| {r['order']} | {n} | {r['rss_mb']} | {r['first_plan_ms']} | {r['step_plan_ms']} "
                         f"| {r['step_plan_mean_ms']} | {r['step_plan_p99_ms']} | {r['resume_ms']} |")
    return "\n".join(lines)


def _size(text: str) -> int:
    return int(float(text)) if "e" in text.lower() else int(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1e6,1e7,1e8,1e9,1e10", help="dataset sizes, comma-separated (1e9 or 10^9 style)")
    p.add_argument("--orders", default="feistel,randperm,before")
    p.add_argument("--before", default="1f697d3", help="git revision of the sampler before the order was a function")
    p.add_argument("--global-batch", type=int, default=512)
    p.add_argument("--steps", type=int, default=1000, help="steps timed after the first plan")
    p.add_argument("--legacy-max", type=_size, default=10**7, help="largest N the randperm order is run at")
    p.add_argument("--timeout", type=float, default=600, help="seconds per (order, N)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--child", nargs=2, metavar=("ORDER", "N"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], int(args.child[1]), args.global_batch, args.steps, args.before)))
        return

    from common import write_json

    sizes = [_size(s.replace("10^", "1e")) for s in args.sizes.split(",") if s.strip()]
    results: list[dict[str, Any]] = []
    for n in sizes:
        for order in [o.strip() for o in args.orders.split(",") if o.strip()]:
            if order in ("randperm", "before") and n > args.legacy_max:
                results.append({"order": order, "num_samples": n, "skipped": True})
                continue
            results.append(run_child(order, n, args))
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    table = markdown(results)
    write_json(args.out, {"benchmark": "sampler_scale", "global_batch": args.global_batch, "steps": args.steps,
                          "python": sys.version.split()[0], "results": results, "table": table})
    print(table)


if __name__ == "__main__":
    main()
