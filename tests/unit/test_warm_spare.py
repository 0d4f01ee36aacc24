"""A spare's workers started while it waits (:class:`elastic_runner.agent.spare.WarmSeat`): real standby processes,
forked by the forkserver as the zygote forks them, handed their places by the process context torch's agent starts
for the round that seats the node."""

from __future__ import annotations

import importlib
import os
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

from elastic_runner import torch_patches
from elastic_runner.agent.spare import WarmSeat
from elastic_runner.agent.worker_context import KeepingContext

from ..support import context_result

pytestmark = [pytest.mark.timeout(120)]


def _worker(name: str) -> tuple[str, int, str, str, str]:
    """Waits for its go-file; says who it is on its output; returns who it was and what of its environment it ran
    with (raises where its environment says FAIL)."""
    go = os.environ["GO_FILE"]
    while not os.path.exists(go):
        time.sleep(0.02)
    print(f"worker {name} pid {os.getpid()}", flush=True)
    if os.environ.get("FAIL"):
        raise ValueError(f"{name} was told to fail")
    return name, os.getpid(), os.environ.get("WHO", ""), os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"]


@dataclass
class Spec:
    """What WarmSeat reads of torch's WorkerSpec."""

    local_world_size: int = 2
    entrypoint: Any = _worker
    args: tuple[str, ...] = ("w${local_rank}",)
    numa_options: Any = None


@dataclass
class Heard:
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def __call__(self, event: str, **fields: Any) -> None:
        self.events.append((event, fields))


def _round_start(tmp: str, count: int = 2, args: dict[int, tuple[str, ...]] | None = None,
                 logs: DefaultLogsSpecs | None = None, failing: int | None = None) -> Any:
    """What torch's LocalElasticAgent._start_workers does for a round: its module's start_processes, with the
    round's environment (here: rank 2 and 3 of a world of 4; local rank ``failing`` told to fail)."""
    module = importlib.import_module(torch_patches.LOCAL_AGENT)
    return module.start_processes(
        name="trainer", entrypoint=_worker, args=args or {r: (f"w{r}",) for r in range(count)},
        envs={r: {"GO_FILE": os.path.join(tmp, "go"), "WHO": f"rank {2 + r}", "LOCAL_RANK": str(r),
                  "WORLD_SIZE": "4"} | ({"FAIL": "1"} if r == failing else {}) for r in range(count)},
        logs_specs=logs or DefaultLogsSpecs(log_dir=tempfile.mkdtemp(dir=tmp)), start_method="forkserver")


def _text(path: str) -> str:
    try:
        return Path(path).read_text()
    except FileNotFoundError:
        return ""


def _wait_built(seat: WarmSeat, count: int) -> None:
    """Until ``count`` standbys said they are done building (here: nothing to build, they say so at once)."""
    deadline = time.monotonic() + 60
    while seat._standbys is not None and len(seat._standbys._answers) < count:
        assert time.monotonic() < deadline, "the standbys never said they were ready"
        seat._standbys.built()
        time.sleep(0.02)


def test_a_waiting_spares_standbys_become_its_workers_with_the_rounds_environment_and_results(
        tmp_path: Any) -> None:
    seat, heard = WarmSeat(), Heard()
    seat.waits(Spec(), max_nodes=3, start_method="forkserver")  # (they build for a world of 6; the round has 4)
    standbys = seat._standbys.pids() if seat._standbys is not None else []
    assert len(standbys) == 2, "one standby per local rank"
    seat.waits(Spec(), max_nodes=3, start_method="forkserver")  # (the handler says so at every poll)
    assert seat._standbys is not None and seat._standbys.pids() == standbys, "started once while they run"
    _wait_built(seat, 2)
    with seat.seating(heard):
        context = _round_start(str(tmp_path))
    try:
        assert isinstance(context, KeepingContext)
        assert list(context.pids().values()) == standbys, "the standbys took the places: no new process"
        assert heard.events == [("spare_seated", {"workers": 2, "built": 0, "build_s": 0.0})], \
            "nothing to build for a function that is not the trainer: none built ahead"
        (tmp_path / "go").touch()
        done = context_result(context)
        assert not done.is_failed()
        assert done.return_values == {0: ("w0", standbys[0], "rank 2", "0", "4"),
                                      1: ("w1", standbys[1], "rank 3", "1", "4")}, \
            "each ran as its local rank's worker of the round: that rank's arguments, environment and result"
    finally:
        context.close()
    assert importlib.import_module(torch_patches.LOCAL_AGENT).start_processes.__name__ == "start_processes"


