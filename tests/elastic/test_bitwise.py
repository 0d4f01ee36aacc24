"""Bitwise resume at every world size: after a worker kill, a graceful stop and restart, or a resume from
disk, a job that ends at the world size it ran at has exactly the model of an uninterrupted run.

Two layouts beside the two-rank case of test_resume.py: 2 agents x 2 processes (world 4) and 3 agents x 1
process (world 3) — from three ranks on, the order in which gradients are added matters, so a resumed
process must add them in the order the uninterrupted one did (the ordered gradient sync,
``elastic_runner.training.parallel``). Each fault comes at a random step (the seed is in the test's id
and in every failure message).
"""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

from elastic_runner.observe.audit import check_audit
from elastic_runner.testing.localjob import LocalJob

from ..support import continue_workers, events, exported_model, run_uninterrupted, stop_workers_at_step

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(420)]

#: (agents, processes per agent) of each layout.
LAYOUTS = {"2x2": (2, 2), "3x1": (3, 1)}
SEED = int(time.time()) % 10_000


def fault_step(name: str) -> int:
    """A step between the first snapshots and the end of the 400-step run, drawn per test from ``SEED``."""
    return random.Random(f"{SEED}-{name}").randint(35, 330)


def start(job: LocalJob, agents: int) -> None:
    for _ in range(agents):
        job.start_agent()


def layout_job(local_job: Callable[..., LocalJob], config: Path, layout: str) -> LocalJob:
    agents, nproc = LAYOUTS[layout]
    return local_job(config=str(config), nnodes=f"{agents}:{agents}", nproc_per_node=nproc)


@pytest.fixture(scope="module")
def uninterrupted(resume_config: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Any]]:
    """The final model of an uninterrupted run of ``resume_config`` in a layout (each run once per module)."""
    models: dict[str, Any] = {}

    def model_of(layout: str) -> Any:
        if layout not in models:
            agents, nproc = LAYOUTS[layout]
            run_dir = run_uninterrupted(resume_config, tmp_path_factory.mktemp(f"uninterrupted-{layout}") / "run",
                                        agents=agents, nproc=nproc)
            models[layout] = exported_model(run_dir, tmp_path_factory.mktemp(f"export-{layout}"))
        return models[layout]

    yield model_of


def stopped_at_a_random_step(local_job: Callable[..., LocalJob], config: Path, layout: str,
                             fault: str) -> tuple[LocalJob, list[Any], int]:
    """The job of ``layout`` running, every worker stopped (SIGSTOP) at the fault's random step, and the step."""
    agents, nproc = LAYOUTS[layout]
    job = layout_job(local_job, config, layout)
    start(job, agents)
    workers, reached = stop_workers_at_step(job, fault_step(f"{fault}-{layout}"), count=agents * nproc, timeout=150)
    return job, workers, reached


def assert_same_model(run_dir: Path, tmp_path: Path, reference: dict[str, torch.Tensor], what: str) -> None:
    ours = exported_model(run_dir, tmp_path)
    assert ours.keys() == reference.keys()
    differing = [k for k in ours if not torch.equal(ours[k], reference[k])]
    assert not differing, f"{what} (seed {SEED}): {len(differing)} of {len(ours)} tensors differ: {differing}"


def assert_clean_audit(run_dir: Path, what: str) -> None:
    report = check_audit(run_dir)
    assert report.ok, f"{what} (seed {SEED}): {report.render()}"
    assert report.finished and report.final_step == 400 and len(report.generations) >= 2


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_worker_killed_at_a_random_step_ends_bitwise_identical(
        layout: str, resume_config: Path, uninterrupted: Callable[[str], Any], local_job, tmp_path: Path) -> None:  # noqa: ANN001
    job, workers, reached = stopped_at_a_random_step(local_job, resume_config, layout, "kill")
    victim = random.Random(f"{SEED}-victim-{layout}").choice(workers)
    job.signal_worker(victim, signal.SIGKILL)
    continue_workers(job, [w for w in workers if w is not victim])
    assert job.wait(timeout=300) == [0] * LAYOUTS[layout][0], job.logs_tail()
    what = f"{layout}, rank {victim.rank} killed at step {reached}"
    resumed = [e for e in events(Path(job.run_dir), "resume") if e["generation"] > 1]
    assert resumed and resumed[0]["tier"] == "memory", f"{what}: a survivor's memory holds the newest step"
    assert_clean_audit(Path(job.run_dir), what)
    assert_same_model(Path(job.run_dir), tmp_path, uninterrupted(layout), what)


