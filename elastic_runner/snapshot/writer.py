"""Save snapshots without stalling training.

The step waits only while tensors are copied into host memory (into buffers
kept from the previous snapshot: :class:`HostStaging`). Serialisation, checksum, fsync,
publish and pruning run in one background thread; at most one write is in
flight, so a new save first waits for the previous one. A failed background
write is logged as an error, counted, and leaves the published snapshots as
they were (the staging directory is removed). A stale-generation error is
fatal: the loop calls :meth:`SnapshotWriter.raise_if_fatal` every step.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from .format import write_snapshot_files
from .space import is_disk_full, space_note, state_bytes
from .store import AlreadyCommittedError, LocalStore, SnapshotError, SnapshotRef, StaleWriterError

log = logging.getLogger(__name__)


class HostStaging:
    """Host copies of a state in buffers kept from one snapshot to the next: after the first, a snapshot's
    blocking part is a copy into memory that is already allocated and touched (a fresh 16 MB buffer costs
    about as much again in page faults as the copy itself). Pinned when the source is on a GPU. Safe to
    reuse because a writer has at most one write in flight and waits for it before the next copy; the price
    is one host copy of the state kept between snapshots."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}

    def copy(self, obj: Any) -> Any:
        seen: set[tuple[Any, ...]] = set()
        out = self._copy(obj, (), seen)
        for path in set(self._buffers) - seen:  # parts the state no longer has
            del self._buffers[path]
        return out

    def _copy(self, obj: Any, path: tuple[Any, ...], seen: set[tuple[Any, ...]]) -> Any:
        if isinstance(obj, torch.Tensor):
            src = obj.detach()
            if src.layout != torch.strided or src.is_quantized:  # rare: a fresh copy, as before
                return src.to("cpu", copy=True)
            buf = self._buffers.get(path)
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype or buf.stride() != src.stride():
                buf = torch.empty_like(src, device="cpu", pin_memory=src.is_cuda and torch.cuda.is_available())
                self._buffers[path] = buf
            buf.copy_(src)
            seen.add(path)
            return buf
        if isinstance(obj, dict):
            return {k: self._copy(v, (*path, k), seen) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._copy(v, (*path, i), seen) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return tuple(self._copy(v, (*path, i), seen) for i, v in enumerate(obj))
        return obj


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


#: After the first failed write, at most one line per this many seconds while writes keep failing.
FAILURE_REPORT_EVERY_S = 60.0


class SnapshotWriter:
    def __init__(self, store: LocalStore, *, generation: int, keep_last: int, async_write: bool = True,
                 observer: SnapshotObserver | None = None, durable: bool = True) -> None:
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
        self._staging = HostStaging()
        self._fatal: BaseException | None = None
        self._failing_since: SnapshotRef | None = None
        self._last_report = 0.0

    # -- public API -------------------------------------------------------------------

    def save(self, step: int, capture: Callable[[], tuple[dict[str, Any], dict[str, Any]]], *, sync: bool = False) -> SaveResult:
        """Snapshot the state at ``step``. ``capture`` returns (state, meta) with live tensors."""
        started = time.perf_counter()
        self.wait()
        ref = SnapshotRef(generation=self.generation, step=step)
        state, meta = capture()
        host_state = self._staging.copy(state)  # the previous write is done (wait above): its buffers are free
        result = SaveResult(ref=ref, blocking_s=time.perf_counter() - started)
        result.size_estimate = state_bytes(host_state)
        meta = dict(meta) | {"step": step, "generation": self.generation, "name": ref.name}
        if self.async_write and not sync:
            self._thread = threading.Thread(
                target=self._write, args=(result, host_state, meta), name=f"snapshot-{ref.name}", daemon=True
            )
            self._thread.start()
        else:
            self._write(result, host_state, meta)
            result.blocking_s = time.perf_counter() - started
        self.last = result
        return result

    def wait(self) -> SaveResult | None:
        """Block until the in-flight write (if any) has finished."""
        thread = self._thread
        if thread is not None:
            thread.join()
            self._thread = None
        return self.last

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def raise_if_fatal(self) -> None:
        if self._fatal is not None:
            raise self._fatal

    def close(self) -> None:
        self.wait()

    # -- background -----------------------------------------------------------------------

    def _write(self, result: SaveResult, state: dict[str, Any], meta: dict[str, Any]) -> None:
        ref = result.ref
        started = time.perf_counter()
        staging = None
        try:
            self.store.check_fence(self.generation)
            staging = self.store.staging(ref)
            result.meta = write_snapshot_files(staging, state, meta)
            # Fence again right before publishing: a newer round may have started meanwhile.
            self.store.check_fence(self.generation)
            try:
                self.store.publish(staging, ref)
                staging = None
            except AlreadyCommittedError:
                log.info("snapshot %s was already published by another rank", ref.name)
            self._prune(ref)
            result.write_s = time.perf_counter() - started
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
        except Exception as exc:  # noqa: BLE001 - report every failure, keep training
            if staging is not None:  # first: the space it took is part of what the report measures
                self.store.discard(staging)
                staging = None
            exc = self._stale_instead(exc)
            result.error = exc
            result.write_s = time.perf_counter() - started
            self.failures += 1
            if isinstance(exc, StaleWriterError):
                self._fatal = exc
                log.error("snapshot %s refused: %s", ref.name, exc)
            else:
                self._report_failure(result, exc)
            if self.observer is not None:
                self.observer.snapshot_failed(ref, exc)
        except BaseException as exc:  # Ctrl-C during a synchronous save: clean up, then abort
            result.error = exc
            raise
        finally:
            if staging is not None:
                self.store.discard(staging)
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

    def _stale_instead(self, exc: Exception) -> Exception:
        """A write that failed because a newer round started meanwhile (its start sweeps older
        rounds' staging directories) is the stale-writer error, not a disk problem to retry."""
        if isinstance(exc, StaleWriterError):
            return exc
        try:
            self.store.check_fence(self.generation)
        except StaleWriterError as stale:
            return stale
        except Exception:  # noqa: BLE001 - the store itself failing: report the original error
            return exc
        return exc

    def _prune(self, newest: SnapshotRef) -> None:
        complete = self.store.complete()
        keep = set(complete[-self.keep_last:])
        for ref in complete:
            if ref not in keep and ref < newest:
                try:
                    self.store.remove(ref)
                except OSError as exc:
                    log.warning("could not delete old snapshot %s: %s", ref.name, exc)


def require_ok(result: SaveResult) -> None:
    """Raise if a (synchronous) save failed: used for the final and graceful-stop saves."""
    result.done.wait()
    if result.error is not None:
        raise SnapshotError(f"snapshot {result.ref.name} was not saved: {result.error}") from result.error
