"""What a snapshot's capture of a GPU state blocks (issue 49): the copy of ~1 GB of device tensors into pinned host
buffers, made the old way (``inline``: a device-to-host copy in the step, which drains the stream first) and the new
way (``side-stream``: queued on a side CUDA stream after the step's event, :mod:`elastic_runner.snapshot.staging`).

One process, one GPU. Each round queues a step's worth of device work (matmuls, ``--step-ms`` long), captures the
state, queues the next step and its optimizer update (an in-place change of every tensor, ordered after the copy as
the loop orders it), and waits for the device. Per mode: the host's time inside the capture call (what the step is
blocked), the round's time against a round without a capture (what the whole step loses), and, for the side stream,
when the copy landed (a reader thread's time). Rounds interleave the modes (``--rounds``, medians and ranges); the first capture of each mode
allocates its buffers and is reported apart (the loop reserves them off the step). The last side-stream round's copy
is checked against the state before the update (the clone it compares with is queued before the capture, so that
round's timings include it)::

    python3 benchmarks/capture_blocking.py --gigabytes 1 --rounds 5 --out results/capture_blocking.json
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Any

import torch

from common import write_json

from elastic_runner.snapshot.staging import HostStaging


def make_state(gigabytes: float) -> dict[str, Any]:
    """A model-and-AdamW-like state: fp32 tensors of 10 MB and a few bf16 ones."""
    count = max(1, int(gigabytes * 1e9 / 10e6))
    return {"model": {f"layer{i}.weight": torch.randn(2_500_000, device="cuda") for i in range(count)},
            "half": [torch.randn(1_000_000, device="cuda").to(torch.bfloat16) for _ in range(8)],
            "step": torch.tensor(1, device="cuda")}


def tensors(state: dict[str, Any]) -> list[torch.Tensor]:
    return [*state["model"].values(), *state["half"]]


def queue_step(work: torch.Tensor, iterations: int) -> None:
    x = work
    for _ in range(iterations):
        x = torch.mm(x, work).tanh_()


def calibrate(work: torch.Tensor, step_ms: float) -> int:
    """Matmuls per step for about ``step_ms`` of device time."""
    queue_step(work, 5)
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    queue_step(work, 50)
    end.record()
    end.synchronize()
    return max(1, int(step_ms / (begin.elapsed_time(end) / 50)))


def one_round(mode: str, state: dict[str, Any], staging: dict[str, HostStaging], work: torch.Tensor,
              iterations: int, check: bool) -> dict[str, float]:
    live = tensors(state)
    torch.cuda.synchronize()
    began = time.perf_counter()
    queue_step(work, iterations)  # the step whose state is captured
    expected = [t.clone() for t in live] if check else None
    blocked = landed = 0.0
    pending = None
    if mode != "none":
        started = time.perf_counter()
        host = staging[mode].copy(state, deferred=mode == "side-stream")
        blocked = time.perf_counter() - started
        pending = staging[mode].take_pending()
        done = threading.Event()
        landed_at: list[float] = []
        if pending is not None:

            def reader() -> None:
                pending.wait()
                landed_at.append(time.perf_counter())
                done.set()

            threading.Thread(target=reader, daemon=True).start()
        else:
            done.set()
    queue_step(work, iterations)  # the next step's forward and backward...
    if mode != "none" and pending is not None:
        pending.order_before_changes()  # (as Checkpointer.mutating does: after them, before the update)
    torch._foreach_add_(live, 1.0)  # ...and its optimizer update
    torch.cuda.synchronize()
    total = time.perf_counter() - began
    if mode != "none":
        done.wait()
        landed = (landed_at[0] if landed_at else started + blocked) - began  # inline: landed when the call returned
        if expected is not None:
            got = [*host["model"].values(), *host["half"]]
            assert all(torch.equal(g, e.cpu()) for g, e in zip(got, expected)), f"{mode}: the copy is not the state"
    return {"blocked_ms": blocked * 1e3, "round_ms": total * 1e3, "landed_ms": landed * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gigabytes", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--step-ms", type=float, default=40.0, help="device time of one step's work")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("capture_blocking.py needs a CUDA device")
    state = make_state(args.gigabytes)
    size = sum(t.numel() * t.element_size() for t in tensors(state))
    work = torch.randn(4096, 4096, device="cuda") / 64
    iterations = calibrate(work, args.step_ms)
    staging = {"inline": HostStaging(), "side-stream": HostStaging()}
    first = {mode: one_round(mode, state, staging, work, iterations, check=False)
             for mode in ("inline", "side-stream")}  # allocates each mode's pinned buffers
    rows: dict[str, list[dict[str, float]]] = {"none": [], "inline": [], "side-stream": []}
    for index in range(args.rounds):
        for mode in rows:
            # The last side-stream round checks the copy against the state before the update: its buffers are
            # reserved, so the copy runs beside the next step as in training (a missing order would show).
            check = mode == "side-stream" and index == args.rounds - 1
            rows[mode].append(one_round(mode, state, staging, work, iterations, check=check))
    baseline = statistics.median(r["round_ms"] for r in rows["none"])
    result: dict[str, Any] = {"benchmark": "capture_blocking", "torch": torch.__version__,
                              "device": torch.cuda.get_device_name(), "state_bytes": size,
                              "step_ms": args.step_ms, "rounds": args.rounds, "round_without_capture_ms": baseline,
                              "first_capture_ms": {m: round(r["blocked_ms"], 2) for m, r in first.items()}}
    for mode in ("inline", "side-stream"):
        blocked = [r["blocked_ms"] for r in rows[mode]]
        lost = [r["round_ms"] - baseline for r in rows[mode]]
        result[mode] = {"blocked_ms_median": round(statistics.median(blocked), 3),
                        "blocked_ms_range": [round(min(blocked), 3), round(max(blocked), 3)],
                        "round_lost_ms_median": round(statistics.median(lost), 2),
                        "landed_ms_median": round(statistics.median(r["landed_ms"] for r in rows[mode]), 2)}
    write_json(args.out, result)


if __name__ == "__main__":
    main()
