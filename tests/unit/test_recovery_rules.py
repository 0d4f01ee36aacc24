"""The rules that keep recovery from losing or corrupting state (from a code review's findings)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_runner.config import BatchConfig, Config, ScheduleConfig, TrainConfig, load_config
from elastic_runner.data.sampler import ElasticSampler
from elastic_runner.observe.events import NullEventLog
from elastic_runner.snapshot import (
    LocalStore,
    SnapshotError,
    SnapshotRef,
    SnapshotUnavailableError,
    SnapshotWriter,
    find_newest,
    require_ok,
)
from elastic_runner.snapshot.memory import MemoryTier
from elastic_runner.training.adapt import planned_total_steps, refresh_schedule, rescale_lr
from elastic_runner.training.boundary import Keeper, StateGuard
from elastic_runner.training.state import TrainState
from elastic_runner.worker.watchdog import PeerWatchdog
from elastic_runner.workload.optim import build_schedule


def capture(step: int):  # noqa: ANN201
    return lambda: ({"model": {"w": torch.full((4,), float(step))}}, {"fingerprint": {"model": "m"}, "run_uid": "run-a"})


def test_a_transient_read_error_moves_nothing_aside(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "s")
    store.ensure()
    w = SnapshotWriter(store, generation=store.claim_generation({}), keep_last=3)
    require_ok(w.save(10, capture(10), sync=True))
    state = store.path(SnapshotRef(1, 10)) / "state.pt"
    state.unlink()
    state.mkdir()  # reading it now fails with an OSError, as on a flaky NFS mount
    with pytest.raises(SnapshotUnavailableError):
        find_newest(store)
    assert store.complete() == [SnapshotRef(1, 10)] and store.corrupt() == []


def test_when_every_snapshot_is_damaged_the_run_stops_instead_of_starting_over(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "s")
    store.ensure()
    w = SnapshotWriter(store, generation=store.claim_generation({}), keep_last=3)
    for step in (10, 20):
        require_ok(w.save(step, capture(step), sync=True))
        (store.path(SnapshotRef(1, step)) / "state.pt").write_bytes(b"garbage")
    with pytest.raises(SnapshotError, match="all 2 snapshot"):
        find_newest(store)


def test_a_half_applied_step_is_never_kept(tmp_path: Path) -> None:
    guard, state = StateGuard(), TrainState(step=5)
    tier = MemoryTier(tmp_path / "mem", generation=1, run_uid="run-a")
    keeper = Keeper(tier, capture(5), guard, state, NullEventLog())
    with pytest.raises(RuntimeError):
        with guard.mutating():
            raise RuntimeError("out of memory inside optimizer.step")
    assert not keeper.keep("failure") and tier.newest(0) is None
    with guard.mutating():
        pass  # a complete step clears the mark
    assert keeper.keep("failure") and tier.newest(0).step == 5


def test_the_resumed_state_is_not_kept_again_under_a_new_generation(tmp_path: Path) -> None:
    state = TrainState(step=7)
    keeper = Keeper(MemoryTier(tmp_path / "mem", 2, "run-a"), capture(7), StateGuard(), state, NullEventLog())
    keeper.resumed_step = 7
    assert not keeper.keep("failure")


def test_one_writer_per_node_others_wait_for_it(tmp_path: Path) -> None:
    writes = []

    def slow_capture() -> tuple[dict[str, Any], dict[str, Any]]:
        writes.append(threading.get_ident())
        time.sleep(0.3)
        return capture(3)()

    tier = MemoryTier(tmp_path / "mem", 1, "run-a")
    results = []
    threads = [threading.Thread(target=lambda: results.append(tier.save(3, slow_capture))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * 4 and len(writes) == 1


def test_a_dead_writers_lock_does_not_block_the_others(tmp_path: Path) -> None:
    tier = MemoryTier(tmp_path / "mem", 1, "run-a")
    tier.store.ensure()
    (tier.root / ".writing-g1-s3").write_text("999999999")  # a pid that does not exist
    assert tier.save(3, capture(3), wait_for_other=5)


def test_copies_of_another_run_on_the_same_path_are_swept(tmp_path: Path) -> None:
    old = MemoryTier(tmp_path / "mem", 5, "run-old")
    assert old.save(8, lambda: ({"model": {}}, {"run_uid": "run-old"}))
    new = MemoryTier(tmp_path / "mem", 1, "run-new")
    new.sweep()
    assert new.newest(0) is None


def test_a_neighbour_gets_the_startup_grace_before_its_first_heartbeat() -> None:
    from torch.distributed import HashStore

    fired: list[str] = []
    dog = PeerWatchdog(HashStore(), rank=0, world_size=2, generation=1, timeout=0.3, interval=0.05,
                       startup_grace=1.5, on_lost=fired.append).start()
    time.sleep(0.8)
    assert not fired, "a slow-starting neighbour is not dead yet"
    deadline = time.monotonic() + 5  # due at 1.5 s; slack for a loaded machine's scheduler
    while not fired and time.monotonic() < deadline:
        time.sleep(0.05)
    dog.stop()
    assert fired and "never started heartbeating within 1.5s" in fired[0]


def test_run_length_follows_the_current_global_batch() -> None:
    cfg = Config(train=TrainConfig(epochs=10), batch=BatchConfig(global_size=None, per_rank_size=8))
    s2 = ElasticSampler(1000, 16)  # world size 2: 16 per step
    assert planned_total_steps(cfg, s2, 0) == 10 * 62
    s2.epoch, s2.consumed = 3, 496
    s4 = ElasticSampler(1000, 32)  # scaled up to world size 4 at step 217 (3 epochs + 31 steps)
    s4.load_state_dict(s2.state_dict())
    assert planned_total_steps(cfg, s4, 217) == 217 + (1000 - 496) // 32 + 6 * 31
    cfg.train.max_steps = 300
    assert planned_total_steps(cfg, s4, 217) == 300


def test_a_restored_schedule_follows_the_new_run_length_and_lr_scale() -> None:
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=0.2)
    sched = build_schedule(ScheduleConfig(name="cosine"), opt, total_steps=100)
    for _ in range(50):
        opt.step()
        sched.step()
    saved = sched.state_dict(), opt.state_dict()
    opt2 = torch.optim.SGD([param], lr=0.2)
    sched2 = build_schedule(ScheduleConfig(name="cosine"), opt2, total_steps=100)
    opt2.load_state_dict(saved[1])
    sched2.load_state_dict(saved[0])
    assert sched2.lr_lambdas[0].total_steps == 100  # what LambdaLR restores
    refresh_schedule(sched2, ScheduleConfig(name="cosine"), 200)
    assert sched2.lr_lambdas[0].total_steps == 200
    rescale_lr(opt2, sched2, old=2.0, new=4.0)
    assert sched2.base_lrs == [pytest.approx(0.4)]


def test_memory_settings_do_not_change_the_fingerprint(quickstart: Path) -> None:
    base = load_config(quickstart).fingerprint()
    assert load_config(quickstart, ["batch.micro_size=4", "batch.uneven=refuse"]).fingerprint() == base


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
