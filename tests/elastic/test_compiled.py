"""A compiled model (``model.compile: true``) under faults: a worker killed at a random step, and the job ends with
exactly the model of an uninterrupted compiled run; its snapshots load into the model uncompiled. Two agents of two
workers each (world 4): from three ranks on the order of the gradient sum matters, and two processes share a node.
Replicated (ddp) and sharded (fsdp: torch.compile runs FSDP2's gathering hooks outside its graphs)."""

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
    run_uninterrupted,
    write_config,
)
from .conftest import RESUME_SECTIONS

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 200
SEED = int(time.time()) % 10_000


@pytest.fixture(scope="module", params=["ddp", "fsdp"])
def compiled_config(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Node memory every 10 steps under fsdp: the kill resumes from it (a survivor's memory under ddp).
    sections = RESUME_SECTIONS | {"model": {"compile": True}, "parallel": {"strategy": request.param},
                                  "snapshot": RESUME_SECTIONS["snapshot"] | {"memory_every_steps": 10},
                                  "train": RESUME_SECTIONS["train"] | {"max_steps": STEPS}}
    return write_config(tmp_path_factory.mktemp("cfg") / f"compiled-{request.param}.yaml", **sections)


@pytest.fixture(scope="module")
def uninterrupted_compiled(compiled_config: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    run_dir = run_uninterrupted(compiled_config, tmp_path_factory.mktemp("uninterrupted-compiled") / "run", nproc=2)
    yield exported_model(run_dir, tmp_path_factory.mktemp("export"))


def test_a_compiled_model_recovers_from_a_worker_kill_bitwise_and_loads_uncompiled(
        compiled_config: Path, uninterrupted_compiled: dict, local_job, tmp_path: Path) -> None:  # noqa: ANN001
    job = local_job(config=str(compiled_config), nnodes="2:2", nproc_per_node=2)
    job.start_agent()
    job.start_agent()
    victim, reached = kill_a_random_worker(job, SEED, STEPS)
    assert job.wait(timeout=300) == [0, 0], job.logs_tail()
    run_dir = Path(job.run_dir)
    what = f"rank {victim.rank} killed at step {reached} (seed {SEED})"
    resumed = [e for e in events(run_dir, "resume") if e["generation"] > 1]
    assert resumed and resumed[0]["tier"] == "memory", f"{what}: the survivor's memory seeded the restart"
    report = check_audit(run_dir)
    assert report.ok and report.finished and report.final_step == STEPS, f"{what}: {report.render()}"
    ours = exported_model(run_dir, tmp_path)
    assert_bitwise_equal(ours, uninterrupted_compiled)
    plain = load_model(run_dir)  # the built-in model, uncompiled, from the snapshot's own config
    assert type(plain).__name__ != "OptimizedModule"
    assert all(torch.equal(v, ours[k]) for k, v in plain.state_dict().items())
