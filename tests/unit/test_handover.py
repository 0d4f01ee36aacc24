"""A kept worker's place in a new round (:mod:`elastic_runner.recovery.handover` and the agent's side,
:mod:`elastic_runner.agent.kept_round`): real worker processes started by torch's ``start_processes`` with the
forkserver, as the zygote does, parked and handed their places through the agent's private directory."""

from __future__ import annotations

import importlib
import os
import signal
import stat
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

from elastic_runner import torch_patches
from elastic_runner.agent import kept_round
from elastic_runner.agent.worker_context import as_keeping
from elastic_runner.recovery.handover import HANDOVER_DIR_VAR, Handover, HandoverError

from ..support import context_result

pytestmark = [pytest.mark.timeout(120)]


def test_a_parked_worker_takes_the_place_its_agent_gives_it(tmp_path: Path) -> None:
    worker, agent = Handover(tmp_path, 1), Handover(tmp_path, 1)
    assert not worker.requested()
    agent.ask_to_park("a node is waiting to join")
    assert worker.requested()
    got: list[Any] = []
    thread = threading.Thread(target=lambda: got.append(worker.park(30)))
    thread.start()
    deadline = time.monotonic() + 10
    while agent.parked_pid() is None:
        assert time.monotonic() < deadline, "the worker never said it parked"
        time.sleep(0.01)
    assert agent.parked_pid() == os.getpid()
    assert stat.S_IMODE(os.stat(agent.parked_file).st_mode) == 0o600, "files we write are private"
    agent.give_place({"RANK": "3", "WORLD_SIZE": "4"})
    thread.join(10)
    assert got == [{"RANK": "3", "WORLD_SIZE": "4"}]
    assert not worker.requested() and agent.parked_pid() is None and not agent.place_file.exists(), \
        "nothing is left for the next park"


def test_a_worker_that_saw_agents_go_silent_tells_its_agent_which_for_that_rounds_size_only(tmp_path: Path) -> None:
    worker, agent = Handover(tmp_path, 0), Handover(tmp_path, 0)
    thread = threading.Thread(target=lambda: worker.park(30, lost_agents=(3, (2, 0))))
    thread.start()
    deadline = time.monotonic() + 10
    while agent.parked_pid() is None:
        assert time.monotonic() < deadline, "the worker never said it parked"
        time.sleep(0.01)
    assert agent.lost_agents(3) == (0, 2)
    assert agent.lost_agents(4) == (), "seen in a round of another size: counts out nobody"
    agent.give_place({"RANK": "0"})
    thread.join(10)
    assert not agent.parked_file.exists() and agent.lost_agents(3) == (), "a later park is not judged by this one"


def test_a_worker_parked_for_another_reason_counts_out_nobody(tmp_path: Path) -> None:
    worker, agent = Handover(tmp_path, 0), Handover(tmp_path, 0)
    thread = threading.Thread(target=lambda: worker.park(30))
    thread.start()
    deadline = time.monotonic() + 10
    while agent.parked_pid() is None:
        assert time.monotonic() < deadline, "the worker never said it parked"
        time.sleep(0.01)
    assert agent.lost_agents(0) == agent.lost_agents(3) == ()
    agent.give_place({"RANK": "0"})
    thread.join(10)


@pytest.mark.parametrize("text", [
    "not json", "[2]", "12345",  # (what the hand-over's files held before its messages were typed: a bare pid)
    '{"kind": "parked", "local_rank": 0, "pid": 7, "agents": 3, "lost": "2"}',
    '{"kind": "parked", "local_rank": 0, "pid": 7, "agents": 3, "lost": [true, 2]}',
    '{"kind": "parked", "local_rank": 1, "pid": 7, "agents": 3, "lost": [2]}',  # another local rank's
    '{"kind": "ready", "local_rank": 0, "pid": 7}'])
def test_a_parked_message_that_is_not_what_a_worker_writes_is_nobody_parked_and_counts_out_nobody(
        tmp_path: Path, text: str, caplog: pytest.LogCaptureFixture) -> None:
    agent = Handover(tmp_path, 0)
    agent.parked_file.write_text(text)
    assert agent.parked_pid() is None and agent.lost_agents(3) == ()
    assert "the agent's private directory holds a value at parked-0 that is not a message" in caplog.text


def test_parked_ranks_outside_the_round_are_nobody_counted_out(tmp_path: Path) -> None:
    agent = Handover(tmp_path, 0)
    agent.parked_file.write_text('{"kind": "parked", "local_rank": 0, "pid": 7, "agents": 3, "lost": [7, -1, 1, 1]}')
    assert agent.parked_pid() == 7 and agent.lost_agents(3) == (1,)


def test_a_park_without_a_place_ends_at_its_deadline_or_at_a_stop(tmp_path: Path) -> None:
    worker = Handover(tmp_path, 0)
    started = time.monotonic()
    assert worker.park(0.2) is None and time.monotonic() - started < 5
    stopped = threading.Event()
    threading.Timer(0.1, stopped.set).start()
    started = time.monotonic()
    assert worker.park(60, stopped=stopped.is_set) is None and time.monotonic() - started < 5
    assert worker.parked_pid() is None


@pytest.mark.parametrize("text", ["not json", '["RANK", "1"]', '{"RANK": 1}'])
def test_a_place_that_is_not_an_environment_is_refused_naming_the_file(tmp_path: Path, text: str) -> None:
    worker = Handover(tmp_path, 0)
    threading.Timer(0.1, lambda: worker.place_file.write_text(text)).start()
    with pytest.raises(HandoverError, match="place-0.json"):
        worker.park(10)


