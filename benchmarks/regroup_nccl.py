"""What a worker pays to be back in the job after a peer's loss, on a CUDA device with NCCL: a new process (today's
path: every worker is restarted) against a survivor that keeps its process and rebuilds only its process group
(:mod:`elastic_runner.recovery.rebuild`, in-process recovery).

One GPU, one rank (NCCL refuses two ranks on one device), so these are the per-worker costs a restart adds or saves,
not a whole job's recovery:

- ``new process``: from spawning a Python process to its first completed all-reduce with the model on the device
  (interpreter, ``import torch``, CUDA context, NCCL communicator, model to the device); ``+ compile``: and its first
  compiled training step (``torch.compile`` from nothing, as a restarted worker without a cache pays it);
- ``in process (recreate)``: the survivor aborts its group, creates it again in the same process and completes an
  all-reduce; ``in process (reconfigure)``: torch's reconfigure API, where this torch has it for NCCL;
- ``compiled step, kept``: a training step of the survivor's already compiled model (nothing to compile again).

    python3 benchmarks/regroup_nccl.py --repeats 3 --out regroup_nccl.json
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model():  # noqa: ANN202 - torch is imported late on purpose (the child times its import)
    import torch

    torch.manual_seed(0)
    layers = []
    for _ in range(8):
        layers += [torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)]
    return torch.nn.Sequential(*layers)


def _step(model, optimizer, x) -> None:  # noqa: ANN001
    import torch

    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()


def child(port: int, compile_model: bool) -> None:
    """A restarted worker: everything it does before it can take part in a step again."""
    import torch
    import torch.distributed as tdist

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    model = _model().to(device)
    store = tdist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=datetime.timedelta(seconds=60))
    tdist.init_process_group("nccl", store=store, rank=0, world_size=1)
    tdist.all_reduce(torch.zeros(1, device=device))
    torch.cuda.synchronize()
    print("ready", flush=True)
    if compile_model:
        model = torch.compile(model)
        optimizer = torch.optim.AdamW(model.parameters())
        _step(model, optimizer, torch.randn(64, 1024, device=device))
        print("stepped", flush=True)
    tdist.destroy_process_group()


def new_process(compile_model: bool) -> tuple[float, float | None]:
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, __file__, "--child", str(_free_port())] + (["--compile"] * compile_model),
                            stdout=subprocess.PIPE, text=True)
    ready = stepped = None
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.strip() == "ready":
            ready = time.perf_counter() - started
        elif line.strip() == "stepped":
            stepped = time.perf_counter() - started
    if proc.wait() != 0 or ready is None:
        raise SystemExit(f"the child process failed (exit {proc.returncode})")
    return ready, stepped


def survivor(repeats: int) -> dict[str, object]:
    import torch
    import torch.distributed as tdist

    from elastic_runner.recovery.rebuild import Membership, Regroup, RegroupError

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    store = tdist.TCPStore("127.0.0.1", _free_port(), 1, is_master=True, timeout=datetime.timedelta(seconds=60))
    out: dict[str, object] = {}
    generation = 0
    for method in ("recreate", "reconfigure"):
        regroup = Regroup(store, "a", "nccl", datetime.timedelta(seconds=60), method=method, device=device)
        times = []
        try:
            for _ in range(repeats + 1):  # the first join creates the group; the others are recoveries
                regroup.abandon()
                generation += 1
                times.append(regroup.join(Membership(generation, ("a",))))
            out[f"in process ({method})"] = times[1:]
        except RegroupError as exc:
            out[f"in process ({method})"] = f"not available: {exc}"
        regroup.leave()
    model = torch.compile(_model().to(device))
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(64, 1024, device=device)
    _step(model, optimizer, x)
    kept = []
    for _ in range(repeats):
        t = time.perf_counter()
        _step(model, optimizer, x)
        kept.append(time.perf_counter() - t)
    out["compiled step, kept"] = kept
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child, args.compile)
        return
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    results: dict[str, object] = {"new process": [], "new process + compile": []}
    # Each figure as it comes: a run cut short by its time limit still says what it measured (2026-11-28 on a cold
    # H200 the whole took more than gpu_check.sh's 100 s then, and printed nothing).
    for _ in range(args.repeats):
        ready, _ = new_process(False)
        results["new process"].append(ready)  # type: ignore[union-attr]
        print(f"new process: {ready:.3f} s", flush=True)
    for _ in range(args.repeats):
        _, stepped = new_process(True)
        results["new process + compile"].append(stepped)  # type: ignore[union-attr]
        print(f"new process + compile: {stepped:.3f} s", flush=True)
    results |= survivor(args.repeats)
    import torch

    results["device"] = f"{torch.cuda.get_device_name()}, torch {torch.__version__}, nccl {torch.cuda.nccl.version()}"
    for name, values in results.items():
        if isinstance(values, list):
            print(f"{name:28s} median {statistics.median(values):8.3f} s  ({', '.join(f'{v:.3f}' for v in values)})")
        else:
            print(f"{name:28s} {values}")
    if args.out:
        import json

        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
