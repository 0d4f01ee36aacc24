"""The run's event log, read incrementally: only new complete lines, the same as reading them all."""

from __future__ import annotations

from pathlib import Path


def test_following_a_run_s_events_reads_only_new_complete_lines_and_matches_reading_them_all(tmp_path: Path) -> None:
    from elastic_runner.observe.events import EVENTS_DIR, EventFollower, EventLog, read_events

    follower = EventFollower(tmp_path)
    assert follower.read() == [], "no events directory yet"
    a, b = EventLog(tmp_path, "a"), EventLog(tmp_path, "b")
    a.emit("start")
    b.emit("start")
    assert [e["source"] for e in follower.read()] == ["a", "b"]
    torn = tmp_path / EVENTS_DIR / "c.jsonl"
    torn.write_text('{"time": 1, "kind": "half-writ')  # a writer killed mid-line, or still writing
    a.emit("progress", step=10)
    assert [e["kind"] for e in follower.read()] == ["start", "start", "progress"]
    with open(torn, "a") as fh:
        fh.write('ten"}\n')
    b.emit("end")
    assert follower.read() == read_events(tmp_path), "the same events, in the same order, as one full read"
    assert [e["kind"] for e in follower.read()][0] == "half-written", "the line counts once it is complete"
    a.close()
    b.close()
