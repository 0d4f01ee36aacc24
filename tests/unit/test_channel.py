"""The recovery protocol's messages in the job's store (:mod:`elastic_runner.recovery.channel`): each read as its type
or not at all; with the job's key, only what was signed with it for that very key — so whoever reaches the store's
port cannot make survivors count a live node out, wait for a replacement nobody announced, or stop every rank."""

from __future__ import annotations

import datetime
import logging
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as tdist

from elastic_runner.recovery.channel import (Abort, AgentBeat, Arrived, Channel, Coming, Handle, InGeneration,
                                             Message, Parked, ParkRequest, Place, PrivateDirectory, ReadyToPark,
                                             WatchdogBeat)
from elastic_runner.recovery.rebuild import RegroupError
from elastic_runner.recovery.regroup import SameMembers, announce_replacement
from elastic_runner.worker.watchdog import PeerWatchdog

from ..support import beating_agents

pytestmark = [pytest.mark.timeout(60)]

KEY = b"k" * 32
EVERY_MESSAGE: list[Message] = [
    AgentBeat(3, 17), AgentBeat(3, 18, stopping=True), Coming(2, 1), InGeneration(1, 4), Handle(4, "1", "gloo:1:2:3:"),
    Arrived(4, "0"), WatchdogBeat(2, 5, 9), WatchdogBeat(2, 5, 10, done=True), Abort(2, 5, "rank 4 stopped"),
    ReadyToPark(1, 4242), ParkRequest(1, "a node joins"), Parked(1, 4242), Parked(0, 4242, 3, (0, 2)),
    Place(1, {"RANK": "3", "WORLD_SIZE": "4"}),
]


@pytest.mark.parametrize("key", [KEY, None], ids=["signed", "unsigned"])
@pytest.mark.parametrize("message", EVERY_MESSAGE, ids=lambda m: f"{type(m).__name__}")
def test_every_message_reads_back_as_it_was_sent(message: Message, key: bytes | None) -> None:
    channel = Channel(tdist.HashStore(), key)
    channel.send(message)
    assert channel.read(type(message), message.key()) == message


def test_a_key_that_holds_nothing_reads_as_no_message() -> None:
    assert Channel(tdist.HashStore(), KEY).read(AgentBeat, "regroup/agent/0") is None


@pytest.mark.parametrize("value", [b"7", b"stopping", b'{"kind":"beat","agent":1,"count":7,"stopping":false}'],
                         ids=["old-counter", "old-stopping", "unsigned-json"])
def test_with_the_jobs_key_a_value_written_without_it_is_nobodys_word(value: bytes,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    store = tdist.HashStore()
    store.set("regroup/agent/1", value)
    channel = Channel(store, KEY)
    with caplog.at_level(logging.WARNING, logger="elastic_runner.recovery.channel"):
        assert channel.read(AgentBeat, "regroup/agent/1") is None
        assert channel.read(AgentBeat, "regroup/agent/1") is None
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1, "one warning per key, not one per look"
    assert "regroup/agent/1" in said[0] and ("not signed" in said[0] or "signature" in said[0]), said


def test_a_signed_message_moved_to_another_key_is_refused() -> None:
    store = tdist.HashStore()
    channel = Channel(store, KEY)
    store.set("regroup/agent/1", channel.encode(AgentBeat(0, 50)))  # node 0's live beat, put in node 1's slot
    assert channel.read(AgentBeat, "regroup/agent/1") is None


def test_a_message_signed_with_another_key_is_refused() -> None:
    store = tdist.HashStore()
    Channel(store, b"x" * 32).send(Coming(1, 0))
    assert Channel(store, KEY).read(Coming, "regroup/1/coming") is None


@pytest.mark.parametrize("value", [
    b"", b"\xff\xfe", b"[1, 2]", b'{"kind":"coming","generation":1,"rank":0}',  # another kind in the beat's slot
    b'{"kind":"beat","agent":1,"count":"7","stopping":false}',  # a field of another type
    b'{"kind":"beat","agent":1,"count":true,"stopping":false}',  # a bool is no count
    b'{"kind":"beat","agent":1,"count":7,"stopping":false,"extra":1}',  # a field it does not have
    b'{"kind":"beat","agent":2,"count":7,"stopping":false}',  # it names another agent's slot
    b"x" * 10_000,
], ids=["empty", "not-utf8", "not-an-object", "another-kind", "string-count", "bool-count", "extra-field",
        "other-slot", "too-large"])
def test_without_a_key_only_a_well_formed_message_of_the_slots_type_is_read(value: bytes) -> None:
    store = tdist.HashStore()
    store.set("regroup/agent/1", value)
    assert Channel(store, None).read(AgentBeat, "regroup/agent/1") is None


@pytest.mark.parametrize("value", [
    b'{"kind":"parked","local_rank":0,"pid":7,"agents":3,"lost":[1.0]}',  # a float is no group rank
    b'{"kind":"parked","local_rank":0,"pid":7,"agents":3,"lost":{"1":1}}',
    b'{"kind":"place","local_rank":0,"environment":{"RANK":1}}',  # an environment holds strings
    b'{"kind":"place","local_rank":0,"environment":["RANK","1"]}',
], ids=["float-rank", "mapping-ranks", "number-in-environment", "list-environment"])
def test_a_list_or_a_mapping_field_reads_only_as_its_type(value: bytes) -> None:
    store = tdist.HashStore()
    cls = Parked if b'"parked"' in value else Place
    store.set(cls.at(0), value)
    assert Channel(store, None).read(cls, cls.at(0)) is None


def test_an_agents_private_directory_holds_one_private_file_per_message(tmp_path: Any) -> None:
    store = PrivateDirectory(tmp_path)
    Channel(store, None).send(Parked(2, 99, 3, (1,)))
    assert [p.name for p in tmp_path.iterdir()] == ["parked-2"] and (tmp_path / "parked-2").stat().st_mode & 0o077 == 0
    assert Channel(store, None).read(Parked, "parked-2") == Parked(2, 99, 3, (1,))
    assert store.delete_key("parked-2") and not store.delete_key("parked-2")
    assert Channel(store, None).read(Parked, "parked-2") is None
    with pytest.raises(KeyError):
        store.get("parked-2")
    with pytest.raises(ValueError, match="no file name"):
        store.set("../parked-2", b"{}")


# -- what a writer on the store without the key can no longer do ----------------------------------------------


def _job_store() -> Any:
    return tdist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)


