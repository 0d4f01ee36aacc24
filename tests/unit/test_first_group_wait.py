"""A kept worker placed in a new round waits for the round's other ranks while its group comes up
(:func:`elastic_runner.worker.group.up` with ``leaving``): when its agent starts yet another round meanwhile (a second
node joins or is lost while the new peer is still starting), the wait ends at once in
:class:`~elastic_runner.recovery.rebuild.AskedToPark`, with no group and no store left behind, and the worker can
park again. Before, that wait was torch's own group start, in native code: the agent could not ask the worker
anything, and started a new process in its place."""

from __future__ import annotations

import datetime
import socket
import threading
import time
from pathlib import Path
from typing import Callable

import pytest
import torch.distributed as tdist

from elastic_runner.env import WorkerEnv
from elastic_runner.recovery.channel import arrived_key
from elastic_runner.recovery.rebuild import AskedToPark, regroup_method
from elastic_runner.testing.localjob import free_port
from elastic_runner.worker import group

pytestmark = [pytest.mark.timeout(60)]

METHODS = ["recreate", pytest.param("reconfigure", marks=pytest.mark.skipif(
    regroup_method("gloo")[0] != "reconfigure", reason=f"this torch cannot: {regroup_method('gloo')[1]}"))]


def _placed(rank: int, port: int) -> WorkerEnv:
    """A kept worker's place in a round of two agents, one worker each; the other rank never comes."""
    return WorkerEnv(rank=rank, local_rank=0, world_size=2, local_world_size=1, group_rank=rank, group_world_size=2,
                     master_addr="127.0.0.1", master_port=port, agent_id=f"test-agent-{rank}")


def _asked_after(seconds: float) -> Callable[[], bool]:
    """The agent's park request, as :meth:`Handover.requested` reads it: ``seconds`` from now."""
    asked = threading.Event()
    threading.Timer(seconds, asked.set).start()
    return asked.is_set


def _up(env: WorkerEnv, regroup: str, leaving: Callable[[], bool]) -> float:
    started = time.monotonic()
    with pytest.raises(AskedToPark) as raised:
        group.up(env, backend="gloo", device="cpu", timeout_seconds=30, init_timeout_seconds=20, in_process=True,
                 regroup_wait_seconds=20, regroup=regroup, leaving=leaving)
    assert "asked it to park" in str(raised.value)
    return time.monotonic() - started


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


@pytest.mark.parametrize("regroup", METHODS)
def test_rank_0_waiting_for_its_new_peer_parks_when_asked_and_leaves_no_group_and_no_store(regroup: str) -> None:
    port = free_port()
    seconds = _up(_placed(0, port), regroup, _asked_after(0.5))
    assert 0.5 <= seconds < 5, "it waited for the request, and not the 20 s start-up deadline after it"
    assert not tdist.is_initialized(), "no group left behind: it parks with none"
    deadline = time.monotonic() + 5
    while _listening(port) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _listening(port), "the abandoned round's store closes with the wait"


def test_another_rank_waiting_for_rank_0s_store_parks_when_asked() -> None:
    port = free_port()  # nothing listens: rank 0's worker is still starting
    seconds = _up(_placed(1, port), "recreate", _asked_after(0.5))
    assert 0.5 <= seconds < 5
    assert not tdist.is_initialized()


@pytest.mark.parametrize("regroup", METHODS)
def test_another_rank_that_reached_the_store_parks_while_it_waits_for_rank_0_in_the_group(regroup: str) -> None:
    # Rank 0's store is up (the test hosts it), and rank 0 never comes into the group.
    store = tdist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30),
                           wait_for_workers=False, multi_tenant=True)
    seconds = _up(_placed(1, store.port), regroup, _asked_after(1.0))
    assert 1.0 <= seconds < 5
    assert not tdist.is_initialized()
    if regroup == "recreate":
        assert store.check([arrived_key(0, "1")]), "it said it arrived for the round's first group"


