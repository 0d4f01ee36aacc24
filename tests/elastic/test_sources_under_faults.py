"""data.sources under faults (real torchrun agents, gloo): a mixture of token shards and packed JSONL documents, and a
user's stream read through DataLoader workers, keep every source exactly once per its own epoch, in its exact share,
through a killed worker, a lost node and nodes that join; at one world size the run is the uninterrupted one, bit
for bit."""

from __future__ import annotations

import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from elastic_runner.observe.audit import AuditReport, check_audit

from ..corpus import mixture_config, write_corpus
from ..support import (assert_bitwise_equal, continue_workers, exported_model, kill_worker_at_step, run_uninterrupted,
                       stop_workers_at_step, wait_for_world)

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(420)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def files_config(corpus: Path, path: Path, **sections: Any) -> Path:
    return mixture_config(path, [{"path": str(corpus / "tok" / "*.bin"), "format": "tokens", "weight": 0.7,
                                  "label": "tok"},
                                 {"path": str(corpus / "web" / "*.jsonl"), "weight": 0.3, "label": "web"}], **sections)


def stream_config(corpus: Path, path: Path, **sections: Any) -> Path:
    return mixture_config(path, [{"path": str(corpus / "tok" / "*.bin"), "format": "tokens", "weight": 0.5,
                                  "label": "tok"},
                                 {"name": "tests.corpus:stream", "params": {"shards": 4, "items": 30}, "weight": 0.5,
                                  "label": "stream", "index": str(path.parent / "stream-index")}], **sections)


def clean_mixture(run_dir: Path, steps: int) -> AuditReport:
    """The audit is clean, the run finished, and each source's share held at every step."""
    report = check_audit(run_dir)
    assert report.ok and report.finished and report.final_step == steps, report.render()
    assert [s.label for s in report.sources] and all(s.worst_deviation < 1 for s in report.sources), report.render()
    return report


def test_a_killed_worker_leaves_a_mixture_of_token_shards_and_packed_documents_bitwise_the_uninterrupted_run(
        corpus: Path, local_job: Any, tmp_path: Path) -> None:
    config = files_config(corpus, tmp_path / "mix.yaml")
    reference = exported_model(run_uninterrupted(config, tmp_path / "reference"), tmp_path)
    job = local_job(config=str(config), nnodes="2:2")
    job.start_agent()
    job.start_agent()
    kill_worker_at_step(job, 60, rank=1, count=2)
    assert job.wait(timeout=240) == [0, 0], job.logs_tail()
    report = clean_mixture(Path(job.run_dir), 300)
    tok = next(s for s in report.sources if s.label == "tok")
    assert tok.epochs_complete >= 2, "the token source ran through epochs of its own during the run"
    assert_bitwise_equal(exported_model(Path(job.run_dir), tmp_path), reference)


def test_a_node_lost_and_two_joining_keep_each_source_exactly_once_in_its_share(
        corpus: Path, local_job: Any, tmp_path: Path) -> None:
    config = files_config(corpus, tmp_path / "mix.yaml", train={"max_steps": 360})
    job = local_job(config=str(config), nnodes="1:3")
    job.start_agent()
    lost = job.start_agent()
    run_dir = Path(job.run_dir)
    workers, _ = stop_workers_at_step(job, 60, count=2)
    lost_at = time.time()
    job.kill_agent(lost)  # the node, its agent and its worker
    continue_workers(job, [w for w in workers if w.agent is not lost])
    wait_for_world(run_dir, 1, lost_at, job)
    joined_at = time.time()
    paused, _ = stop_workers_at_step(job, 0, count=1)  # the survivor alone could finish before two nodes start
    joiners = [job.start_agent(), job.start_agent()]  # at once: both reach the same round
    logs = [run_dir / "events" / f"agent-{socket.gethostname()}-{agent.pid}.jsonl" for agent in joiners]
    deadline = time.monotonic() + 90
    while not all(log.exists() for log in logs):  # each agent writes it just before it joins the rendezvous
        assert time.monotonic() < deadline, job.logs_tail()
        time.sleep(0.05)
    continue_workers(job, paused)
    wait_for_world(run_dir, 3, joined_at, job, timeout=120)
    codes = job.wait(timeout=300)
    assert codes[0] == 0 and codes[2:] == [0, 0], job.logs_tail()
    report = clean_mixture(run_dir, 360)
    assert {1, 3} <= set(report.world_sizes.values()), report.world_sizes


def test_a_users_stream_through_two_loader_workers_resumes_with_three_bitwise(
        corpus: Path, local_job: Any, tmp_path: Path) -> None:
    config = stream_config(corpus, tmp_path / "stream.yaml", train={"max_steps": 240})
    reference = exported_model(run_uninterrupted(config, tmp_path / "reference"), tmp_path)
    first = local_job(config=str(config), nnodes="2:2", overrides=["data.num_workers=2"])
    first.start_agent()
    first.start_agent()
    kill_worker_at_step(first, 50, rank=0, count=2)
    workers, _ = stop_workers_at_step(first, 120, count=2)
    for agent in first.agents:
        first.kill_agent(agent, signal.SIGTERM)  # a preemption of both nodes: each saves and stops
    continue_workers(first, workers)
    first.wait(timeout=120)
    second = local_job(config=str(config), nnodes="2:2", overrides=["data.num_workers=3"])
    second.start_agent()
    second.start_agent()
    assert second.wait(timeout=240) == [0, 0], second.logs_tail()
    report = clean_mixture(Path(second.run_dir), 240)
    assert len(report.generations) >= 3, report.generations
    assert_bitwise_equal(exported_model(Path(second.run_dir), tmp_path), reference)
