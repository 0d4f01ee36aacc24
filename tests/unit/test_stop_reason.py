"""Why a worker is stopped: its agent says so in its private directory just before it sends SIGTERM, and the worker's
signal handler reads it there, so that it does not report a person's SIGTERM. It read the agents' event files in the
run directory before: a shared disk that others may write, and one file per agent of the job to open in a signal
handler (a thousand on a thousand nodes, on a network disk)."""

from __future__ import annotations

import os
import signal
import stat
import time
from pathlib import Path

import pytest

from elastic_runner.env import (GOODPUT_FILE_VAR, STOP_ANNOUNCED_WITHIN_S, STOPPING_FILE, announce_stopping,
                                stop_announced)
from elastic_runner.lifecycle import StopRequest


@pytest.fixture
def private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The agent's private directory, as its workers find it (the goodput file's directory)."""
    directory = tmp_path / "agent"
    directory.mkdir(mode=0o700)
    monkeypatch.setenv(GOODPUT_FILE_VAR, str(directory / "goodput.json"))
    return directory


def test_a_worker_the_agent_named_learns_why_and_no_other_does(private: Path) -> None:
    started = time.time()
    announce_stopping([101, 102], "a node is waiting to join")
    assert stop_announced(101, since=started) == "a node is waiting to join"
    assert stop_announced(102, since=started) == "a node is waiting to join"
    assert stop_announced(103, since=started) is None, "a process the agent did not name: someone else's SIGTERM"
    assert stop_announced(101, since=time.time() + 5) is None, "said before the process began: another with that pid"
    mode = stat.S_IMODE((private / STOPPING_FILE).stat().st_mode)
    assert mode & 0o077 == 0, f"the announcement is this user's alone (mode {mode:o})"


def test_an_old_announcement_accounts_for_no_later_sigterm(private: Path) -> None:
    """A worker the agent kept through a new round stays named in the file; a SIGTERM from someone else a minute
    later is not the agent's."""
    announce_stopping([101], "a new rendezvous round")
    said = private / STOPPING_FILE
    later = time.time() + STOP_ANNOUNCED_WITHIN_S + 1
    assert stop_announced(101, since=0.0) == "a new rendezvous round"
    assert stop_announced(101, since=0.0, now=later) is None
    assert said.exists()


def test_the_newest_announcement_is_the_one_that_counts(private: Path) -> None:
    announce_stopping([101], "a worker of the same node failed")
    announce_stopping([101, 102], "the agent is shutting down on SIGTERM")
    assert stop_announced(101, since=0.0) == "the agent is shutting down on SIGTERM"


def test_without_an_agent_of_ours_nothing_is_said_or_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(GOODPUT_FILE_VAR, raising=False)
    announce_stopping([101], "a new rendezvous round")  # torch's own agent: no private directory, no error
    assert stop_announced(101, since=0.0) is None
    monkeypatch.setenv(GOODPUT_FILE_VAR, str(tmp_path / "gone" / "goodput.json"))  # its agent removed it at exit
    announce_stopping([101], "a new rendezvous round")
    assert stop_announced(101, since=0.0) is None


@pytest.mark.parametrize("content", [b"", b"not json", b"[101]", b'{"pids": 101, "reason": "x", "time": NOW}',
                                     b'{"pids": [101], "reason": "x", "time": true}', b'{"pids": [101], "reason": "x"}',
                                     b'{"pids": [{"a": 1}], "reason": "x", "time": NOW}', b"[" * 100_000,
                                     b'{"pids": [101], "time": NOW, "reason": "' + b"x" * 10_000 + b'"}'])
def test_what_is_not_an_announcement_says_nothing_and_never_raises(private: Path, content: bytes) -> None:
    """It runs in a signal handler: nothing read there may raise (a partial or foreign file, deep nesting), and it
    reads at most 8 KB (an agent writes ~600 bytes). NOW: a fresh announcement's time, so that only what is wrong
    with each makes it say nothing."""
    (private / STOPPING_FILE).write_bytes(content.replace(b"NOW", str(time.time()).encode()))
    assert stop_announced(101, since=0.0) is None
    (private / STOPPING_FILE).write_bytes(b'{"pids": [101], "reason": "x", "time": %f}' % time.time())
    assert stop_announced(101, since=0.0) == "x", "the same, well formed, is read"


def test_a_reason_without_words_still_names_the_agent_and_a_long_one_is_cut(private: Path) -> None:
    announce_stopping([101], "")
    assert stop_announced(101, since=0.0) == "a new rendezvous round"
    announce_stopping([101], "x" * 2000)
    assert len(stop_announced(101, since=0.0) or "") <= 501


def test_a_sigterm_the_agent_announced_is_the_agents_in_the_workers_stop(private: Path) -> None:
    started = time.time()
    stop = StopRequest(lambda: stop_announced(os.getpid(), started)).install()
    stop.training = True  # in its training loop (before it, a stop ends the process at once)
    try:
        announce_stopping([os.getpid()], "a worker of the same node failed")
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not stop.requested and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stop.requested and stop.agent_reason == "a worker of the same node failed"
        assert stop.description == "by the agent (a worker of the same node failed)"
    finally:
        stop.uninstall()
    person = StopRequest(lambda: stop_announced(os.getpid(), time.time() + 5)).install()  # nothing said since
    person.training = True
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not person.requested and time.monotonic() < deadline:
            time.sleep(0.01)
        assert person.requested and person.agent_reason is None and person.description == "on SIGTERM"
    finally:
        person.uninstall()
