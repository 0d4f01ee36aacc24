"""Faults the chaos tool injects from inside a worker: a flipped bit of its replica (``corrupt-param``), a batch
whose loss is not finite (``nan-batch``) and a slow device (``slow-node``).

None can be caused faithfully from outside the process, so a worker started by ``elastic-runner chaos`` (its
environment has ``ELASTIC_RUNNER_CHAOS_HOOKS=1``) takes

- SIGUSR2 as the request to flip, at its next step boundary, one mantissa bit of one element of its largest
  parameter — what a device's silent corruption does: nothing fails, the loss stays finite, and only the replicas'
  fingerprints can tell (:mod:`.fingerprint`);
- SIGUSR1 as the request to make its loss of the next step NaN, as a corrupt record in a corpus would
  (``train.on_nonfinite`` decides what follows);
- :data:`SLOW_ON` / :data:`SLOW_OFF` (two real-time signals; the chaos tool sends each fault's off to the workers it
  slowed only, so a later slow-node on the same node is not ended by an earlier one's) as the start and end of a slow
  device: each step's compute (its batches, forward and
  backward, up to the gradient sync's wait) is stretched to :data:`SLOW_FACTOR` times its length, as a throttled GPU
  or a CPU quota stretches the work and not the wait. A throttle from outside (stopping the process after it had run
  CPU time) could not do that on a loaded machine: its stops landed late, in the collectives, and 4 of 75 nodes
  throttled in the 2026-12-07 soak ran only 1.1-1.6x their peers.

Each records an event (``chaos_corrupted``, ``chaos_nan``, ``chaos_slowed``: its rank and step) for the verdict. In
every other job nothing is installed and the signals keep their default action. A worker that armed the hooks
ignores their signals once its interpreter exits (the interpreter puts a handled signal back to its default action
on the way out, and a real-time signal's default ends the process): a fault's end that reaches a worker finishing
its run does not turn its exit status into a death by signal. The chaos tool sends a hook's signal only to a process
that catches it (its ``/proc`` status), never to one still starting.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import time
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

ENV = "ELASTIC_RUNNER_CHAOS_HOOKS"
#: A mantissa bit of each width (neither the sign nor the exponent): the value changes a little and stays finite.
_MANTISSA_BIT = {2: 3, 4: 12, 8: 40}
_AS_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}
_RTMIN = getattr(signal, "SIGRTMIN", None)  # (Linux's; none on macOS, where there is no slow-node either)
#: The signals that start and end a slow device: two real-time signals a little above the first (which some
#: libraries take for their own); None where the system has none.
SLOW_ON: int | None = int(_RTMIN) + 2 if _RTMIN is not None else None
SLOW_OFF: int | None = int(_RTMIN) + 3 if _RTMIN is not None else None
#: How much longer a slow device's compute takes: a quarter of its speed.
SLOW_FACTOR = 4.0
#: The most of one step's compute a slow device stretches (:func:`stretch`).
STRETCHED_AT_MOST_S = 1.0
#: How often a stretch looks whether the slow device has ended.
STRETCH_SLICE_S = 0.01


class CorruptionRequest:
    """Set by SIGUSR2 (the signal handler only sets a flag); read by the loop between steps. ``nan_requested``: set
    by SIGUSR1, taken by the next step (:meth:`take_nan`). ``slowed_by``: :data:`SLOW_FACTOR` from :data:`SLOW_ON`
    to :data:`SLOW_OFF`, 1 otherwise; the loop hands it to each step."""

    def __init__(self) -> None:
        self.requested = False
        self.nan_requested = False
        self.slowed_by = 1.0

    def _handle(self, signum: int, frame: Any) -> None:  # noqa: ARG002 - signal handler signature
        if signum == signal.SIGUSR1:
            self.nan_requested = True
        elif signum == SLOW_ON:
            self.slowed_by = SLOW_FACTOR
        elif signum == SLOW_OFF:
            self.slowed_by = 1.0
        else:
            self.requested = True

    def take_nan(self) -> bool:
        """Whether this step's loss is to be NaN (once per request)."""
        wanted, self.nan_requested = self.nan_requested, False
        return wanted

    def corrupt(self, model: nn.Module) -> dict[str, Any]:
        """Flip the bit now (in place, on the parameter's device: no host wait); what was flipped, for the event."""
        self.requested = False
        name, param = max(model.named_parameters(), key=lambda item: item[1].numel())
        local = param.to_local() if hasattr(param, "to_local") else param
        flat = local.detach().view(-1)
        index, bit = flat.numel() // 2, _MANTISSA_BIT[flat.element_size()]
        with torch.no_grad():
            flat.view(_AS_INT[flat.element_size()])[index] ^= 1 << bit
        return {"parameter": name, "index": index, "bit": bit}


#: This process's request, when the chaos tool armed it (:func:`install`); None in every other job.
REQUEST: CorruptionRequest | None = None


def install() -> CorruptionRequest | None:
    """Arm the hook where the environment asks for it (once per process, from the main thread)."""
    global REQUEST
    if os.environ.get(ENV) != "1" or REQUEST is not None:
        return REQUEST
    if threading.current_thread() is not threading.main_thread():
        log.warning("%s is set, but the hook can only be armed from the main thread: not armed", ENV)
        return None
    REQUEST = CorruptionRequest()
    for signum in _hook_signals():
        signal.signal(signum, REQUEST._handle)
    atexit.register(_ignore_hook_signals)
    return REQUEST


def stretch(began: float, factor: float) -> None:
    """Make the work since ``began`` (a host time) ``factor`` times as long, by waiting; cut short when the slow
    device's end arrives meanwhile. At most :data:`STRETCHED_AT_MOST_S` of it is stretched: a longer step held a
    one-off (an attempt's first batch, a compile), which a slow device would not make minutes."""
    until = time.perf_counter() + (factor - 1.0) * min(time.perf_counter() - began, STRETCHED_AT_MOST_S)
    while (left := until - time.perf_counter()) > 0 and REQUEST is not None and REQUEST.slowed_by > 1.0:
        time.sleep(min(left, STRETCH_SLICE_S))


def _hook_signals() -> list[int]:
    return [s for s in (signal.SIGUSR1, signal.SIGUSR2, SLOW_ON, SLOW_OFF) if s is not None]


def _ignore_hook_signals() -> None:
    """At the interpreter's exit: a hook's signal arriving now is ignored, not left to its default action."""
    for signum in _hook_signals():
        signal.signal(signum, signal.SIG_IGN)
