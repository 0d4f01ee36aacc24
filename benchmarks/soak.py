"""A thousand faults in one job: a supervised soak on etcd-v3, judged against a fault-free run.

One job of ``configs/soak.yaml`` (the digits CNN, stable for tens of thousands of steps) on a
self-started etcd with 3 agents (``--nnodes 1:4``, one worker each), under ``elastic-runner launch``.
``elastic-runner chaos`` injects exactly ``--faults`` faults of every type, placed by step (each one
``--every-steps`` steps after the previous injection, and not before the previous fault has an outcome),
and keeps 3 agents running as a Kubernetes Job would (a lost agent is replaced after ``--supervise`` seconds). A fault-free reference
run of the same config (at world size 1 unless ``--reference-agents``: the same global batch, and the soak
visits world sizes 1-4 anyway) comes first. The chaos tool's invariants (no sample lost or repeated, constant
global batch, every resume from the newest state, no orphan process, the job finishes, final loss
within tolerance of the reference) decide the exit status.

    .venv/bin/python benchmarks/soak.py --faults 1000 --out results/soak-1000     # ~1.5 h on 2 cores
    .venv/bin/python benchmarks/soak.py --faults 20 --out /tmp/soak-20            # ~3 min
    .venv/bin/python benchmarks/soak.py --faults 200 --types all --nnodes 1:3 --out /tmp/soak-all  # every fault type

Writes ``OUT/soak.json`` (the figures; ``faulted_window``: the goodput from the job's start to the last fault's
outcome, without the fault-free steps after it), ``OUT/timeline.png`` and the chaos tool's reports under
``OUT/run/chaos/``. Needs etcd on the PATH (``apt-get install etcd-server``), and root for ``fill-disk``
(the job's snapshots go on a small tmpfs, gone with the soak; without root that fault is left out).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from common import ROOT, write_json

from elastic_runner.chaos.runner import ChaosRun
from elastic_runner.chaos.scenario import FAULT_TYPES, Scenario, ScenarioError

# slow-node lasts seconds; spare-takeover needs a full round (agents = --nnodes' maximum), which the default job is not:
# ask for it with --types and --nnodes 1:3.
DEFAULT_TYPES = [t for t in FAULT_TYPES if t not in ("slow-node", "spare-takeover")]

#: Steps of training planned per fault: the mean interval, plus what runs while a fault is judged and settles
#: (an absorbed one needs ~2 s of training to tell; a resume from disk redoes steps), with a margin: skipped
#: faults are drawn again, and the job must outlast the last one. Measured: 146 steps a fault at 40:80 on the
#: 2-core VM (the first 1,000-fault run planned 110 and ran out of steps after 919 faults); 277 with in-process
#: recovery across rounds, whose shorter recoveries leave more of each fault's judging to training (60-fault runs
#: planned 202 and 241 a fault and ran out after 53 and 56). The steps left after the last fault are not in
#: ``faulted_window``'s goodput.
JUDGING_STEPS = 170
STEP_MARGIN = 1.3
#: Steps after the last fault's place: its judging, plus a resume from disk just before it, which takes the job back
#: by up to a snapshot interval while the faults' places (steps reached) do not move back (seen: 347 steps redone by
#: the 8th of 9 faults left the 9th at the job's end).
TAIL_STEPS = 700
#: Steps a slow-node fault holds the next one for: its throttle's 10 s go by before it is judged, however many steps
#: they hold. Measured: 475 steps a slow-node fault (2026-12-06, 50 of them in a 200-fault soak of slow-node,
#: kill-worker, kill-node, join and spare-takeover, which planned 299 a fault and ran out after 190); 850 (median,
#: 450-1,050) once the throttle stretched only the compute, which slows the job less (2026-12-07, a 50-fault soak of
#: slow-node alone, which planned 624 a fault and ran out after 38); 1,150 (median, 700-1,350) since the workers
#: stretch their own compute (2026-12-07, the same soak: it planned 1,105 a fault and injected all 50, barely).
SLOW_NODE_STEPS = 1150


def planned_steps(faults: int, every: tuple[int, int], types: list[str]) -> int:
    """Training steps for ``faults`` faults drawn evenly from ``types`` every ``every`` steps, and the tail."""
    each = ((every[0] + every[1]) / 2 + JUDGING_STEPS) * STEP_MARGIN
    slow = types.count("slow-node") / len(types) if types else 0.0
    return int(faults * ((1 - slow) * each + slow * max(each, SLOW_NODE_STEPS * STEP_MARGIN))) + TAIL_STEPS


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (nearest rank) of ``values``; None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def soak_figures(report: dict[str, Any], wanted: int, seconds: float) -> dict[str, Any]:
    """The soak's figures from the chaos tool's report."""
    faults = report["faults"]
    recovered = [f for f in faults if f.get("outcome") == "recovered"]
    times = [float(f["recovery_s"]) for f in recovered if f.get("recovery_s") is not None]
    audit = report["audit"]
    comparison = report.get("reference") or {}
    goodput = report.get("goodput") or {}
    by_type: dict[str, dict[str, int]] = {}
    for f in faults:
        counts = by_type.setdefault(f["type"], {"injected": 0, "recovered": 0, "absorbed": 0, "job ended": 0})
        counts["injected"] += 1
        if f.get("outcome") in counts:
            counts[f["outcome"]] += 1
    return {
        "ok": bool(report["ok"]) and len(faults) == wanted,
        "faults_wanted": wanted,
        "faults_injected": len(faults),
        "recoveries": len(recovered),
        "absorbed": sum(1 for f in faults if f.get("outcome") == "absorbed"),
        "job_ended": sum(1 for f in faults if f.get("outcome") == "job ended"),
        "undecided": sum(1 for f in faults if f.get("outcome") is None),
        "by_type": by_type,
        "replacements": report.get("replacements", 0),
        "samples_lost": sum(e["missing"] for e in audit.get("epochs", [])),
        "samples_repeated": sum(e["duplicates"] for e in audit.get("epochs", [])),
        "epochs_audited": len(audit.get("epochs", [])),
        "recovery_p50_s": round(statistics.median(times), 3) if times else None,
        "recovery_p99_s": percentile(times, 99),
        "recovery_max_s": max(times, default=None),
        "recovery_by_type_p50_s": {t: round(statistics.median(v), 3) for t in FAULT_TYPES
                                   if (v := [float(f["recovery_s"]) for f in recovered
                                             if f["type"] == t and f.get("recovery_s") is not None])},
        "steps_recomputed_total": sum(int(f.get("steps_recomputed") or 0) for f in recovered),
        "goodput": goodput.get("goodput"),
        "goodput_lost_s": goodput.get("lost_s"),
        "final_step": audit.get("final_step"),
        "final_loss": comparison.get("loss"),
        "reference_final_loss": comparison.get("reference_loss"),
        "reference_check": comparison.get("detail"),
        "finished": bool(report["checks"]["job finished"]["ok"]),
        "checks": report["checks"],
        "generations": report.get("generations"),
        "job_wall_s": report.get("wall_seconds"),
        "soak_wall_s": round(seconds, 1),
    }


def faulted_window(run_dir: Path, faults: list[dict[str, Any]]) -> dict[str, Any]:
    """Goodput from the job's start to the last fault's outcome (its recovery, or how long it lasted), and the fault
    rate there: the job's whole goodput also counts the fault-free steps after the last fault up to the planned end,
    which are more or fewer from run to run (a run whose recoveries are shorter has more left)."""
    from elastic_runner.observe.events import read_events
    from elastic_runner.observe.report import summarize

    if not faults:
        return {}
    end = max(float(f["at"]) + float(f.get("recovery_s") or 0.0) + float(f.get("lasts_s") or 0.0) for f in faults)
    events = [e for e in read_events(str(run_dir)) if isinstance(e.get("time"), (int, float)) and e["time"] <= end + 1]
    try:
        goodput = summarize(str(run_dir), events).goodput
    except (ValueError, KeyError):
        return {}
    if goodput is None or goodput.fraction is None:
        return {}
    return {"goodput": round(goodput.fraction, 4), "wall_s": round(goodput.wall_s, 1),
            "faults_per_min": round(len(faults) / (goodput.wall_s / 60.0), 1),
            "lost_s": {cause: round(seconds, 1) for cause, seconds in goodput.lost_s.items()}}


@contextlib.contextmanager
def snapshot_volume(path: Path, megabytes: int) -> Iterator[bool]:
    """A small tmpfs for the job's snapshots, so that fill-disk fills a volume and not this machine's disk.
    Yields False where it cannot be mounted (mounting needs root)."""
    path.mkdir(parents=True)
    try:
        ok = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={megabytes}m,mode=0700", "tmpfs", str(path)],
                            capture_output=True, text=True).returncode == 0
    except OSError:  # no mount command
        ok = False
    try:
        yield ok
    finally:
        if ok:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--faults", type=int, default=1000, help="faults to inject (default 1000)")
    ap.add_argument("--out", required=True, help="new directory for the run, soak.json and timeline.png")
    ap.add_argument("--config", default=str(ROOT / "configs" / "soak.yaml"))
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="config override for both runs (e.g. data.sampler=... to prove the checks can fail)")
    ap.add_argument("--types", default=",".join(DEFAULT_TYPES),
                    help="fault types to draw, or all (default: all but slow-node, whose throttle of seconds "
                         "outlasts the 40-80 steps between faults, and spare-takeover, which needs a full round: "
                         "--nnodes 1:3); with corrupt-param or nan-batch, recovery.max_rollbacks is set to --faults "
                         "(each is rolled back), with nan-batch train.on_nonfinite to rollback, and with slow-node "
                         "recovery.straggler_window_seconds to 4 and recovery.straggler_ratio to 2.0")
    ap.add_argument("--every-steps", default="40:80", metavar="MIN:MAX", help="steps between faults (default 40:80)")
    ap.add_argument("--agents", type=int, default=3)
    ap.add_argument("--nnodes", default="1:4")
    ap.add_argument("--supervise", type=float, default=2.0, help="seconds before a lost agent is replaced")
    ap.add_argument("--hang-seconds", type=float, default=5.0)
    ap.add_argument("--fill-seconds", type=float, default=4.0, help="how long fill-disk keeps the volume full")
    ap.add_argument("--snapshot-volume-mb", type=int, default=64,
                    help="size of the tmpfs the job's snapshots live on (for fill-disk; needs root, else fill-disk "
                         "is left out)")
    ap.add_argument("--reference-agents", type=int, default=1,
                    help="agents of the fault-free reference run (default 1: the same global batch, 3x faster here)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--loss-tolerance", type=float, default=0.25,
                    help="final loss within this fraction of the reference's (the world size changes)")
    ap.add_argument("--timeout", type=float, default=None, help="give up after this many seconds (default: 30 s a fault + 10 min)")
    args = ap.parse_args(argv)

    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        ap.error(f"--out {out} is not empty: a soak starts from scratch")
    lo, _, hi = args.every_steps.partition(":")
    if not lo.isdigit() or not (hi or lo).isdigit() or not 0 < int(lo) <= int(hi or lo):
        ap.error(f"--every-steps {args.every_steps!r}: write MIN:MAX steps, e.g. 40:80")
    every = (int(lo), int(hi or lo))
    if args.faults < 1:
        ap.error("--faults must be at least 1")
    types = list(FAULT_TYPES) if args.types == "all" else [t.strip() for t in args.types.split(",") if t.strip()]
    steps = planned_steps(args.faults, every, types)
    out.mkdir(parents=True, exist_ok=True)
    volume = out / "snapshot-volume"
    with snapshot_volume(volume, args.snapshot_volume_mb) if "fill-disk" in types else contextlib.nullcontext(False) \
            as mounted:
        extra = [f"snapshot.dir={volume / 'snapshots'}"] if mounted else []
        if "fill-disk" in types and not mounted:
            types.remove("fill-disk")
            print("soak: fill-disk left out: a small volume for the snapshots cannot be mounted here (needs root)")
        # Every flipped bit and NaN batch is rolled back; a real job stops after recovery.max_rollbacks of them (a
        # device that keeps corrupting its replica, a run that diverges), the soak injects them on purpose.
        extra += [f"recovery.max_rollbacks={args.faults}"] if {"corrupt-param", "nan-batch"} & set(types) else []
        extra += ["train.on_nonfinite=rollback"] if "nan-batch" in types else []
        # A throttle of seconds must be named within them, so the window is short; and the soak's "nodes" share two
        # cores, where a process starting beside a worker (a joining agent, a spare building its standby) slows it
        # by 1.4-1.6x for seconds. A slowed node's workers stretch their compute to 4x and run 3.1-3.8x their peers'
        # local time (the median per fault, 50 faults, 2026-12-07: the update after the sync is not stretched).
        # Chosen when an outside throttle left them 2.1-2.8x, by replaying the watch over two soaks' windows
        # (benchmarks.md, 2026-12-07): 2.0 over 4 s named every one of those and no worker never slowed; 2.5 over
        # 3 s missed 2 of 36, 2.0 over 3 s named one bystander. Kept: a wide margin now.
        extra += ["recovery.straggler_window_seconds=4", "recovery.straggler_ratio=2.0"] if "slow-node" in types else []
        scenario = Scenario(
            config=args.config, run_dir=str(out / "run"),
            overrides=[f"train.max_steps={steps}", *extra, *args.overrides],
            nnodes=args.nnodes, agents=args.agents, rdzv_backend="etcd-v3", launcher="elastic-runner",
            random_types=types, every_steps=every, count=args.faults, seed=args.seed, hang_seconds=args.hang_seconds,
            fill_seconds=args.fill_seconds, supervise=args.supervise, reference=True,
            reference_agents=args.reference_agents, loss_tolerance=args.loss_tolerance, settle_seconds=0.5,
            timeout=args.timeout if args.timeout is not None else 30.0 * args.faults + 600.0,
        )
        print(f"soak: {args.faults} fault(s) of {', '.join(types)} every {every[0]}-{every[1]} steps, {steps} steps, "
              f"{args.agents} agents supervised ({args.supervise:g} s), etcd-v3", flush=True)
        started = time.monotonic()
        try:
            verdict, report = ChaosRun(scenario, out=lambda line: print(line, flush=True)).run()
        except ScenarioError as exc:
            print(f"soak: {exc}", file=sys.stderr)
            return 2
    figures = soak_figures(report, args.faults, time.monotonic() - started)
    figures["command"] = " ".join(["benchmarks/soak.py", *(argv if argv is not None else sys.argv[1:])])
    figures["steps_planned"] = steps
    figures["faulted_window"] = faulted_window(Path(scenario.run_dir), report["faults"])
    timeline = Path(scenario.run_dir) / "chaos" / "timeline.png"
    if timeline.is_file():
        shutil.copyfile(timeline, out / "timeline.png")
        figures["timeline"] = str(out / "timeline.png")
    write_json(str(out / "soak.json"), figures)
    for name, (ok, detail) in verdict.checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}")
    if len(report["faults"]) != args.faults:
        print(f"FAIL  {len(report['faults'])} of {args.faults} faults injected (the job ended first?)")
    return 0 if figures["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
