"""Memory per rank of a sharded model against the replicated one, and what a sharded snapshot blocks a step.

W processes (default 4) on a gloo process group train a GPT for a few steps with AdamW through elastic_runner's own
step (TrainStep, StepGradients) and gradient sync: ``parallel.strategy: fsdp`` (training/sharding.py) and then the
replicated path (the ordered gradient sum), the two one after the other in this run. Each rank reports

- the bytes it holds of parameters, gradients and optimizer state (every tensor's local storage: under fsdp a
  rank's slice; the gradients as they are right after the backward pass, before the update frees them);
- its resident set after the training steps (before any snapshot) and its peak (``ru_maxrss``); both include torch
  itself (compare the difference between the two runs), and the peak includes the whole model every rank builds
  before it is sharded;
- under fsdp, what one sharded snapshot blocks the step (taking the state's structure: the model's and optimizer's
  ``state_dict()`` and the split into this rank's slices, as the loop does; then whatever is left of the
  copy of this rank's slices into host memory when the next step's optimizer update must wait for it; the copy runs
  beside that step's forward and backward passes) and how long the write takes (every rank its part, rank 0
  publishing), against ``dd conv=fsync`` of the same bytes on the same disk (the physical limit), run by rank 0
  between two snapshots, so that both are measured in the same state of the machine: first with the next training
  step beside the write, as the loop runs (``write_vs_dd``), then with nothing beside it (``write_alone_vs_dd``: the
  writer's own cost; with W ranks on fewer cores, training takes the CPU the writer's hashing needs).

    cd benchmarks && ../.venv-vision/bin/python sharded_memory.py --world 4 --layers 8 --embd 256
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VOCAB, BLOCK, BATCH_PER_RANK = 96, 64, 4


def _local_bytes(tensors: list[Any]) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def _dd(name: str, directory: Path) -> tuple[float, int]:
    """Seconds for ``dd conv=fsync`` to write snapshot ``name``'s own bytes (every file of it, one stream) from memory
    (/dev/shm) into ``directory`` (the same disk): not zeros, which a virtual disk may store for less."""
    with tempfile.NamedTemporaryFile(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as source:
        for f in sorted((directory / name).iterdir()):
            source.write(f.read_bytes())
        source.flush()
        target = directory / "dd.bin"
        started = time.perf_counter()
        subprocess.run(["dd", f"if={source.name}", f"of={target}", "bs=1M", "conv=fsync"], check=True,
                       capture_output=True)
        seconds = time.perf_counter() - started
        size = source.tell()
    target.unlink()
    return seconds, size


def _worker(rank: int, world: int, store: str, job: dict[str, Any]) -> None:
    import torch.distributed as tdist

    from elastic_runner.config import EvalConfig, ModelConfig, ParallelConfig
    from elastic_runner.data.layout import BatchLayout
    from elastic_runner.data.sampler import StepPlan
    from elastic_runner.snapshot import LocalStore
    from elastic_runner.snapshot.sharded_writer import ShardedSnapshotWriter
    from elastic_runner.snapshot.shards import split
    from elastic_runner.training.gradients import StepGradients
    from elastic_runner.training.parallel import replicate
    from elastic_runner.training.parts import TrainingParts
    from elastic_runner.training.sharding import FSDPSync, shard_model
    from elastic_runner.training.state import TrainState
    from elastic_runner.training.step import TrainStep
    from elastic_runner.workload.gpt import GPT
    from elastic_runner.workload.tasks import build_task

    torch.set_num_threads(1)
    tdist.init_process_group("gloo", store=tdist.FileStore(store, world), rank=rank, world_size=world)
    torch.manual_seed(0)
    model = GPT(VOCAB, BLOCK, job["layers"], 4, job["embd"])
    cpu = torch.device("cpu")
    g = torch.Generator().manual_seed(rank)
    batch = torch.randint(0, VOCAB, (BATCH_PER_RANK, BLOCK + 1), generator=g)
    stand_in = (batch[:1, :-1], batch[:1, 1:])

    def loss(module: torch.nn.Module, b: Any) -> torch.Tensor:
        x, y = b
        logits = module(x)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1),
                                                 reduction="none").view(y.shape).mean(1)

    class _Dist:
        world_size = world

        @staticmethod
        def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
            tdist.all_reduce(tensor)
            return tensor

    if job["strategy"] == "fsdp":
        shard_model(model, ParallelConfig(strategy="fsdp"), cpu, world, world)
        sync: Any = FSDPSync(model, lambda m: loss(m, stand_in).sum())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if job["strategy"] != "fsdp":
        sync = replicate(model, cpu, "ordered")
    global_batch = BATCH_PER_RANK * world
    layout = BatchLayout(world, global_batch, BATCH_PER_RANK, 1, (BATCH_PER_RANK,) * world)
    parts = TrainingParts(model=model, optimizer=optimizer, scheduler=torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 1.0), scaler=None, sampler=None, state=TrainState())
    gradients = StepGradients(_Dist(), model, 1.0, "stop", None, averages_over=sync.averages_over)
    task = build_task(ModelConfig(loss="cross_entropy"), EvalConfig(), loss=loss)
    step = TrainStep(parts, sync, task, layout, gradients, seed=0, rank=rank, device=cpu, precision="fp32")
    plan = StepPlan(epoch=0, start=0, global_count=global_batch, indices=list(range(BATCH_PER_RANK)))
    params = list(model.parameters())
    grad_bytes = 0
    for number in range(1, job["steps"] + 1):
        result = step.compute(number, plan, iter([(batch[:, :-1], batch[:, 1:])]))
        grad_bytes = max(grad_bytes, _local_bytes([p.grad for p in params]))
        step.update(result)
    state_tensors = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    report: dict[str, Any] = {
        "rank": rank, "param_bytes": _local_bytes(params), "grad_bytes": grad_bytes,
        "optimizer_bytes": _local_bytes(state_tensors),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rss_after_steps_bytes": int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE"),
    }
    if job["strategy"] == "fsdp":
        directory = Path(job["snapshots"])
        if rank == 0:
            LocalStore(directory).claim_generation({})
        tdist.barrier()
        writer = ShardedSnapshotWriter(LocalStore(directory), generation=1, keep_last=2, rank=rank,
                                       writers=list(range(world)))
        blocking, captures, writes, dd, alone, dd_alone = [], [], [], [], [], []
        count = job["snapshots_count"]
        # First the snapshots as the loop takes them, the next step training beside the write; then as many again
        # with nothing beside the write (the writer's own cost: on 2 cores, 4 training ranks take the CPU it needs).
        for n in range(2 * count):
            training = n < count

            def capture(n: int = n, model: Any = model,
                        optimizer: Any = optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
                # What the loop's capture does (training/checkpointer.py), timed as part of the step's blocking.
                state = {"model": model.state_dict(keep_vars=True), "optimizer": optimizer.state_dict(),
                         "train": {"step": n}}
                replicated, tensors, offsets = split(state)
                return ({"replicated": replicated if rank == 0 else None,
                         "part": {"tensors": tensors, "offsets": offsets}}, {"world_size": world})

            result = writer.save(n + 1, capture)
            if training:
                captures.append(result.blocking_s)
                # The next step, as the loop runs it: forward and backward beside the copy, which the optimizer
                # waits for.
                computed = step.compute(job["steps"] + n + 1, plan, iter([(batch[:, :-1], batch[:, 1:])]))
                writer.wait_staged()
                step.update(computed)
            writer.wait()
            if training:
                blocking.append(result.blocking_s)
            (writes if training else alone).append(result.write_s)
            tdist.barrier()
            if rank == 0:  # the physical limit, between two snapshots: the same state of the machine for both
                (dd if training else dd_alone).append(_dd(result.ref.name, directory))
            tdist.barrier()
        writer.close()
        report |= {"snapshot_blocking_ms": [round(1000 * b, 2) for b in blocking],
                   "snapshot_capture_ms": [round(1000 * c, 2) for c in captures],
                   "snapshot_write_s": [round(w, 4) for w in writes], "dd_s": [round(d[0], 4) for d in dd],
                   "snapshot_write_alone_s": [round(w, 4) for w in alone],
                   "dd_alone_s": [round(d[0], 4) for d in dd_alone], "dd_bytes": dd[0][1] if dd else None}
    gathered: list[Any] = [None] * world
    tdist.all_gather_object(gathered, report)
    if rank == 0:
        Path(job["out"]).write_text(json.dumps(gathered))
    del step, sync, parts, model, optimizer
    import gc

    gc.collect()
    tdist.destroy_process_group()


def run(strategy: str, world: int, layers: int, embd: int, steps: int, workdir: Path, snapshots: int) -> list[dict]:
    out = workdir / f"{strategy}.json"
    job = {"strategy": strategy, "layers": layers, "embd": embd, "steps": steps, "out": str(out),
           "snapshots": str(workdir / "snapshots"), "snapshots_count": snapshots}
    mp.start_processes(_worker, args=(world, tempfile.mktemp(dir=workdir), job), nprocs=world, start_method="spawn")
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--embd", type=int, default=256)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--snapshots", type=int, default=12)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fsdp = run("fsdp", args.world, args.layers, args.embd, args.steps, Path(tmp), args.snapshots)
        ddp = run("ddp", args.world, args.layers, args.embd, args.steps, Path(tmp), 0)

    def state_bytes(rows: list[dict]) -> int:
        return max(r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"] for r in rows)

    blocking = [b for r in fsdp for b in r["snapshot_blocking_ms"][1:]]  # the first one allocates its buffers
    captures = [c for r in fsdp for c in r["snapshot_capture_ms"][1:]]
    writes = [w for r in fsdp if r["rank"] == 0 for w in r["snapshot_write_s"][1:]]
    dd_s = [d for r in fsdp if r["rank"] == 0 for d in r["dd_s"][1:]]
    alone = [w for r in fsdp if r["rank"] == 0 for w in r["snapshot_write_alone_s"]]
    dd_alone = [d for r in fsdp if r["rank"] == 0 for d in r["dd_alone_s"]]
    dd_bytes = fsdp[0]["dd_bytes"]
    result = {
        "world_size": args.world, "model": f"gpt n_layer={args.layers} n_embd={args.embd} AdamW", "torch": torch.__version__,
        "fsdp": fsdp, "ddp": ddp,
        "state_bytes_per_rank": {"fsdp": state_bytes(fsdp), "ddp": state_bytes(ddp)},
        "state_ratio_fsdp_vs_ddp": round(state_bytes(fsdp) / state_bytes(ddp), 3),
        "peak_rss_bytes_max": {"fsdp": max(r["peak_rss_bytes"] for r in fsdp), "ddp": max(r["peak_rss_bytes"] for r in ddp)},
        "rss_after_steps_bytes_max": {"fsdp": max(r["rss_after_steps_bytes"] for r in fsdp),
                                      "ddp": max(r["rss_after_steps_bytes"] for r in ddp)},
        "snapshot_state_bytes_total": sum(r["param_bytes"] + r["optimizer_bytes"] for r in fsdp),
        "snapshot_blocking_ms_median": round(statistics.median(blocking), 2) if blocking else None,
        "snapshot_blocking_ms_p90": round(sorted(blocking)[int(0.9 * (len(blocking) - 1))], 2) if blocking else None,
        "of_which_capture_ms_median": round(statistics.median(captures), 2) if captures else None,
        "snapshot_write_s_median": round(statistics.median(writes), 4) if writes else None,
        "dd_bytes": dd_bytes,
        "dd_fsync_s_median": round(statistics.median(dd_s), 4),
        "write_vs_dd": round(statistics.median(writes) / statistics.median(dd_s), 2) if writes else None,
        "snapshot_write_alone_s_median": round(statistics.median(alone), 4) if alone else None,
        "dd_alone_s_median": round(statistics.median(dd_alone), 4) if dd_alone else None,
        "write_alone_vs_dd": round(statistics.median(alone) / statistics.median(dd_alone), 2) if alone else None,
        "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps({k: v for k, v in result.items() if k not in ("fsdp", "ddp")}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
