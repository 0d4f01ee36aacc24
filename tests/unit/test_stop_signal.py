"""The agent's stop signals are never lost: torch's handler raises ``SignalException`` wherever the agent's main
thread is, and an ``except Exception`` there used to swallow it (CI: an agent SIGTERMed while it looked at the
round's members ran on, parked its workers and waited for a round that never came)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from torch.distributed.elastic.multiprocessing.api import SignalException, _terminate_process_handler
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from elastic_runner.agent import stop_signal
from elastic_runner.agent.agent import ElasticRunnerAgent
from elastic_runner.agent.finish import wait_at_exit
from elastic_runner.agent.round_members import MemberWatch, look


@pytest.fixture
def torchs_handler() -> Iterator[None]:
    """SIGTERM handled as torch's process context handles it in the agent; restored after the test."""
    before = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, _terminate_process_handler)
    stop_signal.forget()
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)
        stop_signal.forget()


def _swallowed_sigterm() -> None:
    """A SIGTERM that arrives inside a broad ``except``, as in a store request of the agent's."""
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises in here
        raise AssertionError("the handler never ran")
    except Exception as exc:  # noqa: BLE001 - the point: code that swallows everything
        assert isinstance(exc, SignalException)


def test_a_stop_swallowed_by_a_broad_except_is_raised_again_with_its_signal(torchs_handler: None) -> None:
    stop_signal.latch()
    _swallowed_sigterm()
    assert stop_signal.received() == signal.SIGTERM
    with pytest.raises(SignalException) as raised:
        stop_signal.raise_if_received()
    assert raised.value.sigval == signal.SIGTERM
    with pytest.raises(SignalException):  # it stays: an agent told to stop never goes on
        stop_signal.raise_if_received()


def test_without_a_signal_nothing_is_raised_and_latching_twice_wraps_once(torchs_handler: None) -> None:
    stop_signal.latch()
    wrapped = signal.getsignal(signal.SIGTERM)
    stop_signal.latch()  # each start of torch's process context calls it again
    assert signal.getsignal(signal.SIGTERM) is wrapped
    stop_signal.raise_if_received()
    assert stop_signal.received() is None


def test_the_default_action_is_left_alone() -> None:
    before = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        stop_signal.latch()
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # it ends the process: nothing to record
    finally:
        signal.signal(signal.SIGTERM, before)


def test_the_agents_next_monitoring_look_stops_it_after_a_swallowed_signal(torchs_handler: None) -> None:
    stop_signal.latch()
    _swallowed_sigterm()
    agent = object.__new__(ElasticRunnerAgent)  # nothing of it is touched before the stop
    with pytest.raises(SignalException):
        agent._monitor_workers(SimpleNamespace())  # type: ignore[arg-type]


def test_a_look_at_the_rounds_members_passes_the_stop_on_and_a_failed_look_is_no_verdict() -> None:
    def stopped() -> str | None:
        raise SignalException("got SIGTERM", sigval=signal.SIGTERM)

    def unreachable() -> str | None:
        raise ConnectionResetError("the store went away")

    with pytest.raises(SignalException):
        look(stopped)
    assert look(unreachable) is None


class _Barrier:
    """The exit barrier's store, with the last agent never arriving."""

    def add(self, key: str, amount: int) -> int:
        return 1

    def set(self, key: str, value: str) -> None:
        raise AssertionError("one of two agents arrived: nobody is let go")

    def check(self, keys: list[str]) -> bool:
        return False


def test_the_exit_barrier_wait_ends_on_a_stop_whether_raised_in_it_or_swallowed_before(torchs_handler: None) -> None:
    def asked_when_stopped() -> int:
        raise SignalException("got SIGTERM", sigval=signal.SIGTERM)

    with pytest.raises(SignalException):
        wait_at_exit(_Barrier(), 2, 30.0, asked_when_stopped)
    stop_signal.latch()
    _swallowed_sigterm()
    started = time.monotonic()
    with pytest.raises(SignalException):
        wait_at_exit(_Barrier(), 2, 30.0, lambda: 0)
    assert time.monotonic() - started < 25.0  # not the barrier's timeout


class _Rendezvous:
    """A handler whose store request is interrupted by the agent's stop, wrapped as torch's c10d handler wraps it."""

    def __init__(self, wrap: bool) -> None:
        self.wrap = wrap

    def member_gone(self) -> str | None:
        return None

    def num_nodes_waiting(self) -> int:
        try:
            raise SignalException("got SIGTERM", sigval=signal.SIGTERM)
        except Exception as exc:
            if self.wrap:
                raise RendezvousConnectionError("the store request failed") from exc
            return 0  # swallowed


@pytest.mark.parametrize("wrap", [True, False], ids=["wrapped", "swallowed"])
def test_a_stop_inside_the_rendezvous_question_between_looks_reaches_the_launcher_as_a_stop(
        torchs_handler: None, wrap: bool) -> None:
    """Not a rendezvous error: torch's launcher would close the rendezvous for every node and exit 1."""
    handler = _Rendezvous(wrap)
    MemberWatch().watch(handler, lambda member: None)
    if not wrap:  # a swallowed one is known only by its record
        stop_signal.latch()
        _swallowed_sigterm()
    with pytest.raises(SignalException):
        handler.num_nodes_waiting()
