"""A store whose calls end within a deadline (:mod:`elastic_runner.bounded_store`): torch's own client waits without
end on a server that is there and does not answer."""

from __future__ import annotations

import datetime
import os
import signal
import threading
import time

import pytest

from elastic_runner.bounded_store import BoundedStore, StoreUnresponsive, connect_within

from ..support import store_server

pytestmark = [pytest.mark.timeout(60)]


class _Store:
    """A fake store: ``get`` answers, ``fail`` raises the store's own error, ``block`` waits for ``release``."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.port = 29500

    def get(self, key: str) -> bytes:
        return key.encode()

    def fail(self) -> None:
        raise RuntimeError("the store's own error")

    def block(self) -> None:
        self.release.wait(30)


def test_an_answer_and_the_stores_own_error_reach_the_caller_as_they_are() -> None:
    store = BoundedStore(_Store(), deadline=1.0)
    assert store.get("k") == b"k" and store.port == 29500
    with pytest.raises(RuntimeError, match="the store's own error"):
        store.fail()
    assert store.get("again") == b"again" and not store.unresponsive, "an error is an answer"


def test_a_call_that_does_not_return_ends_at_the_deadline_and_every_call_meanwhile_at_once() -> None:
    fake = _Store()
    store = BoundedStore(fake, deadline=0.3)
    try:
        began = time.monotonic()
        with pytest.raises(StoreUnresponsive, match=r"did not answer block\(\) within 0.3s") as first:
            store.block()
        assert 0.25 <= time.monotonic() - began < 2.0
        assert first.value.since >= began
        began = time.monotonic()
        with pytest.raises(StoreUnresponsive, match=r"has not answered block\(\)") as later:
            store.get("k")
        assert time.monotonic() - began < 0.5, "no second wait while the first call has not returned"
        assert later.value.since == first.value.since and store.unresponsive
    finally:
        fake.release.set()
    deadline = time.monotonic() + 5
    while store.unresponsive and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.get("k") == b"k", "a store that only stalled answers again once its call returned"


def test_the_helper_thread_does_not_keep_the_store_alive() -> None:
    """Rank 0's job's store must close once its owner lets it go: the helper holds neither it nor its wrapper."""
    import gc
    import weakref

    fake = _Store()
    store = BoundedStore(fake, deadline=1.0)
    assert store.get("k") == b"k"
    thread, gone = store._thread, weakref.ref(fake)
    del store, fake
    gc.collect()
    assert gone() is None, "the store outlived its last owner"
    assert thread is not None
    thread.join(5)
    assert not thread.is_alive(), "the helper thread ends with its store"


def test_a_deadline_must_be_positive() -> None:
    with pytest.raises(ValueError, match="deadline must be positive"):
        BoundedStore(_Store(), deadline=0)


def test_a_stopped_tcpstore_server_which_torchs_client_waits_on_without_end_answers_within_the_deadline() -> None:
    from torch.distributed import TCPStore

    with store_server() as server:
        client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=1),
                          wait_for_workers=False)
        store = BoundedStore(client, deadline=1.0)
        assert store.get("k") == b"v"
        os.kill(server.pid, signal.SIGSTOP)
        began = time.monotonic()
        with pytest.raises(StoreUnresponsive):
            store.get("k")
        assert time.monotonic() - began < 3.0


def test_a_connection_is_made_within_the_deadline_or_refused_with_the_stores_own_error() -> None:
    made = object()
    assert connect_within(lambda: made, 1.0, "the store") is made

    def refused() -> None:
        raise ConnectionRefusedError("nobody listens")

    with pytest.raises(ConnectionRefusedError, match="nobody listens"):
        connect_within(refused, 1.0, "the store")
    with pytest.raises(ValueError, match="deadline must be positive"):
        connect_within(lambda: made, 0, "the store")


def test_a_new_client_of_a_stopped_tcpstore_server_is_refused_at_the_deadline_not_waited_for() -> None:
    """torch's client construction waits on a server that accepts and does not answer, as its calls do."""
    from torch.distributed import TCPStore

    with store_server() as server:
        os.kill(server.pid, signal.SIGSTOP)
        began = time.monotonic()
        with pytest.raises(StoreUnresponsive, match="rank 0's store did not answer a new connection within 1s"):
            connect_within(lambda: TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False,
                                            timeout=datetime.timedelta(seconds=1)), 1.0, "rank 0's store")
        assert time.monotonic() - began < 3.0