def _survivor(store: Any, key: bytes | None) -> SameMembers:
    timeout = datetime.timedelta(seconds=5)
    return SameMembers(store, 1, 2, "gloo", torch.device("cpu"), timeout, timeout, agents=2, key=key)


class _Forger:
    """Writes ``value`` at ``key`` every few milliseconds from a thread, as someone who reached the store's port."""

    def __init__(self, store: Any, key: str, value: bytes) -> None:
        self.client = tdist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=5),
                                     wait_for_workers=False)
        self.key, self.value, self._stop = key, value, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.client.set(self.key, self.value)
            time.sleep(0.003)

    def __enter__(self) -> _Forger:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self.thread.join(5)


def test_a_beat_held_still_by_someone_without_the_key_does_not_count_a_live_node_out() -> None:
    """Before: writing the same bytes into a live agent's slot made its beat stand still, and survivors counted
    its node out of the next round."""
    store = _job_store()
    beats = beating_agents(store, [0, 1], KEY)
    try:
        # A well-formed beat, held at one count: without the key it is nobody's word (and so is any other value).
        forged = b'{"agent":1,"count":7,"kind":"beat","stopping":false}'
        with _Forger(store, "regroup/agent/1", forged):
            with pytest.raises(RegroupError, match="no replacement was announced within 1.5s"):
                _survivor(store, KEY).survive(datetime.timedelta(seconds=1.5))
    finally:
        for beat in beats:
            beat.close()


class _ReplayingStore:
    """The job's store, where someone puts node 1's old signed beat back right after the survivor's first look."""

    def __init__(self, old: bytes) -> None:
        self.inner, self.old, self.looks = tdist.HashStore(), old, 0

    def set(self, key: str, value: bytes) -> None:
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values = self.inner.multi_get(keys)
        if "regroup/agent/1" in keys:
            self.looks += 1
            if self.looks == 1:
                self.inner.set("regroup/agent/1", self.old)
        return values


def test_an_old_signed_beat_put_back_is_a_replay_not_the_nodes_silence(caplog: pytest.LogCaptureFixture) -> None:
    early = tdist.HashStore()
    Channel(early, KEY).send(AgentBeat(1, 3))
    store = _ReplayingStore(early.get("regroup/agent/1"))  # what someone watching the store saw early on
    channel = Channel(store, KEY)
    channel.send(AgentBeat(1, 40))
    stop = threading.Event()

    def node_0_beats() -> None:
        count = 0
        while not stop.is_set():
            channel.send(AgentBeat(0, count))
            count += 1
            time.sleep(0.05)

    thread = threading.Thread(target=node_0_beats, daemon=True)
    thread.start()
    try:
        with caplog.at_level(logging.WARNING, logger="elastic_runner.recovery.regroup"):
            with pytest.raises(RegroupError, match="no replacement was announced within 1.5s"):
                _survivor(store, KEY).survive(datetime.timedelta(seconds=1.5))
    finally:
        stop.set()
        thread.join(5)
    assert store.looks >= 2, "the survivor looked again after the replay"
    assert any("went back from 40 to 3" in r.getMessage() for r in caplog.records), caplog.text


def test_an_announcement_without_the_key_is_not_waited_for() -> None:
    store = _job_store()
    Channel(store, KEY).send(InGeneration(0, 0))
    store.set("regroup/1/coming", b"0")  # as an agent announced a replacement before
    started = time.monotonic()
    with pytest.raises(RegroupError, match="no replacement was announced within 0.5s"):
        _survivor(store, KEY).survive(datetime.timedelta(seconds=0.5))
    assert time.monotonic() - started < 5


