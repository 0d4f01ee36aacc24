"""Host copies of a state, in buffers reused from one snapshot to the next; on a GPU, made on a side stream that the
step never waits for (issue 49).

A snapshot or a node-memory refresh must copy the state out of the live tensors before the next optimizer step
changes them. On the CPU that copy is a ``memcpy`` (the writers overlap it with the next forward and backward in a
thread). On a GPU a plain device-to-host copy drains the stream: the host waits for every kernel queued before it,
then for the copy, and the GPU idles until the host queues the next step. So a *deferred* copy of device tensors:

1. records an event on the step's stream (the state after the step) and makes a side stream wait for it;
2. queues every copy on the side stream, ``non_blocking`` into pinned host buffers, and records a second event;
3. returns at once: the host never waits, the step's stream never waits either — except that, before the next
   optimizer step changes the tensors, :meth:`Pending.order_before_changes` makes the step's stream wait for the copy
   (on the device: the forward and backward passes in between run beside it, so in practice it is long done);
4. whoever reads the host buffers (the writer's thread, the node-memory thread) waits for the second event first
   (:meth:`Pending.wait`), in its own thread.

The source tensors are held until the copy is known to be done, so the caching allocator cannot hand their memory to
the step's stream while the side stream still reads it. bf16 stays bf16 (the buffers have the source's dtype). The
buffers are pinned, allocated once per attempt and reused: :meth:`HostStaging.reserve` allocates them in a background
thread after the attempt's first step (a page-locked gigabyte takes a few hundred milliseconds to allocate, which must
not fall in a step); a state whose shapes change gets new buffers at its next copy. The CPU path is unchanged: tensors
on the CPU are copied at once, as before.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol, Sequence

import torch


class Pending(Protocol):
    """A copy under way off the step's stream."""

    def order_before_changes(self) -> None:
        """Make the step's stream wait (on the device, not the host) for the copy: call before changing the sources."""

    def wait(self) -> None:
        """Block this thread until the copy has landed in the host buffers (a reader's thread, not the step's)."""


