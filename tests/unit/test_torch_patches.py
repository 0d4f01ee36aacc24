"""Canaries for every private torch internal we patch (elastic_runner.torch_patches).

Two kinds per patch: the symbols are still there in the shape we use them (a failure names the
torch symbol), and the patch still *does* something on this torch (the behaviour it corrects is
observed to change), so that a torch upgrade cannot silently turn our behaviour off.
"""

from __future__ import annotations

import logging
import sys
import time
import uuid
from datetime import timedelta
from typing import Any, Iterator

import pytest
from torch.distributed import HashStore
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

from elastic_runner.agent import fast_rendezvous as fr
from elastic_runner import torch_patches
from elastic_runner.torch_patches import ALL, Need, TorchPatch
from elastic_runner.testing.contracts import rendezvous_together

from ..support import fast_rendezvous_installed as fast_rendezvous_patched


@pytest.mark.parametrize("patch", ALL, ids=lambda p: p.where)
def test_every_private_torch_symbol_a_patch_needs_is_still_there(patch: TorchPatch) -> None:
    problems = patch.problems()
    assert not problems, f"{patch.where} cannot patch this torch: " + "; ".join(problems)


def test_a_patch_that_no_longer_fits_gives_one_warning_naming_the_symbol(caplog: pytest.LogCaptureFixture) -> None:
    broken = TorchPatch("a correction", "elastic_runner.somewhere", "torch's behaviour",
                        (Need(torch_patches.DR, "_RendezvousJoinOp.__call__", params=("ctx", "renamed")),
                         Need(torch_patches.DR, "_NoSuchClass"),
                         Need(torch_patches.AGENT_API, "SimpleElasticAgent._no_such_attribute", init_attr=True)))
    with caplog.at_level(logging.WARNING):
        assert not torch_patches.usable(broken)
    [record] = caplog.records
    text = record.getMessage()
    assert "dynamic_rendezvous._RendezvousJoinOp.__call__ no longer takes renamed" in text
    assert "dynamic_rendezvous._NoSuchClass does not exist" in text
    assert "SimpleElasticAgent._no_such_attribute is no longer set" in text
    assert "running with torch's behaviour instead: torch's behaviour" in text


# -- fast rendezvous -----------------------------------------------------------------------------------


@pytest.fixture
def fast_rendezvous_installed() -> Iterator[None]:
    with fast_rendezvous_patched():
        yield


def _torch_handlers(count: int, last_call: float) -> list[Any]:
    store, run_id = HashStore(), f"canary-{uuid.uuid4().hex[:8]}"
    backend = C10dRendezvousBackend(store, run_id)
    timeout = dr.RendezvousTimeout(join=timedelta(seconds=60), last_call=timedelta(seconds=last_call))
    return [dr.DynamicRendezvousHandler.from_backend(run_id, store, backend, min_nodes=1, max_nodes=count + 1,
                                                     local_addr="127.0.0.1", timeout=timeout, keep_alive_interval=1)
            for _ in range(count)]


