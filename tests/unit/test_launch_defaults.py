"""What ``elastic-runner launch`` sets where the user sets nothing: a restart budget, each worker's threads."""

from __future__ import annotations

import logging

import pytest

from elastic_runner.agent import launch


@pytest.mark.parametrize(("argv", "environ", "expected"), [
    ([], {}, launch.MAX_RESTARTS_DEFAULT),  # torchrun's own default, 0, ends the job at the first failure
    (["--max-restarts=0"], {}, 0),  # the user's choice, even 0
    (["--max_restarts", "7"], {}, 7),
    ([], {"PET_MAX_RESTARTS": "5"}, 5),  # as Kubernetes manifests set it
])
def test_launch_gives_a_restart_budget_unless_the_user_chose_one(
        argv: list[str], environ: dict[str, str], expected: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PET_MAX_RESTARTS", raising=False)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    args = launch.apply_defaults(["--standalone", "--nproc_per_node=2", *argv, "-m", "elastic_runner.train"])
    assert args.max_restarts == expected


@pytest.mark.parametrize(("nproc", "cores", "expected"), [
    ("2", 8, "4"), ("3", 8, "2"), ("4", 2, "1"),  # never 0
    ("cpu", 6, "1"),  # a worker per core
    ("1", 8, None),  # one worker: torch's own default (its physical cores) stays
])
def test_each_worker_gets_its_share_of_the_nodes_cores_and_it_is_said_once(
        nproc: str, cores: int, expected: str | None, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(launch, "available_cores", lambda: cores)
    environ: dict[str, str] = {}
    with caplog.at_level(logging.INFO, logger="elastic_runner"):
        launch.set_worker_threads([f"--nproc_per_node={nproc}", "-m", "elastic_runner.train"], environ)
    assert environ.get("OMP_NUM_THREADS") == expected
    said = [r.getMessage() for r in caplog.records if "OMP_NUM_THREADS" in r.getMessage()]
    assert len(said) == (1 if expected else 0), said


def test_the_users_threads_are_kept_and_the_processes_may_come_from_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch, "available_cores", lambda: 8)
    chosen = {"OMP_NUM_THREADS": "3"}
    launch.set_worker_threads(["--nproc_per_node=2"], chosen)
    assert chosen == {"OMP_NUM_THREADS": "3"}
    from_env = {"PET_NPROC_PER_NODE": "4"}
    launch.set_worker_threads(["-m", "elastic_runner.train"], from_env)
    assert from_env["OMP_NUM_THREADS"] == "2"


def test_a_cgroup_cpu_quota_caps_the_cores(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # noqa: ANN001
    quota = tmp_path / "cpu.max"
    quota.write_text("150000 100000\n")  # 1.5 CPUs: 2 cores' worth of threads, not the machine's
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(quota if path == "/sys/fs/cgroup/cpu.max"
                                                                         else path, *a, **k))
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(64)))
    assert launch.available_cores() == 2
    quota.write_text("max 100000\n")
    assert launch.available_cores() == 64
