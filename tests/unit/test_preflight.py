"""The worker names launch setups that torch 2.13 is known to fail with."""

from __future__ import annotations

from elastic_runner.worker.preflight import problems, rendezvous_conf

TORCHRUN = {"TORCHELASTIC_RUN_ID": "job"}


def test_shared_rendezvous_store_is_named_with_the_fix() -> None:
    found = problems(TORCHRUN | {"TORCHELASTIC_USE_AGENT_STORE": "True"}, "2.13.0+cpu")
    assert len(found) == 1 and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in found[0] and "elastic-runner launch" in found[0]
    assert problems(TORCHRUN | {"TORCHELASTIC_USE_AGENT_STORE": "False"}, "2.13.0") == []
    assert problems(TORCHRUN | {"TORCHELASTIC_USE_AGENT_STORE": "True"}, "2.3.1") == []


def test_split_brain_prone_keep_alive_is_named() -> None:
    found = problems(TORCHRUN | {"PET_RDZV_CONF": "keep_alive_interval=1,keep_alive_max_attempt=2"}, "2.13.0")
    assert len(found) == 1 and "split brain" in found[0]
    assert problems(TORCHRUN | {"PET_RDZV_CONF": "keep_alive_interval=1,keep_alive_max_attempt=3"}, "2.13.0") == []


def test_rendezvous_conf_is_read_from_the_agents_command_line() -> None:
    cmdline = ["python", "-m", "torch.distributed.run", "--rdzv_conf=keep_alive_max_attempt=2,last_call_timeout=1", "x.py"]
    assert rendezvous_conf({}, cmdline) == {"keep_alive_max_attempt": "2", "last_call_timeout": "1"}
    assert rendezvous_conf({}, ["torchrun", "--rdzv-conf", "a=1"]) == {"a": "1"}
    assert rendezvous_conf({"ELASTIC_RUNNER_RDZV_CONF": "b=2"}, cmdline) == {"b": "2"}


def test_nothing_to_say_outside_torchrun() -> None:
    assert problems({"TORCHELASTIC_USE_AGENT_STORE": "True"}, "2.13.0") == []
