"""The run's event log, read incrementally: only new complete lines, the same as reading them all."""

from __future__ import annotations

from pathlib import Path


def test_following_a_run_s_events_reads_only_new_complete_lines_and_matches_reading_them_all(tmp_path: Path) -> None:
    from elastic_runner.observe.events import EVENTS_DIR, EventFollower, EventLog, read_events

    follower = EventFollower(tmp_path)
    assert follower.read() == [], "no events directory yet"
    a, b = EventLog(tmp_path, "a"), EventLog(tmp_path, "b")
    a.emit("start", world_size=2)
    b.emit("start", world_size=2)
    assert [e["source"] for e in follower.read()] == ["a", "b"]
    torn = tmp_path / EVENTS_DIR / "c.jsonl"
    torn.write_text('{"time": 1, "kind": "half-writ')  # a writer killed mid-line, or still writing
    a.emit("progress", step=10, loss=0.5, samples_per_s=100.0)
    assert [e["kind"] for e in follower.read()] == ["start", "start", "progress"]
    with open(torn, "a") as fh:
        fh.write('ten"}\n')
    b.emit("end")
    assert follower.read() == read_events(tmp_path), "the same events, in the same order, as one full read"
    assert [e["kind"] for e in follower.read()][0] == "half-written", "the line counts once it is complete"
    a.close()
    b.close()


def test_a_line_that_is_no_event_of_ours_is_skipped_with_one_warning_per_file(tmp_path: Path, caplog) -> None:  # noqa: ANN001
    """A writer of the run directory planted lines every reader would have crashed on (a string time, a deeply
    nested line, a start without its world size, a number no run writes)."""
    import logging

    from elastic_runner.observe.events import EVENTS_DIR, EventLog, furthest_step_reached, read_events

    log = EventLog(tmp_path, "gen-000001-rank-00000", generation=1, rank=0)
    log.emit("start", world_size=1)
    log.emit("progress", step=3, loss=0.5, samples_per_s=10.0)
    log.close()
    with open(tmp_path / EVENTS_DIR / "gen-000001-rank-00000.jsonl", "a") as fh:
        for line in ('{"time": "soon", "kind": "progress"}', "[" * 100_000 + "]" * 100_000,
                     '{"time": 1, "kind": "start"}', '{"time": 1e400, "kind": "end"}', '[1, 2]',
                     '{"time": 2, "kind": "progress", "step": 9, "loss": 1, "samples_per_s": 1, "generation": null}'):
            fh.write(line + "\n")
    with caplog.at_level(logging.WARNING, logger="elastic_runner.observe.events"):
        kinds = [e["kind"] for e in read_events(tmp_path)]
    assert kinds == ["start", "progress"]
    assert len([r for r in caplog.records if "is skipped" in r.message]) == 1
    assert furthest_step_reached(tmp_path, before_generation=2) == 3


def test_a_look_back_reads_only_the_sources_asked_for_and_the_files_written_to_in_the_window(tmp_path: Path) -> None:
    """(Rank 0 counts the rollbacks of the last hour at every rollback: in a soak's run directory, reading every
    attempt's file took longer than the next fault took to come.)"""
    import os
    import time

    from elastic_runner.observe.events import EventLog, recent_events

    for source in ("gen-000001-rank-00000", "gen-000002-rank-00000", "gen-000002-rank-00001"):
        log = EventLog(tmp_path, source, rank=int(source[-1]))
        log.emit("replica_mismatch", step=10, verified_step=5, suspects=[], status="rolled_back")
        log.close()
    old = tmp_path / "events" / "gen-000001-rank-00000.jsonl"
    os.utime(old, (time.time() - 7200, time.time() - 7200))  # an attempt of two hours ago
    since = time.time() - 3600
    seen = recent_events(tmp_path, since, sources="gen-*-rank-00000")
    assert [e["source"] for e in seen] == ["gen-000002-rank-00000"]
    assert len(recent_events(tmp_path, since)) == 2 and recent_events(tmp_path, time.time() + 1) == []
