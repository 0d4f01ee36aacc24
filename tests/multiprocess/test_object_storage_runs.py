"""Real runs (torchrun, 2 workers) whose snapshots live in a bucket of a real S3 server, not in a shared directory."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

from elastic_runner import load_model
from elastic_runner.observe.audit import check_audit, latest_step
from elastic_runner.observe.records_view import run_view
from elastic_runner.snapshot.format import read_meta, read_verified_bytes
from elastic_runner.snapshot.object_store import ObjectStore
from elastic_runner.testing.s3_server import S3Server
from elastic_runner.lifecycle import EXIT_NOT_DURABLE

from ..support import end_events, events, run_bounded, torchrun_standalone

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]


def run(config: Path, run_dir: Path, env: dict[str, str], steps: int, *more: str) -> str:
    result = torchrun_standalone(config, run_dir, nproc=2, timeout=240, extra_env=env,
                                 overrides=[f"train.max_steps={steps}", *more])
    assert result.returncode == 0, result.stdout[-4000:]
    return result.stdout


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_job_with_no_shared_directory_resumes_from_the_bucket_on_a_node_with_an_empty_disk(
        small_config: Path, s3_server: S3Server, s3_prefix: str, tmp_path: Path, strategy: str) -> None:
    url = f"{s3_prefix}/snapshots"
    parallel = f"parallel.strategy={strategy}"
    # Every start is a fresh node: its own empty run.dir and its own empty node memory.
    def node_env(name: str) -> dict[str, str]:
        shm = tmp_path / f"shm-{name}"
        shm.mkdir(mode=0o700)
        return s3_server.env() | {"ELASTIC_RUNNER_SHM_DIR": str(shm)}

    first, second = tmp_path / "node-1", tmp_path / "node-2"
    output = run(small_config, first, node_env("1"), 30, f"snapshot.dir={url}", parallel)
    # The client is warmed up for real (an unawaited warm-up left a warning in every worker), and the agent's last
    # upload runs before its interpreter shuts down (at exit, the client could no longer send a request).
    assert "never awaited" not in output and "could not upload the run's records" not in output, output[-3000:]
    agent_logs = s3_server.filesystem().find(f"{url.removeprefix('s3://')}/records/events")  # type: ignore[attr-defined]
    assert any("/agent-" in key for key in agent_logs), agent_logs
    run(small_config, second, node_env("2"), 60, f"snapshot.dir={url}", parallel)
    (resume,) = [e for e in events(second, "resume") if e["rank"] == 0]
    assert resume["tier"] == "disk" and resume["step"] == 30, resume
    assert not (second / "snapshots").exists() and not (first / "snapshots").exists(), "nothing of it on a node"

    # The same two runs with a directory (max_steps shapes the schedule: 30 then 60 is not 60 in one go): the
    # same model, bit for bit.
    reference = tmp_path / "reference"
    run(small_config, reference, node_env("ref-1"), 30, parallel)
    run(small_config, reference, node_env("ref-2"), 60, parallel)
    ours, theirs = end_events(second), end_events(reference)
    assert {e["params_sha256"] for e in ours} == {e["params_sha256"] for e in theirs}, "the bucket changed the model"

    assert os.stat(tmp_path / "node-2" / ".objects").st_mode & 0o077 == 0, "the node's copies are private"

    # Everything about the run, read from the bucket alone (the nodes' directories gone).
    shutil.rmtree(first)
    shutil.rmtree(second)
    env = os.environ | s3_server.env()
    audit = run_bounded([sys.executable, "-m", "elastic_runner", "audit", url], timeout=120, env=env)
    assert audit.returncode == 0 and "CLEAN — finished at step 60" in audit.stdout, audit.stdout[-3000:]
    inspect = run_bounded([sys.executable, "-m", "elastic_runner", "snapshot", "inspect", url], timeout=120, env=env)
    assert inspect.returncode == 0, inspect.stdout[-3000:]
    assert json.loads(inspect.stdout)["snapshots"][-1]["name"] == "step-000000060-gen-000002"
    report = run_bounded([sys.executable, "-m", "elastic_runner", "report", url], timeout=120, env=env)
    assert report.returncode == 0 and "finished" in report.stdout, report.stdout[-3000:]
    for key, value in s3_server.env().items():
        os.environ[key] = value
    try:
        model = load_model(url)
    finally:
        for key in s3_server.env():
            os.environ.pop(key)
    reference_model = load_model(str(reference))
    assert all(torch.equal(v, reference_model.state_dict()[k]) for k, v in model.state_dict().items())


class Alone:
    """``python -m elastic_runner.train`` (world size 1) in the background, its output in a file; killed if the
    test fails."""

    def __init__(self, config: Path, run_dir: Path, env: dict[str, str], *overrides: str) -> None:
        self.log = run_dir.with_suffix(".log")
        cmd = [sys.executable, "-m", "elastic_runner.train", "--config", str(config), "--set", f"run.dir={run_dir}"]
        for item in overrides:
            cmd += ["--set", item]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=os.environ | env | {"PYTHONUNBUFFERED": "1"}, start_new_session=True)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def wait_until(what: str, condition: Callable[[], bool], timeout: float, job: Alone) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline or job.proc.poll() is not None:
            raise AssertionError(f"{what}: not within {timeout:.0f} s\n{job.output()[-3000:]}")
        time.sleep(0.1)


@pytest.fixture
def bucket_job(s3_server: S3Server, s3_prefix: str, tmp_path: Path, small_config: Path) -> Iterator[Any]:
    jobs: list[Alone] = []

    def start(*overrides: str) -> tuple[Alone, ObjectStore, Path]:
        url, run_dir = f"{s3_prefix}/snapshots", tmp_path / "run"
        env = s3_server.env() | {"ELASTIC_RUNNER_SHM_DIR": str(tmp_path / "shm")}
        jobs.append(Alone(small_config, run_dir, env, f"snapshot.dir={url}", "train.epochs=1000", *overrides))
        return jobs[-1], ObjectStore(url, local=tmp_path / "reader", fs=s3_server.filesystem()), run_dir

    yield start
    for job in jobs:
        job.close()
    if not s3_server.running():
        s3_server.start()


def test_the_store_down_for_20_s_mid_run_training_goes_on_and_the_snapshots_resume_after(
        bucket_job: Any, s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    job, store, run_dir = bucket_job("train.max_steps=1000000", "snapshot.every_steps=0", "snapshot.every_seconds=1",
                                     "snapshot.records_every_seconds=1")
    wait_until("a first snapshot in the bucket", lambda: bool(store.complete()), 90, job)
    s3_server.stop()
    down_at = latest_step(run_dir)
    time.sleep(20)
    during = latest_step(run_dir)
    assert job.proc.poll() is None and during > down_at + 100, f"training went on: step {down_at} -> {during}"
    s3_server.start()
    wait_until("a snapshot written after the store came back",
               lambda: bool(store.complete()) and store.complete()[-1].step > during, 90, job)
    job.proc.send_signal(signal.SIGTERM)
    assert job.wait(120) == 0, job.output()[-3000:]
    out = job.output()
    failed = [line for line in out.splitlines() if "SNAPSHOT WRITE FAILED" in line]
    assert 1 <= len(failed) <= 2, "said once in full, then at most once a minute"
    for ref in store.complete():  # nothing half-visible: every snapshot the bucket lists is whole
        read_verified_bytes(store.path(ref), read_meta(store.path(ref)), True)
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    report = check_audit(run_view(store.location))
    assert report.ok, report.render()


def test_a_final_snapshot_that_cannot_be_uploaded_stays_in_node_memory_exit_4_and_persist_writes_it_later(
        bucket_job: Any, s3_server: S3Server, tmp_path: Path) -> None:
    job, store, run_dir = bucket_job("train.max_steps=1500", "snapshot.every_steps=0")
    wait_until("training", lambda: latest_step(run_dir) >= 1, 90, job)
    s3_server.stop()
    try:
        assert job.wait(180) == EXIT_NOT_DURABLE, job.output()[-3000:]
    finally:
        s3_server.start()
    final = [line for line in job.output().splitlines() if line.startswith("elastic_runner: training finished")]
    assert len(final) == 1 and "kept in node memory" in final[0], job.output()[-3000:]
    assert f"can be reached, `elastic-runner snapshot persist {run_dir}`" in final[0]
    env = os.environ | s3_server.env() | {"ELASTIC_RUNNER_SHM_DIR": str(tmp_path / "shm")}
    persisted = run_bounded([sys.executable, "-m", "elastic_runner", "snapshot", "persist", str(run_dir)], 120, env)
    assert persisted.returncode == 0, persisted.stdout[-3000:]
    assert json.loads(persisted.stdout.strip().splitlines()[-1])["step"] == 1500
    assert store.complete()[-1].step == 1500


@pytest.mark.parametrize("problem, env_change, expected", [
    ("wrong secret", {"AWS_SECRET_ACCESS_KEY": "not-the-secret"}, "refused access"),
    ("missing bucket", {}, "does not exist"),
])
def test_wrong_credentials_or_a_missing_bucket_stop_the_job_before_training_with_one_line_and_exit_2(
        small_config: Path, s3_server: S3Server, s3_prefix: str, tmp_path: Path, problem: str,
        env_change: dict[str, str], expected: str) -> None:
    url = f"{s3_prefix}/snapshots" if problem != "missing bucket" else "s3://no-such-bucket-here/snapshots"
    env = os.environ | s3_server.env() | env_change | {"PYTHONUNBUFFERED": "1"}
    result = run_bounded([sys.executable, "-m", "elastic_runner.train", "--config", str(small_config),
                          "--set", f"run.dir={tmp_path / 'run'}", "--set", f"snapshot.dir={url}"], timeout=120, env=env)
    assert result.returncode == 2, result.stdout[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("elastic_runner:")]
    assert len(lines) == 1 and "snapshot.dir" in lines[0] and expected in lines[0], result.stdout[-3000:]
    assert "not-the-secret" not in result.stdout and "Traceback" not in result.stdout
    assert not list((tmp_path / "run").rglob("audit/*")), "no step was trained"