def test_a_graceful_stop_and_restart_ends_bitwise_identical(
        resume_config: Path, uninterrupted: Callable[[str], Any], local_job, tmp_path: Path) -> None:  # noqa: ANN001
    job, workers, reached = stopped_at_a_random_step(local_job, resume_config, "2x2", "sigterm")
    continue_workers(job, workers)
    for agent in list(job.agents):
        agent.proc.send_signal(signal.SIGTERM)  # the whole job preempted, as Kubernetes does
    job.wait(timeout=90)
    run_dir = Path(job.run_dir)
    stop_steps = {e["step"] for e in events(run_dir, "stop")}
    assert len(stop_steps) == 1, f"the job stopped at one step (seed {SEED}, near step {reached}): {stop_steps}"
    start(job, 2)  # later, the job comes back
    assert job.wait(timeout=300)[-2:] == [0, 0], job.logs_tail()
    what = f"2x2, stopped at step {min(stop_steps)} and started again"
    resumed = [e for e in events(run_dir, "resume") if e["generation"] > 1]
    assert resumed and resumed[0]["step"] == min(stop_steps), f"{what}: no step lost on a graceful stop"
    assert_clean_audit(run_dir, what)
    assert_same_model(run_dir, tmp_path, uninterrupted("2x2"), what)


def test_a_resume_from_disk_ends_bitwise_identical(
        resume_config: Path, uninterrupted: Callable[[str], Any], local_job, tmp_path: Path) -> None:  # noqa: ANN001
    job, workers, reached = stopped_at_a_random_step(local_job, resume_config, "3x1", "disk")
    for worker in workers:  # no survivor keeps the newest step: the job goes back to the disk snapshot
        job.signal_worker(worker, signal.SIGKILL)
    assert job.wait(timeout=300) == [0, 0, 0], job.logs_tail()
    run_dir = Path(job.run_dir)
    what = f"3x1, every worker killed at step {reached}"
    resumed = [e for e in events(run_dir, "resume") if e["generation"] > 1]
    assert resumed and resumed[0]["tier"] == "disk" and resumed[0]["step"] % 20 == 0, what
    assert_clean_audit(run_dir, what)
    assert_same_model(run_dir, tmp_path, uninterrupted("3x1"), what)


def test_a_graceful_stop_and_restart_on_nodes_with_empty_disks_resumes_from_a_bucket_bitwise_identical(
        resume_config: Path, uninterrupted: Callable[[str], Any], local_job, tmp_path: Path,  # noqa: ANN001
        s3_server: Any, s3_prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """2 agents x 2 processes, each agent with a run.dir of its own and the snapshots in a bucket: the whole job
    preempted (SIGTERM), then two new nodes with empty directories and empty memory: they resume from the bucket
    alone, and the model is the uninterrupted run's to the bit; the audit, read from the bucket, is clean."""
    from elastic_runner.observe.events import read_events
    from elastic_runner.observe.records_view import run_view

    url = f"{s3_prefix}/snapshots"
    agents, nproc = LAYOUTS["2x2"]
    job = local_job(config=str(resume_config), nnodes=f"{agents}:{agents}", nproc_per_node=nproc,
                    separate_run_dirs=True, env=s3_server.env(), overrides=[f"snapshot.dir={url}"])
    start(job, agents)
    workers, reached = stop_workers_at_step(job, fault_step("bucket-2x2"), count=agents * nproc, timeout=150)
    continue_workers(job, workers)
    for agent in list(job.agents):
        agent.proc.send_signal(signal.SIGTERM)
    job.wait(timeout=90)

    def node_events(kind: str) -> list[dict[str, Any]]:
        return [e for node in sorted(Path(job.run_dir).glob("node-*")) for e in read_events(node) if e["kind"] == kind]

    stop_steps = {e["step"] for e in node_events("stop")}
    assert len(stop_steps) == 1, f"the job stopped at one step (seed {SEED}, near step {reached}): {stop_steps}"
    start(job, agents)  # nodes 2 and 3: their run.dir and their memory are new
    assert job.wait(timeout=300)[-2:] == [0, 0], job.logs_tail()
    what = f"2x2 with a bucket, stopped at step {min(stop_steps)} and started again on new nodes"
    resumed = [e for e in node_events("resume") if e["generation"] > 1]
    assert resumed and resumed[0]["tier"] == "disk" and resumed[0]["step"] == min(stop_steps), what
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    assert_clean_audit(Path(run_view(url)), what)
    assert_same_model(url, tmp_path, uninterrupted("2x2"), what)  # type: ignore[arg-type] - a bucket URL is a run too
