"""How fast the survivors of a killed member rebuild their process group, each way (``recovery.regroup``), on gloo.

``--members`` processes all-reduce in a loop on 127.0.0.1 (a ring: some survivors wait on another survivor, not on
the dead member); the last one SIGKILLs itself; the others leave the failed collective, give the group up
(:meth:`~elastic_runner.recovery.rebuild.Regroup.abandon`) and rebuild it without the dead member
(:meth:`~elastic_runner.recovery.rebuild.Regroup.join`, a first all-reduce included). Reported per method: the slowest
survivor's seconds from giving up to the rebuilt group's first all-reduce (the group is as fast as its slowest
member), median over the repeats. ``reconfigure`` needs torch >= 2.14.

    .venv-vision/bin/python benchmarks/regroup_ring.py --members 4 --repeats 3 --out regroup_ring.json
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import median, write_json  # noqa: E402

#: Far above any rebuild: a survivor still blocked when this passes shows as a rebuild of about this long.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)


def _member(name: str, members: tuple[str, ...], port: int, method: str, queue: Any) -> None:
    import torch
    import torch._dynamo  # noqa: F401 - before any process group, as a worker does
    import torch.distributed as tdist

    from elastic_runner.recovery.rebuild import Membership, Regroup

    store = tdist.TCPStore("127.0.0.1", port, None, False, timeout=COLLECTIVE_TIMEOUT)
    group = Regroup(store, name, "gloo", COLLECTIVE_TIMEOUT, method=method)
    group.join(Membership(1, members))
    try:
        for number in range(500):
            if name == members[-1] and number == 50:
                os.kill(os.getpid(), signal.SIGKILL)
            tdist.all_reduce(torch.ones(200_000))
    except RuntimeError:
        pass  # the step in flight is abandoned; out of the handler, as a worker does
    started = time.perf_counter()
    group.abandon()
    group.join(Membership(2, members[:-1]))
    queue.put((name, time.perf_counter() - started))
    group.leave()


def rebuild(method: str, count: int) -> float:
    """The slowest survivor's rebuild, seconds."""
    import torch.distributed as tdist

    store = tdist.TCPStore("127.0.0.1", 0, None, True, timeout=COLLECTIVE_TIMEOUT)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    members = tuple(f"m{i}" for i in range(count))
    procs = [ctx.Process(target=_member, args=(name, members, store.port, method, queue)) for name in members]
    try:
        for proc in procs:
            proc.start()
        seconds = [queue.get(timeout=2 * COLLECTIVE_TIMEOUT.total_seconds())[1] for _ in members[:-1]]
        for proc in procs:
            proc.join(timeout=30)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    return max(seconds)


def main() -> None:
    from elastic_runner.recovery.rebuild import regroup_method

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--members", type=int, default=4, help="members before the kill (at least 3: two survivors)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="write the JSON result here too")
    args = p.parse_args()
    if args.members < 3:
        p.error(f"--members {args.members}: use at least 3, so that two survivors rebuild a group")
    methods = ["recreate"] + (["reconfigure"] if regroup_method("gloo")[0] == "reconfigure" else [])
    raw = {m: [round(rebuild(m, args.members), 4) for _ in range(args.repeats)] for m in methods}
    for method, values in raw.items():
        print(f"{method}: {values}", flush=True)
    write_json(args.out, {"benchmark": "regroup_ring", "members": args.members, "repeats": args.repeats,
                          "raw": raw, "medians": {m: median(v) for m, v in raw.items()},
                          "skipped": {} if "reconfigure" in raw else {"reconfigure": regroup_method("gloo")[1]}})


if __name__ == "__main__":
    main()