class Copier(Protocol):
    """Which sources a deferred copy takes off the step's stream, and how."""

    def handles(self, source: torch.Tensor) -> bool: ...

    def start(self, destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> Pending: ...


class _CudaPending:
    def __init__(self, done: list[tuple[torch.device, torch.cuda.Event]], sources: Sequence[torch.Tensor]) -> None:
        self._done = done
        self._sources: Sequence[torch.Tensor] | None = sources  # held until the copy is done (see the module doc)
        self._ordered = False
        self._lock = threading.Lock()

    def order_before_changes(self) -> None:
        if not self._ordered:  # once is enough: all later work on the stream comes after the wait
            for device, event in self._done:
                torch.cuda.current_stream(device).wait_event(event)
            self._ordered = True

    def wait(self) -> None:
        for _, event in self._done:
            event.synchronize()
        with self._lock:
            self._sources = None


class CudaSideStream:
    """One side stream per device, made when first needed (a process that never snapshots a GPU state makes none)."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def handles(self, source: torch.Tensor) -> bool:
        return source.is_cuda

    def start(self, destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> Pending:
        by_device: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for destination, source in zip(destinations, sources):
            pair = by_device.setdefault(source.device, ([], []))
            pair[0].append(destination)
            pair[1].append(source)
        done = []
        for device, (dsts, srcs) in by_device.items():
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
            after_step = torch.cuda.Event()
            after_step.record(torch.cuda.current_stream(device))
            stream.wait_event(after_step)
            with torch.cuda.stream(stream):
                _copy_all(dsts, srcs, non_blocking=True)
            copied = torch.cuda.Event(blocking=True)  # its reader's thread sleeps while it waits, not spins a core
            copied.record(stream)
            done.append((device, copied))
        return _CudaPending(done, list(sources))


#: The process's side streams.
SIDE_STREAM = CudaSideStream()


def _copy_all(destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor], non_blocking: bool = False) -> None:
    # One call for every tensor: it gives up the GIL once. A copy per tensor must win the GIL back after each one,
    # and beside a training step (whose Python holds it for up to the 5 ms switch interval at a time) a few hundred
    # tensors took 30-40 ms that way.
    try:
        torch._foreach_copy_(list(destinations), list(sources), non_blocking=non_blocking)
    except (AttributeError, RuntimeError, TypeError):  # a torch without it, or tensors it does not take
        for destination, source in zip(destinations, sources):
            destination.copy_(source, non_blocking=non_blocking)


def copy_into(destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor], *, deferred: bool = False,
              copier: Copier = SIDE_STREAM) -> Pending | None:
    """Copy ``sources`` into ``destinations``: host sources at once; device sources at once too, or (``deferred``)
    off the step's stream, returning what is under way (None: everything is copied)."""
    on_host = [(d, s) for d, s in zip(destinations, sources) if not copier.handles(s)]
    on_device = [(d, s) for d, s in zip(destinations, sources) if copier.handles(s)]
    if on_host:
        _copy_all([d for d, _ in on_host], [s for _, s in on_host])
    if not on_device:
        return None
    if deferred:
        return copier.start([d for d, _ in on_device], [s for _, s in on_device])
    _copy_all([d for d, _ in on_device], [s for _, s in on_device])
    return None


class HostStaging:
    """Host copies of a state in buffers kept from one snapshot to the next: after the first, a snapshot's
    blocking part is a copy into memory that is already allocated and touched (a fresh 16 MB buffer costs
    about as much again in page faults as the copy itself). Pinned when the source is on a GPU. Safe to
    reuse because a writer has at most one write in flight and waits for it before the next copy; the price
    is one host copy of the state kept between snapshots. ``copier``: how a deferred copy leaves the step's stream
    (the module docstring; tests pass a fake)."""

    def __init__(self, copier: Copier = SIDE_STREAM) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self._copier = copier
        self._reserving: threading.Thread | None = None
        #: The deferred copy under way since the last :meth:`copy` (None: none, or it copied everything at once).
        self.pending: Pending | None = None

    def on_device(self, obj: Any) -> bool:
        """Whether a deferred copy of ``obj`` would leave some of it to the side stream."""
        if isinstance(obj, torch.Tensor):
            return self._copier.handles(obj)
        if isinstance(obj, dict):
            return any(self.on_device(v) for v in obj.values())
        if isinstance(obj, (list, tuple)):
            return any(self.on_device(v) for v in obj)
        return False

    def reserve(self, obj: Any) -> None:
        """Allocate the buffers a copy of ``obj`` needs, in a background thread (the next :meth:`copy` waits for it);
        only the tensors' shapes are read, so the step may go on changing their values meanwhile."""
        self._join_reservation()
        thread = threading.Thread(target=self._walk, args=(obj, (), set(), None), name="snapshot-buffers", daemon=True)
        self._reserving = thread
        thread.start()

    def copy(self, obj: Any, *, deferred: bool = False) -> Any:
        """A host copy of ``obj`` in this staging's buffers. ``deferred``: device tensors are copied off the step's
        stream (:attr:`pending` says when they have landed); host tensors are copied at once either way."""
        self._join_reservation()
        seen: set[tuple[Any, ...]] = set()
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        out = self._walk(obj, (), seen, pairs)
        for path in set(self._buffers) - seen:  # parts the state no longer has
            del self._buffers[path]
        self.pending = copy_into([d for d, _ in pairs], [s for _, s in pairs], deferred=deferred,
                                 copier=self._copier) if pairs else None
        return out

    def take_pending(self) -> Pending | None:
        pending, self.pending = self.pending, None
        return pending

    def _join_reservation(self) -> None:
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None

    def _walk(self, obj: Any, path: tuple[Any, ...], seen: set[tuple[Any, ...]],
              pairs: list[tuple[torch.Tensor, torch.Tensor]] | None) -> Any:
        """The state with each tensor replaced by its buffer (made if missing); ``pairs`` (None: only allocate)
        collects (buffer, source) for the copy."""
        if isinstance(obj, torch.Tensor):
            src = obj.detach()
            if src.layout != torch.strided or src.is_quantized:  # rare: a fresh copy, as before
                return src.to("cpu", copy=True) if pairs is not None else None
            buf = self._buffers.get(path)
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype or buf.stride() != src.stride():
                buf = torch.empty_like(src, device="cpu", pin_memory=src.is_cuda and torch.cuda.is_available())
                self._buffers[path] = buf
            if pairs is not None:
                pairs.append((buf, src))
            seen.add(path)
            return buf
        if isinstance(obj, dict):
            return {k: self._walk(v, (*path, k), seen, pairs) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._walk(v, (*path, i), seen, pairs) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return tuple(self._walk(v, (*path, i), seen, pairs) for i, v in enumerate(obj))
        return obj


__all__ = ["SIDE_STREAM", "Copier", "CudaSideStream", "HostStaging", "Pending", "copy_into"]