def test_only_a_worker_of_an_agent_that_offers_a_directory_has_a_handover(tmp_path: Path) -> None:
    assert Handover.from_environ(0, {}) is None
    assert Handover.from_environ(0, {HANDOVER_DIR_VAR: str(tmp_path / "gone")}) is None
    assert Handover.from_environ(2, {HANDOVER_DIR_VAR: str(tmp_path)}).park_file == tmp_path / "park-2"


# -- the agent's side, with real workers --------------------------------------------------------------------


def _worker(name: str) -> tuple[str, int, str]:
    """A worker of the first round says it can park (local rank 3 never does: it is still building), waits to be
    asked, parks and returns the rank of its new place; one started for the new round returns at once."""
    if os.environ["RANK"] != os.environ["FIRST_RANK"]:
        return name, os.getpid(), os.environ["RANK"]
    place = Handover(os.environ["DIR"], int(os.environ["LOCAL_RANK"]))
    if place.local_rank == 3:
        time.sleep(120)
    place.ready()
    while not place.requested():
        time.sleep(0.01)
    if os.environ.get("NEVER_PARK"):
        time.sleep(120)
    new = place.park(60)
    assert new is not None
    return name, os.getpid(), new["RANK"]


def _env(tmp: Path, local_rank: int, rank: int, first_rank: int) -> dict[str, str]:
    return {"DIR": str(tmp), "LOCAL_RANK": str(local_rank), "RANK": str(rank), "FIRST_RANK": str(first_rank)}


def _started(tmp_path: Path, count: int, **extra: str) -> Any:
    context = as_keeping(start_processes(
        name="trainer", entrypoint=_worker, args={r: (f"w{r}",) for r in range(count)},
        envs={r: _env(tmp_path, r, r, r) | extra for r in range(count)},
        logs_specs=DefaultLogsSpecs(log_dir=tempfile.mkdtemp(dir=tmp_path)), start_method="forkserver"))
    assert context is not None
    return context


def _all_ready(context: Any, places: list[Handover], local_ranks: list[int]) -> None:
    deadline = time.monotonic() + 30
    while any(places[r].ready_pid() != context.pids()[r] for r in local_ranks):
        assert time.monotonic() < deadline, "the workers never said they can park"
        time.sleep(0.01)


def test_the_agent_parks_its_workers_and_hands_them_their_new_places_the_others_start_anew(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HANDOVER_DIR_VAR, str(tmp_path))
    places = kept_round.handovers(4)
    assert places is not None
    context = _started(tmp_path, 4)
    try:
        before = context.pids()
        _all_ready(context, places, [0, 1, 2])
        os.kill(before[2], signal.SIGKILL)  # died with the membership change: its place goes to a new process
        context._pc.processes[2].join(10)
        assert kept_round.park(context, places, "a node is waiting to join", wait_s=30)
        assert kept_round.parked(context, places) == [0, 1], "local rank 3 was not asked: it cannot park yet"
        assert not places[3].park_file.exists()
        # torch's agent starts the round's workers through the module's start_processes: the places go instead
        module = importlib.import_module(torch_patches.LOCAL_AGENT)
        original = module.start_processes
        with kept_round.handing_over(context, places) as outcome:
            returned = module.start_processes(name="trainer", entrypoint=_worker, args={}, logs_specs=None,
                                              envs={r: _env(tmp_path, r, r + 4, r) for r in range(4)})
        assert module.start_processes is original
        assert returned is context
        after = context.pids()
        assert outcome == [(0, before[0], True), (1, before[1], True), (2, after[2], False), (3, after[3], False)]
        assert after[2] != before[2] and after[3] != before[3], "the dead worker and the busy one are new processes"
        assert places[0].parked_pid() is None, "a worker handed its place is not parked any more"
        done = context_result(context)
        assert not done.is_failed(), done.failures
        assert done.return_values == {0: ("w0", before[0], "4"), 1: ("w1", before[1], "5"),
                                      2: ("w2", after[2], "6"), 3: ("w3", after[3], "7")}
        assert context.envs[0]["RANK"] == "4", "a later replacement of local rank 0 starts with the new place"
    finally:
        context.close()


def test_a_worker_that_does_not_park_in_time_makes_the_agent_restart_every_worker(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HANDOVER_DIR_VAR, str(tmp_path))
    places = kept_round.handovers(1)
    assert places is not None
    context = _started(tmp_path, 1, NEVER_PARK="1")
    try:
        _all_ready(context, places, [0])
        assert not kept_round.park(context, places, "a node is waiting to join", wait_s=0.5)
        assert not places[0].park_file.exists(), "the request is withdrawn: the worker restarts as before"
    finally:
        context.close()


def test_a_parked_file_left_by_a_killed_worker_does_not_pass_for_its_successor(tmp_path: Path) -> None:
    context = _started(tmp_path, 1)
    try:
        places = [Handover(tmp_path, 0)]
        stranger = context.pids()[0] + 1_000_000  # a pid that is not the worker's
        places[0].parked_file.write_text(f'{{"kind": "parked", "local_rank": 0, "pid": {stranger}, "agents": 0, '
                                         '"lost": []}')
        assert kept_round.parked(context, places) == []
    finally:
        context.close()
