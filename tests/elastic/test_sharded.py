"""Sharded models (``parallel.strategy: fsdp | hsdp``) under faults, with real torchrun agents: two agents of two
workers each (world 4; under hsdp a 2 x 2 mesh: sharded within an agent, replicated across the two).

A worker killed at a random step: every rank resumes from the newest copy of the shards in node memory (refreshed
every 10 steps), the audit is clean and the job ends with exactly the model of an uninterrupted run. A lost node: the
survivors take its shards from the copy their own node's memory holds. A sharded
run's snapshots resume in a run of another world size and strategy: 4 ranks of fsdp -> 3 ranks of fsdp -> 2 of ddp,
every sample of the epoch exactly once, and the final model what a replicated run continued from the same state ends
with (up to the order of the additions, which differs between world sizes).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator

import pytest
import torch

from elastic_runner import load_model
from elastic_runner.observe.audit import check_audit

from ..support import (
    assert_bitwise_equal,
    events,
    exported_model,
    kill_a_random_worker,
    continue_workers,
    run_uninterrupted,
    start_agent_while_paused,
    stop_workers_at_step,
    write_config,
)
from .conftest import RESUME_SECTIONS

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 160
SEED = int(time.time()) % 10_000


def _config(tmp_path_factory: pytest.TempPathFactory, strategy: str, **extra: dict) -> Path:
    # Node memory every 10 steps (not auto): the test knows which step a failure resumes from.
    sections = RESUME_SECTIONS | {"parallel": {"strategy": strategy},
                                  "snapshot": RESUME_SECTIONS["snapshot"] | {"memory_every_steps": 10},
                                  "train": RESUME_SECTIONS["train"] | {"max_steps": STEPS}} | extra
    return write_config(tmp_path_factory.mktemp("cfg") / f"{strategy}.yaml", **sections)


@pytest.fixture(scope="module", params=["fsdp", "hsdp"])
def sharded(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, dict]]:
    config = _config(tmp_path_factory, request.param)
    run_dir = run_uninterrupted(config, tmp_path_factory.mktemp(f"uninterrupted-{request.param}") / "run", nproc=2)
    yield request.param, config, exported_model(run_dir, tmp_path_factory.mktemp("export"))


def test_a_sharded_model_recovers_from_a_worker_kill_bitwise(sharded: tuple[str, Path, dict], local_job,  # noqa: ANN001
                                                             tmp_path: Path) -> None:
    strategy, config, uninterrupted = sharded
    job = local_job(config=str(config), nnodes="2:2", nproc_per_node=2)
    job.start_agent()
    job.start_agent()
    victim, reached = kill_a_random_worker(job, SEED, STEPS)
    assert job.wait(timeout=300) == [0, 0], job.logs_tail()
    run_dir = Path(job.run_dir)
    what = f"{strategy}: rank {victim.rank} killed at step {reached} (seed {SEED})"
    resumed = [e for e in events(run_dir, "resume") if e["generation"] > 1]
    assert resumed and resumed[0]["tier"] == "memory", f"{what}: resumed from the shards in node memory"
    assert resumed[0]["step"] % 10 == 0 and reached - resumed[0]["step"] < 10 + 2, f"{what}: {resumed[0]}"
    saved = [e for e in events(run_dir, "snapshot_saved")]
    assert saved, what
    newest = sorted((run_dir / "snapshots").glob("step-*"))[-1]
    parts = sorted(p.name for p in newest.glob("part-*.bin"))
    assert parts == ([f"part-{r:05d}.bin" for r in range(4)] if strategy == "fsdp" else
                     ["part-00000.bin", "part-00001.bin"]), f"{what}: every shard written once ({parts})"
    report = check_audit(run_dir)
    assert report.ok and report.finished and report.final_step == STEPS, f"{what}: {report.render()}"
    ours = exported_model(run_dir, tmp_path)
    assert_bitwise_equal(ours, uninterrupted)
    plain = load_model(run_dir)  # the whole model, from the parts
    assert all(torch.equal(v, ours[k]) for k, v in plain.state_dict().items())


def test_a_node_joining_a_sharded_job_loads_its_shards_resharded(local_job, tmp_path: Path) -> None:  # noqa: ANN001
    """One agent of two workers, then a second joins: world 2 -> 4 under fsdp. The two stop at a step boundary and
    write their parts; all four load their quarter of each tensor from the two halves; every sample once."""
    config = write_config(tmp_path / "fsdp.yaml", **(RESUME_SECTIONS | {
        "parallel": {"strategy": "fsdp"}, "train": RESUME_SECTIONS["train"] | {"max_steps": STEPS},
        "audit": {"samples": True}}))
    job = local_job(config=str(config), nnodes="1:2", nproc_per_node=2)
    job.start_agent()
    start_agent_while_paused(job, at_step=40, count=2, timeout=120)
    assert job.wait(timeout=300) == [0, 0], job.logs_tail()
    run_dir = Path(job.run_dir)
    assert {e["world_size"] for e in events(run_dir, "world")} == {2, 4}
    resumed = [e for e in events(run_dir, "resume") if e["generation"] > 1]
    # The stop snapshot of the step they stopped at, from disk — or from node memory where a refresh (memory_every_steps:
    # auto) fell on that very step: a tie goes to memory, and the newcomers receive every part from the holders.
    assert resumed and resumed[0]["tier"] in ("disk", "memory") and resumed[0]["steps_recomputed"] == 0, resumed
    report = check_audit(run_dir)
    assert report.ok and report.finished and report.final_step == STEPS, report.render()
    assert set(report.global_batches) == {32}
    newest = sorted((run_dir / "snapshots").glob("step-*"))[-1]
    assert len(list(newest.glob("part-*.bin"))) == 4


def test_a_lost_node_s_shards_come_back_from_the_survivors_memory(local_job, tmp_path: Path) -> None:  # noqa: ANN001
    """2 agents x 2 workers under fsdp; one agent and its workers are SIGKILLed (its node memory goes with it): the
    two ranks left resume from node memory — their own shards and the copy of the lost node's — not from disk."""
    config = write_config(tmp_path / "fsdp.yaml", **(RESUME_SECTIONS | {
        "parallel": {"strategy": "fsdp"}, "train": RESUME_SECTIONS["train"] | {"max_steps": STEPS},
        "snapshot": RESUME_SECTIONS["snapshot"] | {"every_steps": 50, "memory_every_steps": 10}}))
    job = local_job(config=str(config), nnodes="1:2", nproc_per_node=2)
    job.start_agent()
    second = job.start_agent()
    workers, reached = stop_workers_at_step(job, 65, count=4, timeout=240)
    job.kill_agent(second)
    continue_workers(job, workers)
    codes = job.wait(timeout=300)
    assert codes[0] == 0, job.logs_tail()
    run_dir = Path(job.run_dir)
    resumed = [e for e in events(run_dir, "resume") if e["generation"] > 1]
    assert resumed and resumed[0]["tier"] == "memory" and resumed[0]["step"] == 60, (resumed, job.logs_tail())
    assert {e["world_size"] for e in events(run_dir, "world")} == {4, 2}
    report = check_audit(run_dir)
    assert report.ok and report.finished and report.final_step == STEPS, report.render()
