"""Steady-state throughput: elastic_runner (every feature on) vs the baseline DDP script.

No faults. One agent with two workers, the same model, data and global batch,
``--steps`` steps, the rate measured between step ``--skip`` and the end (so
start-up is excluded). Three workloads (``--workloads``): ``cnn`` (a 32-channel CNN on
3x32x32 synthetic images, samples/s), ``gpt`` (the tiny GPT of configs/tiny-lm.yaml on
the shipped Shakespeare text, AdamW, tokens/s; elastic_runner with its token-weighted
loss, the baseline with the mean token loss of its batch) and ``resnet18`` (torchvision's
resnet18 on augmented 3x32x32 images from 2 DataLoader workers per rank, images/s; needs
the vision extra). Variants run interleaved,
``--repeats`` times each, and medians are compared, because this machine's speed drifts
with other load:

- ``baseline``: benchmarks/baseline_ddp.py under tuned torchrun, checkpoint every 50 steps;
- ``elastic-runner``: defaults (snapshot every 50 steps, in-memory tier, peer watchdog);
- ``elastic-runner-bare``: snapshots, memory tier and watchdog off — the cost of those features;
- ``elastic-runner-ddp``: defaults but ``dist.gradient_sync: ddp`` (torch's DistributedDataParallel instead of the
  ordered gradient sum that makes a resume bitwise at every world size) — the cost of the ordered sync, as the
  median of per-repeat pair ratios (``ordered_vs_ddp_sync``; the two run back to back in every repeat);
- ``elastic-runner-fsdp`` and ``baseline-fsdp``: ``parallel.strategy: fsdp`` against the baseline script with
  ``--parallel fsdp`` (FSDP2 on every block as torchtitan does it, torch.distributed.checkpoint every 50 steps), run
  back to back (``fsdp_vs_plain_fsdp``, the median of per-repeat pair ratios); ``elastic-runner-fsdp-bare``: the same
  without snapshots, node memory and watchdog (``fsdp_bare_vs_plain_fsdp``); ``elastic-runner-fsdp-no-snapshots``,
  ``-no-memory`` and ``-no-watchdog``: one of those three off alone (which one costs what);
- ``elastic-runner-compiled``: defaults but ``model.compile: true`` — what torch.compile gains or costs, as the median
  of per-repeat pair ratios with ``elastic-runner`` (``compiled_vs_uncompiled``); the compile itself happens before
  the measured steps;
- ``elastic-runner-untimed``: defaults but ``recovery.straggler_ratio: null`` (no step timed for stragglers):
  ``timed_vs_untimed``, the median of per-repeat pair ratios with ``elastic-runner``;
- ``elastic-runner-unfingerprinted``: defaults but ``recovery.fingerprint_every_steps: null`` (no replica
  fingerprints): ``fingerprinted_vs_not`` (the default, auto) and, with ``elastic-runner-fingerprint-every-log``
  (a check at every logging step, the most often there can be one), ``fingerprint_every_log_vs_not``.

    .venv/bin/python benchmarks/throughput.py --repeats 3 --out results/throughput.json
    cd benchmarks && ../.venv-vision/bin/python throughput.py --workloads cnn,gpt \
        --variants elastic-runner,elastic-runner-ddp --repeats 5      # the ordered gradient sync against DDP
    cd benchmarks && ../.venv-vision/bin/python throughput.py --workloads cnn,gpt \
        --variants elastic-runner,elastic-runner-compiled --repeats 3 # a compiled model against the same uncompiled
    cd benchmarks && ../.venv-vision/bin/python throughput.py --workloads cnn,gpt \
        --variants elastic-runner,elastic-runner-untimed --repeats 5  # what the stragglers' timing costs
    cd benchmarks && ../.venv-vision/bin/python throughput.py --workloads cnn,gpt --variants \
        elastic-runner,elastic-runner-fingerprint-every-log,elastic-runner-unfingerprinted --repeats 5  # fingerprints
    cd benchmarks && ../.venv-vision/bin/python throughput.py --workloads gpt \
        --variants elastic-runner-fsdp,baseline-fsdp --repeats 5     # FSDP2: ours against the plain script
    cd benchmarks && python throughput.py --gpu --workloads gpt --gpt-size 12,12,768 \
        --variants elastic-runner-fsdp,baseline-fsdp --repeats 3     # the same on one GPU, NCCL, bf16 compute
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from common import Workload, make_job, median, read_events, scratch_dir, steady_rate, write_json

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "baseline": ("torchrun-tuned", {}),
    "elastic-runner": ("elastic-runner", {}),
    "elastic-runner-ddp": ("elastic-runner", {"dist.gradient_sync": "ddp"}),  # right after: a pair per repeat
    "elastic-runner-compiled": ("elastic-runner", {"model.compile": True}),  # likewise
    # Defaults without the stragglers' timing (recovery.straggler_ratio: null): what timing every step costs
    "elastic-runner-untimed": ("elastic-runner", {"recovery.straggler_ratio": None}),
    # Replicas' fingerprints at every logging step (the most often), and none: what checking for corruption costs
    "elastic-runner-fingerprint-every-log": ("elastic-runner", {"recovery.fingerprint_every_steps": 50}),
    "elastic-runner-unfingerprinted": ("elastic-runner", {"recovery.fingerprint_every_steps": None}),
    # FSDP2 (right after each other: a pair per repeat): ours against the plain script with FSDP2 and DCP checkpoints
    "elastic-runner-fsdp": ("elastic-runner", {"parallel.strategy": "fsdp"}),
    "baseline-fsdp": ("torchrun-tuned", {"baseline_args": ["--parallel", "fsdp"]}),
    "elastic-runner-fsdp-bare": ("elastic-runner", {"parallel.strategy": "fsdp", "snapshot.every_steps": 0,
                                                    "snapshot.in_memory": False, "dist.heartbeat_seconds": 0}),
    # Each feature of the bare variant turned off alone, to say which one costs what (one GPU: features cost ~29 %)
    "elastic-runner-fsdp-no-snapshots": ("elastic-runner", {"parallel.strategy": "fsdp", "snapshot.every_steps": 0}),
    "elastic-runner-fsdp-no-memory": ("elastic-runner", {"parallel.strategy": "fsdp", "snapshot.in_memory": False}),
    "elastic-runner-fsdp-no-watchdog": ("elastic-runner", {"parallel.strategy": "fsdp", "dist.heartbeat_seconds": 0}),
    "elastic-runner-bare": ("elastic-runner", {"snapshot.every_steps": 0, "snapshot.in_memory": False,
                                               "dist.heartbeat_seconds": 0}),
}


def one_run(name: str, workload: Workload, workdir: Path, steps: int, skip: int,
            gpu: bool = False) -> tuple[float | None, list[float]]:
    """Samples/s after the warm-up, and how long each snapshot blocked the step (s; elastic_runner). ``gpu``: one
    worker on the one CUDA device (NCCL), bfloat16 compute under fsdp, instead of two CPU workers."""
    variant, overrides = VARIANTS[name]
    overrides = dict(overrides)
    extra = overrides.pop("baseline_args", [])
    if gpu:
        fsdp = overrides.get("parallel.strategy") == "fsdp" or "fsdp" in extra
        if variant == "elastic-runner":
            overrides |= {"dist.device": "auto", "dist.backend": "auto"}
            overrides |= {"parallel.mixed_precision": "bf16"} if fsdp else {}
        else:
            extra = extra + ["--device", "cuda"] + (["--bf16"] if fsdp else [])
    run_dir = workdir / f"{name}-{time.time_ns()}"
    job = make_job(variant, workload, run_dir, nnodes="1:1", nproc_per_node=1 if gpu else 2, steps=steps, log_every=50,
                   baseline_extra=extra, **overrides)
    try:
        job.start_agent()
        job.wait(timeout=900)
    finally:
        job.close()
    blocking = [e["blocking_s"] for e in read_events(run_dir) if e["kind"] == "snapshot_saved"] \
        if variant == "elastic-runner" else []
    return steady_rate(variant, run_dir, skip, workload.batch_per_rank * workload.world), blocking


def measure(name: str, workload: Workload, workdir: Path, repeats: int, steps: int, skip: int,
            variants: list[str] | None = None, gpu: bool = False) -> dict[str, Any]:
    chosen = [v for v in VARIANTS if variants is None or v in variants]
    rates: dict[str, list[float]] = {variant: [] for variant in chosen}
    blocking: list[float] = []
    #: Ratios of two variants run back to back, one pair per repeat: ordered / DDP sync, compiled / uncompiled.
    pairs: dict[str, list[float]] = {"ordered_vs_ddp_sync": [], "compiled_vs_uncompiled": [], "timed_vs_untimed": [],
                                     "fingerprinted_vs_not": [], "fingerprint_every_log_vs_not": [],
                                     "fsdp_vs_plain_fsdp": [], "fsdp_bare_vs_plain_fsdp": [], "fsdp_on_vs_off": [], "ddp_vs_plain_ddp": []}
    fsdp_blocking: list[float] = []
    for _ in range(repeats):
        this: dict[str, float] = {}
        for variant in chosen:
            rate, blocked = one_run(variant, workload, workdir, steps, skip, gpu)
            if variant == "elastic-runner":
                blocking += blocked
            if variant == "elastic-runner-fsdp":
                fsdp_blocking += blocked
            if rate is not None:
                this[variant] = rate
                rates[variant].append(round(rate * workload.sample_unit, 1))
            print(f"{name} {variant}: {rates[variant]}", flush=True)
        for key, (ours, other) in {"ordered_vs_ddp_sync": ("elastic-runner", "elastic-runner-ddp"),
                                   "compiled_vs_uncompiled": ("elastic-runner-compiled", "elastic-runner"),
                                   "timed_vs_untimed": ("elastic-runner", "elastic-runner-untimed"),
                                   "fingerprinted_vs_not": ("elastic-runner", "elastic-runner-unfingerprinted"),
                                   "fingerprint_every_log_vs_not": ("elastic-runner-fingerprint-every-log",
                                                                    "elastic-runner-unfingerprinted"),
                                   "fsdp_vs_plain_fsdp": ("elastic-runner-fsdp", "baseline-fsdp"),
                                   "fsdp_bare_vs_plain_fsdp": ("elastic-runner-fsdp-bare", "baseline-fsdp"),
                                   "fsdp_on_vs_off": ("elastic-runner-fsdp", "elastic-runner-fsdp-bare"),
                                   "ddp_vs_plain_ddp": ("elastic-runner", "baseline")}.items():
            if this.get(ours) and this.get(other):
                pairs[key].append(this[ours] / this[other])
    med = {variant: median(values) for variant, values in rates.items()}
    base = med.get("baseline")
    ratios = {}
    if base:
        for variant in ("elastic-runner", "elastic-runner-bare"):
            if med.get(variant):
                ratios[f"{variant}_vs_baseline"] = round(med[variant] / base, 3)
    if med.get("elastic-runner") and med.get("elastic-runner-bare"):
        ratios["features_on_vs_off"] = round(med["elastic-runner"] / med["elastic-runner-bare"], 3)
    for key, values in pairs.items():
        if values:
            ratios[key] = round(median(values), 3)
            ratios[f"{key}_range"] = [round(min(values), 3), round(max(values), 3)]
    unit = "tokens_per_s" if workload.sample_unit > 1 else "samples_per_s"
    return {"unit": unit, "rates": rates, "medians": med, "ratios": ratios, "steps": steps, "skip": skip,
            "snapshot_blocking_ms_median": round(1000 * median(blocking), 1) if blocking else None,
            "snapshots": len(blocking),
            "fsdp_snapshot_blocking_ms": [round(1000 * b, 2) for b in fsdp_blocking]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--skip", type=int, default=100, help="steps excluded as warm-up")
    p.add_argument("--workloads", default="cnn,gpt,resnet18")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"which of {', '.join(VARIANTS)} to run (default: all), e.g. elastic-runner,elastic-runner-ddp")
    p.add_argument("--gpu", action="store_true",
                   help="one worker on the machine's CUDA device (NCCL; bf16 compute under fsdp) instead of two on CPUs")
    p.add_argument("--gpt-size", default="4,4,128", help="gpt workload: n_layer,n_head,n_embd (12,12,768: GPT-2 small)")
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    with scratch_dir(args.workdir, "er-bench-throughput-") as workdir:
        chosen = [w.strip() for w in args.workloads.split(",") if w.strip()]
        variants = [v.strip() for v in args.variants.split(",") if v.strip()]
        unknown = sorted(set(variants) - set(VARIANTS))
        if unknown:
            p.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
        results: dict[str, Any] = {}
        world = 1 if args.gpu else 2  # the workers of one_run: the global batch is batch_per_rank x world for both
        if "cnn" in chosen:
            # A step of tens of milliseconds (3x32x32 images, 32-channel CNN): per-step overheads
            # are measured against real work, not against a 1 ms toy step.
            cnn = Workload(data="synthetic", synthetic_shape="3,32,32", channels=32, hidden=128, world=world)
            results["cnn"] = measure("cnn", cnn, workdir, args.repeats, args.steps, args.skip, variants,
                                   args.gpu)
        if "gpt" in chosen:
            from elastic_runner.data.tokens import prepare_text

            tokens = workdir / "shakespeare-char"
            prepare_text(Path(__file__).resolve().parent.parent / "examples" / "data" / "shakespeare.txt", tokens)
            gpt = Workload(data="tokens", model="gpt", tokens_dir=str(tokens), optim="adamw", lr=2e-3, gpt=args.gpt_size,
                           world=world)
            results["gpt"] = measure("gpt", gpt, workdir, args.repeats, max(100, args.steps * 3 // 4), args.skip,
                                     variants, args.gpu)
        if "resnet18" in chosen:
            # torchvision's resnet18 (BatchNorm) on 3x32x32 images, random crop and flip in 2 DataLoader workers per
            # rank: elastic_runner seeds each sample's draws, the baseline uses the workers' generators.
            resnet = Workload(data="fake_images", model="resnet18", synthetic_size=2048, synthetic_shape="3,32,32",
                              workers=2, augment=True, lr=0.05, world=world)
            results["resnet18"] = measure("resnet18", resnet, workdir, args.repeats, max(60, args.steps // 4),
                                          max(10, args.skip // 4), variants, args.gpu)
        out: dict[str, Any] = {"benchmark": "throughput", "workloads": results, "repeats": args.repeats}
        if "cnn" in results:  # the summary table's row (benchmarks/run_all.py)
            out |= {"samples_per_s": results["cnn"]["rates"], "median_samples_per_s": results["cnn"]["medians"],
                    "ratios": results["cnn"]["ratios"]}
        write_json(args.out, out)


if __name__ == "__main__":
    main()