def test_a_round_of_the_previous_members_completes_without_torchs_last_call(
        fast_rendezvous_installed: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    polls: list[float] = []
    monkeypatch.setattr(fr, "poll_interval", lambda: polls.append(0.1) or 0.1)
    handlers = _torch_handlers(2, last_call=30)
    # The two nodes were the previous round (as the agent records it when it rejoins).
    fr.set_previous_participants([h._this_node for h in handlers])
    started = time.monotonic()
    try:
        infos = rendezvous_together(handlers, timeout=20)
        # While training: heartbeats checked twice an interval, a waiting node seen within 0.2 s.
        timers = [h._keep_alive_timer._ctx.interval for h in handlers]
        caches = [h._state_holder._cache_duration for h in handlers]
    except AssertionError as exc:
        pytest.fail(f"no round within 20 s ({exc}): torch's last call (30 s) was waited out, so "
                    f"{torch_patches.DR}._RendezvousJoinOp no longer lets elastic_runner.agent.fast_rendezvous "
                    "complete early")
    finally:
        for h in handlers:
            h.shutdown()
    assert timers == [0.5, 0.5], f"{torch_patches.DR}.DynamicRendezvousHandler._start_heartbeats: timer {timers}"
    assert caches == [0.2, 0.2], f"the state cache while training is {caches}"
    assert sorted(i.rank for i in infos) == [0, 1] and time.monotonic() - started < 20
    assert fr.completed_early, f"the round completed, but not through the patched {torch_patches.DR}._RendezvousJoinOp"
    assert polls, (f"{torch_patches.DR}._DistributedRendezvousOpExecutor.run no longer waits through _delay(seconds=1) "
                   "between state polls: elastic_runner.agent.fast_rendezvous's faster poll does nothing")


# -- outage-tolerant etcd handler -------------------------------------------------------------------------


def test_the_etcd_handler_uses_our_state_holder_and_its_sanitize_runs_on_every_read(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from elastic_runner.rendezvous import handler as etcd_handler
    from elastic_runner.rendezvous.backend import EtcdRendezvousBackend
    from elastic_runner.rendezvous.store import EtcdStore
    from elastic_runner.testing.memory_etcd import MemoryEtcd

    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    calls: list[int] = []
    original = etcd_handler.OutageTolerantStateHolder._sanitize

    def counting(self: Any) -> None:
        calls.append(1)
        original(self)

    monkeypatch.setattr(etcd_handler.OutageTolerantStateHolder, "_sanitize", counting)
    client = MemoryEtcd().client()
    params = RendezvousParameters("etcd-v3", "unused", "canary", 1, 1, local_addr="127.0.0.1",
                                  last_call_timeout="1", keep_alive_interval="1")
    handler = etcd_handler.create_handler(EtcdStore(client, "/canary/run"), EtcdRendezvousBackend(client, "run", "/canary"),
                                          params)
    try:
        assert isinstance(handler, etcd_handler.EtcdRendezvousHandler), "torch's handler was used instead of ours"
        assert isinstance(handler._state_holder, etcd_handler.OutageTolerantStateHolder), (
            f"{torch_patches.DR}.DynamicRendezvousHandler no longer keeps the state holder it is given")
        info = handler.next_rendezvous()
        assert info.world_size == 1
        assert calls, (f"{torch_patches.DR}._BackendRendezvousStateHolder no longer calls _sanitize on a read: "
                       "the etcd-v3 outage rules do nothing")
        assert handler._state_holder.member_of == (handler._state_holder.state.round, 0)
    finally:
        handler.shutdown()


# -- our agent in torch's launcher -----------------------------------------------------------------------------

WORKER = ("import os, sys; sys.exit(1 if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0' else 2)")


def test_the_launcher_builds_our_agent_whose_overrides_torch_calls(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher import api as launcher_api

    from elastic_runner.agent.agent import ElasticRunnerAgent
    from elastic_runner.testing.localjob import free_port

    called: list[str] = []
    notified: list[tuple[str, dict[str, Any]]] = []

    class Recording(ElasticRunnerAgent):
        default_observers = [lambda event, **fields: notified.append((event, fields))]

    for name in ("_rendezvous", "_stop_workers", "_shutdown", "_monitor_workers", "_restart_workers"):
        def wrap(name: str = name) -> Any:
            inner = getattr(ElasticRunnerAgent, name)

            def recorded(self: Any, *args: Any, **kwargs: Any) -> Any:
                called.append(name)
                return inner(self, *args, **kwargs)
            return recorded
        setattr(Recording, name, wrap())
    monkeypatch.setattr(launcher_api, "LocalElasticAgent", Recording)  # what elastic-runner launch does
    config = launcher_api.LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=1, run_id=f"canary-{uuid.uuid4().hex[:8]}", rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}", rdzv_configs={"is_host": True}, max_restarts=3,
        monitor_interval=0.1, logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path)))
    with pytest.raises(ChildFailedError) as failed:
        launcher_api.elastic_launch(config, sys.executable)("-c", WORKER)
    assert {f.exitcode for f in failed.value.failures.values()} == {2}
    missing = [n for n in ("_rendezvous", "_stop_workers", "_shutdown", "_monitor_workers", "_restart_workers")
               if n not in called]
    assert not missing, (f"torch's agent no longer calls {missing} of {torch_patches.LOCAL_AGENT}.LocalElasticAgent "
                         "(overridden by elastic_runner.agent.agent.ElasticRunnerAgent)")
    failures = [f["exit_codes"] for event, f in notified if event == "worker_failed"]
    assert failures == [[1], [2]], (
        f"exit 1 should be restarted and exit 2 should end the job with restarts left ({failures}): "
        f"{torch_patches.AGENT_API}.SimpleElasticAgent._remaining_restarts no longer stops the restarts")
    assert [e for e, _ in notified].count("restart") == 1


