"""What the operator commands say about a run they cannot vouch for: a torn snapshot, a run kept
without an audit trail, a reader that leaves early, a run directory that is a file."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic_runner.cli import main as cli_main
from elastic_runner.snapshot import LocalStore, SnapshotRef

from .test_snapshot import capture, require_ok, writer_for


def test_snapshot_inspect_shows_a_torn_snapshot_as_damaged_without_verify_and_exits_1(
        tmp_path: Path, capsys) -> None:  # noqa: ANN001
    store = LocalStore(tmp_path / "run" / "snapshots")
    store.ensure()
    w = writer_for(store)
    for step in (10, 20):
        require_ok(w.save(step, capture(step), sync=True))
    state = store.path(SnapshotRef(1, 20)) / "state.pt"
    state.write_bytes(state.read_bytes()[:100])  # torn: the marker still says complete
    assert cli_main(["snapshot", "inspect", str(tmp_path / "run")]) == 1
    out, err = capsys.readouterr()
    assert '"complete": false' in out and "torn or replaced" in out
    assert "step-000000020-gen-000001" in err
    assert cli_main(["snapshot", "inspect", str(tmp_path / "run")]) == 1, "inspecting changes nothing"
    capsys.readouterr()
    state.unlink()
    (store.root / "step-000000020-gen-000001").rename(store.root / "old")  # only the intact one left
    assert cli_main(["snapshot", "inspect", str(tmp_path / "run")]) == 0


def test_audit_of_a_run_without_an_audit_trail_says_so_and_exits_2(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    (tmp_path / "run" / "events").mkdir(parents=True)  # a run: it has events, and no audit trail
    assert cli_main(["audit", str(tmp_path / "run")]) == 2
    out = capsys.readouterr().out
    assert "NOT AUDITED" in out and "audit.samples" in out and "VIOLATIONS" not in out
    assert cli_main(["audit", str(tmp_path / "nowhere")]) == 2
    assert "is not a directory" in capsys.readouterr().out


def test_audit_of_a_directory_that_is_no_run_says_so_rather_than_blame_audit_samples(
        tmp_path: Path, capsys) -> None:  # noqa: ANN001
    (tmp_path / "downloads").mkdir()
    assert cli_main(["audit", str(tmp_path / "downloads")]) == 2
    out = capsys.readouterr().out
    assert "is not a run directory" in out and "audit.samples" not in out, out


def test_a_reader_that_leaves_early_gets_no_traceback() -> None:
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, getattr(fcntl, "F_SETPIPE_SZ", 1031), 4096)  # smaller than the output: it must block
    proc = subprocess.Popen([sys.executable, "-m", "elastic_runner", "config", "--docs"], stdout=write_end,
                            stderr=subprocess.PIPE)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as reader:
        reader.readline()  # `| head -1`
    assert proc.stderr is not None
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_a_run_directory_that_is_a_file_is_named_as_such(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "run"
    not_a_dir.write_text("x")
    result = subprocess.run([sys.executable, "-m", "elastic_runner.train", "--config",
                             str(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"),
                             "--set", f"run.dir={not_a_dir}"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "is not a directory" in result.stderr + result.stdout and "permissions" not in result.stderr + result.stdout


def _generation(g: int, t: float, agents: list[str | None], world: int, *, first_step: bool = True,
                end: str | None = None, failure: str | None = None) -> list[dict]:
    """The events of one generation: a start per rank (naming its agent), its first step, and how it ended."""
    out: list[dict] = []
    for rank, agent in enumerate(agents):
        src = {"source": f"gen-{g:06d}-rank-{rank:05d}", "generation": g, "rank": rank, "pid": 1000 * g + rank}
        out.append(src | {"time": t, "kind": "start", "world_size": world, "run_id": "job", "agent": agent})
        if first_step:
            out.append(src | {"time": t + 1, "kind": "first_step", "step": 1})
            out.append(src | {"time": t + 10, "kind": "progress", "step": 50, "loss": 1.0, "samples_per_s": 1.0})
        if failure:
            out.append(src | {"time": t + 10.5, "kind": "failure", "error": failure, "step": 50})
        if end:
            out.append(src | {"time": t + 11, "kind": "end", "status": end, "step": 50})
    return out


def test_report_tells_a_job_resumed_by_hand_and_a_failed_start_from_recoveries(tmp_path: Path) -> None:
    """Before: a run extended by hand a day later showed one 'recovery' of a day, 'uptime fraction 0.003'."""
    from elastic_runner.observe.report import summarize

    day = 86_400.0
    events = (
        _generation(1, 0.0, ["a-1-0", "b-1-0"], 2, failure="DistBackendError: peer")   # a worker fails ...
        + _generation(2, 12.0, ["a-1-0", "b-1-0"], 2, end="finished")                   # ... and is recovered
        + _generation(3, day, ["a-7-1", "b-7-1"], 2, first_step=False, failure="ResumeError: no snapshot")
        + _generation(4, 2 * day, ["a-9-2", "b-9-2"], 2, end="finished")               # resumed by hand, next day
    )
    summary = summarize(str(tmp_path), events)
    assert [g.generation for g in summary.gaps] == [2], "one recovery, inside the first session"
    assert summary.gaps[0].seconds == pytest.approx(3.0)  # last progress (10 s) to the next first step (13 s)
    assert [s.first_generation for s in summary.sessions] == [1, 3, 4]
    assert summary.failed_starts == 1
    assert summary.wall == pytest.approx(22 + 0 + 10)   # the days between sessions are nobody's downtime
    assert summary.uptime_fraction > 0.9
    text = summary.text()
    assert "sessions: 3" in text and "1 failed start(s)" in text and "recoveries: 1," in text


def test_report_without_agent_names_splits_sessions_after_a_finished_run(tmp_path: Path) -> None:
    from elastic_runner.observe.report import summarize

    events = (_generation(1, 0.0, [None], 1, end="finished") + _generation(2, 500.0, [None], 1, end="finished"))
    summary = summarize(str(tmp_path), events)
    assert not summary.gaps and len(summary.sessions) == 2


def _node_memory(base: Path, location: Path, step: int) -> Path:
    """A run's node-memory directory holding ``step`` (what a survivor leaves when an attempt ends)."""
    from elastic_runner.snapshot.memory import MemoryTier, memory_root

    root = memory_root(str(location), base=str(base))
    assert MemoryTier(root, 1, "u").save(step, capture(step))
    return root


