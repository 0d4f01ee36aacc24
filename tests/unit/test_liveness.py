"""Whether group rank 0's agent is alive once the job's store is gone with rank 0's worker
(:mod:`elastic_runner.recovery.liveness`): a survivor counts rank 0's node out of the next round only when its agent
is gone too, and at once when its port refuses, instead of the next round waiting for that node's lease."""

from __future__ import annotations

import datetime
import socket
import threading
import time
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as tdist

from elastic_runner.recovery import liveness
from elastic_runner.recovery.channel import AliveAt, Channel
from elastic_runner.recovery import regroup
from elastic_runner.recovery.rebuild import RegroupError
from elastic_runner.recovery.regroup import SameMembers

pytestmark = [pytest.mark.timeout(60)]

KEY = b"k" * 32


@pytest.fixture
def server() -> Iterator[liveness.LivenessServer]:
    alive = liveness.LivenessServer("host-1-2", KEY)
    alive.start()
    yield alive
    alive.close()


def test_a_live_agent_answers_its_challenge_at_once(server: liveness.LivenessServer) -> None:
    started = time.monotonic()
    assert not liveness.agent_lost("127.0.0.1", AliveAt(server.port, server.agent), KEY)
    assert server.answered == 1
    assert time.monotonic() - started < liveness.ANSWER_S


def test_every_survivor_of_a_large_job_asking_at_once_finds_a_live_agent_alive(
        server: liveness.LivenessServer) -> None:
    # One connection per worker, all at the failure's moment: none may wait out its answer in the listening queue.
    from concurrent.futures import ThreadPoolExecutor

    where = AliveAt(server.port, server.agent)
    with ThreadPoolExecutor(max_workers=256) as pool:
        lost = list(pool.map(lambda _: liveness.agent_lost("127.0.0.1", where, KEY), range(512)))
    assert not any(lost) and server.answered == 512


def test_an_asker_that_holds_its_connection_delays_nobody_else(server: liveness.LivenessServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port)) as holder:
        holder.sendall(b"12")  # (and never the rest of its challenge)
        started = time.monotonic()
        assert not liveness.agent_lost("127.0.0.1", AliveAt(server.port, server.agent), KEY)
        assert time.monotonic() - started < liveness.ANSWER_S


def test_an_agent_whose_port_is_closed_is_lost_at_once(server: liveness.LivenessServer) -> None:
    server.close()
    started = time.monotonic()
    assert liveness.agent_lost("127.0.0.1", AliveAt(server.port, server.agent), KEY)
    assert time.monotonic() - started < liveness.ANSWER_S


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_port_that_accepts_but_never_answers_is_a_lost_agent_within_the_answer_wait() -> None:
    # A stopped process's port (SIGSTOP, or swapped out for good): the kernel accepts, nobody answers.
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(8)
        started = time.monotonic()
        assert liveness.agent_lost("127.0.0.1", AliveAt(held.getsockname()[1], "host-1-2"), KEY)
        assert time.monotonic() - started < liveness.ANSWER_S + 1.0


class Answering:
    """A port that answers every challenge with ``answer(challenge)``: another process, or a forger."""

    def __init__(self, answer: Any) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port, self.answer = self.sock.getsockname()[1], answer
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.sendall(self.answer(conn.recv(64)))


def test_an_answer_signed_for_another_agent_or_key_or_a_replayed_one_is_evidence_of_nothing(
        caplog: pytest.LogCaptureFixture) -> None:
    from elastic_runner.rendezvous.seal import Sealer

    # A forger cannot make a lost agent look alive: it can only say nothing that counts, which leaves the next
    # round waiting for the lease as before; and its words are logged.
    other_agent = Answering(lambda c: Sealer(KEY).seal(b"elastic_runner/alive another", c))
    other_key = Answering(lambda c: Sealer(b"x" * 32).seal(b"elastic_runner/alive host-1-2", c))
    replayed = Answering(lambda c: Sealer(KEY).seal(b"elastic_runner/alive host-1-2", b"0" * 16))
    for forger in (other_agent, other_key, replayed):
        assert not liveness.agent_lost("127.0.0.1", AliveAt(forger.port, "host-1-2"), KEY)
        forger.sock.close()
    assert sum("is not its word" in r.getMessage() for r in caplog.records) == 3


def test_without_the_job_s_key_the_answer_is_the_challenge_itself() -> None:
    alive = liveness.LivenessServer("host-1-2", None)
    alive.start()
    try:
        assert not liveness.agent_lost("127.0.0.1", AliveAt(alive.port, "host-1-2"), None)
    finally:
        alive.close()


def test_the_port_is_read_from_the_environment_only_when_it_is_one() -> None:
    assert liveness.port_from_environment({liveness.ALIVE_PORT_VAR: "29511"}) == 29511
    for bad in ("", "0", "70000", "-3", "29511; rm", "２９５"):
        assert liveness.port_from_environment({liveness.ALIVE_PORT_VAR: bad}) is None
    assert liveness.port_from_environment({}) is None


