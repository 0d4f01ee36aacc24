"""What a survivor of a peer's failure waits for before it rebuilds its group (:meth:`SameMembers.survive`): a
replacement's announcement, for ``announce_wait`` at most; less when its agent asks it to park for a new round or
the job's store is gone with rank 0's worker."""

from __future__ import annotations

import datetime
import time
from typing import Any

import pytest
import torch
import torch.distributed as tdist

from elastic_runner.recovery.channel import AgentBeat as BeatMessage, Channel, Coming, arrived_key
from elastic_runner.recovery.rebuild import RegroupError
from elastic_runner.recovery.regroup import SameMembers, agent_beat

from ..support import beating_agents

pytestmark = [pytest.mark.timeout(60)]


def _survivor(store: Any) -> SameMembers:
    timeout = datetime.timedelta(seconds=5)
    return SameMembers(store, 1, 2, "gloo", torch.device("cpu"), timeout, timeout)


class GoneStore:
    """The store of a rank 0 whose node was lost."""

    def check(self, keys: list[str]) -> bool:
        raise tdist.DistNetworkError("Connection reset by peer")


def test_without_an_announcement_the_survivor_gives_up_after_the_announce_wait() -> None:
    started = time.monotonic()
    with pytest.raises(RegroupError, match="no replacement was announced within 0.3s"):
        _survivor(tdist.HashStore()).survive(datetime.timedelta(seconds=0.3))
    assert 0.3 <= time.monotonic() - started < 5


def test_a_park_request_ends_the_wait_at_once() -> None:
    asked = {"n": 0}

    def leaving() -> bool:
        asked["n"] += 1
        return asked["n"] > 2

    started = time.monotonic()
    with pytest.raises(RegroupError, match="asked it to park"):
        _survivor(tdist.HashStore()).survive(datetime.timedelta(seconds=30), leaving=leaving)
    assert time.monotonic() - started < 5


def test_a_park_request_also_ends_the_wait_for_an_announced_replacement_that_is_still_on_its_way() -> None:
    # The replacement was announced (its agent gave the place to a standby that still builds), and a node joins
    # meanwhile: the survivor's agent asks it to park, and it must not wait the regroup's wait for the newcomer first
    # (its agent gives up on it after 15 s and restarts it).
    store = tdist.HashStore()
    Channel(store, None).send(Coming(1, 0))
    wait = datetime.timedelta(seconds=30)
    survivor = SameMembers(store, 1, 2, "gloo", torch.device("cpu"), datetime.timedelta(seconds=5), wait)
    asked = {"n": 0}

    def leaving() -> bool:
        asked["n"] += 1
        return asked["n"] > 20  # well into the wait for the newcomer: the announcement is read at the first look

    started = time.monotonic()
    with pytest.raises(RegroupError, match="asked it to park"):
        survivor.survive(datetime.timedelta(seconds=30), leaving=leaving)
    assert time.monotonic() - started < 5
    assert store.check([arrived_key(1, "1")]), "it had arrived for the newcomer's generation when it was asked"
    assert not tdist.is_initialized(), "no group left behind: it parks with none"


def test_a_store_gone_with_rank_0s_worker_ends_the_wait_at_once() -> None:
    started = time.monotonic()
    with pytest.raises(RegroupError, match="store does not answer"):
        _survivor(GoneStore()).survive(datetime.timedelta(seconds=30))
    assert time.monotonic() - started < 5


def test_a_group_given_up_alone_gets_an_id_that_training_s_seeded_random_does_not_decide(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Every rank seeds Python's random the same way for its data; forked workers share its state too. Two kept
    # workers that drew their alone-ids from it handed in the same handle and their new group failed.
    import random

    from elastic_runner.recovery.rebuild import Regroup

    ids: list[int] = []

    class Work:
        def wait(self) -> None:
            pass

    monkeypatch.setattr(tdist, "_get_reconfigure_handle", lambda: "gloo:0:-1:0:", raising=False)
    monkeypatch.setattr(tdist, "_reconfigure", lambda uuid, handles, timeout: ids.append(uuid) or Work(),
                        raising=False)
    regroup = Regroup(tdist.HashStore(), "0", "gloo", datetime.timedelta(seconds=5), method="recreate")
    for _ in range(2):
        random.seed(1234)
        regroup._alone()
    assert len(set(ids)) == 2 and all(0 <= i < 2**62 for i in ids), ids


# -- a lost node's silent agent ---------------------------------------------------------------------------


def _job_store() -> Any:
    return tdist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)


def _survivor_of(store: Any, agents: int) -> SameMembers:
    timeout = datetime.timedelta(seconds=5)
    return SameMembers(store, 1, 2, "gloo", torch.device("cpu"), timeout, timeout, agents=agents)


def test_a_survivor_stops_waiting_for_an_announcement_once_a_nodes_agent_is_silent() -> None:
    store = _job_store()
    (alive,) = beating_agents(store, [0])
    try:
        agent_beat(Channel(store, None), 1, 7)  # it beat here, then its node was gone: no beat since, no last word, no announcement
        started = time.monotonic()
        with pytest.raises(RegroupError, match="agent of node 1 has not beaten") as raised:
            _survivor_of(store, agents=2).survive(datetime.timedelta(seconds=30))
        assert time.monotonic() - started < 5, "not the 30 s announcement wait"
        assert raised.value.lost_agents == (1,), "seen beating, then still: its agent is told to count that node out"
    finally:
        alive.close()


