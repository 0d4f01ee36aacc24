"""Run the whole benchmark suite and print the summary table for the README.

Each benchmark is also runnable alone (see its docstring). With the defaults
the suite takes about 15 minutes on a 2-core machine (torchrun with its
default settings is measured once: each of its recoveries takes 30-60 s, and
its join hangs until ``--hang-after``); ``--quick`` trims the repeats. Results: ``--out DIR/{recovery,throughput,snapshots,rendezvous}.json``
and ``DIR/summary.md``.

    .venv/bin/python benchmarks/run_all.py --out results/
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def run(script: str, out: Path, *args: str) -> dict[str, Any] | None:
    started = time.monotonic()
    print(f"==> {script} {' '.join(args)}", flush=True)
    result = subprocess.run([sys.executable, str(HERE / script), "--out", str(out), *args], cwd=HERE)
    print(f"    {script}: exit {result.returncode} after {time.monotonic() - started:.0f}s", flush=True)
    return json.loads(out.read_text()) if out.is_file() else None


def fmt(value: Any, unit: str = "", hang_after: float | None = None) -> str:
    if value is None:
        return "n/a"
    if value == "hang":
        return f"hang (> {hang_after:.0f} s)" if hang_after else "hang"
    if isinstance(value, float):
        return f"{value:.2f}{unit}"
    return f"{value}{unit}"


def table(recovery: dict[str, Any] | None, throughput: dict[str, Any] | None, snapshots: dict[str, Any] | None) -> str:
    lines = ["| measure | torchrun defaults | torchrun tuned | elastic_runner (launch) | ratio vs tuned | ratio vs defaults |",
             "|---|---|---|---|---|---|"]
    plain: list[str] = []
    if recovery:
        med, ratios, hang = recovery["medians"], recovery["ratios"], recovery.get("hang_after_s")
        rows = [("worker SIGKILL -> all ranks stepping", "worker_kill_s", "worker_kill"),
                ("node loss -> survivors stepping", "node_loss_s", "node_loss"),
                ("node join -> stepping at the larger world", "node_join_s", "node_join")]
        for label, key, rkey in rows:
            lines.append(f"| {label} (s, median) | {fmt(med.get('torchrun-default', {}).get(key), hang_after=hang)} | "
                         f"{fmt(med.get('torchrun-tuned', {}).get(key), hang_after=hang)} | "
                         f"{fmt(med.get('elastic-runner', {}).get(key), hang_after=hang)} | "
                         f"{fmt(ratios.get(f'{rkey}_vs_torchrun-tuned'))} | {fmt(ratios.get(f'{rkey}_vs_torchrun-default'))} |")
        lines.append(f"| steps recomputed per failure (max) | {fmt(med.get('torchrun-default', {}).get('steps_lost_max'))} | "
                     f"{fmt(med.get('torchrun-tuned', {}).get('steps_lost_max'))} | "
                     f"{fmt(med.get('elastic-runner', {}).get('steps_lost_max'))} | | |")
        if any(v in med for v in ("elastic-runner-torchrun", "elastic-runner-torchrun-tuned")):
            plain = ["| plain `torchrun -m elastic_runner.train` | torchrun defaults: elastic_runner | ratio vs tutorial, "
                     "same defaults | torchrun tuned: elastic_runner | ratio vs tutorial, same tuning |", "|---|---|---|---|---|"]
            for label, key, rkey in rows:
                d, tu = "elastic-runner-torchrun", "elastic-runner-torchrun-tuned"
                plain.append(f"| {label} (s, median) | {fmt(med.get(d, {}).get(key), hang_after=hang)} | "
                             f"{fmt(ratios.get(f'{d}:{rkey}_vs_torchrun-default'))} | "
                             f"{fmt(med.get(tu, {}).get(key), hang_after=hang)} | "
                             f"{fmt(ratios.get(f'{tu}:{rkey}_vs_torchrun-tuned'))} |")
    if throughput:
        r = throughput["ratios"]
        m = throughput["median_samples_per_s"]
        lines.append(f"| steady-state samples/s (no faults) | | {fmt(m.get('baseline'))} | {fmt(m.get('elastic-runner'))} | "
                     f"{fmt(r.get('elastic-runner_vs_baseline'))} | |")
    if snapshots:
        for model, s in snapshots["models"].items():
            b, o = s["baseline"], s["elastic-runner-process"]  # the default writer
            lines.append(f"| {model} model: throughput with snapshots every {snapshots['every']} steps / without | | "
                         f"{fmt(b.get('throughput_ratio_on_vs_off'))} | {fmt(o.get('throughput_ratio_on_vs_off'))} | | |")
            lines.append(f"| {model} model: save blocks the step (ms, median) / full write | | "
                         f"{fmt(b.get('save_blocking_ms_median'))} / {fmt(b.get('save_write_ms_median'))} | "
                         f"{fmt(o.get('save_blocking_ms_median'))} / {fmt(o.get('save_write_ms_median'))} | | |")
    return "\n".join(lines) + ("\n\n" + "\n".join(plain) if plain else "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results")
    p.add_argument("--quick", action="store_true", help="one repeat each (noisier)")
    p.add_argument("--skip", default="", help="comma-separated: recovery,throughput,snapshots,rendezvous")
    args = p.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    reps = "1" if args.quick else "3"
    started = time.monotonic()
    recovery = None if "recovery" in skip else run("recovery.py", out / "recovery.json", "--repeats", reps,
                                                          "--default-repeats", "1", "--hang-after", "100")
    throughput = None if "throughput" in skip else run("throughput.py", out / "throughput.json", "--repeats", reps,
                                                                "--steps", "400", "--skip", "80")
    snapshots = None if "snapshots" in skip else run("snapshot_overhead.py", out / "snapshots.json", "--repeats", "1" if args.quick else "2",
                                                                  "--writers", "process")
    rendezvous = None if "rendezvous" in skip else run("rendezvous_scale.py", out / "rendezvous.json")
    summary = table(recovery, throughput, snapshots)
    if rendezvous:
        summary += "\n\nRendezvous of N simulated agents (seconds to a complete round, requests per agent):\n\n"
        summary += rendezvous["table"]
    (out / "summary.md").write_text(summary + "\n")
    print(f"\n{summary}\n\nsuite took {time.monotonic() - started:.0f}s; results in {out}")


if __name__ == "__main__":
    main()
