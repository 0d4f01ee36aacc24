"""A snapshot's copy of a GPU state leaves the step's stream (issue 49): the step queues it and goes on, the writer
waits for it before reading, the next optimizer step is ordered after it, and what is written is the state of the step
that was captured.

On the CPU the protocol runs against a fake device whose copies land only when something waits for them or orders
itself after them, or when the test lets the device get to them: a writer that forgot either wait would write values
from after the capture, and these tests would see it. The real side stream is tested where there is a GPU."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Sequence

import pytest
import torch

from elastic_runner.snapshot import LocalStore, SnapshotRef, load_snapshot, require_ok, shm
from elastic_runner.snapshot.staging import HostStaging, copy_into
from elastic_runner.snapshot.writer import SnapshotWriter


class FakeCopy:
    def __init__(self, device: FakeDevice, destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
        self.device, self.pairs = device, list(zip(destinations, sources))
        self.landed = threading.Event()
        self.ordered = False

    def land(self) -> None:
        if not self.landed.is_set():
            for destination, source in self.pairs:
                destination.copy_(source)
            self.landed.set()

    def order_before_changes(self) -> None:
        self.ordered = True
        self.land()  # whatever the step's stream does next comes after the copy

    def wait(self) -> None:
        assert self.landed.wait(10), "a reader waited for a copy that nothing let land"


class FakeDevice:
    """Tensors made by :meth:`tensor` are 'on the device'; their deferred copies are queued, not made."""

    def __init__(self) -> None:
        self.storages: set[int] = set()
        self.queued: list[FakeCopy] = []

    def tensor(self, values: torch.Tensor) -> torch.Tensor:
        self.storages.add(values.untyped_storage().data_ptr())
        return values

    def handles(self, source: torch.Tensor) -> bool:
        return source.untyped_storage().data_ptr() in self.storages

    def start(self, destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> FakeCopy:
        copy = FakeCopy(self, destinations, sources)
        self.queued.append(copy)
        return copy

    def get_to_the_copies(self) -> None:
        for copy in self.queued:
            copy.land()


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    s = LocalStore(tmp_path / "snapshots")
    s.ensure()
    return s


def test_a_deferred_copy_returns_at_once_and_the_reader_waits_for_it() -> None:
    device = FakeDevice()
    weights, step = device.tensor(torch.arange(6.0)), torch.tensor(7)
    staging = HostStaging(device)
    host = staging.copy({"w": weights, "step": step}, deferred=True)
    assert host["step"].item() == 7, "a host tensor is copied at once"
    assert not device.queued[0].landed.is_set(), "the device's tensors are queued, not copied, in the step"
    pending = staging.take_pending()
    assert pending is not None and staging.pending is None
    reader = threading.Thread(target=pending.wait)
    reader.start()
    reader.join(0.2)
    assert reader.is_alive(), "the reader waits until the device gets to the copy"
    device.get_to_the_copies()
    reader.join(10)
    assert not reader.is_alive()
    assert torch.equal(host["w"], torch.arange(6.0))


def test_the_fake_device_catches_a_change_that_is_not_ordered_after_the_copy() -> None:
    """The control: without order_before_changes, a change the step makes reaches the copy — so the tests below, which
    change the state right after the capture, fail if the writer or the loop forgets the order."""
    device = FakeDevice()
    weights = device.tensor(torch.zeros(4))
    copying = copy_into([dst := torch.empty(4)], [weights], deferred=True, copier=device)
    weights += 1
    device.get_to_the_copies()
    assert copying is not None and torch.equal(dst, torch.ones(4))


def test_a_copy_that_is_not_deferred_is_made_in_the_call_as_before() -> None:
    device = FakeDevice()
    weights = device.tensor(torch.ones(4))
    assert copy_into([dst := torch.empty(4)], [weights], copier=device) is None
    assert torch.equal(dst, weights) and not device.queued


def test_a_snapshot_written_by_the_thread_holds_the_captured_step_though_the_next_step_changes_it(
        store: LocalStore) -> None:
    device = FakeDevice()
    w = SnapshotWriter(store, generation=store.claim_generation({}), keep_last=3, writer="thread")
    w.copier = device
    w._staging = HostStaging(device)
    live = device.tensor(torch.zeros(1000))
    try:
        result = w.save(1, lambda: ({"model": {"w": live}}, {}))
        assert not device.queued[0].landed.is_set() and not result.done.is_set(), "the step did not wait for the copy"
        w.wait_staged()  # the loop's next optimizer step, in Checkpointer.mutating
        assert device.queued[0].ordered
        live += 1
        require_ok(w.wait() or result)
    finally:
        w.close()
    _, state = load_snapshot(store.path(SnapshotRef(1, 1)))
    assert torch.equal(state["model"]["w"], torch.zeros(1000))


@pytest.mark.skipif(not shm.supported(), reason="the writer process needs memfd (Linux)")
def test_a_snapshot_handed_to_the_writer_process_holds_the_captured_step(store: LocalStore) -> None:
    device = FakeDevice()
    w = SnapshotWriter(store, generation=store.claim_generation({}), keep_last=3, writer="process")
    w.copier = device
    w._process_ready()
    assert w._process is not None and w._process.ready.wait(60), "the writer process never got ready"
    live = {"w": device.tensor(torch.randn(256, 256)), "b": device.tensor(torch.randn(7).to(torch.bfloat16))}
    captured = {k: v.clone() for k, v in live.items()}
    try:
        result = w.save(1, lambda: ({"model": live, "step": 1}, {}))
        assert w._submitter is not None, "the hand-over waits for the copy in a thread, not in the step"
        w.wait_staged()
        for tensor in live.values():
            tensor.zero_()
        require_ok(w.wait() or result)
    finally:
        w.close()
    _, state = load_snapshot(store.path(SnapshotRef(1, 1)))
    assert state["model"]["b"].dtype == torch.bfloat16
    assert all(torch.equal(state["model"][k], captured[k]) for k in captured)


@pytest.mark.skipif(not shm.supported(), reason="the writer process needs memfd (Linux)")
def test_a_reservation_starts_the_writer_process_and_makes_the_arena_the_first_save_uses(store: LocalStore) -> None:
    device = FakeDevice()
    w = SnapshotWriter(store, generation=store.claim_generation({}), keep_last=3, writer="process")
    w.copier = device
    live = {"w": device.tensor(torch.randn(512, 512))}
    try:
        w.reserve({"model": live})
        assert w._process is not None, "the process starts at the reservation, not at the first save"
        w.wait()
        arena = w._arena
        assert arena is not None and arena.size >= 512 * 512 * 4
        assert w._process.ready.wait(60)
        result = w.save(1, lambda: ({"model": live}, {}))
        assert w._arena is arena, "the first save fills the reserved arena"
        w.wait_staged()
        require_ok(w.wait() or result)
    finally:
        w.close()
    _, state = load_snapshot(store.path(SnapshotRef(1, 1)))
    assert torch.equal(state["model"]["w"], live["w"])


def test_buffers_reserved_ahead_are_the_ones_the_copy_fills_and_hold_its_values() -> None:
    staging = HostStaging()
    live = {"w": torch.zeros(1000), "opt": {0: {"exp_avg": torch.zeros(1000)}}}
    staging.reserve(live)
    live["w"] += 3  # the step goes on: a reservation reads shapes, not values
    host = staging.copy(live)
    reserved = staging._buffers[("w",)]
    assert host["w"].data_ptr() == reserved.data_ptr() and torch.equal(host["w"], torch.full((1000,), 3.0))
    assert set(staging._buffers) == {("w",), ("opt", 0, "exp_avg")}


# -- on a GPU: the real side stream ----------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the production path)")


@pytest.mark.gpu
@needs_cuda
def test_on_a_gpu_the_capture_neither_waits_for_the_device_nor_sees_the_next_change() -> None:
    weights = torch.randn(64 << 20 >> 2, device="cuda")  # 64 MB
    half = torch.randn(1 << 20, device="cuda").to(torch.bfloat16)
    expected = (weights + 1).cpu(), half.cpu()
    staging = HostStaging()
    staging.reserve({"w": weights, "h": half})  # as the loop does after the first step: no allocation in the capture
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # the device is busy (~1 s) with the step's work...
    weights.add_(1)  # ...whose last kernel the capture must see
    torch.cuda.set_sync_debug_mode("error")  # any host synchronisation in the capture raises
    try:
        host = staging.copy({"w": weights, "h": half}, deferred=True)
        pending = staging.take_pending()
        assert pending is not None
        pending.order_before_changes()  # the next optimizer step
        weights.zero_()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert not torch.cuda.current_stream().query(), "the host went on while the device was still busy"
    pending.wait()
    assert host["w"].is_pinned() and host["h"].dtype == torch.bfloat16
    assert torch.equal(host["w"], expected[0]) and torch.equal(host["h"], expected[1])


@pytest.mark.gpu
@needs_cuda
def test_on_a_gpu_a_snapshot_through_the_writer_process_is_exact(store: LocalStore) -> None:
    if not shm.supported():
        pytest.skip("the writer process needs memfd (Linux)")
    w = SnapshotWriter(store, generation=store.claim_generation({}), keep_last=3, writer="process")
    w._process_ready()
    assert w._process is not None and w._process.ready.wait(60)
    state: dict[str, Any] = {"model": {"w": torch.randn(1024, 1024, device="cuda"),
                                       "h": torch.randn(4096, device="cuda").to(torch.bfloat16)}}
    captured = {k: v.cpu() for k, v in state["model"].items()}
    try:
        result = w.save(1, lambda: (state, {}))
        w.wait_staged()
        for tensor in state["model"].values():
            tensor.zero_()
        require_ok(w.wait() or result)
        assert w._arena is not None and w._arena.pinned
    finally:
        w.close()
    _, loaded = load_snapshot(store.path(SnapshotRef(1, 1)))
    assert all(torch.equal(loaded["model"][k], captured[k]) for k in captured)