class Vanishing:
    """The job's store of rank 0's worker, until :meth:`vanish`: then every operation fails as a reset does."""

    def __init__(self) -> None:
        self.inner, self.gone = tdist.HashStore(), False

    def vanish(self) -> None:
        self.gone = True

    def __getattr__(self, name: str) -> Any:
        if self.gone:
            def reset(*_: Any) -> Any:
                raise tdist.DistNetworkError("Connection reset by peer")
            return reset
        return getattr(self.inner, name)


class Freezing(Vanishing):
    """The job's store of rank 0's worker, until :meth:`vanish`: then every operation waits without end, as torch's
    client does on a machine gone without resetting its connections (released at the test's end)."""

    def __init__(self) -> None:
        super().__init__()
        self.released = threading.Event()

    def __getattr__(self, name: str) -> Any:
        if self.gone:
            def frozen(*_: Any) -> Any:
                self.released.wait(60)
                raise tdist.DistNetworkError("released")
            return frozen
        return getattr(self.inner, name)


def _members(store: Any, rank: int, alive_port: int | None, agent: str = "host-1-2", asks: bool = True,
             master_addr: str = "127.0.0.1") -> SameMembers:
    timeout = datetime.timedelta(seconds=5)
    return SameMembers(store, rank, 2, "gloo", torch.device("cpu"), timeout, timeout, agents=2, key=KEY,
                       context="127.0.0.1:1", master_addr=master_addr, alive_port=alive_port, agent_id=agent,
                       asks_rank0_agent=asks)


def _survivor_of_a_gone_store(rank0_port: int | None, agent: str = "host-1-2", asks: bool = True,
                              master_addr: str = "127.0.0.1") -> SameMembers:
    """Rank 1, after the round's first group formed with a rank 0 whose agent answers at ``rank0_port``; then the
    job's store goes with rank 0's worker."""
    store = Vanishing()
    _members(store, 0, rank0_port, agent, master_addr=master_addr)
    survivor = _members(store, 1, None, asks=asks, master_addr=master_addr)
    survivor.formed()
    store.vanish()
    return survivor


def test_rank_0_says_where_its_agent_answers_and_a_survivor_learns_it_once_the_first_group_works(
        server: liveness.LivenessServer) -> None:
    store = Vanishing()
    _members(store, 0, server.port, server.agent)
    survivor = _members(store, 1, None)
    assert survivor.rank0_agent is None
    survivor.formed()
    assert survivor.rank0_agent == AliveAt(server.port, server.agent)


def test_a_store_gone_while_rank_0s_agent_lives_parks_the_survivor_without_counting_that_node_out(
        server: liveness.LivenessServer) -> None:
    survivor = _survivor_of_a_gone_store(server.port, server.agent)
    with pytest.raises(RegroupError, match="rank 0's worker ended .node 0's agent is alive") as raised:
        survivor.survive(datetime.timedelta(seconds=30))
    assert raised.value.lost_agents == ()


def test_a_store_gone_with_rank_0s_agent_counts_that_node_out_at_once() -> None:
    survivor = _survivor_of_a_gone_store(_free_port())  # (rank 0's agent served there; its node is gone)
    started = time.monotonic()
    with pytest.raises(RegroupError, match="nor does node 0's agent: that node was lost") as raised:
        survivor.survive(datetime.timedelta(seconds=30))
    assert raised.value.lost_agents == (0,)
    assert time.monotonic() - started < 2.0


def test_a_store_that_stops_answering_without_closing_counts_a_gone_agents_node_out_within_seconds() -> None:
    store = Freezing()
    _members(store, 0, _free_port())  # (rank 0's agent served there; its machine vanished with the store)
    survivor = _members(store, 1, None)
    survivor.formed()
    store.vanish()
    started = time.monotonic()
    try:
        with pytest.raises(RegroupError, match="nor does node 0's agent: that node was lost") as raised:
            survivor.survive(datetime.timedelta(seconds=30))
        assert raised.value.lost_agents == (0,)
        assert time.monotonic() - started < regroup.STORE_ANSWER_S + 2.0, "the store's answer waited for at most its bound"
    finally:
        store.released.set()


def test_without_a_word_from_rank_0_a_gone_store_counts_nobody_out() -> None:
    # torch's own agent, or a script's workers: nothing says where rank 0's agent answers.
    survivor = _survivor_of_a_gone_store(None)
    with pytest.raises(RegroupError, match="rank 0's worker ended, or its node was lost") as raised:
        survivor.survive(datetime.timedelta(seconds=30))
    assert raised.value.lost_agents == ()


def test_a_forged_word_from_rank_0_is_not_taken(server: liveness.LivenessServer) -> None:
    store = Vanishing()
    Channel(store, b"x" * 32, "127.0.0.1:1").send(AliveAt(_free_port(), "forged"))
    survivor = _members(store, 1, None)
    survivor.formed()
    assert survivor.rank0_agent is None


