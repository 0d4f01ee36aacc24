"""Step boundaries: the lock a step's commit holds, the model's buffers as of the last boundary, and the
keeper that writes the last *completed* step into node memory from whichever thread ends the attempt.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

if TYPE_CHECKING:
    from ..observe.events import EventLog
    from ..snapshot.memory import MemoryTier

log = logging.getLogger(__name__)

Capture = Callable[[], "tuple[dict[str, Any], dict[str, Any]]"]


class StateGuard:
    """The lock the loop holds while it changes the saved state, and a ``dirty`` mark that stays set
    when an exception escapes that window (a half-applied step is never kept)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.dirty = False

    @contextlib.contextmanager
    def mutating(self) -> Iterator[None]:
        with self.lock:
            self.dirty = True
            yield
            self.dirty = False  # not reached when the block raised: the state stays "dirty"


class Keeper:
    """Writes the last *completed* step into the node's memory tier, from whichever thread."""

    def __init__(self, memory: MemoryTier | None, capture: Capture, guard: StateGuard, state: Any,
                 events: EventLog) -> None:
        self.memory = memory
        self.capture = capture
        self.guard = guard
        self.state = state
        self.events = events
        #: The step this attempt resumed at: that state is already stored where it came from.
        self.resumed_step: int | None = None
        #: A rollback: no state after this step is kept, from any thread (no check vouched for it).
        self.keep_at_most: int | None = None
        #: The first step of this attempt whose gradient was not finite, or None (a read of the device: this path
        #: copies the state off it anyway): no state from it on is kept, whoever asks, before any check read it.
        self.diverged_at: Callable[[], int | None] | None = None
        self._kept_step: int | None = None

    def keep(self, reason: str, lock_timeout: float = 10.0) -> bool:
        """Keep the newest completed step in node memory; True if the node holds it."""
        if self.memory is None or self.state.step == 0 or self.state.step == self.resumed_step:
            return False
        if self.keep_at_most is not None and self.state.step > self.keep_at_most:
            log.info("not keeping step %d in memory (%s): no fingerprint check vouched for it", self.state.step, reason)
            return False
        if self._kept_step == self.state.step:
            return True
        started = time.perf_counter()
        if not self.guard.lock.acquire(timeout=lock_timeout):
            log.warning("could not keep the state in memory: the training step did not finish within %.0fs", lock_timeout)
            return False
        try:
            if self.guard.dirty:
                log.error("not keeping step %d in memory: an error interrupted the optimizer step, so the "
                          "state is half-applied; the next attempt resumes from the previous snapshot", self.state.step)
                return False
            step = self.state.step
            bad = self.diverged_at() if self.diverged_at is not None else None
            if bad is not None and step >= bad:
                log.info("not keeping step %d in memory (%s): the gradient of step %d was not finite", step, reason,
                         bad)
                return False
            ok = self.memory.save(step, self.capture)
        finally:
            self.guard.lock.release()
        if ok:
            self._kept_step = step
            self.events.emit("kept_in_memory", step=step, reason=reason, seconds=time.perf_counter() - started)
            log.info("kept step %d in node memory (%s) in %.3fs", step, reason, time.perf_counter() - started)
        return ok


class StepBoundary:
    """The model's persistent buffers as they were at the last step boundary.

    A forward updates some buffers in place (BatchNorm's running statistics and its batch counter,
    a user's running averages), and not always through an operation that bumps the tensor's
    version (BatchNorm's kernel writes its statistics directly). When an attempt ends in the middle
    of a step, those buffers already hold part of a step that will never complete. So at every
    boundary (the end of each optimizer step, a restore) the buffers that a snapshot holds are
    copied aside, and a snapshot always takes them from that copy: one ``_foreach_copy_`` per step
    of the persistent buffers' bytes (a few KB for a ResNet; nothing for a model without buffers).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        persistent = set(model.state_dict(keep_vars=True))
        self.names = [name for name, _ in model.named_buffers() if name in persistent]
        self.copies: list[torch.Tensor] = []
        self.mark()

    def live(self) -> list[torch.Tensor]:
        if not self.names:
            return []
        named = dict(self.model.named_buffers())  # looked up each time: a module may replace a buffer
        return [named[name] for name in self.names]

    def mark(self) -> None:
        buffers = self.live()
        if [t.shape for t in buffers] != [t.shape for t in self.copies] or \
                [(t.dtype, t.device) for t in buffers] != [(t.dtype, t.device) for t in self.copies]:
            self.copies = [t.detach().clone() for t in buffers]
        elif buffers:
            torch._foreach_copy_(self.copies, [t.detach() for t in buffers])

    def overlay(self, model_state: dict[str, Any]) -> dict[str, Any]:
        """``model_state`` with every persistent buffer as of the last boundary."""
        for name, copy in zip(self.names, self.copies):
            model_state[name] = copy
        return model_state