@pytest.mark.parametrize("regroup", METHODS)
def test_a_worker_that_is_not_asked_brings_the_group_up_with_a_new_peer(regroup: str) -> None:
    # The kept worker (rank 1: it may be asked) and a new process (rank 0, in a child: not asked) meet in one group.
    import multiprocessing

    port = free_port()
    child = multiprocessing.get_context("spawn").Process(target=_new_rank_0, args=(port, regroup))
    child.start()
    try:
        dist = group.up(_placed(1, port), backend="gloo", device="cpu", timeout_seconds=30, init_timeout_seconds=20,
                        in_process=True, regroup_wait_seconds=20, regroup=regroup, leaving=lambda: False)
        assert (dist.rank, dist.world_size) == (1, 2)
        dist.down()
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
            child.join()
    assert child.exitcode == 0


def _new_rank_0(port: int, regroup: str) -> None:
    time.sleep(1.0)  # still starting when the kept worker comes
    dist = group.up(_placed(0, port), backend="gloo", device="cpu", timeout_seconds=30, init_timeout_seconds=20,
                    in_process=True, regroup_wait_seconds=20, regroup=regroup)
    dist.down()


def test_a_kept_worker_asked_to_park_inside_its_groups_native_start_ends_at_once_for_a_new_process(
        tmp_path: Path) -> None:
    # Rank 0 said it arrived and never came into the group (its node's agent was killed right after the round was
    # sealed): the kept rank 1 waits for it inside gloo's start, where nothing can ask it anything. Its agent's park
    # request ends the process with 76, for a new one in its place, not the start's deadline (75, 20 s later).
    import multiprocessing

    from elastic_runner.lifecycle import EXIT_PEER_LOST, EXIT_PEER_TIMEOUT
    from elastic_runner.recovery.channel import Arrived, Channel

    store = tdist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30),
                           wait_for_workers=False, multi_tenant=True)
    Channel(store, None, f"127.0.0.1:{store.port}").send(Arrived(0, "0"))
    asked = tmp_path / "park-0"
    child = multiprocessing.get_context("spawn").Process(target=_kept_rank_1, args=(store.port, str(asked)))
    child.start()
    try:
        # Past its wait for the arrivals (a ms), into the group's start: rank 1 then looks for rank 0's address.
        deadline = time.monotonic() + 15
        while not store.check([arrived_key(0, "1")]) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)
        asked.touch()
        child.join(15)
    finally:
        if child.is_alive():
            child.kill()
            child.join()
    assert child.exitcode != _PARKED, "it had left its wait for the others: the request met it in native code"
    assert child.exitcode == EXIT_PEER_LOST, (
        f"exit status {child.exitcode}: asked, it ends at once (76), not at the start's deadline ({EXIT_PEER_TIMEOUT})")


#: The child's status where the request met it still in a wait it can leave (it would park instead).
_PARKED = 10


def _kept_rank_1(port: int, asked: str) -> None:
    import os
    import sys

    try:
        group.up(_placed(1, port), backend="gloo", device="cpu", timeout_seconds=30, init_timeout_seconds=20,
                 in_process=True, regroup_wait_seconds=20, regroup="recreate", leaving=lambda: os.path.exists(asked))
    except AskedToPark:
        sys.exit(_PARKED)
    sys.exit(0)


@pytest.mark.parametrize("section_s, status", [(0.3, 0), (3.0, 76)])
def test_a_start_that_comes_out_within_the_grace_keeps_its_process_and_one_that_does_not_ends_it(
        section_s: float, status: int) -> None:
    # Asked from the first look: a native start that works comes out within milliseconds (the worker then parks),
    # and a kept process is worth a second's wait; one still inside after the grace (1 s) is stuck there.
    import multiprocessing

    child = multiprocessing.get_context("spawn").Process(target=_inside_a_native_start, args=(section_s,))
    child.start()
    child.join(30)
    if child.is_alive():
        child.kill()
        child.join()
    assert child.exitcode == status


def _inside_a_native_start(seconds: float) -> None:
    import sys

    from elastic_runner.recovery.rebuild import leaves_when_asked

    with leaves_when_asked(lambda: True, "a test's start", grace_s=1.0):
        time.sleep(seconds)  # (the main thread busy elsewhere, as inside native code)
    sys.exit(0)
