"""What one replica fingerprint costs (recovery.fingerprint_every_steps): the sums of a model's parameters and its
AdamW state as 64-bit words, against one training step of the same model, in one process.

The check runs once every so many steps (auto: as often as keeps it at or below 1 % of step time), so its share of
training time is ``check / (step x interval)``; this prints the check's time, the step's, and the interval auto
would choose at a logging interval of 10. ``--device cuda`` times both on a GPU (CUDA events)::

    .venv-vision/bin/python benchmarks/fingerprint_cost.py --out results/fingerprint_cost.json
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Any, Callable

import torch
from torch import nn

from common import write_json

from elastic_runner.training.fingerprint import AUTO_SHARE, fingerprint, replica_tensors

#: (name, width, depth): MLPs of growing size; the batch is 64 rows.
SIZES = [("mlp-0.3M", 256, 4), ("mlp-4M", 1024, 4), ("mlp-25M", 2048, 6)]


def timed(call: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """The median seconds of ``call`` over ``repeats`` runs (after one warm-up)."""
    call()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            call()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1000.0)
        else:
            started = time.perf_counter()
            call()
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(width: int, depth: int, device: torch.device, repeats: int) -> dict[str, Any]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = torch.randn(64, width, device=device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(batch).square().mean().backward()
        optimizer.step()

    step()  # the optimizer's state exists from here
    check_s = timed(lambda: fingerprint(replica_tensors(model, optimizer), device), device, repeats)
    step_s = timed(step, device, repeats)
    numbers = sum(t.numel() for t in replica_tensors(model, optimizer))
    interval = 10 * max(1, math.ceil(math.ceil(check_s / (AUTO_SHARE * step_s)) / 10))
    return {"numbers": numbers, "check_ms": round(check_s * 1000, 3), "step_ms": round(step_s * 1000, 3),
            "ns_per_number": round(check_s / numbers * 1e9, 3), "auto_interval_at_logging_10": interval,
            "share_at_auto_interval": round(check_s / (step_s * interval), 4)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = torch.device(args.device)
    results = {}
    for name, width, depth in SIZES:
        results[name] = measure(width, depth, device, args.repeats)
        print(name, results[name], flush=True)
    report = {"benchmark": "fingerprint_cost", "device": str(device), "torch": torch.__version__,
              "threads": torch.get_num_threads(), "sizes": results}
    if args.out:
        write_json(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
