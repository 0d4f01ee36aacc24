"""The snapshot writer process: what the worker hands it comes back on disk exactly, a large state's copy
overlaps the next step without ever seeing it, and a writer process that fails or dies never costs a
snapshot's correctness or leaves a process behind."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_runner.snapshot import LocalStore, SnapshotRef, StaleWriterError, load_snapshot, require_ok, shm
from elastic_runner.snapshot.writer import OVERLAP_BYTES, SnapshotWriter

pytestmark = pytest.mark.skipif(not shm.supported(), reason="the writer process needs memfd (Linux)")


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    s = LocalStore(tmp_path / "snapshots")
    s.ensure()
    return s


def process_writer(store: LocalStore, **kwargs: Any) -> SnapshotWriter:
    """A writer whose process has started and is ready (it starts with the first periodic save)."""
    w = SnapshotWriter(store, generation=store.claim_generation({}), keep_last=kwargs.pop("keep_last", 3),
                       writer="process", **kwargs)
    w._process_ready()
    assert w._process is not None and w._process.ready.wait(60), "the writer process never got ready"
    return w


def test_saves_go_through_the_thread_until_the_writer_process_is_ready(store: LocalStore) -> None:
    w = SnapshotWriter(store, generation=store.claim_generation({}), keep_last=3, writer="process")
    try:
        result = w.save(1, lambda: ({"model": {"w": torch.ones(3)}}, {}))
        assert w._thread is not None, "the first save must not wait for the process to import torch"
        w.wait()
        assert result.error is None and w._process is not None
        assert w._process.ready.wait(60)
        w.save(2, lambda: ({"model": {"w": torch.ones(3)}}, {}))
        assert w._thread is None and w._in_flight is not None
        w.wait()
    finally:
        w.close()
    assert [r.step for r in store.complete()] == [1, 2]


def a_user_state(step: int) -> dict[str, Any]:
    """The shapes a real state has: int keys (optimizer state), tuples, a bf16 and a 0-dim tensor, a
    transposed (non-contiguous) weight, an empty tensor, plain values."""
    weight = torch.arange(12, dtype=torch.float32).reshape(3, 4).t() + step
    return {"model": {"w": weight, "half": torch.full((5,), 0.5 + step, dtype=torch.bfloat16),
                      "count": torch.tensor(step), "empty": torch.empty(0, 3)},
            "optimizer": {"state": {0: {"momentum": torch.ones(4) * step, "step": torch.tensor(float(step))}},
                          "param_groups": [{"lr": 0.1, "params": [0]}]},
            "rng": (torch.arange(7, dtype=torch.uint8), 3), "train": {"step": step, "name": "run"}}


def assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def test_auto_writes_a_small_state_in_the_thread_and_a_large_one_through_the_process(store: LocalStore) -> None:
    from elastic_runner.snapshot.writer import PROCESS_BYTES

    w = SnapshotWriter(store, generation=store.claim_generation({}), keep_last=3, writer="auto")
    try:
        require_ok(w.save(1, lambda: ({"model": {"w": torch.ones(1000)}}, {})))
        assert w._process is None and not w.process_wanted, "a small state never starts a process"
    finally:
        w.close()
    w = SnapshotWriter(store, generation=store.claim_generation({}), keep_last=3, writer="auto")
    try:
        require_ok(w.save(2, lambda: ({"model": {"w": torch.zeros(PROCESS_BYTES // 4)}}, {})))
        assert w._process is not None and w.process_wanted
    finally:
        w.close()


def test_a_state_written_by_the_writer_process_loads_exactly_as_it_was_captured(store: LocalStore) -> None:
    w = process_writer(store)
    try:
        for step in (1, 2):
            result = w.save(step, lambda: (a_user_state(step), {"epoch": 0}))
            w.wait()
            assert result.error is None, result.error
            assert w._process is not None and w._process.pid != os.getpid() and w._process.alive()
        meta, state = load_snapshot(store.path(SnapshotRef(1, 2)))
        assert_same(state, a_user_state(2))
        assert meta["step"] == 2 and meta["epoch"] == 0 and meta["size_bytes"] > 0
    finally:
        w.close()
    assert w._process is None


def test_a_state_that_outgrows_its_arena_gets_a_larger_one_and_a_large_one_is_copied_beside_the_next_step(
        store: LocalStore) -> None:
    w = process_writer(store)
    live = torch.zeros(OVERLAP_BYTES // 4 * 2)  # 16 MB of float32: more than the first arena, copied by a thread
    try:
        require_ok(w.save(1, lambda: ({"model": {"w": torch.ones(10)}}, {})))
        first_arena = w._arena
        assert first_arena is not None and first_arena.size < live.numel() * 4
        w.save(2, lambda: ({"model": {"w": live}}, {}))
        assert w._arena is not first_arena and w._arena.size >= live.numel() * 4
        assert w._stager is not None, "a large CPU state is staged beside the step, not inside it"
        w.wait_staged()  # what Checkpointer.mutating does before the optimizer step
        live.add_(1.0)  # the next step changes the live tensor
        w.wait()
        assert w.last is not None and w.last.error is None
        require_ok(w.save(3, lambda: ({"model": {"w": torch.full((10,), 3.0)}}, {})))  # smaller again: same arena
    finally:
        w.close()
    assert torch.equal(load_snapshot(store.path(SnapshotRef(1, 2)))[1]["model"]["w"], torch.zeros_like(live))
    assert torch.equal(load_snapshot(store.path(SnapshotRef(1, 3)))[1]["model"]["w"], torch.full((10,), 3.0))


def test_a_newer_generation_refuses_the_writer_process_as_it_does_the_thread(store: LocalStore) -> None:
    old = process_writer(store)
    try:
        require_ok(old.save(1, lambda: ({"w": torch.ones(3)}, {})))
        store.claim_generation({})  # a newer round owns the run directory now
        result = old.save(2, lambda: ({"w": torch.ones(3)}, {}))
        old.wait()
        assert isinstance(result.error, StaleWriterError), result.error
        with pytest.raises(StaleWriterError, match="stale"):
            old.raise_if_fatal()
    finally:
        old.close()
    assert [r.step for r in store.complete()] == [1]


def test_a_writer_process_that_dies_costs_one_reported_snapshot_and_the_thread_takes_over(
        store: LocalStore, caplog: pytest.LogCaptureFixture) -> None:
    w = process_writer(store)
    try:
        require_ok(w.save(1, lambda: ({"w": torch.ones(3)}, {})))
        assert w._process is not None
        os.kill(w._process.pid, signal.SIGKILL)  # the OOM killer's way
        w._process.proc.wait(timeout=10)
        with caplog.at_level(logging.WARNING):
            deadline = time.monotonic() + 10
            while w.process_wanted and time.monotonic() < deadline:
                time.sleep(0.01)
        assert not w.process_wanted
        assert any("SIGKILL" in r.getMessage() and "out-of-memory" in r.getMessage() and
                   "background thread" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
        result = w.save(2, lambda: ({"model": {"w": torch.full((3,), 2.0)}}, {}))
        assert w._arena is None and w._process is None, "the arena is let go before the thread makes its own copy"
        w.wait()
        assert result.error is None and w._thread is None and w.failures == 0
    finally:
        w.close()
    assert torch.equal(load_snapshot(store.path(SnapshotRef(1, 2)))[1]["model"]["w"], torch.full((3,), 2.0))


def test_a_copy_that_fails_before_its_job_is_sent_costs_that_snapshot_only(
        store: LocalStore, monkeypatch: pytest.MonkeyPatch) -> None:
    real_stage = shm.stage
    calls = []

    def stage_failing_once(arena: shm.Arena, plan: shm.Plan) -> None:
        calls.append(plan.total)
        if len(calls) == 1:
            raise ValueError("a tensor changed under the copy")
        real_stage(arena, plan)

    monkeypatch.setattr(shm, "stage", stage_failing_once)
    w = process_writer(store)
    try:
        first = w.save(1, lambda: ({"model": {"w": torch.ones(3)}}, {}))
        w.wait()
        assert isinstance(first.error, ValueError) and w.failures == 1
        # The new arena's descriptor never reached the process with the failed job: it goes with this one.
        second = w.save(2, lambda: ({"model": {"w": torch.full((3,), 2.0)}}, {}))
        assert w._thread is None, "still through the writer process"
        w.wait()
        assert second.error is None, second.error
    finally:
        w.close()
    assert [r.step for r in store.complete()] == [2]
    assert torch.equal(load_snapshot(store.path(SnapshotRef(1, 2)))[1]["model"]["w"], torch.full((3,), 2.0))


def test_ctrl_c_while_a_job_is_handed_over_leaves_the_final_save_to_the_thread(
        store: LocalStore, monkeypatch: pytest.MonkeyPatch) -> None:
    w = process_writer(store)
    process = w._process
    assert process is not None

    def interrupted(arena: shm.Arena, plan: shm.Plan) -> None:
        raise KeyboardInterrupt  # a second Ctrl-C lands in the copy (a GPU state's takes seconds)

    monkeypatch.setattr(shm, "stage", interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            w.save(1, lambda: ({"model": {"w": torch.ones(3)}}, {}))
        # What the worker does next: the stop's synchronous save. It must neither wait for the job that
        # never went out nor send a job after half of one.
        require_ok(w.save(2, lambda: ({"model": {"w": torch.full((3,), 2.0)}}, {}), sync=True))
        assert process.proc.poll() is not None and w._process is None
    finally:
        w.close()
    assert [r.step for r in store.complete()] == [2]


class ObserverFailingOnce:
    """A metrics hook with a bug: its first call raises."""

    def __init__(self) -> None:
        self.saved: list[int] = []

    def snapshot_saved(self, ref: SnapshotRef, meta: dict[str, Any], blocking_s: float, write_s: float) -> None:
        self.saved.append(ref.step)
        if len(self.saved) == 1:
            raise KeyError("a metric label nobody declared")

    def snapshot_failed(self, ref: SnapshotRef, exc: BaseException) -> None:
        pass


def test_an_outcome_that_cannot_be_handled_stops_the_process_and_no_save_waits_forever(
        store: LocalStore, caplog: pytest.LogCaptureFixture) -> None:
    observer = ObserverFailingOnce()
    w = process_writer(store, observer=observer)
    try:
        with caplog.at_level(logging.WARNING):
            w.save(1, lambda: ({"w": torch.ones(3)}, {}))
            w.wait()
            deadline = time.monotonic() + 10
            while w.process_wanted and time.monotonic() < deadline:
                time.sleep(0.01)
        assert not w.process_wanted
        assert any("could not be handled" in r.getMessage() and "KeyError" in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]
        require_ok(w.save(2, lambda: ({"w": torch.full((3,), 2.0)}, {})))  # through the thread, no hang
        assert w._process is None
    finally:
        w.close()
    assert observer.saved == [1, 2] and [r.step for r in store.complete()] == [1, 2]


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's exit is reaped by whoever adopted it, here maybe nobody)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_the_writer_process_dies_with_its_worker(store: LocalStore, tmp_path: Path) -> None:
    """A SIGKILLed worker leaves no writer process behind (the chaos tool checks for orphans)."""
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time, torch
        from elastic_runner.snapshot import LocalStore, require_ok
        from elastic_runner.snapshot.writer import SnapshotWriter
        store = LocalStore({str(store.root)!r})
        w = SnapshotWriter(store, generation=store.claim_generation({{}}), keep_last=2, writer="process")
        w._process_ready()
        w._process.ready.wait(60)
        require_ok(w.save(1, lambda: ({{"w": torch.ones(3)}}, {{}})))
        print(w._process.pid, flush=True)
        time.sleep(600)
    """))
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    worker = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert worker.stdout is not None
        writer_pid = int(worker.stdout.readline())
        os.kill(writer_pid, 0)
        worker.kill()
        worker.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and running(writer_pid):
            time.sleep(0.05)
        if running(writer_pid):
            os.kill(writer_pid, signal.SIGKILL)
            pytest.fail(f"writer process {writer_pid} outlived its SIGKILLed worker")
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


@pytest.mark.gpu
def test_a_cuda_state_goes_through_a_pinned_arena_and_loads_exactly(store: LocalStore) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (the production path); none here")
    w = process_writer(store)
    state = {"model": {"w": torch.randn(1024, 1024, device="cuda"), "n": torch.tensor(3, device="cuda")}}
    try:
        require_ok(w.save(1, lambda: (state, {})))
        assert w._arena is not None and w._arena.pinned, "device-to-host copies should land in page-locked memory"
    finally:
        w.close()
    _, loaded = load_snapshot(store.path(SnapshotRef(1, 1)))
    assert torch.equal(loaded["model"]["w"], state["model"]["w"].cpu()) and loaded["model"]["n"].item() == 3
