"""A user's own transformer with dict batches, padding and a token-weighted loss, under real faults."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from elastic_runner.observe.audit import check_audit

from ..support import (
    ROOT,
    assert_bitwise_equal,
    end_events,
    events,
    exported_model,
    kill_worker_at_step,
    run_uninterrupted,
    start_agent_while_paused,
    stop_workers_at_step,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

EXAMPLES = ROOT / "examples"
#: hf_style.py from examples/ by import path, as `cd examples` would make it importable.
ENV = {"PYTHONPATH": os.pathsep.join([str(EXAMPLES), str(ROOT)])}


@pytest.fixture(scope="module")
def hf_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    data = yaml.safe_load((EXAMPLES / "hf_style.yaml").read_text())
    data["data"]["params"] = {"limit": 768, "eval_limit": 96}
    data["train"] = {"epochs": 4}  # 24 steps an epoch at a global batch of 32
    data["snapshot"] = {"every_steps": 10}
    data["audit"] = {"samples": True}
    data["logging"] = {"every_steps": 8}
    path = tmp_path_factory.mktemp("hf") / "hf.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def hf_reference(hf_config: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield run_uninterrupted(hf_config, tmp_path_factory.mktemp("hf-reference") / "run", timeout=180,
                            launcher="elastic-runner", env=ENV)


def test_dict_batch_transformer_survives_a_worker_kill_and_ends_bitwise_identical(
        hf_config: Path, hf_reference: Path, local_job, tmp_path: Path) -> None:  # noqa: ANN001
    job = local_job(config=str(hf_config), nnodes="2:2", launcher="elastic-runner", env=ENV)
    job.start_agent()
    job.start_agent()
    kill_worker_at_step(job, 40)
    assert job.wait(timeout=180) == [0, 0], job.logs_tail()
    run_dir = Path(job.run_dir)
    resumes = [e for e in events(run_dir, "resume") if e["generation"] > 1]
    assert resumes and resumes[0]["tier"] == "memory", "the survivor's node memory seeded the restart"
    report = check_audit(run_dir)
    assert report.ok and report.finished, report.render()
    assert_bitwise_equal(exported_model(run_dir, tmp_path), exported_model(hf_reference, tmp_path))


def test_the_script_api_survives_a_worker_kill_and_a_node_join(local_job) -> None:  # noqa: ANN001
    job = local_job(config="", nnodes="1:2", launcher="elastic-runner", env=ENV)
    # One epoch of the script's 4,096 lines is 128 steps: the kill at step 30 and the join at step 60 fall in it.
    job.program = [str(EXAMPLES / "hf_style.py"), "--run-dir", job.run_dir, "--set", "audit.samples=true",
                   "--set", "train.epochs=1", "--set", "snapshot.every_steps=10"]
    job.start_agent()
    run_dir = Path(job.run_dir)
    [worker], _ = stop_workers_at_step(job, 30, count=1, timeout=120)
    job.signal_worker(worker, signal.SIGKILL)
    # The restarted worker is held from its first step: left running until the test sees the restart, a fast
    # job on a loaded machine ran to its end first (the join then found no rendezvous to join).
    start_agent_while_paused(job, at_step=60, count=1, replacing=[worker])  # node join: a second agent
    assert job.wait(timeout=240) == [0, 0], job.logs_tail()
    assert {e["world_size"] for e in events(run_dir, "world")} == {1, 2}
    report = check_audit(run_dir)
    assert report.ok and report.finished, report.render()
    assert len({e["params_sha256"] for e in end_events(run_dir)}) == 1
