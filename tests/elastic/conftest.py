"""Shared, session-scoped reference runs for the elastic tests (one uninterrupted run per config)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from elastic_runner.testing.localjob import LocalJob

from ..support import exported_model, write_config

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
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    job = LocalJob(config=str(resume_config), run_dir=str(run_dir), nnodes="2:2")
    try:
        job.start_agent()
        job.start_agent()
        codes = job.wait(timeout=180)
        assert codes == [0, 0], job.logs_tail()
    finally:
        job.close()
    yield run_dir


@pytest.fixture(scope="session")
def reference_model(reference_run: Path, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    return exported_model(reference_run, tmp_path_factory.mktemp("export"))
