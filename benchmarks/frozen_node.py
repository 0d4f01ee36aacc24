"""A node gone without resetting its connections: every process of one node SIGSTOPped (as a machine powered off,
cut off from the network, or frozen), and the time until the survivor steps alone.

A SIGKILLed node's sockets are reset by its kernel, so its peers learn of the loss at once; a machine that vanishes
resets nothing, and torch's store client waits without end on a server that is there and does not answer. Each
repeat runs one job of two agents (``elastic-runner launch``, ``configs/soak.yaml``, one worker each, etcd-v3 with
launch's 3 s lease on a self-started etcd), freezes group rank ``--node``'s node 600 steps in, and reports the seconds
from the freeze to the survivor's first step at world size 1 (its ``progress`` events, every 50 steps: up to ~0.4 s
late), then ends the job.

    .venv-vision/bin/python benchmarks/frozen_node.py --node 0 --repeats 3     # ~1.5 min
    .venv-vision/bin/python benchmarks/frozen_node.py --node 1 --repeats 3

Needs etcd on the PATH (``apt-get install etcd-server``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from elastic_runner.observe.events import read_events  # noqa: E402
from elastic_runner.testing.etcd_server import EtcdServer  # noqa: E402
from elastic_runner.testing.localjob import LocalJob, descendants  # noqa: E402

FREEZE_AFTER_STEPS = 600
WAIT_S = 120.0


def _progress(run_dir: Path) -> list[dict[str, Any]]:
    return [e for e in read_events(run_dir) if e["kind"] == "progress"]


def once(node: int, work: Path, etcd: EtcdServer) -> float | None:
    """One job; seconds from the freeze of group rank ``node``'s node to the survivor stepping alone (None: not
    within WAIT_S)."""
    run_dir = work / "run"
    with LocalJob(config=str(ROOT / "configs" / "soak.yaml"), run_dir=str(run_dir), nnodes="1:2",
                  launcher="elastic-runner", rdzv_backend="etcd-v3", rdzv_endpoint=etcd.endpoint,
                  overrides=["train.max_steps=20000"]) as job:
        job.start_agent()
        job.start_agent()
        deadline = time.monotonic() + WAIT_S
        while not [e for e in _progress(run_dir) if e.get("world_size") == 2 and e["step"] >= FREEZE_AFTER_STEPS]:
            if time.monotonic() > deadline:
                raise SystemExit("the job did not reach step %d at world size 2\n%s" % (FREEZE_AFTER_STEPS,
                                                                                         job.logs_tail()))
            time.sleep(0.1)
        ranks = {int(e["source"].rsplit("-", 1)[1]): e for e in read_events(run_dir) if e["kind"] == "agent_rendezvous"}
        target = next((a for a in job.agents if ranks.get(a.pid, {}).get("group_rank") == node), None)
        if target is None:
            raise SystemExit(f"no agent says it is group rank {node}: {sorted(ranks)}\n{job.logs_tail()}")
        pids = [target.pid, *descendants(target.pid)]
        frozen_at = time.time()
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        found: float | None = None
        deadline = time.monotonic() + WAIT_S
        while found is None and time.monotonic() < deadline:
            alone = [e["time"] for e in _progress(run_dir) if e["time"] > frozen_at and e.get("world_size") == 1]
            found = min(alone) - frozen_at if alone else None
            time.sleep(0.1)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--node", type=int, choices=(0, 1), default=0,
                        help="the group rank of the node frozen (0: it hosts the job's store)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the JSON result here too")
    args = parser.parse_args()
    etcd_binary = shutil.which("etcd")
    if etcd_binary is None:
        raise SystemExit("etcd is not on the PATH: apt-get install etcd-server")
    work = Path(tempfile.mkdtemp(prefix="frozen-node-"))
    etcd = EtcdServer(work / "etcd", binary=etcd_binary)
    etcd.start()
    try:
        seconds = [once(args.node, work / f"repeat-{i}", etcd) for i in range(args.repeats)]
    finally:
        etcd.stop()
        shutil.rmtree(work, ignore_errors=True)
    found = [s for s in seconds if s is not None]
    result = {"benchmark": "frozen_node", "node": args.node, "seconds": seconds,
              "median_s": statistics.median(found) if found else None, "not_within_s": WAIT_S,
              "missed": len(seconds) - len(found)}
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if len(found) < len(seconds):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
