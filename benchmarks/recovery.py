"""Recovery benchmark: worker kill, node loss, node join — baseline vs elastic_runner (launch and plain torchrun).

For each variant (see common.py) one job of two agents runs; then
- ``--repeats`` times: SIGKILL the worker of the second agent, time until all
  ranks step again (and count the steps recomputed);
- ``--repeats`` times: SIGKILL the second agent with its worker (node loss), time
  until the survivor steps at world size 1; start a new agent (node join), time
  from its start until all ranks step at world size 2.
- ``--scenarios spare``: in a job of at most two nodes, ``--repeats`` times: a third agent waits as a spare and a
  seated node is lost (time until all ranks step at world size 2 again); a node lost with its replacement started at
  once (the same); a node lost with nobody coming (world size 1), then a join.
A wait longer than ``--hang-after`` seconds is recorded as a hang (the shared
rendezvous store of torch's defaults makes joins hang) and ends that variant.

    .venv/bin/python benchmarks/recovery.py --repeats 3 --out results/recovery.json
    .venv/bin/python benchmarks/recovery.py --variants elastic-runner,elastic-runner-torchrun-tuned \
        --scenarios worker_kill --loader-workers 0,2          # recovery with DataLoader workers vs without
    .venv/bin/python benchmarks/recovery.py --variants elastic-runner --scenarios worker_kill \
        --compile 0,1                                         # a compiled model's recovery vs the same uncompiled
    .venv-vision/bin/python benchmarks/recovery.py --variants elastic-runner --scenarios node \
        --parallel ddp,fsdp                                   # a sharded model's node loss vs the replicated one
    .venv-vision/bin/python benchmarks/recovery.py --variants elastic-runner --scenarios node \
        --storage dir,s3                                      # node loss and join with snapshots in a bucket
    .venv-vision/bin/python benchmarks/recovery.py --variants elastic-runner,elastic-runner-torchrun \
        --scenarios worker_kill --in-process 0,1              # the survivor kept (recovery.in_process) vs restarted
    .venv-vision/bin/python benchmarks/recovery.py --variants elastic-runner --scenarios worker_kill \
        --in-process 0,1 --regroup reconfigure,recreate       # ... and the two ways it rebuilds its process group
    .venv-vision/bin/python benchmarks/recovery.py --variants elastic-runner --scenarios spare \
        --repeats 5                                           # a spare taking a lost node's place vs none waiting
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import time
from pathlib import Path
from typing import Any

from common import (
    OURS,
    SAME_SETTINGS,
    VARIANTS,
    Workload,
    furthest_completed_step,
    make_job,
    median,
    scratch_dir,
    wait_stepping,
    write_json,
)

from elastic_runner.chaos.faults import wait_until_spare
from elastic_runner.testing.s3_server import S3Server


#: The bucket of ``--storage s3`` on the local SeaweedFS.
BUCKET = "bench"


def measure(variant: str, repeats: int, hang_after: float, workdir: Path, scenarios: list[str],
            loader_workers: int = 0, compiled: bool = False, parallel: str = "ddp",
            s3: S3Server | None = None, in_process: bool = False, regroup: str = "auto") -> dict[str, Any]:
    key = variant_key(variant, loader_workers, compiled, parallel, "s3" if s3 else "dir", in_process, regroup)
    run_dir = workdir / key
    overrides = ({"model.compile": True} if compiled else {}) | ({"recovery.in_process": True} if in_process else {}) | \
        ({"parallel.strategy": parallel} if parallel != "ddp" else {}) | \
        ({"snapshot.dir": f"s3://{BUCKET}/{key}/snapshots"} if s3 else {}) | \
        ({"recovery.regroup": regroup} if in_process and regroup != "auto" else {})
    # With a spare the job's maximum is two nodes, so that a third agent waits beyond it.
    job = make_job(variant, Workload(workers=loader_workers), run_dir, nnodes="1:2" if "spare" in scenarios else "1:4",
                   **overrides)
    if s3 is not None:
        job.env |= s3.env()  # the agents and workers reach the bucket the AWS way
    result: dict[str, Any] = {"worker_kill": [], "node_loss": [], "node_join": [], "spare_takeover": [],
                              "replacement": [], "steps_lost": [], "hangs": []}
    try:
        job.start_agent()
        second = job.start_agent()
        started = time.time()
        took, _ = wait_stepping(variant, run_dir, started - 60, 2, 300)
        if took is None:
            raise RuntimeError(f"{variant}: the job never stepped at world size 2\n{job.logs_tail()}")
        time.sleep(3)
        def timed(kind: str, t: float, world: int, count_lost: bool = True) -> bool:
            """Wait for recovery after a fault at ``t``; record it; False on a hang."""
            took, attempt = wait_stepping(variant, run_dir, t, world, hang_after)
            if took is None:
                result["hangs"].append(kind)
                return False
            result[kind].append(round(took, 3))
            if count_lost and attempt is not None and attempt.resumed_step is not None:
                result["steps_lost"].append(furthest_completed_step(variant, run_dir, t) - attempt.resumed_step)
            time.sleep(3)
            return True

        if "worker_kill" in scenarios:
            for _ in range(repeats):
                # Rank 1's: rank 0's worker hosts the job's store, whose loss in-process recovery cannot survive.
                victim = next(w for w in job.workers() if w.rank == 1)
                t = time.time()
                job.signal_worker(victim, signal.SIGKILL)
                if not timed("worker_kill", t, 2):
                    return result
        if "node" in scenarios:
            for _ in range(repeats):
                t = time.time()
                job.kill_agent(second)
                if not timed("node_loss", t, 1):
                    return result
                t = time.time()
                second = job.start_agent()
                if not timed("node_join", t, 2, count_lost=False):
                    return result
        if "spare" in scenarios:
            for _ in range(repeats):
                # Interleaved in one job of at most two nodes: a node lost while a spare waits (the world stays at
                # two); one lost with its replacement started at once, as a restarted pod would be (the world is
                # two again once it joins); one lost with nobody coming (the world shrinks to one), then a join.
                spare = job.start_agent()
                if not wait_until_spare(job, spare):
                    raise RuntimeError(f"the spare never waited\n{job.logs_tail()}")
                t = time.time()
                job.kill_agent(_seated_guest(job))
                if not timed("spare_takeover", t, 2):
                    return result
                t = time.time()
                job.kill_agent(_seated_guest(job))
                job.start_agent()
                if not timed("replacement", t, 2, count_lost=False):  # (the first round, at world 1, lost it)
                    return result
                t = time.time()
                job.kill_agent(_seated_guest(job))
                if not timed("node_loss", t, 1):
                    return result
                t = time.time()
                job.start_agent()
                if not timed("node_join", t, 2, count_lost=False):
                    return result
        return result
    finally:
        job.close()


def _seated_guest(job: Any) -> Any:
    """A running agent with workers that does not host the c10d store (losing that loses a c10d job)."""
    for agent in job.running_agents():
        if not agent.hosts_store and job.workers(agent):
            return agent
    raise RuntimeError(f"no seated agent but the store's host is running\n{job.logs_tail()}")


def variant_key(variant: str, loader_workers: int, compiled: bool, parallel: str = "ddp", storage: str = "dir",
                in_process: bool = False, regroup: str = "auto") -> str:
    return variant + (f"@loader{loader_workers}" if loader_workers else "") + ("@compiled" if compiled else "") + \
        (f"@{parallel}" if parallel != "ddp" else "") + (f"@{storage}" if storage != "dir" else "") + \
        ("@in-process" if in_process else "") + (f"@{regroup}" if in_process and regroup != "auto" else "")


def summarize(raw: dict[str, dict[str, Any]], hang_after: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for variant, r in raw.items():
        # A hang ends the variant: the scenarios after it are not measured (None).
        out[variant] = {
            f"{kind}_s": "hang" if kind in r["hangs"] else median(r[kind])
            for kind in ("worker_kill", "node_loss", "node_join", "spare_takeover", "replacement")
        } | {
            "steps_lost_max": max(r["steps_lost"]) if r["steps_lost"] else None,
            "steps_lost_median": median([float(x) for x in r["steps_lost"]]),
        }
    ratios: dict[str, Any] = {}

    def ratio(name: str, ours: dict[str, Any], base: str) -> None:
        b = out.get(base)
        if not b or not ours:
            return
        for key in ("worker_kill_s", "node_loss_s", "node_join_s"):
            if isinstance(b.get(key), float) and isinstance(ours.get(key), float) and b[key] > 0:
                ratios[f"{name}{key[:-2]}_vs_{base}"] = round(ours[key] / b[key], 3)
            elif b.get(key) == "hang" and isinstance(ours.get(key), float):
                # An upper bound: the baseline took longer than hang_after (and maybe forever).
                ratios[f"{name}{key[:-2]}_vs_{base}"] = f"< {ours[key] / hang_after:.3f} (baseline hung > {hang_after:.0f} s)"

    # launch against both baselines (the keys the README has always shown) ...
    for base in ("torchrun-tuned", "torchrun-default"):
        ratio("", out.get("elastic-runner", {}), base)
    # ... and elastic_runner under plain torchrun against the tutorial script under the same torchrun settings,
    # and against torch's defaults.
    for variant, same in SAME_SETTINGS.items():
        for base in dict.fromkeys((same, "torchrun-default")):
            ratio(f"{variant}:", out.get(variant, {}), base)
    return {"medians": out, "ratios": ratios, "hang_after_s": hang_after}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--default-repeats", type=int, default=None,
                   help="repeats for torchrun-default (default: --repeats); its recoveries take 30-60 s each")
    p.add_argument("--hang-after", type=float, default=120.0, help="seconds without recovery that count as a hang")
    p.add_argument("--scenarios", default="worker_kill,node",
                   help="worker_kill, node (loss + join) and/or spare (in a job of at most two nodes: a node lost "
                        "while a third agent waits as a spare, one lost with its replacement started at once, one "
                        "lost with nobody coming, then a join; interleaved in the same job)")
    p.add_argument("--loader-workers", default="0",
                   help="data.num_workers (DataLoader processes per rank), comma-separated: each variant runs once "
                        "per value, e.g. 0,2 to compare recovery with and without loader workers in one run")
    p.add_argument("--compile", default="0",
                   help="model.compile, comma-separated 0/1: each of our variants runs once per value, e.g. 0,1 to "
                        "compare a compiled model's recovery with the same model uncompiled (the baselines: 0 only)")
    p.add_argument("--parallel", default="ddp",
                   help="parallel.strategy, comma-separated: each of our variants runs once per value, e.g. ddp,fsdp to "
                        "compare a sharded model's recovery (from the shards in node memory) with the replicated one")
    p.add_argument("--storage", default="dir",
                   help="where snapshots live, comma-separated: dir (RUN_DIR/snapshots) and/or s3 (a bucket on a local "
                        "SeaweedFS started here): each of our variants runs once per value, e.g. dir,s3 to compare a "
                        "join (and every recovery) with snapshots in object storage against a shared directory")
    p.add_argument("--in-process", default="0",
                   help="recovery.in_process, comma-separated 0/1: each of our variants runs once per value, e.g. 0,1 "
                        "to compare keeping the survivors' processes with restarting every worker")
    p.add_argument("--regroup", default="auto",
                   help="recovery.regroup for the in-process runs, comma-separated auto/reconfigure/recreate: each "
                        "in-process run is made once per value, e.g. reconfigure,recreate to compare the two ways the "
                        "survivors rebuild their process group")
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default=None, help="write the JSON result here too")
    args = p.parse_args()
    with scratch_dir(args.workdir, "er-bench-recovery-") as workdir, contextlib.ExitStack() as servers:
        raw = {}
        storages = [s.strip() for s in args.storage.split(",") if s.strip()]
        s3 = None
        if "s3" in storages:
            s3 = servers.enter_context(S3Server(workdir / "seaweedfs"))
            s3.create_bucket(BUCKET)
        loader_counts = [int(n) for n in args.loader_workers.split(",") if n.strip()]
        compiles = [bool(int(n)) for n in args.compile.split(",") if n.strip()]
        strategies = [s.strip() for s in args.parallel.split(",") if s.strip()]
        kept = [bool(int(n)) for n in args.in_process.split(",") if n.strip()]
        regroups = [r.strip() for r in args.regroup.split(",") if r.strip()]
        for variant in [v.strip() for v in args.variants.split(",") if v.strip()]:
            for workers in loader_counts:
                for compiled in compiles if variant in OURS else [False]:
                    for parallel in strategies if variant in OURS else ["ddp"]:
                        for storage, in_process, regroup in [
                                (s, k, r) for s in (storages if variant in OURS else ["dir"])
                                for k in (kept if variant in OURS else [False]) for r in (regroups if k else ["auto"])]:
                            key = variant_key(variant, workers, compiled, parallel, storage, in_process, regroup)
                            started = time.monotonic()
                            repeats = (args.default_repeats if variant == "torchrun-default" and args.default_repeats
                                       else args.repeats)
                            raw[key] = measure(variant, repeats, args.hang_after, workdir, args.scenarios.split(","),
                                               workers, compiled, parallel, s3 if storage == "s3" else None,
                                               in_process, regroup)
                            raw[key]["wall_s"] = round(time.monotonic() - started, 1)
                            print(f"{key}: {raw[key]}", flush=True)
        result = summarize(raw, args.hang_after)
        # A node lost with a spare waiting against one replaced by a new agent at once (both keep the world size)
        # and one lost with nobody coming (the world shrinks), in the same job.
        for key, medians in result["medians"].items():
            for base in ("replacement_s", "node_loss_s"):
                if isinstance(medians.get("spare_takeover_s"), float) and isinstance(medians.get(base), float):
                    result["ratios"][f"{key}:spare_takeover_vs_{base[:-2]}"] = round(
                        medians["spare_takeover_s"] / medians[base], 3)
        # Loader processes, compiling and sharding must not slow recovery, and in-process recovery must speed it up:
        # each such variant against itself without.
        for key, medians in result["medians"].items():
            variant, _, extra = key.partition("@")
            base = result["medians"].get(variant, {})
            for scenario in ("worker_kill_s", "node_loss_s", "node_join_s"):
                if extra and isinstance(medians.get(scenario), float) and isinstance(base.get(scenario), float):
                    result["ratios"][f"{key}:{scenario[:-2]}_vs_{variant}"] = round(medians[scenario] / base[scenario], 3)
        write_json(args.out, {"benchmark": "recovery", "repeats": args.repeats, "workdir": args.workdir, "raw": raw} | result)


if __name__ == "__main__":
    main()
