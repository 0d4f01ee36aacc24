"""A node joining a job on a corpus of 10^9 windows against the same join on 10^4 (issue 46: aim <= 1.1x).

Two corpora of flat token shards (``data.sources``, format tokens, windows of 16 + 1 tokens): 10^4 windows in one
shard, and 10^9 windows in 100 shards (sparse files of 320 MB each: their size, not their bytes, is what a join
could pay for — the listing, the index, the sampler's order). For each, a job of one agent (a tiny GPT) trains; once it
steps, a second agent starts, and the time from its start to every rank stepping at world size 2 is the join. The two
corpora alternate (each first in every other repeat), ``--repeats`` times each, in one run; the figures are the ratios
of the medians, of the whole join and of its part after the new round (the new attempt's start to every rank
stepping: the restore, the sources opened, the first plan and read). The indexes are built once before the timing (a
corpus's index is built once, by ``elastic-runner data index`` or the first worker).

    ../.venv-vision/bin/python corpus_join.py --repeats 3 --out DIR/join.json      # ~3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BLOCK = 16


def corpus(root: Path, windows: int, shards: int) -> Path:
    root.mkdir(parents=True)
    per = windows // shards
    for k in range(shards):
        with open(root / f"shard-{k:03d}.bin", "wb") as fh:
            fh.truncate((per * BLOCK + 1) * 2)  # uint16 tokens, all 0: sparse, nothing written
    return root


def config(path: Path, root: Path) -> Path:
    path.write_text(yaml.safe_dump({
        "run": {"dir": str(path.parent / "run")},
        "data": {"sources": [{"path": str(root / "*.bin"), "format": "tokens"}], "pack": {"block_size": BLOCK}},
        "model": {"name": "gpt", "params": {"n_layer": 1, "n_head": 2, "n_embd": 16, "vocab_size": 64}},
        "batch": {"global_size": 8}, "train": {"max_steps": 10**9, "eval_every_steps": 0},
        "snapshot": {"every_steps": 50}, "logging": {"every_steps": 10}, "audit": {"samples": False},
    }))
    return path


def one_join(cfg: Path, run_dir: Path, timeout: float) -> tuple[float, float] | None:
    """(agent start -> every rank stepping at world 2, the new attempt's start -> every rank stepping)."""
    from common import wait_stepping
    from elastic_runner.testing.localjob import LocalJob

    job = LocalJob(config=str(cfg), run_dir=str(run_dir), nnodes="1:2", launcher="elastic-runner", rdzv_conf=None,
                   max_restarts=100)
    try:
        job.start_agent()
        first, _ = wait_stepping("elastic-runner", run_dir, time.time() - 60, 1, timeout)
        if first is None:
            return None
        time.sleep(2.0)  # a steady job
        joined = time.time()
        job.start_agent()
        seconds, attempt = wait_stepping("elastic-runner", run_dir, joined, 2, timeout)
        if seconds is None or attempt is None or attempt.all_stepping is None:
            return None
        return seconds, attempt.all_stepping - attempt.started
    finally:
        job.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=120)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from common import write_json

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        sizes = {"1e4": corpus(root / "small", 10**4, 1), "1e9": corpus(root / "large", 10**9, 100)}
        configs = {name: config(root / f"{name}.yaml", path) for name, path in sizes.items()}
        for name, cfg in configs.items():  # the index, once, as a job's first worker (or data index) builds it
            subprocess.run([sys.executable, "-m", "elastic_runner", "data", "index", "--config", str(cfg)], check=True)
        joins: dict[str, list[tuple[float, float] | None]] = {name: [] for name in sizes}
        for r in range(args.repeats):
            # Each corpus goes first in every other repeat: what a join leaves behind (processes being reaped,
            # memory and page cache freed) must not always fall on the same one.
            for name, cfg in (list(configs.items()) if r % 2 == 0 else list(configs.items())[::-1]):
                joins[name].append(one_join(cfg, root / f"run-{name}-{r}", args.timeout))
                print(f"{name}: join {joins[name][-1]}", file=sys.stderr, flush=True)
    whole = {name: statistics.median([j[0] for j in values if j]) for name, values in joins.items()}
    after = {name: statistics.median([j[1] for j in values if j]) for name, values in joins.items()}
    result = {"benchmark": "corpus_join", "joins": joins, "median_join_s": whole, "median_round_to_stepping_s": after,
              "ratio_join": round(whole["1e9"] / whole["1e4"], 3),
              "ratio_round_to_stepping": round(after["1e9"] / after["1e4"], 3)}
    write_json(args.out, result)


if __name__ == "__main__":
    main()