def test_the_agent_serves_its_port_for_its_workers_with_the_job_s_key(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    from elastic_runner.agent import adopt
    from elastic_runner.env import AGENT_ID_VAR
    from elastic_runner.snapshot.format import KEY_FILE_VAR, signing_key_from_environment

    key_file = tmp_path / "job.key"
    key_file.write_bytes(b"s" * 32)
    key_file.chmod(0o600)
    monkeypatch.setenv(KEY_FILE_VAR, str(key_file))
    monkeypatch.setenv(AGENT_ID_VAR, "host-7-8")
    monkeypatch.setenv(liveness.ALIVE_PORT_VAR, "")  # (recorded: what the agent sets is undone after the test)
    monkeypatch.setattr(adopt, "_liveness", None)
    adopt._serve_liveness()
    try:
        port = liveness.port_from_environment()
        assert adopt._liveness.answered == 0 and adopt._liveness._thread is None, \
            "no thread before the zygote forks (it forks only from an agent without other threads)"
        adopt._liveness.start()
        assert port is not None
        key = signing_key_from_environment()
        assert not liveness.agent_lost("127.0.0.1", AliveAt(port, "host-7-8"), key)
        assert adopt._liveness.answered == 1
    finally:
        adopt._liveness.close()


class AskingHandler:
    """A rendezvous handler that asks the agents it waits for (the etcd-v3 lease protocol's: a ``liveness`` slot)."""

    liveness: Any = None


def test_the_agent_tells_a_rendezvous_that_asks_where_it_answers_and_how_to_ask_the_others(
        server: liveness.LivenessServer) -> None:
    handler = AskingHandler()
    assert liveness.offer(handler, server, KEY)
    told = handler.liveness
    assert (told.port, told.agent) == (server.port, "host-1-2"), "what its node key names"
    assert told.lost("127.0.0.1", server.port, "host-1-2") is False
    assert told.lost("localhost", server.port, "host-1-2") is False, "a host name is looked up"
    assert told.lost("127.0.0.1", server.port, "host-9-9") is False, "an answer bound to another agent: no evidence"
    assert told.lost("a" * 64 + ".example", server.port, "host-1-2") is False, "a name that does not resolve: no evidence"
    server.close()
    assert told.lost("127.0.0.1", server.port, "host-1-2") is True
    assert not liveness.offer(object(), server, KEY), "torch's own handlers ask nobody"
    assert not liveness.offer(AskingHandler(), None, KEY), "an agent without a port (it keeps no workers) says none"
    nameless = liveness.LivenessServer("", KEY)
    try:
        assert not liveness.offer(AskingHandler(), nameless, KEY), "nor one without a name"
    finally:
        nameless.close()


def test_an_agent_whose_job_key_cannot_be_read_serves_no_port(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    from elastic_runner.agent import adopt
    from elastic_runner.snapshot.format import KEY_FILE_VAR

    monkeypatch.setenv(KEY_FILE_VAR, str(tmp_path / "missing.key"))
    monkeypatch.setenv(liveness.ALIVE_PORT_VAR, "")  # (recorded: what the agent sets is undone after the test)
    monkeypatch.setattr(adopt, "_liveness", None)
    adopt._serve_liveness()  # (its workers meet the same file and exit 2 naming it)
    assert liveness.port_from_environment() is None and adopt._liveness is None


def test_only_a_nodes_first_worker_asks_its_node_s_agent_counts_out_what_it_found() -> None:
    # A job of many nodes asks rank 0's agent once per node, not once per worker.
    second = _survivor_of_a_gone_store(_free_port(), asks=False)
    assert second.rank0_agent is None
    with pytest.raises(RegroupError, match="rank 0's worker ended, or its node was lost") as raised:
        second.survive(datetime.timedelta(seconds=30))
    assert raised.value.lost_agents == ()


def test_master_addr_as_a_name_is_looked_up_while_the_store_serves(
        server: liveness.LivenessServer, monkeypatch: pytest.MonkeyPatch) -> None:
    survivor = _survivor_of_a_gone_store(server.port, server.agent, master_addr="localhost")
    real = socket.getaddrinfo

    def no_lookup(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host == "localhost":
            raise AssertionError("a name looked up after the store was gone")
        return real(host, *args, **kwargs)  # (a numeric address: no lookup)

    monkeypatch.setattr(socket, "getaddrinfo", no_lookup)
    with pytest.raises(RegroupError, match="node 0's agent is alive"):
        survivor.survive(datetime.timedelta(seconds=30))


def test_more_askers_at_once_than_it_answers_are_closed_unanswered_not_queued(
        server: liveness.LivenessServer, monkeypatch: pytest.MonkeyPatch) -> None:
    # A flood must not take the agent's descriptors: beyond MAX_OPEN held connections, new ones are closed at once.
    monkeypatch.setattr(liveness, "MAX_OPEN", 3)
    holders = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(3)]
    try:
        time.sleep(0.2)  # (accepted and waiting for their challenges)
        assert liveness.agent_lost("127.0.0.1", AliveAt(server.port, server.agent), KEY)
        for holder in holders:
            holder.close()
        time.sleep(0.2)
        assert not liveness.agent_lost("127.0.0.1", AliveAt(server.port, server.agent), KEY)
    finally:
        for holder in holders:
            holder.close()
