"""The writer of a sharded snapshot on each rank (:mod:`.shards`): the :class:`~.writer.SnapshotWriter`'s
staging, reporting and failure handling, with the write itself replaced by this rank's share
(:func:`~.publish.write_sharded`). It writes in a thread: the writer process takes one state through one shared
memory arena per node, and a rank's shards are a state of its own.

The step waits only for the structure of the state (no copy): the copy of this rank's slices into host memory (the
same reused buffers as a replicated snapshot) runs beside the next forward and backward passes — in a thread on the
CPU, on a side CUDA stream on a GPU (:mod:`.staging`) —, and the file, its SHA-256 and its fsync beside the next steps,
on every rank at once, each rank writing 1/W of the state.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from .publish import write_sharded
from .space import state_bytes
from .store import ShardedStore, SnapshotError, SnapshotRef
from .writer import SaveResult, SnapshotObserver, SnapshotWriter


class ShardedSnapshotWriter(SnapshotWriter):
    """``rank``: this rank; ``writers``: the ranks that write parts (all of them under fsdp, the first replica's
    under hsdp). Rank 0 reports a published snapshot; the others report their part written."""

    def __init__(self, store: ShardedStore, *, generation: int, keep_last: int, rank: int, writers: list[int],
                 async_write: bool = True, observer: SnapshotObserver | None = None) -> None:
        super().__init__(store, generation=generation, keep_last=keep_last, async_write=async_write,
                         observer=observer if rank == 0 else None, writer="thread")
        self.store: ShardedStore = store
        self.rank, self.writers = rank, writers
        self.process_wanted = False
        #: Not rank 0: a line per part would repeat rank 0's line W times.
        self.durable = rank == 0

    def save(self, step: int, capture: Callable[[], tuple[dict[str, Any], dict[str, Any]]], *,
             sync: bool = False) -> SaveResult:
        """Snapshot ``step``. The step waits for ``capture`` (the state's structure, no copy); the copy of this rank's
        slices into host memory runs beside the next forward and backward passes, which only read them, and
        :meth:`wait_staged` (called before the optimizer changes them) waits for what is left of it."""
        started = time.perf_counter()
        self.wait()
        ref = SnapshotRef(generation=self.generation, step=step)
        state, meta = capture()
        meta = dict(meta) | {"step": step, "generation": self.generation, "name": ref.name}
        result = SaveResult(ref=ref, blocking_s=0.0)
        self.last = result
        if sync or not self.async_write:
            host = self._staging.copy(state)
            result.size_estimate = state_bytes(host)
            self._write(result, host, meta)
            result.blocking_s = time.perf_counter() - started
            return result
        if self._staging.on_device(state):
            # A GPU's shards: queued on a side stream into pinned buffers (.staging); the write thread waits for the
            # copy, the step's stream waits for it only before the next optimizer step (wait_staged), on the device.
            try:
                host = self._staging.copy(state, deferred=True)
            except Exception as exc:  # noqa: BLE001 - no pinned memory, a device error: this save fails, training goes on
                queued = self._staging.take_pending()
                if queued is not None:
                    queued.wait()  # (nothing may be left copying into buffers the next save reuses)
                self._failed(result, SnapshotError(f"copying the state of {ref.name} failed: {exc}"), 0.0)
                return result
            result.size_estimate = state_bytes(host)
            self._device_copy = self._staging.take_pending()
            result.blocking_s = time.perf_counter() - started
            self._thread = threading.Thread(target=self._write_when_copied, args=(self._device_copy, result, host, meta),
                                            name=f"snapshot-{ref.name}", daemon=True)
            self._thread.start()
            return result
        result.blocking_s = time.perf_counter() - started

        def stage() -> None:
            try:
                host = self._staging.copy(state)
            except BaseException as exc:  # noqa: BLE001 - reported as this save's failure
                self._failed(result, SnapshotError(f"copying the state of {ref.name} failed: {exc}"), 0.0)
                return
            result.size_estimate = state_bytes(host)
            self._thread = threading.Thread(target=self._write, args=(result, host, meta), name=f"snapshot-{ref.name}",
                                            daemon=True)
            self._thread.start()

        self._in_flight = result  # wait_staged adds the time the step waits for the copy to its blocking time
        self._stager = threading.Thread(target=stage, name=f"stage-{ref.name}", daemon=True)
        self._stager.start()
        return result

    def _write(self, result: SaveResult, state: dict[str, Any], meta: dict[str, Any]) -> None:
        started = time.perf_counter()
        try:
            written = write_sharded(self.store, self.generation, self.keep_last, result.ref, state, meta,
                                    rank=self.rank, writers=self.writers)
        except Exception as exc:  # noqa: BLE001 - report every failure, keep training
            self._failed(result, exc, time.perf_counter() - started)
        except BaseException as exc:
            result.error = exc
            result.done.set()
            raise
        else:
            self._succeeded(result, written, written.seconds_since(started))
