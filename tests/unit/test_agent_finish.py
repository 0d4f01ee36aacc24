"""An agent's part of a job ends within seconds whatever happens in its last moments: it leaves torch's exit barrier
when a node asks for a new round instead of arriving, and a worker that failed after saying it finished the job is
the success it was."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

from elastic_runner.agent.finish import BARRIER_KEY, failed_after_finishing, wait_at_exit
from elastic_runner.env import GOODPUT_FILE_VAR, say_finished


class FakeStore:
    """The part of a c10d store the exit barrier uses."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.counts: dict[str, int] = {}
        self.lock = threading.Lock()

    def add(self, key: str, amount: int) -> int:
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + amount
            return self.counts[key]

    def set(self, key: str, value: str) -> None:
        self.values[key] = value.encode()

    def check(self, keys: list[str]) -> bool:
        return all(k in self.values for k in keys)


def test_the_last_agent_to_arrive_lets_every_agent_go() -> None:
    store = FakeStore()
    first: list[str] = []
    waiter = threading.Thread(target=lambda: first.append(wait_at_exit(store, 2, 30, lambda: 0)))
    waiter.start()
    time.sleep(0.3)
    assert not first, "one of two arrived: it waits"
    assert wait_at_exit(store, 2, 30, lambda: 0) == "all"
    waiter.join(5)
    assert first == ["all"] and store.counts[f"{BARRIER_KEY}/num_members"] == 2


def test_a_node_that_asks_for_a_new_round_instead_of_arriving_is_not_waited_for() -> None:
    began = time.monotonic()
    assert wait_at_exit(FakeStore(), 2, 300, lambda: 1) == "new round"
    assert time.monotonic() - began < 5


def test_without_either_the_barrier_ends_at_its_timeout() -> None:
    assert wait_at_exit(FakeStore(), 2, 0.5, lambda: 0) == "timeout"


def test_a_failure_counts_as_finished_only_for_processes_that_said_so(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv(GOODPUT_FILE_VAR, str(tmp_path / "goodput.json"))
    say_finished(local_rank=0)
    ours, other = SimpleNamespace(pid=os.getpid()), SimpleNamespace(pid=os.getpid() + 1)
    assert failed_after_finishing({0: ours}, str(tmp_path))
    assert not failed_after_finishing({0: ours, 1: other}, str(tmp_path)), "one of them failed in the job"
    assert not failed_after_finishing({}, str(tmp_path))
    (tmp_path / "finished-0").write_text("not a pid")
    assert not failed_after_finishing({0: ours}, str(tmp_path))
