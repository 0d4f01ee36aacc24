"""The agent's worker processes kept when one fails (:mod:`elastic_runner.agent.worker_context`): real processes
started by torch's own ``start_processes`` with a function entrypoint and the forkserver, as the zygote does."""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import time
from typing import Any, Iterator

import pytest
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

from elastic_runner.agent.standby_schedule import StandbySchedule
from elastic_runner.agent.worker_context import KeepingContext, as_keeping

from ..support import context_result

pytestmark = [pytest.mark.timeout(120)]


def _worker(name: str) -> tuple[str, int, str]:
    """Waits for its go-file (so that the test decides when it ends); returns who it was."""
    go = os.environ["GO_FILE"]
    while not os.path.exists(go):
        time.sleep(0.02)
    return name, os.getpid(), os.environ.get("WHO", "")


def _start(tmp: str, count: int) -> Any:
    return start_processes(
        name="trainer", entrypoint=_worker, args={r: (f"w{r}",) for r in range(count)},
        envs={r: {"GO_FILE": os.path.join(tmp, "go"), "WHO": "first"} for r in range(count)},
        logs_specs=DefaultLogsSpecs(log_dir=tempfile.mkdtemp(dir=tmp)), start_method="forkserver")


def test_a_failed_worker_is_reported_alone_and_replaced_while_its_siblings_run_on(tmp_path: Any) -> None:
    context = as_keeping(_start(str(tmp_path), 3))
    assert isinstance(context, KeepingContext)
    try:
        before = context.pids()
        os.kill(before[1], signal.SIGKILL)
        failed = context_result(context)
        assert list(failed.failures) == [1] and failed.failures[1].exitcode == -signal.SIGKILL
        alive = [p.is_alive() for p in context._pc.processes]
        assert alive == [True, False, True], "torch's own context would have terminated local ranks 0 and 2"
        new_pid, from_standby = context.replace(1, env={"GO_FILE": str(tmp_path / "go"), "WHO": "replacement"})
        assert not from_standby, "no standby was started: a new process takes the place"
        assert context.pids() == {0: before[0], 1: new_pid, 2: before[2]}
        with pytest.raises(RuntimeError, match="still running"):
            context.replace(0)
        (tmp_path / "go").touch()
        done = context_result(context)
        assert not done.is_failed()
        assert done.return_values == {0: ("w0", before[0], "first"), 1: ("w1", new_pid, "replacement"),
                                      2: ("w2", before[2], "first")}
    finally:
        context.close()


def test_a_replacement_that_fails_is_reported_like_any_worker_and_close_ends_them_all(tmp_path: Any) -> None:
    context = as_keeping(_start(str(tmp_path), 2))
    assert context is not None
    try:
        os.kill(context.pids()[0], signal.SIGKILL)
        context_result(context)
        replacement, _ = context.replace(0)
        os.kill(replacement, signal.SIGKILL)
        failed = context_result(context)
        assert list(failed.failures) == [0] and failed.failures[0].pid == replacement
        survivor = context._pc.processes[1]
        assert survivor.is_alive()
    finally:
        context.close()
    assert not survivor.is_alive(), "closing the context ends every worker, replacements and survivors alike"


@contextlib.contextmanager
def _keeping(tmp_path: Any, count: int) -> Iterator[KeepingContext]:
    """A started KeepingContext of ``count`` workers, closed on the way out."""
    context = as_keeping(_start(str(tmp_path), count))
    assert context is not None
    try:
        yield context
    finally:
        context.close()


def test_the_standby_takes_a_failed_worker_s_place_with_that_worker_s_environment_output_and_result(
        tmp_path: Any) -> None:
    with _keeping(tmp_path, 2) as context:
        standby = context.start_standby()
        assert standby is not None and context.start_standby() is None, "one standby per node"
        assert standby not in context.pids().values(), "a standby is no worker until it takes a place"
        before = context.pids()
        os.kill(before[1], signal.SIGKILL)
        context_result(context)
        new_pid, from_standby = context.replace(1, env={"GO_FILE": str(tmp_path / "go"), "WHO": "replacement"})
        assert (new_pid, from_standby) == (standby, True)
        assert context.pids() == {0: before[0], 1: standby}
        assert context.start_standby() not in (None, standby), "the next standby is a new process"
        (tmp_path / "go").touch()
        done = context_result(context)
        assert not done.is_failed()
        assert done.return_values == {0: ("w0", before[0], "first"), 1: ("w1", standby, "replacement")}