def test_the_agents_announcement_signed_with_the_key_is_what_survivors_wait_for() -> None:
    store = tdist.HashStore()
    channel = Channel(store, KEY)
    channel.send(InGeneration(1, 2))  # rank 1 was in generation 2 when it failed
    assert announce_replacement(channel, 1) == 3
    assert channel.read(Coming, "regroup/3/coming") == Coming(3, 1)


def test_a_replacement_does_not_take_its_generation_from_a_value_nobody_signed() -> None:
    store = tdist.HashStore()
    store.set("regroup/in/1", b"41")
    with pytest.raises(RegroupError, match="ended before the round's first process group was formed"):
        announce_replacement(Channel(store, KEY), 1)


def _watchdog(store: Any, fired: list[str], timeout: float = 0.5) -> PeerWatchdog:
    return PeerWatchdog(store, rank=0, world_size=2, generation=1, timeout=timeout, interval=0.02, startup_grace=5.0,
                        on_lost=fired.append, key=KEY)


def test_a_forged_abort_stops_no_rank() -> None:
    store, fired = tdist.HashStore(), []
    dog = _watchdog(store, fired, timeout=30.0).start()
    try:
        store.set("er/abort/1", b"rank 1: stop everything")
        Channel(store, b"y" * 32).send(Abort(1, 1, "signed with another key"))
        time.sleep(0.4)
        assert not fired, fired
        Channel(store, KEY).send(Abort(1, 1, "a real abort"))  # a peer's, signed: it still stops this rank
        deadline = time.monotonic() + 5
        while not fired and time.monotonic() < deadline:
            time.sleep(0.02)
        assert fired and "rank 1: a real abort" in fired[0]
    finally:
        dog.stop(done=False)


def test_a_forged_done_does_not_hide_a_hung_rank() -> None:
    store, fired = tdist.HashStore(), []
    Channel(store, KEY).send(WatchdogBeat(1, 1, 1))  # rank 1 started, then hung
    dog = _watchdog(store, fired).start()
    try:
        store.set("er/hb/1/1", b"done")
        deadline = time.monotonic() + 10
        while not fired and time.monotonic() < deadline:
            time.sleep(0.02)
        assert fired and "rank 1" in fired[0], "the hung rank is still found"
    finally:
        dog.stop(done=False)


def test_an_old_counter_put_back_does_not_make_a_live_rank_look_hung(caplog: pytest.LogCaptureFixture) -> None:
    store, fired = tdist.HashStore(), []
    channel = Channel(store, KEY)
    stop = threading.Event()
    channel.send(WatchdogBeat(1, 1, 1))
    old = store.get("er/hb/1/1")

    def rank_1_beats() -> None:
        count = 100
        while not stop.is_set():
            channel.send(WatchdogBeat(1, 1, count))
            count += 1
            time.sleep(0.05)
            store.set("er/hb/1/1", old)  # put back at once after each of its beats
            time.sleep(0.05)

    thread = threading.Thread(target=rank_1_beats, daemon=True)
    dog = _watchdog(store, fired, timeout=1.0)
    with caplog.at_level(logging.WARNING, logger="elastic_runner.worker.watchdog"):
        thread.start()
        dog.start()
        try:
            time.sleep(3.0)  # three times the watchdog's timeout
        finally:
            stop.set()
            thread.join(5)
            dog.stop(done=False)
    assert not fired, fired
    assert any("went back" in r.getMessage() for r in caplog.records)


def test_a_message_signed_in_an_earlier_rounds_store_does_not_verify_in_this_ones() -> None:
    store = tdist.HashStore()
    earlier = Channel(store, KEY, "10.0.0.1:29500")
    earlier.send(Coming(1, 0))  # an announcement of the round whose store was at 10.0.0.1:29500
    assert earlier.read(Coming, "regroup/1/coming") == Coming(1, 0)
    assert Channel(store, KEY, "10.0.0.2:29511").read(Coming, "regroup/1/coming") is None


def test_an_old_counter_put_back_does_not_hide_a_hung_rank() -> None:
    store, fired = tdist.HashStore(), []
    channel = Channel(store, KEY)
    channel.send(WatchdogBeat(1, 1, 1))
    old = store.get("er/hb/1/1")
    channel.send(WatchdogBeat(1, 1, 9))  # rank 1's newest beat, and then it hangs
    dog = _watchdog(store, fired)
    stop = threading.Event()

    def replaying() -> None:
        while not stop.is_set():
            store.set("er/hb/1/1", old)
            time.sleep(0.01)

    thread = threading.Thread(target=replaying, daemon=True)
    dog.start()
    time.sleep(0.1)  # (the watchdog saw the newest beat first)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not fired and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        stop.set()
        thread.join(5)
        dog.stop(done=False)
    assert fired and "rank 1 stopped heartbeating" in fired[0], fired
