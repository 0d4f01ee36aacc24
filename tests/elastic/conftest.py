"""Shared, session-scoped reference runs for the elastic tests (one uninterrupted run per config)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from elastic_runner.testing.etcd_server import EtcdServer

from ..support import exported_model, run_uninterrupted, write_config

#: Long enough to be interrupted mid-run (a few seconds at world size 2), short enough for CI.
RESUME_SECTIONS = dict(
    train={"epochs": 100, "max_steps": 400, "eval_every_steps": 0},
    snapshot={"every_steps": 20, "keep_last": 3},
    logging={"every_steps": 10},
    schedule={"name": "cosine", "warmup_steps": 20},
)


@pytest.fixture(scope="session")
def resume_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_config(tmp_path_factory.mktemp("cfg") / "resume.yaml", **RESUME_SECTIONS)


@pytest.fixture(scope="session")
def reference_run(resume_config: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The uninterrupted run of ``resume_config``: two agents of one worker each, world size 2."""
    yield run_uninterrupted(resume_config, tmp_path_factory.mktemp("reference") / "run", timeout=180)


@pytest.fixture(scope="session")
def reference_model(reference_run: Path, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    return exported_model(reference_run, tmp_path_factory.mktemp("export"))


@pytest.fixture
def etcd(etcd_binary: str, tmp_path: Path) -> Iterator[EtcdServer]:
    """A real etcd on a free port of 127.0.0.1, for this test alone."""
    server = EtcdServer(tmp_path / "etcd" / "data", binary=etcd_binary)
    server.start()
    try:
        yield server
    finally:
        server.stop()
