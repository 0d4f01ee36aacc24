"""When the torchrun.handlers entry point sets a torchrun agent up (elastic_runner.agent.torchrun_hook):
only torchrun itself, only for elastic_runner's worker, never when opted out."""

from __future__ import annotations

import logging
import sys
import types

import pytest

from elastic_runner.agent import torchrun_hook
from elastic_runner.agent.adopt import worker_program


def main_module(name: str | None) -> types.ModuleType:
    module = types.ModuleType("__main__")
    module.__spec__ = None if name is None else types.SimpleNamespace(name=name)  # type: ignore[assignment]
    return module


@pytest.mark.parametrize(("argv0", "main", "expected"), [
    ("/venv/bin/torchrun", None, True),
    ("/venv/lib/python3.11/site-packages/torch/distributed/run.py", "torch.distributed.run", True),
    ("/venv/bin/elastic-runner", "elastic_runner.__main__", False),  # launch sets itself up
    ("-m", "elastic_runner.train", False),  # a worker importing torch's rendezvous package
    ("train.py", None, False),
])
def test_only_a_torchrun_process_is_adopted(argv0: str, main: str | None, expected: bool) -> None:
    assert torchrun_hook.is_torchrun_process(argv0, main_module(main)) is expected


@pytest.fixture
def in_torchrun(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    monkeypatch.setattr(sys, "argv", ["/venv/bin/torchrun"])
    monkeypatch.setattr(torchrun_hook, "_installed", False)
    monkeypatch.setattr(torchrun_hook, "_wrap", lambda api: None)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    return {}


def test_other_programs_under_torchrun_are_left_alone(in_torchrun: dict[str, str]) -> None:
    for argv in (["--nnodes=2", "train.py", "--config", "x"], ["-m", "mypackage.train"], ["--nnodes=1", "-m", "elastic_runner"]):
        assert not torchrun_hook.install(argv, in_torchrun)
    assert in_torchrun == {}, "nothing set in the environment"


def test_elastic_runners_worker_gets_launchs_store_setting_unless_the_user_chose(in_torchrun: dict[str, str]) -> None:
    assert torchrun_hook.install(["--nnodes=1:4", "--rdzv_conf=join_timeout=60", "-m", "elastic_runner.train"], in_torchrun)
    assert in_torchrun["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert in_torchrun["ELASTIC_RUNNER_NNODES"] == "1:4"
    assert in_torchrun["ELASTIC_RUNNER_RDZV_CONF"] == "join_timeout=60", "torchrun's flags are the user's: no defaults"
    torchrun_hook._installed = False
    chosen = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"}
    assert torchrun_hook.install(["-m", "elastic_runner.train"], chosen)
    assert chosen["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "0"


def test_the_hook_can_be_turned_off(in_torchrun: dict[str, str]) -> None:
    env = {torchrun_hook.OPT_OUT: "0"}
    assert not torchrun_hook.install(["-m", "elastic_runner.train"], env)
    assert env == {torchrun_hook.OPT_OUT: "0"}


def test_the_worker_command_is_recognised_as_torchrun_builds_it() -> None:
    assert worker_program(sys.executable, ["-u", "-m", "elastic_runner.train", "--config", "x"]) == ["--config", "x"]
    assert worker_program(sys.executable, ["-m", "elastic_runner.train"]) == []
    assert worker_program(sys.executable, ["-u", "train.py"]) is None
    assert worker_program("/bin/other", ["-m", "elastic_runner.train"]) is None


def test_the_hook_gives_each_worker_its_share_of_the_cores_before_torchrun_would_set_one(
        in_torchrun: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    from elastic_runner.agent import launch

    monkeypatch.setattr(launch, "available_cores", lambda: 8)
    assert torchrun_hook.install(["--nproc_per_node=2", "-m", "elastic_runner.train"], in_torchrun)
    assert in_torchrun["OMP_NUM_THREADS"] == "4"


def test_under_torchrun_a_restart_budget_of_0_is_said_before_the_job_starts(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from elastic_runner.agent import adopt, terminal

    api = types.SimpleNamespace(launch_agent=lambda config, entrypoint, args: "ran")
    monkeypatch.setattr(adopt, "adopt", lambda api, config, entrypoint, args, zygote: (entrypoint, args, lambda: None))
    monkeypatch.setattr(terminal, "log_to_stderr", lambda: None)  # the records reach pytest's handler instead
    monkeypatch.setattr(logging.getLogger("elastic_runner"), "propagate", True)  # (another test's agent set it off)
    torchrun_hook._wrap(api)
    for budget, warned in ((0, True), (3, False)):
        caplog.clear()
        with caplog.at_level("WARNING"):
            assert api.launch_agent(types.SimpleNamespace(max_restarts=budget), "worker", []) == "ran"
        said = [r.getMessage() for r in caplog.records if "--max-restarts is 0" in r.getMessage()]
        assert bool(said) is warned, said