def _durable(location: Path, step: int) -> None:
    store = LocalStore(location)
    store.ensure()
    require_ok(writer_for(store).save(step, capture(step), sync=True))


def _age(root: Path, seconds: float) -> None:
    old = time.time() - seconds
    for path in [root, *root.rglob("*")]:
        os.utime(path, (old, old), follow_symlinks=False)


def test_snapshot_gc_removes_what_no_run_needs_and_keeps_the_only_copy_of_newer_steps(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    base = tmp_path / "shm"
    redundant = _node_memory(base, tmp_path / "a", 20)
    _durable(tmp_path / "a", 20)                          # the disk has that step: the copy is redundant
    only_copy = _node_memory(base, tmp_path / "b", 30)
    _durable(tmp_path / "b", 20)                          # the disk lags: the copy is the only step 30
    from elastic_runner.snapshot.memory import memory_root

    empty_old = memory_root(str(tmp_path / "c"), base=str(base))
    _age(empty_old, 2 * 3600)                             # a run that never kept anything, 2 h ago
    starting = memory_root(str(tmp_path / "d"), base=str(base))  # a run starting now

    assert cli_main(["snapshot", "gc", "--shm-dir", str(base), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert all(p.exists() for p in (redundant, only_copy, empty_old, starting)), "a dry run removes nothing"
    assert f"would remove {redundant}" in out and f"would remove {empty_old}" in out and "would free" in out

    assert cli_main(["snapshot", "gc", "--shm-dir", str(base)]) == 0
    out = capsys.readouterr().out
    assert not redundant.exists() and not empty_old.exists()
    assert only_copy.exists() and starting.exists()
    assert f"kept {only_copy}" in out and "step 30 is newer than every durable snapshot" in out

    _age(only_copy, 3 * 3600)
    assert cli_main(["snapshot", "gc", "--shm-dir", str(base), "--older-than", "2h"]) == 0
    assert not only_copy.exists(), "abandoned for longer than --older-than"
    assert "abandoned: step 30" in capsys.readouterr().out


def test_snapshot_gc_never_touches_a_copy_being_written(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    base = tmp_path / "shm"
    root = _node_memory(base, tmp_path / "a", 20)
    _durable(tmp_path / "a", 20)
    (root / ".writing-g1-s21").write_text(str(os.getpid()))  # a live writer (this process)
    assert cli_main(["snapshot", "gc", "--shm-dir", str(base), "--older-than", "0"]) == 0
    assert root.exists() and "a writer is alive" in capsys.readouterr().out
    assert cli_main(["snapshot", "gc", "--shm-dir", str(base), "--older-than", "soon"]) == 1
    assert "--older-than 'soon' is not an age" in capsys.readouterr().err


def test_goodput_breaks_the_lost_time_down_by_cause(tmp_path: Path) -> None:
    from elastic_runner.observe.report import summarize

    events = (_generation(1, 0.0, ["a-1-0", "b-1-0"], 2, failure="DistBackendError: peer")
              + _generation(2, 12.0, ["a-1-0", "b-1-0"], 2, end="finished"))
    agent = {"role": "agent", "source": "agent-a-1"}
    events += [agent | {"time": 10.3, "kind": "agent_worker_failed"},        # noticed 0.3 s after the last step
               agent | {"time": 11.5, "kind": "agent_rendezvous", "seconds": 1.0, "world_size": 2}]
    for e in events:
        if e["kind"] == "start" and e["generation"] == 2:
            e["process_start"] = 12.2                                          # 0.8 s to the first step at 13.0
        if e["kind"] == "progress":
            e["samples_per_s"] = 320.0                                         # 32 samples a step: 0.1 s a step
    events += [{"time": 12.1, "kind": "resume", "generation": 2, "rank": 0, "steps_recomputed": 5},
               {"time": 1.0, "kind": "world", "generation": 1, "rank": 0, "world_size": 2, "global_batch": 32},
               {"time": 5.0, "kind": "snapshot_saved", "generation": 1, "rank": 0, "blocking_s": 0.25, "write_s": 0.1}]
    good = summarize(str(tmp_path), events).goodput
    assert good is not None
    lost = good.to_dict()["lost_s"]
    assert lost == {"detection": 0.3, "rendezvous": 1.0, "worker start and restore": 0.8, "other": 0.9,
                    "recomputed steps": 0.5, "snapshot blocking": 0.25}
    assert good.fraction == pytest.approx((22 - 3.75) / 22)
    assert "goodput 0.830" in good.text()
