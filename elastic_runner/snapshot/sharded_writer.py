"""The writer of a sharded snapshot on each rank (:mod:`.shards`): the :class:`~.writer.SnapshotWriter`'s
staging, reporting and failure handling, with the write itself replaced by this rank's share
(:func:`~.publish.write_sharded`). It writes in a thread: the writer process takes one state through one shared
memory arena per node, and a rank's shards are a state of its own.

The step waits only for the copy of this rank's slices into host memory (the same reused buffers as a
replicated snapshot); the file, its SHA-256 and its fsync run beside the next steps, on every rank at once,
each rank writing 1/W of the state.
"""

from __future__ import annotations

import time
from typing import Any

from .publish import write_sharded
from .store import LocalStore
from .writer import SaveResult, SnapshotObserver, SnapshotWriter


class ShardedSnapshotWriter(SnapshotWriter):
    """``rank``: this rank; ``writers``: the ranks that write parts (all of them under fsdp, the first replica's
    under hsdp). Rank 0 reports a published snapshot; the others report their part written."""

    def __init__(self, store: LocalStore, *, generation: int, keep_last: int, rank: int, writers: list[int],
                 async_write: bool = True, observer: SnapshotObserver | None = None) -> None:
        super().__init__(store, generation=generation, keep_last=keep_last, async_write=async_write,
                         observer=observer if rank == 0 else None, writer="thread")
        self.rank, self.writers = rank, writers
        self.process_wanted = False
        #: Not rank 0: a line per part would repeat rank 0's line W times.
        self.durable = rank == 0

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
            self._succeeded(result, written, time.perf_counter() - started)