def test_a_standby_that_ended_while_the_spare_waited_leaves_its_place_to_a_new_process(tmp_path: Any) -> None:
    seat = WarmSeat()
    seat.waits(Spec(), max_nodes=2, start_method="forkserver")
    assert seat._standbys is not None
    first, second = seat._standbys.pids()
    os.kill(second, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while seat._standbys.alive():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    with seat.seating(Heard()):
        context = _round_start(str(tmp_path))
    try:
        pids = context.pids()
        assert pids[0] == first and pids[1] not in (first, second)
        (tmp_path / "go").touch()
        assert context_result(context).return_values[1][1:3] == (pids[1], "rank 3")
    finally:
        context.close()


def test_standbys_started_for_other_workers_end_and_the_round_starts_new_processes(tmp_path: Any) -> None:
    seat = WarmSeat()
    seat.waits(Spec(), max_nodes=2, start_method="forkserver")
    assert seat._standbys is not None
    standbys = seat._standbys.pids()
    processes = list(seat._standbys._standbys.values())
    with seat.seating(Heard()):
        context = _round_start(str(tmp_path), args={0: ("other",), 1: ("other",)})
    try:
        pids = context.pids()
        assert not set(pids.values()) & set(standbys)
        for process, _ in processes:
            process.join(10)
            assert not process.is_alive(), "a standby that took no place is ended"
        (tmp_path / "go").touch()
        assert context_result(context).return_values == {0: ("other", pids[0], "rank 2", "0", "4"),
                                                         1: ("other", pids[1], "rank 3", "1", "4")}
    finally:
        context.close()


def test_a_seated_standbys_output_goes_where_the_round_redirects_it_and_its_failure_is_reported_as_a_workers(
        tmp_path: Any) -> None:
    seat = WarmSeat()
    seat.waits(Spec(), max_nodes=2, start_method="forkserver")
    assert seat._standbys is not None
    standbys = seat._standbys.pids()
    with seat.seating(Heard()):
        context = _round_start(str(tmp_path), logs=DefaultLogsSpecs(log_dir=str(tmp_path / "logs"),
                                                                    redirects=Std.ALL), failing=1)
    try:
        assert list(context.pids().values()) == standbys
        (tmp_path / "go").touch()
        failed = context_result(context)
        assert list(failed.failures) == [1] and failed.failures[1].pid == standbys[1]
        assert failed.failures[1].message["message"] == "ValueError: w1 was told to fail", failed.failures[1].message
        assert failed.failures[1].error_file == context.error_files[1], "torch's error file of the rank, as any worker's"
        for local_rank in (0, 1):  # (rank 0 may not have run yet when rank 1's failure is reported)
            said, deadline = f"worker w{local_rank} pid {standbys[local_rank]}", time.monotonic() + 30
            while said not in _text(context.stdouts[local_rank]) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert said in _text(context.stdouts[local_rank]), \
                "the output of the worker the standby became is in its rank's redirect file"
    finally:
        context.close()


def test_no_standbys_without_in_process_standbys_beside_busy_workers_or_for_a_binary(tmp_path: Any) -> None:
    for seat, spec, busy in ((WarmSeat(wanted=False), Spec(), False), (WarmSeat(), Spec(), True),
                             (WarmSeat(), Spec(entrypoint="/usr/bin/python3"), False)):
        seat.waits(spec, max_nodes=2, start_method="forkserver", busy=lambda: busy)
        assert seat._standbys is None
        with seat.seating(Heard()):  # nothing to seat: torch's start, untouched
            pass


def test_the_agents_end_ends_a_waiting_spares_standbys() -> None:
    seat = WarmSeat()
    seat.waits(Spec(local_world_size=1), max_nodes=3, start_method="forkserver")
    assert seat._standbys is not None
    (process, _), = seat._standbys._standbys.values()
    seat.close()
    process.join(10)
    assert not process.is_alive() and seat._standbys is None


def test_standbys_are_left_out_of_a_round_whose_workers_another_hand_over_places(tmp_path: Any) -> None:
    """kept_round's hand-over holds torch's start_processes name: this node's own parked workers take the places."""
    seat = WarmSeat()
    seat.waits(Spec(local_world_size=1), max_nodes=2, start_method="forkserver")
    assert seat._standbys is not None
    (process, _), = seat._standbys._standbys.values()
    module = importlib.import_module(torch_patches.LOCAL_AGENT)
    original = module.start_processes
    module.start_processes = lambda **kwargs: "handed over"
    try:
        with seat.seating(Heard()):
            assert module.start_processes(envs={}) == "handed over"
    finally:
        module.start_processes = original
    process.join(10)
    assert not process.is_alive()
