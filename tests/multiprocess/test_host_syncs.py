"""A step that neither logs nor captures never makes the host wait for the device (issue 49), proved on the CPU.

Each worker runs under tests/sync_probe.py, which counts every read of a device value into the host (``.item()``,
``bool(tensor)``, ``tolist``, ``nonzero``...) in each step and between steps, with its call site. A language model on
packed data.sources (a weighted, token-count loss: the hardest case), with every feature on — the audit, the
goodput clock, the peer watchdog, node memory, the non-finite check, metrics — for each strategy: such steps read
nothing; a logging step and a capture step read a bounded number of values (stated below)."""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path

import pytest

from ..corpus import mixture_config, write_corpus
from ..support import free_port, run_bounded

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

LOG_EVERY, SNAPSHOT_EVERY, MEMORY_EVERY, STEPS = 10, 15, 7, 45
#: What a logging step reads: the window's loss and count (one tolist), whether a step diverged (one int), and once
#: an attempt which form the loss has (one tolist); a capture step: whether a step diverged (one int).
LOGGING_READS, CAPTURE_READS = 3, 1


def probe(tmp_path: Path, strategy: str, nproc: int, *more: str) -> list[list[dict]]:
    corpus = write_corpus(tmp_path / "corpus")
    config = mixture_config(tmp_path / "job.yaml", [{"path": str(corpus / "tok" / "*.bin"), "weight": 0.5},
                                                    {"path": str(corpus / "web" / "*.jsonl"), "weight": 0.5}],
                            train={"max_steps": STEPS}, parallel={"strategy": strategy},
                            snapshot={"every_steps": SNAPSHOT_EVERY, "memory_every_steps": MEMORY_EVERY},
                            logging={"every_steps": LOG_EVERY})
    out = tmp_path / "syncs-{rank}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           f"--rdzv_endpoint=127.0.0.1:{free_port()}", "-m", "tests.sync_probe", str(out), "--",
           "--config", str(config), *[arg for item in more for arg in ("--set", item)]]
    result = run_bounded(cmd, timeout=240, env=os.environ | {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                                                                  "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    assert result.returncode == 0, result.stdout[-4000:]
    return [json.loads((tmp_path / f"syncs-{rank}.json").read_text()) for rank in range(nproc)]


def check(ranks: list[list[dict]], sharded: bool) -> None:
    for rank, records in enumerate(ranks):
        assert {r["step"] for r in records} == set(range(1, STEPS + 1)), "every step was probed"
        quiet, logged, captured = Counter(), Counter(), Counter()
        for r in records:
            step = r["step"]
            capture = r["snapshot"] or (sharded and step % MEMORY_EVERY == 0)
            into = logged if r["logged"] else captured if capture else quiet
            into.update(r["syncs"])
            if into is logged and sum(r["syncs"].values()) > LOGGING_READS + CAPTURE_READS:
                pytest.fail(f"rank {rank}, step {step} (logging): {r['syncs']}")
            if into is captured and r["part"] == "after_step" and sum(r["syncs"].values()) > CAPTURE_READS:
                pytest.fail(f"rank {rank}, step {step} (capture): {r['syncs']}")
        assert not quiet, f"rank {rank}: steps that neither log nor capture read the device at {dict(quiet)}"
        assert logged, "the probe saw the logging steps read (it can see a read)"


@pytest.mark.parametrize(("strategy", "nproc", "more"), [
    ("ddp", 2, ()),
    ("ddp", 2, ("train.precision=bf16", "optim.grad_clip_norm=1.0")),
    ("ddp", 2, ("train.on_nonfinite=skip", "optim.params={fused: true}")),  # the fused AdamW skips on the device
    ("fsdp", 2, ()),
    ("hsdp", 4, ()),
], ids=["ddp", "ddp-bf16-clipped", "ddp-skip-fused", "fsdp", "hsdp"])
def test_a_step_that_neither_logs_nor_captures_never_waits_for_the_device(
        strategy: str, nproc: int, more: tuple[str, ...], tmp_path: Path) -> None:
    check(probe(tmp_path, strategy, nproc, *more), sharded=strategy != "ddp")


def test_the_probe_sees_a_read_of_the_device_where_there_is_one(tmp_path: Path) -> None:
    """train.on_nonfinite: skip with an optimizer that cannot skip on the device reads the gradient's finiteness at
    every step (documented): the probe must see it."""
    ranks = probe(tmp_path, "ddp", 2, "train.on_nonfinite=skip")
    quiet = Counter(k for r in ranks[0] if not (r["logged"] or r["snapshot"]) for k in r["syncs"])
    assert any("gradients.py" in site and "(finish)" in site for site in quiet), quiet
