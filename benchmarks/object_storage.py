"""Snapshots in object storage: what a step waits for, and the time to durable, against a directory and a raw upload.

A local S3 server (SeaweedFS, as the tests start it) and a ~100 MB state (25 float32 tensors of 1 M elements: the
size of issue 31's target). The writer is the one training uses (``SnapshotWriter``, ``snapshot.writer: process``),
fed the same state in the same process, alternating between

- a directory on the local disk (``snapshot.dir: RUN_DIR/snapshots``),
- the bucket (``snapshot.dir: s3://...``),
- the server's own raw upload of the same bytes: ``s3fs``'s ``put_file`` of the snapshot's ``state.pt`` (one object,
  no staging copy, no checksum, no marker),

so that each comparison is measured in the same state of the machine. Reported: the median time a ``save`` blocked
the caller (a training step waits that long), and the median time from ``save`` to the snapshot being published
(durable); ratios bucket/directory for blocking (aim <= 1.1) and bucket/raw upload for durable (aim <= 1.5).

    .venv-vision/bin/python benchmarks/object_storage.py --snapshots 8 --out results/object_storage.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
from common import scratch_dir, write_json

from elastic_runner.snapshot import SnapshotWriter, require_ok
from elastic_runner.snapshot.object_store import ObjectStore
from elastic_runner.snapshot.store import LocalStore
from elastic_runner.testing.s3_server import S3Server


def state_of(megabytes: int) -> dict[str, Any]:
    count = max(1, megabytes // 4)
    return {"model": {f"layer{i}.weight": torch.randn(1 << 20) for i in range(count)}, "train": {"step": 0}}


def timed_saves(writer: SnapshotWriter, state: dict[str, Any], first_step: int) -> tuple[float, float]:
    """One save: (blocking seconds, seconds until published)."""
    for tensor in state["model"].values():
        tensor.add_(1.0)  # a new state every time, as training makes one
    began = time.perf_counter()
    result = writer.save(first_step, lambda: (state, {"epoch": 0, "consumed": first_step}))
    blocking = result.blocking_s
    writer.wait()
    durable = time.perf_counter() - began
    require_ok(result)
    return blocking, durable


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--megabytes", type=int, default=100)
    p.add_argument("--snapshots", type=int, default=8, help="measured snapshots per target (after 2 warm-ups)")
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    with scratch_dir(args.workdir, "object-storage-") as work:
        server = S3Server(work / "seaweedfs")
        server.start()
        try:
            for key, value in server.env().items():
                os.environ[key] = value
            server.create_bucket("bench")
            directory = LocalStore(work / "run" / "snapshots")
            directory.ensure()
            bucket = ObjectStore("s3://bench/run/snapshots", local=work / "node" / ".objects")
            bucket.ensure()
            fs: Any = server.filesystem()
            writers = {name: SnapshotWriter(store, generation=store.claim_generation({}), keep_last=2,
                                            writer="process")
                       for name, store in (("directory", directory), ("bucket", bucket))}
            state = state_of(args.megabytes)
            step = 0
            samples: dict[str, dict[str, list[float]]] = {n: {"blocking": [], "durable": []} for n in writers}
            samples["raw_upload"] = {"durable": []}
            for round_ in range(args.snapshots + 2):
                for name, writer in writers.items():
                    step += 1
                    blocking, durable = timed_saves(writer, state, step)
                    if round_ >= 2:  # the writer process starts with the first save; the second is warm
                        samples[name]["blocking"].append(blocking)
                        samples[name]["durable"].append(durable)
                newest = directory.complete()[-1]
                began = time.perf_counter()
                fs.put_file(str(directory.path(newest) / "state.pt"), f"bench/raw/{step}")
                if round_ >= 2:
                    samples["raw_upload"]["durable"].append(time.perf_counter() - began)
                fs.rm_file(f"bench/raw/{step}")
            for writer in writers.values():
                writer.close()
            size = int(os.path.getsize(directory.path(directory.complete()[-1]) / "state.pt"))
        finally:
            server.stop()
    medians = {name: {k: round(statistics.median(v), 4) for k, v in kinds.items()} for name, kinds in samples.items()}
    result = {
        "snapshot_bytes": size, "snapshots": args.snapshots, "torch": torch.__version__, "cpus": os.cpu_count(),
        "median_seconds": medians,
        "ratios": {
            "blocking_bucket_vs_directory": round(medians["bucket"]["blocking"] / medians["directory"]["blocking"], 3),
            "durable_bucket_vs_raw_upload": round(medians["bucket"]["durable"] / medians["raw_upload"]["durable"], 3),
            "durable_bucket_vs_directory": round(medians["bucket"]["durable"] / medians["directory"]["durable"], 3),
        },
        "samples": samples,
    }
    print(f"state.pt {size / 1e6:.1f} MB, {args.snapshots} snapshots each")
    for name, kinds in medians.items():
        print(f"  {name:<11}" + "".join(f"  {k} {v * 1000:8.1f} ms" for k, v in kinds.items()))
    for name, value in result["ratios"].items():
        print(f"  {name}: {value}")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
