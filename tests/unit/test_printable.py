"""Text that others wrote, in our lines: one line, encodable, every printable character kept."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_runner.env import GOODPUT_FILE_VAR, announce_stopping, stop_announced
from elastic_runner.printable import printable


def test_what_is_not_printable_is_written_as_its_escape_and_the_rest_is_kept() -> None:
    assert printable("node-a") == "node-a"
    assert printable("straße 東京") == "straße 東京", "any script's printable characters stay"
    planted = printable("x\nWARNING forged line\x1b[2J\udfff")
    assert planted == "x\\nWARNING forged line\\x1b[2J\\udfff"
    assert "\n" not in planted and planted.encode("utf-8")
    assert printable("a" * 300, 10) == "a" * 10 + "…"
    assert printable(None) == "None" and printable(12) == "12"


def test_an_agents_stop_reason_reaches_the_worker_as_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker reads why its agent stops it from the agent's private directory: the reason it says in its log is one
    line that encodes, whatever the agent was given to say (a reason names other nodes)."""
    monkeypatch.setenv(GOODPUT_FILE_VAR, str(tmp_path / "goodput.json"))
    announce_stopping([4242], "preempted\nERROR forged \udfff")
    reason = stop_announced(4242, since=0.0)
    assert reason == "preempted\\nERROR forged \\udfff", reason
    assert reason.encode("utf-8")