def test_a_standby_that_is_gone_leaves_the_place_to_a_new_process_and_close_ends_a_waiting_standby(
        tmp_path: Any) -> None:
    with _keeping(tmp_path, 2) as context:
        gone = context.start_standby()
        assert gone is not None
        os.kill(gone, signal.SIGKILL)
        os.kill(context.pids()[0], signal.SIGKILL)
        context_result(context)
        new_pid, from_standby = context.replace(0)
        assert not from_standby and new_pid != gone
        assert context._standby is None
        context.start_standby()
        waiting = context._standby[0]
        assert waiting.is_alive()
    assert not waiting.is_alive(), "closing the context ends the standby too"


def test_a_standby_that_took_a_place_and_fails_is_reported_like_any_worker(tmp_path: Any) -> None:
    with _keeping(tmp_path, 2) as context:
        standby = context.start_standby()
        os.kill(context.pids()[1], signal.SIGKILL)
        context_result(context)
        assert context.replace(1) == (standby, True)
        os.kill(standby, signal.SIGKILL)
        failed = context_result(context)
        assert list(failed.failures) == [1] and failed.failures[1].pid == standby
        assert failed.failures[1].exitcode == -signal.SIGKILL


def test_without_keeping_survivors_torch_s_all_or_nothing_policy_holds(tmp_path: Any) -> None:
    context = as_keeping(_start(str(tmp_path), 2))
    assert context is not None
    context.keep_survivors = False
    try:
        os.kill(context.pids()[0], signal.SIGKILL)
        failed = context_result(context)
        assert list(failed.failures) == [0]
        assert not any(p.is_alive() for p in context._pc.processes), "torch's policy: the sibling was terminated"
    finally:
        context.close()


# -- the agent's choice (recovery.in_process): which failed workers are started again alone ------------------------


class FakeKeeping:
    """What the agent uses of a KeepingContext: the workers' environments (with the job's store, as the workers
    get it) and replace()."""

    def __init__(self, store_port: int) -> None:
        where = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store_port)}
        self.envs = {0: {"RANK": "2"} | where, 1: {"RANK": "3"} | where}
        self.replaced: list[tuple[int, dict[str, str]]] = []

    def replace(self, local_rank: int, env: dict[str, str]) -> tuple[int, bool]:
        self.replaced.append((local_rank, env))
        return 9000 + local_rank, False


def _agent_choice(keeping: FakeKeeping | None, failures: dict[int, tuple[int, int]], restarts: int = 3,
                  first_rank: int = 2) -> tuple[bool, Any, Any]:
    """``failures``: global rank -> (local rank, exit code) on a node whose workers are ranks first_rank.."""
    from types import SimpleNamespace

    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from elastic_runner.agent.agent import ElasticRunnerAgent

    agent = ElasticRunnerAgent.__new__(ElasticRunnerAgent)  # its policy alone, without torch's agent set-up
    agent._keeping, agent._remaining_restarts, agent.observers = keeping, restarts, []
    agent._job_key = None  # (a job without auth_key_file: its messages unsigned)
    agent._standbys, agent.standby = StandbySchedule(agent._notify), False
    group = SimpleNamespace(workers=[SimpleNamespace(id=100 + i, global_rank=first_rank + i) for i in range(2)])
    result = RunResult(state=WorkerState.FAILED, failures={
        rank: ProcessFailure(local_rank=local, pid=100 + local, exitcode=code, error_file="/nonexistent")
        for rank, (local, code) in failures.items()})
    return agent._replace_failed(group, result), agent, group


@pytest.fixture
def job_store() -> Any:
    """The job's store, as rank 0's worker hosts it."""
    import datetime

    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=5), wait_for_workers=False)


def test_a_killed_worker_is_started_again_alone_with_the_pid_it_replaces_in_its_environment(job_store: Any) -> None:
    from elastic_runner.recovery.channel import Channel, Coming, InGeneration

    keeping = FakeKeeping(job_store.port)
    Channel(job_store, None).send(InGeneration(3, 4))  # the failed worker was in the group's generation 4
    replaced, agent, group = _agent_choice(keeping, {3: (1, -9)})
    assert replaced and [(r, env["ELASTIC_RUNNER_REPLACES"], env["RANK"]) for r, env in keeping.replaced] == \
        [(1, "101", "3")]
    assert group.workers[1].id == 9001 and group.workers[0].id == 100, "torch's agent tracks the new pid"
    assert agent._remaining_restarts == 2, "a replacement counts as a restart"
    assert Channel(job_store, None).read(Coming, "regroup/5/coming") == Coming(5, 3), \
        "its peers are told that rank 3's replacement joins generation 5"


def test_with_the_jobs_store_gone_every_worker_restarts() -> None:
    from elastic_runner.testing.localjob import free_port

    keeping = FakeKeeping(free_port())  # nothing listens there: rank 0's worker is gone
    replaced, agent, _ = _agent_choice(keeping, {3: (1, -9)})
    assert not replaced and not keeping.replaced and agent._remaining_restarts == 3


