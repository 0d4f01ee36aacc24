"""A kept worker's place in a new round (:mod:`elastic_runner.worker.handover` and the agent's side,
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

from elastic_runner.agent import kept_round
from elastic_runner.agent.worker_context import as_keeping
from elastic_runner.worker.handover import HANDOVER_DIR_VAR, Handover, HandoverError

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
    """A worker of the first round waits to be asked to park, parks and returns the rank of its new place; one
    started for the new round returns at once."""
    if os.environ["RANK"] != os.environ["FIRST_RANK"]:
        return name, os.getpid(), os.environ["RANK"]
    place = Handover(os.environ["DIR"], int(os.environ["LOCAL_RANK"]))
    while not place.requested():
        time.sleep(0.01)
    new = place.park(60)
    assert new is not None
    return name, os.getpid(), new["RANK"]


def _env(tmp: Path, local_rank: int, rank: int, first_rank: int) -> dict[str, str]:
    return {"DIR": str(tmp), "LOCAL_RANK": str(local_rank), "RANK": str(rank), "FIRST_RANK": str(first_rank)}


def _wait(context: Any, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = context.wait(0)
        if result is not None:
            return result
        time.sleep(0.05)
    raise AssertionError("the context never reported")


def test_the_agent_parks_its_workers_and_hands_them_their_new_places_a_gone_one_is_started_anew(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HANDOVER_DIR_VAR, str(tmp_path))
    places = kept_round.handovers(3)
    assert places is not None
    context = as_keeping(start_processes(
        name="trainer", entrypoint=_worker, args={r: (f"w{r}",) for r in range(3)},
        envs={r: _env(tmp_path, r, r, r) for r in range(3)},
        logs_specs=DefaultLogsSpecs(log_dir=tempfile.mkdtemp(dir=tmp_path)), start_method="forkserver"))
    assert context is not None
    try:
        before = context.pids()
        os.kill(before[2], signal.SIGKILL)  # died with the membership change: its place goes to a new process
        context._pc.processes[2].join(10)
        assert kept_round.park(context, places, "a node is waiting to join", wait_s=30)
        assert kept_round.parked(context, places) == [0, 1]
        # torch's agent starts the round's workers through the module's start_processes: the places go instead
        module = importlib.import_module(kept_round.LOCAL_AGENT)
        original = module.start_processes
        with kept_round.handing_over(context, places) as outcome:
            returned = module.start_processes(name="trainer", entrypoint=_worker, args={}, logs_specs=None,
                                              envs={r: _env(tmp_path, r, r + 3, r) for r in range(3)})
        assert module.start_processes is original
        assert returned is context
        new_pid = context.pids()[2]
        assert outcome == [(0, before[0], True), (1, before[1], True), (2, new_pid, False)]
        assert new_pid != before[2]
        done = _wait(context)
        assert not done.is_failed(), done.failures
        assert done.return_values == {0: ("w0", before[0], "3"), 1: ("w1", before[1], "4"), 2: ("w2", new_pid, "5")}
        assert context.envs[0]["RANK"] == "3", "a later replacement of local rank 0 starts with the new place"
    finally:
        context.close()


def test_a_worker_that_does_not_park_in_time_makes_the_agent_restart_every_worker(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HANDOVER_DIR_VAR, str(tmp_path))
    places = kept_round.handovers(1)
    assert places is not None
    context = as_keeping(start_processes(
        name="trainer", entrypoint=time.sleep, args={0: (60,)}, envs={0: {}},
        logs_specs=DefaultLogsSpecs(log_dir=tempfile.mkdtemp(dir=tmp_path)), start_method="forkserver"))
    assert context is not None
    try:
        assert not kept_round.park(context, places, "a node is waiting to join", wait_s=0.5)
        assert not places[0].park_file.exists(), "the request is withdrawn: the worker restarts as before"
    finally:
        context.close()
