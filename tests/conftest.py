"""Shared fixtures: paths, small configs, a per-test LocalJob that always cleans up."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from elastic_runner.testing.localjob import LocalJob
from elastic_runner.worker.lifecycle import become_subreaper

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "configs" / "quickstart.yaml"

# Workers of the multi-process tests must import the package from this checkout.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
become_subreaper()


def mount_small_volume(path: Path, size: str) -> None:
    """A small tmpfs at ``path`` (a real ENOSPC when it is full); skips the test where mounting needs root."""
    path.mkdir(parents=True, exist_ok=True)
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                                 capture_output=True, text=True)
    except OSError as exc:
        pytest.skip(f"a small tmpfs cannot be mounted here (no mount command: {exc})")
    if mounted.returncode != 0:
        pytest.skip(f"a small tmpfs cannot be mounted here (needs root): {mounted.stderr.strip()}")


def unmount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


def write_config(path: Path, **sections: dict) -> Path:
    """A quickstart-derived config with some sections replaced/extended."""
    data = yaml.safe_load(QUICKSTART.read_text())
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="session")
def etcd_binary() -> str:
    """etcd, installed from Debian when missing (as root), for tests that need a real server."""
    from elastic_runner.testing.etcd_server import ensure_installed

    try:
        return ensure_installed()
    except RuntimeError as exc:
        pytest.skip(str(exc))


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


def python() -> str:
    return sys.executable