def test_an_agent_lost_before_it_first_beat_in_this_rounds_store_is_judged_once_the_others_beat() -> None:
    store = _job_store()
    (alive,) = beating_agents(store, [0])  # group rank 1's agent died before it ever beat here
    try:
        started = time.monotonic()
        with pytest.raises(RegroupError, match="agent of node 1 has not beaten") as raised:
            _survivor_of(store, agents=2).survive(datetime.timedelta(seconds=30))
        assert raised.value.lost_agents == (), "never seen beating here: it may be late; not counted out"
        assert time.monotonic() - started < 5, "not the 30 s announcement wait"
    finally:
        alive.close()


def test_while_every_agent_beats_the_survivor_waits_for_the_announcement() -> None:
    store = _job_store()
    beats = beating_agents(store, [0, 1])
    try:
        started = time.monotonic()
        with pytest.raises(RegroupError, match="no replacement was announced within 1.5s"):
            _survivor_of(store, agents=2).survive(datetime.timedelta(seconds=1.5))
        assert time.monotonic() - started >= 1.5
    finally:
        for beat in beats:
            beat.close()


def test_agents_that_do_not_beat_are_never_judged_silent() -> None:
    started = time.monotonic()
    with pytest.raises(RegroupError, match="no replacement was announced"):
        _survivor_of(_job_store(), agents=2).survive(datetime.timedelta(seconds=1.5))
    assert time.monotonic() - started >= 1.5


def test_an_agent_that_restarts_its_workers_for_a_new_round_goes_on_beating_in_it() -> None:
    """torch's _stop_workers calls the agent's _shutdown: that pauses the beat; only the agent's end closes it (it
    used to close it, so an agent never beat again after its first restart, and its node's loss went unseen)."""
    from elastic_runner.agent.agent import ElasticRunnerAgent
    from elastic_runner.agent.config_check import ConfigRecord
    from elastic_runner.agent.spare import WarmSeat

    agent = object.__new__(ElasticRunnerAgent)  # only what _shutdown touches
    agent._pcontext, agent._worker_watchdog, agent._health_check_server = None, None, None
    agent._config_record, agent._warm_seat = ConfigRecord(None, None), WarmSeat()
    first, second = _job_store(), _job_store()
    (agent._beat,) = beating_agents(first, [1])
    try:
        agent._stopping_group = True
        agent._shutdown()  # the workers restart for a new round
        agent._beat.follow("127.0.0.1", second.port, 1)  # the new round's store
        deadline = time.monotonic() + 10
        while not second.check(["regroup/agent/1"]):
            assert time.monotonic() < deadline, "the agent does not beat in the new round's store"
            time.sleep(0.01)
        agent._stopping_group = False
        agent._shutdown()  # the agent ends
        beats = agent._beat.beats
        time.sleep(0.5)
        assert agent._beat.beats == beats, "an agent that ended beats no more"
    finally:
        agent._beat.close()


def test_an_agent_that_stops_beating_on_purpose_is_parked_for_but_never_counted_out() -> None:
    """An agent that restarts its node's workers (or ends) stops beating with a last beat that says so: its node is
    alive, whatever its silence says after it (counting it out would seat a new round while its workers still run)."""
    store = _job_store()
    alive, restarting = beating_agents(store, [0, 1])
    try:
        restarting.pause()  # its workers restart for a new round
        with pytest.raises(RegroupError, match="agent of node 1 has not beaten") as raised:
            _survivor_of(store, agents=2).survive(datetime.timedelta(seconds=30))
        assert raised.value.lost_agents == (), "alive: parked for, not counted out"
        last = Channel(store, None).read(BeatMessage, "regroup/agent/1")
        assert last is not None and last.stopping, last
    finally:
        alive.close()
        restarting.close()


def test_an_agent_whose_store_went_away_stops_beating_there_without_torch_logging_a_failed_operation(
        capfd: pytest.CaptureFixture[str]) -> None:
    """The store's server is rank 0's worker: it goes whenever that worker ends (the job finished, the worker failed
    or parked). torch logs every failed store operation as a C++ warning with a stack trace on the agent's
    terminal; the beat sees the server's end on a bare connection of its own and never writes into the void."""
    store = _job_store()
    port = store.port
    (beat,) = beating_agents(store, [1])
    try:
        del store  # the server ends, as rank 0's worker does at the end of the job
        time.sleep(1.0)  # ten beats' time
        beat.pause()  # the agent ends its workers: its last word would go to the gone store
        time.sleep(0.3)
        err = capfd.readouterr().err
        assert "failed on" not in err and "Exception raised from" not in err, err
        assert beat.beats > 1
        replacement = tdist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # its successor
        beat.follow("127.0.0.1", port, 1)
        deadline = time.monotonic() + 10
        while not replacement.check(["regroup/agent/1"]):
            assert time.monotonic() < deadline, "the beat does not go on in the successor's store"
            time.sleep(0.01)
    finally:
        beat.close()