def test_a_round_a_member_never_takes_its_part_in_is_left_for_the_next_one(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Seen in a 1,000-fault soak: an agent SIGKILLed right after a round was sealed never wrote its part of
    the round's store; torch's agent waited 60 s for it and raised, and every agent with it: the job ended."""
    from types import SimpleNamespace

    from torch.distributed import DistStoreError
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from elastic_runner.agent.agent import ROUND_RETRIES, ElasticRunnerAgent
    from elastic_runner.agent.config_check import ConfigRecord
    from elastic_runner.agent.round_members import MemberWatch

    rounds: list[int] = []
    failing = {"rounds": 1}

    def torchs_rendezvous(self: Any, worker_group: Any) -> None:
        rounds.append(len(rounds))
        if len(rounds) <= failing["rounds"]:
            raise DistStoreError("Timed out after 60 s waiting for 1 of 4 key(s) in the etcd store: "
                                 "'torch.rendezvous.job.1.56/torchelastic/role_info/2'.\nmore")

    monkeypatch.setattr(LocalElasticAgent, "_rendezvous", torchs_rendezvous)
    notified: list[str] = []
    agent = ElasticRunnerAgent.__new__(ElasticRunnerAgent)  # its torch parts are not used here
    agent.observers, agent._rounds = [lambda event, **fields: notified.append(event)], 0
    agent._members, agent._config_record = MemberWatch(), ConfigRecord(None, None)
    group = SimpleNamespace(spec=SimpleNamespace(rdzv_handler=SimpleNamespace(completed_early=False),
                                                 local_world_size=1),
                            group_world_size=3, group_rank=0)
    with caplog.at_level(logging.WARNING):
        agent._rendezvous(group)
    assert rounds == [0, 1] and notified == ["rendezvous"]
    assert "role_info/2" in caplog.text and "joins the next round (1 of 5)" in caplog.text
    rounds.clear()
    failing["rounds"] = 100
    with pytest.raises(DistStoreError):
        agent._rendezvous(group)
    assert len(rounds) == ROUND_RETRIES + 1, "a store that never answers still ends the agent"


def test_a_stop_signal_inside_a_store_request_stops_the_agent_and_is_never_taken_for_an_etcd_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Seen in the 1,000-fault soak: a preemption's SIGTERM reached an agent inside an etcd request; the client
    reported it as an etcd error, the agent took it for a failed round and trained on. torch's launcher must see
    its SignalException, or it closes the rendezvous for every node."""
    import signal as signals
    from types import SimpleNamespace

    from torch.distributed import DistStoreError
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from elastic_runner.agent.agent import ElasticRunnerAgent
    from elastic_runner.rendezvous.gateway import EtcdGatewayClient
    from elastic_runner.rendezvous.options import EtcdOptions, parse_endpoints
    from elastic_runner.rendezvous.store import EtcdStore
    from elastic_runner.testing.localjob import free_port

    client = EtcdGatewayClient(EtcdOptions(parse_endpoints(f"127.0.0.1:{free_port()}")))
    preempted = {"requests": 0}

    def sigterm_arrives(*args: Any, **kwargs: Any) -> Any:
        preempted["requests"] += 1
        raise SignalException("Process 1 got signal: 15", sigval=signals.SIGTERM)

    for member in client._members:
        monkeypatch.setattr(member.client, "get_url", lambda path: f"http://127.0.0.1:1/v3/{path.lstrip('/')}")
        monkeypatch.setattr(member.client, "post", sigterm_arrives)
        monkeypatch.setattr(member.client.session, "post", sigterm_arrives)
    with pytest.raises(SignalException):
        EtcdStore(client, "/t/store").get("role_info/2")
    with pytest.raises(SignalException):
        client.watch_prefix(b"/t/", 1, 5.0, lambda events: True)
    assert preempted["requests"] == 2, "a stop is not retried"

    rounds: list[int] = []

    def torchs_rendezvous(self: Any, worker_group: Any) -> None:
        rounds.append(1)
        try:
            raise SignalException("Process 1 got signal: 15", sigval=signals.SIGTERM)
        except SignalException as exc:  # what an older store did with it
            raise DistStoreError("The etcd store could not read keys.") from exc

    monkeypatch.setattr(LocalElasticAgent, "_rendezvous", torchs_rendezvous)
    agent = ElasticRunnerAgent.__new__(ElasticRunnerAgent)
    agent.observers, agent._rounds = [], 0
    group = SimpleNamespace(spec=SimpleNamespace(rdzv_handler=SimpleNamespace(completed_early=False),
                                                 local_world_size=1),
                            group_world_size=1, group_rank=0)
    with pytest.raises(SignalException):
        agent._rendezvous(group)
    assert rounds == [1], "a stop is not a failed round"


def test_every_private_method_of_torchs_agent_that_ours_overrides_is_listed_with_a_canary() -> None:
    """A private override torch renames would silently stop being called (our correction lost without a word): each
    one is a need of a canary, which says so at start-up and falls back to torch's agent."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from elastic_runner.agent.agent import ElasticRunnerAgent

    overridden = sorted(name for name in vars(ElasticRunnerAgent) if name.startswith("_") and not name.startswith("__")
                        and callable(getattr(LocalElasticAgent, name, None)))
    listed = {need.path.split(".")[-1] for patch in torch_patches.ALL for need in patch.needs
              if need.path.split(".")[0] in ("LocalElasticAgent", "SimpleElasticAgent") and not need.init_attr}
    assert overridden, "ElasticRunnerAgent overrides torch's private methods"
    missing = [name for name in overridden if name not in listed]
    assert not missing, f"overridden by ElasticRunnerAgent and not a need of any canary in torch_patches: {missing}"
