"""Text that others wrote, in our lines: one line, encodable, every printable character kept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elastic_runner.observe.events import EVENTS_DIR, agent_stop_reason
from elastic_runner.printable import printable


def test_what_is_not_printable_is_written_as_its_escape_and_the_rest_is_kept() -> None:
    assert printable("node-a") == "node-a"
    assert printable("straße 東京") == "straße 東京", "any script's printable characters stay"
    planted = printable("x\nWARNING forged line\x1b[2J\udfff")
    assert planted == "x\\nWARNING forged line\\x1b[2J\\udfff"
    assert "\n" not in planted and planted.encode("utf-8")
    assert printable("a" * 300, 10) == "a" * 10 + "…"
    assert printable(None) == "None" and printable(12) == "12"


def test_an_agents_planted_stop_reason_reaches_the_worker_as_one_line(tmp_path: Path) -> None:
    """A worker reads why its agent stops it from the agent's event file (the run directory, which others may
    write): the reason it says in its log is one line that encodes, whatever was planted there."""
    events = tmp_path / EVENTS_DIR
    events.mkdir()
    planted = {"time": 10.0, "kind": "agent_stopping_workers", "pids": [4242],
               "reason": "preempted\nERROR forged \udfff"}
    (events / "agent-host-4242.jsonl").write_text(json.dumps(planted) + "\n")
    reason = agent_stop_reason(tmp_path, 4242, since=0.0)
    assert reason == "preempted\\nERROR forged \\udfff", reason
    assert reason.encode("utf-8")
