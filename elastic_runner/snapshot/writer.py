"""Save snapshots without stalling training.

The step waits only while tensors are copied out of the live state. With the
writer process (``snapshot.writer: process``, and ``auto``, the default, for a
state of 8 MB or more) they are copied into a shared-memory arena and a
writer process serialises, checksums, fsyncs, publishes and prunes
(:mod:`.writer_process`), so none of that competes with training for the
interpreter; a CPU state of 8 MB or more is copied by a thread beside the next
forward and backward, and the next optimizer step waits for that copy
(:meth:`SnapshotWriter.wait_staged`). Otherwise (``thread``, a platform without
memfd, or once the process is gone) the copy goes into host buffers kept from
the previous snapshot (:class:`HostStaging`) and one background thread writes.
At most one write is in flight, so a new save first waits for the previous one.
A failed background write is logged as an error, counted, and leaves the
published snapshots as they were (the staging directory is removed). A
stale-generation error is fatal: the loop calls
:meth:`SnapshotWriter.raise_if_fatal` every step. Synchronous saves (final,
stop, node memory) are written by the caller.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from ..files import sharing
from . import shm
from .publish import Written, write_and_publish
from .staging import SIDE_STREAM, Copier, HostStaging, Pending
from .space import is_disk_full, space_note, state_bytes
from .object_store import ObjectStore
from .store import CorruptSnapshotError, LocalStore, SnapshotError, SnapshotRef, SnapshotStore, StaleWriterError
from .writer_process import Outcome, WriterGone, WriterProcess

log = logging.getLogger(__name__)


class SnapshotObserver(Protocol):
    def snapshot_saved(self, ref: SnapshotRef, meta: dict[str, Any], blocking_s: float, write_s: float) -> None: ...
    def snapshot_failed(self, ref: SnapshotRef, error: BaseException) -> None: ...


@dataclass
class SaveResult:
    ref: SnapshotRef
    blocking_s: float
    write_s: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)
    error: BaseException | None = None
    size_estimate: int = 0  #: tensor bytes of the state (the file is about this size)
    done: threading.Event = field(default_factory=threading.Event)


def _rebuilt(error: dict[str, Any]) -> SnapshotError:
    """The writer process's error as the worker's exception (its errno kept: a full disk is told apart)."""
    kinds = {k.__name__: k for k in (StaleWriterError, CorruptSnapshotError, SnapshotError)}
    kind = kinds.get(error["type"], SnapshotError)
    message = error["message"] if error["type"] in kinds else f"{error['type']}: {error['message']}"
    exc = kind(message)
    if error.get("errno"):
        exc.__cause__ = OSError(error["errno"], os.strerror(error["errno"]))
    return exc


#: After the first failed write, at most one line per this many seconds while writes keep failing.
FAILURE_REPORT_EVERY_S = 60.0
#: ``writer: auto`` writes a state at least this large through the writer process.
PROCESS_BYTES = 8 << 20
#: A CPU state at least this large is copied into the arena beside the next forward/backward (the copy of
#: 100 MB takes ~12 ms here); a smaller one is copied at once, which costs less than starting a thread.
OVERLAP_BYTES = 8 << 20


class SnapshotWriter:
    """See the module docstring. ``writer``: "process" writes through a writer process
    (:mod:`.writer_process`) where the platform has memfd and the store is a local directory, "auto" does
    so for a state of at least :data:`PROCESS_BYTES`; otherwise, or once that process is
    gone, in a thread."""

    def __init__(self, store: SnapshotStore, *, generation: int, keep_last: int, async_write: bool = True,
                 observer: SnapshotObserver | None = None, durable: bool = True, writer: str = "thread") -> None:
        self.store = store
        self.generation = generation
        self.keep_last = keep_last
        self.async_write = async_write
        self.observer = observer
        #: False for the node-memory copy: its lines never say "saved" as if the state were on disk.
        self.durable = durable
        self.failures = 0
        self.last: SaveResult | None = None
        self.last_saved: SnapshotRef | None = None
        self._thread: threading.Thread | None = None
        #: How a GPU state's copy leaves the step's stream (:mod:`.staging`; tests put a fake here).
        self.copier: Copier = SIDE_STREAM
        self._staging = HostStaging(self.copier)
        self._fatal: BaseException | None = None
        self._failing_since: SnapshotRef | None = None
        self._last_report = 0.0
        self.mode = writer
        self.process_wanted = writer in ("process", "auto") and async_write and shm.supported() and \
            type(store) in (LocalStore, ObjectStore)  # the process opens the same store by its spec: no subclass
        self._process: WriterProcess | None = None
        self._arena: shm.Arena | None = None
        self._stager: threading.Thread | None = None
        #: A GPU state's copy under way on the side stream (the step's stream waits for it before the next change).
        self._device_copy: Pending | None = None
        #: Hands a GPU state's arena to the writer process once its side-stream copy has landed.
        self._submitter: threading.Thread | None = None
        #: The last side-stream copy into the arena: waited for before the arena is closed, whatever happened since.
        self._arena_copy: Pending | None = None
        #: Makes the arena off the step (:meth:`reserve`).
        self._reserving: threading.Thread | None = None
        self._in_flight: SaveResult | None = None
        self._write_began = 0.0
        self._outcome_lock = threading.Lock()

    # -- public API -------------------------------------------------------------------

    def save(self, step: int, capture: Callable[[], tuple[dict[str, Any], dict[str, Any]]], *, sync: bool = False) -> SaveResult:
        """Snapshot the state at ``step``. ``capture`` returns (state, meta) with live tensors."""
        started = time.perf_counter()
        self.wait()
        if not self.process_wanted:
            self._drop_process()
        ref = SnapshotRef(generation=self.generation, step=step)
        state, meta = capture()
        meta = dict(meta) | {"step": step, "generation": self.generation, "name": ref.name}
        if self.async_write and not sync and self._process_ready(state):
            through = self._save_through_process(ref, state, meta, started)
            if through is not None:
                self.last = through
                return through
        deferred = self.async_write and not sync
        # The previous write is done (wait above): its buffers are free. Deferred: a GPU state is copied on a side
        # stream (.staging); the write thread, not the step, waits for it.
        host_state = self._staging.copy(state, deferred=deferred)
        copying = self._staging.take_pending()
        result = SaveResult(ref=ref, blocking_s=time.perf_counter() - started)
        result.size_estimate = state_bytes(host_state)
        if deferred:
            self._device_copy = copying
            self._thread = threading.Thread(
                target=self._write_when_copied, args=(copying, result, host_state, meta), name=f"snapshot-{ref.name}",
                daemon=True)
            self._thread.start()
        else:
            self._write(result, host_state, meta)
            result.blocking_s = time.perf_counter() - started
        self.last = result
        return result

    def reserve(self, state: dict[str, Any]) -> None:
        """Allocate the host buffers a snapshot of ``state`` will be copied into, off the step (a GPU state's pinned
        buffers: see :mod:`.staging`); the first save waits for them if they are not ready by then."""
        self.wait()
        if self._process_ready(state) or self._process is not None:
            # The writer process starts now rather than at the first save (this is after the attempt's first step,
            # off a recovery's critical path), and its arena is made and page-locked in the background: the first
            # save through it would otherwise do both in the step (most of a second for a gigabyte).
            layout = shm.plan(state)
            devices = [src.device.index or 0 for src in layout.sources if self.copier.handles(src)]
            self._reserving = threading.Thread(target=self._make_arena, args=(layout.total, devices[0] if devices else None),
                                               name="snapshot-arena", daemon=True)
            self._reserving.start()
            return
        self._staging.reserve(state)

    def _make_arena(self, size: int, device: int | None) -> None:
        try:
            arena = shm.Arena(size)
        except OSError as exc:  # the first save says so and falls back to the thread
            log.debug("no snapshot arena reserved (%s)", exc)
            return
        if device is not None:
            arena.pin(device)
        self._arena = arena

    def wait_staged(self) -> None:
        """Block until the state of the save in flight is copied out of the live tensors: call it before
        changing them (the loop does, in ``Checkpointer.mutating``). A copy on a GPU's side stream is waited for by
        the step's stream, on the device: the host goes on."""
        copying, self._device_copy = self._device_copy, None
        if copying is not None:
            copying.order_before_changes()
        stager = self._stager
        if stager is not None:
            waited = time.perf_counter()
            stager.join()
            self._stager = None
            # The step waited for this snapshot: its blocking time (reported with its outcome, which comes
            # after the write, well after the copy).
            if self._in_flight is not None and not self._in_flight.done.is_set():
                self._in_flight.blocking_s += time.perf_counter() - waited

    def wait(self) -> SaveResult | None:
        """Block until the in-flight write (if any) has finished."""
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None
        self.wait_staged()
        for thread in (self._thread, self._submitter):
            if thread is not None:
                thread.join()
        self._thread = self._submitter = None
        if self._in_flight is not None:
            self._in_flight.done.wait()
            self._in_flight = None
        return self.last

    def busy(self) -> bool:
        return (self._thread is not None and self._thread.is_alive()) or \
            (self._in_flight is not None and not self._in_flight.done.is_set())

    def raise_if_fatal(self) -> None:
        if self._fatal is not None:
            raise self._fatal

    def close(self) -> None:
        self.wait()
        self._drop_process()

    def _drop_process(self) -> None:
        """Stop the writer process and free its arena (no write uses them: the caller has waited). Once the
        process is gone for good, before the thread takes over: the thread makes a host copy of its own."""
        if self._process is not None:
            self._process.close()
            self._process = None
        if self._arena is not None:
            if self._arena_copy is not None:  # (a save cut short after its copy was queued: nothing waited for it)
                self._arena_copy.wait()
            self._arena.close()
            self._arena = None
        self._arena_copy = None

    # -- through the writer process ---------------------------------------------------------------------

    def _process_ready(self, state: Any = None) -> bool:
        if not self.process_wanted:
            return False
        if self._process is None:
            if self.mode == "auto" and state is not None and state_bytes(state) < PROCESS_BYTES:
                # Measured: for a small state the thread costs less (its copy is cheaper than a pickled
                # skeleton and a socket round trip, and the GIL it holds is brief). A state does not grow
                # tenfold within an attempt: decided once.
                self.process_wanted = False
                return False
            try:
                self._process = WriterProcess(self.store.spec(), self.generation, self.keep_last, sharing(),
                                              self._on_outcome, self._on_gone)
            except (WriterGone, OSError) as exc:
                self.process_wanted = False
                log.warning("%s; snapshots are written in a background thread", exc)
                return False
        # Until it has imported torch, saves go through the thread: the process starts with the first
        # periodic snapshot, not beside the worker's own start-up (a recovery's critical path).
        return self._process.ready.is_set() and self._process.alive()

    def _save_through_process(self, ref: SnapshotRef, state: dict[str, Any], meta: dict[str, Any],
                              started: float) -> SaveResult | None:
        layout = shm.plan(state)
        fd = None
        if self._arena is None or self._arena.size < layout.total:
            if self._arena is not None:
                self._arena.close()  # nothing reads it: the previous write is done
                self._arena = None
            try:
                self._arena = shm.Arena(layout.total)
            except OSError as exc:  # no memory for a second copy of the state: the thread copies into its own
                self.process_wanted = False
                log.warning("no shared memory for a %.1f MB snapshot arena (%s); snapshots are written in a "
                            "background thread", layout.total / 1e6, exc.strerror or exc)
                return None
        fd = self._arena.fd  # until the writer process has it: sent with the first job that gets through
        self._staging = HostStaging(self.copier)  # the thread's host copy (saves before the process was ready) goes
        result = SaveResult(ref=ref, blocking_s=0.0, size_estimate=layout.total)
        self._in_flight = result
        job = {"step": ref.step, "skeleton": layout.skeleton, "meta": meta, "arena_size": self._arena.size}
        on_device = any(self.copier.handles(src) for src in layout.sources)
        try:
            if on_device:
                self._arena.pin()
            self._write_began = time.perf_counter()
            if on_device:
                # Queued on a side stream into the pinned arena: the step neither waits for the copy nor for the
                # hand-over, which a thread does once the copy has landed (.staging).
                copying = self._arena_copy = shm.stage(self._arena, layout, deferred=True, copier=self.copier)
                result.blocking_s = time.perf_counter() - started
                self._device_copy = copying
                self._submitter = threading.Thread(target=self._submit_when_copied, args=(copying, result, job, fd),
                                                   name=f"snapshot-submit-{ref.name}", daemon=True)
                self._submitter.start()
            elif layout.total >= OVERLAP_BYTES:
                # The loop changes these tensors only in its next optimizer step (under the step lock, which
                # waits for this thread first, adding its wait to blocking_s): the copy overlaps the next
                # forward and backward.
                result.blocking_s = time.perf_counter() - started
                self._stager = threading.Thread(target=self._stage_and_submit, args=(result, layout, job, fd),
                                                name=f"snapshot-stage-{ref.name}", daemon=True)
                self._stager.start()
            else:
                self._stage_and_submit(result, layout, job, fd, started)
        except BaseException as exc:  # Ctrl-C while the main thread copies or sends: no write is in flight
            self._abort(result, exc)
            raise
        return result

    def _stage_and_submit(self, result: SaveResult, layout: shm.Plan, job: dict[str, Any], fd: int | None,
                          started: float | None = None) -> None:
        arena, process = self._arena, self._process
        try:
            assert arena is not None and process is not None
            shm.stage(arena, layout)
            if started is not None:  # before the outcome can come back and be reported with it
                result.blocking_s = time.perf_counter() - started
            process.submit(job, fd)
            if fd is not None:
                arena.release_fd()  # the writer process has its own now
        except Exception as exc:  # noqa: BLE001 - reported like any failed write; training goes on
            self._failed(result, exc, 0.0)

    def _submit_when_copied(self, copying: Pending | None, result: SaveResult, job: dict[str, Any],
                            fd: int | None) -> None:
        try:
            if copying is not None:
                copying.wait()
            assert self._process is not None and self._arena is not None
            self._process.submit(job, fd)
            if fd is not None:
                self._arena.release_fd()
        except Exception as exc:  # noqa: BLE001 - reported like any failed write; training goes on
            self._failed(result, exc, 0.0)

    def _write_when_copied(self, copying: Pending | None, result: SaveResult, state: dict[str, Any],
                           meta: dict[str, Any]) -> None:
        if copying is not None:
            try:
                copying.wait()
            except Exception as exc:  # noqa: BLE001 - a device error: this save fails, the step reports the rest
                self._failed(result, SnapshotError(f"copying the state of {result.ref.name} failed: {exc}"), 0.0)
                return
        self._write(result, state, meta)

    def _abort(self, result: SaveResult, exc: BaseException) -> None:
        """A save cut short in the caller's thread (Ctrl-C): half a job may be in the socket, so the writer
        process is stopped and later saves, the final one included, go through the thread."""
        self.process_wanted = False
        if self._process is not None:
            self._process.kill()
        with self._outcome_lock:
            if not result.done.is_set():
                result.error = exc
                result.done.set()

    def _on_outcome(self, outcome: Outcome) -> None:
        result = self._in_flight
        if result is None or result.done.is_set():
            return
        kind, body = outcome
        write_s = time.perf_counter() - self._write_began
        if kind == "ok":
            self._succeeded(result, Written(body["meta"], body["already_committed"], body["prune_errors"]), write_s)
        else:
            self._failed(result, _rebuilt(body), write_s)

    def _on_gone(self, reason: str) -> None:
        self.process_wanted = False
        log.warning("%s; snapshots are written in a background thread from now on", reason)
        result = self._in_flight
        if result is not None and not result.done.is_set():
            self._failed(result, WriterGone(f"{reason} while writing {result.ref.name}"), 0.0)

    # -- in this process ------------------------------------------------------------------------------

    def _write(self, result: SaveResult, state: dict[str, Any], meta: dict[str, Any]) -> None:
        started = time.perf_counter()
        try:
            written = write_and_publish(self.store, self.generation, self.keep_last, result.ref, state, meta)
        except Exception as exc:  # noqa: BLE001 - report every failure, keep training
            self._failed(result, exc, time.perf_counter() - started)
        except BaseException as exc:  # Ctrl-C during a synchronous save: abort
            result.error = exc
            result.done.set()
            raise
        else:
            self._succeeded(result, written, written.seconds_since(started))

    # -- outcomes (from the writer thread, the process's reader thread, or the caller) -------------------

    def _succeeded(self, result: SaveResult, written: Written, write_s: float) -> None:
        with self._outcome_lock:  # one outcome per save, whichever thread reports first
            if not result.done.is_set():
                self._report_success(result, written, write_s)

    def _report_success(self, result: SaveResult, written: Written, write_s: float) -> None:
        ref = result.ref
        try:
            result.meta, result.write_s = written.meta, write_s
            if written.already_committed:
                log.info("snapshot %s was already published by another rank", ref.name)
            for line in written.prune_errors:
                log.warning("%s", line)
            self.last_saved = ref
            if self._failing_since is not None:
                log.warning("snapshot %s saved: durable snapshots work again after %d failure(s) since %s", ref.name,
                            self.failures, self._failing_since.name)
                self._failing_since = None
            log.log(logging.INFO if self.durable else logging.DEBUG,
                    "snapshot %s saved (%.1f MB, blocked %.3fs, written in %.3fs)" if self.durable else
                    "snapshot %s copied into node memory (%.1f MB, blocked %.3fs, written in %.3fs)", ref.name,
                    result.meta.get("size_bytes", 0) / 1e6, result.blocking_s, result.write_s)
            if self.observer is not None:
                self.observer.snapshot_saved(ref, result.meta, result.blocking_s, result.write_s)
        finally:
            result.done.set()

    def _failed(self, result: SaveResult, exc: Exception, write_s: float) -> None:
        with self._outcome_lock:  # one outcome per save: a dead process and a failed send may both report it
            if not result.done.is_set():
                self._report_failed(result, exc, write_s)

    def _report_failed(self, result: SaveResult, exc: Exception, write_s: float) -> None:
        try:
            result.error, result.write_s = exc, write_s
            self.failures += 1
            if isinstance(exc, StaleWriterError):
                self._fatal = exc
                log.error("snapshot %s refused: %s", result.ref.name, exc)
            else:
                self._report_failure(result, exc)
            if self.observer is not None:
                self.observer.snapshot_failed(result.ref, exc)
        finally:
            result.done.set()

    def _report_failure(self, result: SaveResult, exc: Exception) -> None:
        """The first failed write in full; while writes keep failing, one line a minute (a full disk fails
        every save: a line per save would bury everything else)."""
        now = time.monotonic()
        first = self._failing_since is None
        if first:
            self._failing_since = result.ref
        elif now - self._last_report < FAILURE_REPORT_EVERY_S:
            log.debug("snapshot %s failed: %s", result.ref.name, exc)
            return
        self._last_report = now
        newest = self.last_saved.name if self.last_saved is not None else "none written by this attempt"
        space = space_note(self.store.root, result.size_estimate) if is_disk_full(exc) else ""
        log.error("SNAPSHOT WRITE FAILED for %s: %s%s; training goes on, the previous snapshots are intact (newest "
                  "durable: %s), the next save retries (%d failure(s) since %s)", result.ref.name, exc,
                  f" ({space})" if space else "", newest, self.failures, self._failing_since.name)


def require_ok(result: SaveResult) -> None:
    """Raise if a (synchronous) save failed: used for the final and graceful-stop saves."""
    result.done.wait()
    if result.error is not None:
        raise SnapshotError(f"snapshot {result.ref.name} was not saved: {result.error}") from result.error