@pytest.mark.parametrize("failures, restarts, first_rank, why", [
    ({0: (0, -9)}, 3, 0, "rank 0's worker hosts the job's store"),
    ({3: (1, 76)}, 3, 2, "it left because its peers were lost"),
    ({3: (1, 75)}, 3, 2, "its process group timed out"),
    ({3: (1, 2)}, 3, 2, "a configuration error fails again"),
    ({2: (0, -9), 3: (1, -9)}, 1, 2, "fewer restarts left than failed workers"),
])
def test_every_worker_restarts_when_a_replacement_cannot_help(failures: dict[int, tuple[int, int]], restarts: int,
                                                                first_rank: int, why: str, job_store: Any) -> None:
    keeping = FakeKeeping(job_store.port)
    replaced, agent, _ = _agent_choice(keeping, failures, restarts, first_rank)
    assert not replaced and not keeping.replaced, why
    assert agent._remaining_restarts == restarts


def test_without_a_keeping_context_every_worker_restarts() -> None:
    assert not _agent_choice(None, {3: (1, -9)})[0]


class FakeStandbys:
    """What the agent uses of a KeepingContext's standby: start it, hear that it is ready or that it ended."""

    def __init__(self) -> None:
        self.started: list[int] = []
        self.ready: tuple[int, bool, float] | None = None
        self.lost: int | None = None

    def start_standby(self) -> int:
        self.started.append(7000 + len(self.started))
        return self.started[-1]

    def standby_ready(self) -> tuple[int, bool, float] | None:
        ready, self.ready = self.ready, None
        return ready

    def standby_lost(self) -> int | None:
        lost, self.lost = self.lost, None
        return lost


def test_the_agent_starts_a_standby_after_a_delay_and_again_when_one_is_lost_but_not_forever(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from elastic_runner.agent import standby_schedule
    from elastic_runner.agent.standby_schedule import STANDBYS_LOST_LIMIT

    monkeypatch.setattr(standby_schedule, "STANDBY_DELAY_S", 0.0)
    monkeypatch.setattr(standby_schedule, "STANDBY_AGAIN_S", 0.0)
    heard: list[tuple[str, dict[str, Any]]] = []
    schedule = StandbySchedule(lambda event, **fields: heard.append((event, fields)))
    standbys = FakeStandbys()
    schedule.workers_started(wanted=True)
    schedule.tend(standbys)
    assert standbys.started == [7000] and heard[-1] == ("standby_started", {"pid": 7000})
    schedule.tend(standbys)
    assert standbys.started == [7000], "one standby at a time"
    standbys.ready = (7000, True, 0.25)
    schedule.tend(standbys)
    assert heard[-1] == ("standby_ready", {"pid": 7000, "built": True, "seconds": 0.25})
    for lost in range(STANDBYS_LOST_LIMIT + 2):
        standbys.lost = -9
        schedule.tend(standbys)
    assert len(standbys.started) == 1 + STANDBYS_LOST_LIMIT, "lost ones are started again, a few times"
    assert [e for e, _ in heard].count("standby_lost") == STANDBYS_LOST_LIMIT + 2
    schedule.took_place()  # one that lived: the count begins again
    schedule.again(wanted=True)
    schedule.tend(standbys)
    assert len(standbys.started) == 2 + STANDBYS_LOST_LIMIT

    standbys = FakeStandbys()  # recovery.standby: false
    schedule.workers_started(wanted=False)
    schedule.tend(standbys)
    schedule.again(wanted=False)
    schedule.tend(standbys)
    assert standbys.started == []


def test_a_standby_is_not_started_while_the_workers_build_nor_in_a_hand_over() -> None:
    schedule = StandbySchedule(lambda event, **fields: None)
    standbys = FakeStandbys()
    schedule.workers_started(wanted=True)  # due STANDBY_DELAY_S (2 s) from now
    schedule.tend(standbys)
    assert standbys.started == [], "not before the delay"
    schedule.schedule(True, 0.0)
    schedule.cancel()  # the workers are handed over to a new round: the new round's workers get their own
    schedule.tend(standbys)
    assert standbys.started == [] and schedule.due is None


def test_a_replacements_error_file_is_in_a_directory_no_other_user_can_enter() -> None:
    """torch unpickles a failed worker's error file: its name must not be one another local user can create first."""
    import stat

    from elastic_runner.agent.worker_context import _new_error_file

    first, second = _new_error_file(), _new_error_file()
    assert first != second and not os.path.exists(first), "a fresh name, created only by a failure"
    directory = os.path.dirname(first)
    assert directory == os.path.dirname(second) and directory != tempfile.gettempdir()
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
