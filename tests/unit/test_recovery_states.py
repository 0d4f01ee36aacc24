"""The worker's recovery state machine (:mod:`elastic_runner.recovery.states`): after an attempt, where the process
goes — back to training, rejoin, park or exit — decided in one place, and its docstring is its table."""

from __future__ import annotations

import math
import re

import pytest
import torch

from elastic_runner.config import ConfigError
from elastic_runner.recovery import states
from elastic_runner.recovery.states import TRANSITIONS, State, after_failure, unusable_device
from elastic_runner.training.gradients import NonFiniteGradient, NonFiniteRollback
from elastic_runner.training.loop import MembershipChange
from elastic_runner.worker.ending import ending_for


class FakeDist:
    """What the machine reads of a Dist: whether the process is kept (in-process recovery), and its device."""

    def __init__(self, in_process: bool = True) -> None:
        self.in_process = object() if in_process else None
        self.device = torch.device("cpu")


def _after(exc: BaseException, in_process: bool = True, stop_requested: bool = False) -> states.Broken:
    return after_failure(exc, FakeDist(in_process), stop_requested=stop_requested,  # type: ignore[arg-type]
                         ends_job=ending_for(exc, False).exit_code is not None)


PEER = RuntimeError("NCCL communicator was aborted on rank 0: Connection reset by peer")
STICKY = RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error (run with NCCL_DEBUG=INFO for "
                      "details), NCCL version 2.28.9\nncclUnhandledCudaError: Call to CUDA function failed.\nLast "
                      "error:\nCuda failure 'an illegal memory access was encountered'")


def test_the_docstring_is_the_transition_table() -> None:
    doc = states.__doc__ or ""
    rows = [line for line in doc.splitlines() if re.match(r"^(training|broken|rejoin|park)\s{2,}", line)]
    parsed = [tuple(part.strip() for part in re.split(r"\s{2,}", row)) for row in rows]
    assert parsed == [(t.source.value, t.when, t.target.value) for t in TRANSITIONS]


def test_every_state_but_exit_has_a_way_out_and_every_state_is_reached() -> None:
    sources = {t.source for t in TRANSITIONS}
    targets = {t.target for t in TRANSITIONS}
    assert sources == set(State) - {State.EXIT}
    assert targets == set(State), "each state is reached"


@pytest.mark.parametrize(("exc", "in_process", "stop", "target"), [
    (NonFiniteRollback(12, [1], "step 12: rolled back"), True, False, State.TRAINING),
    (NonFiniteRollback(12, [1], "step 12: rolled back"), False, False, State.TRAINING),
    (MembershipChange("a node joins"), True, False, State.PARK),
    (PEER, True, False, State.REJOIN),
    (PEER, False, False, State.EXIT),  # not kept: torch's agent restarts every worker
    (PEER, True, True, State.EXIT),  # the agent stops the job: the peers stopping broke the collective
    (ValueError("its own bug"), True, False, State.EXIT),
    (ConfigError("train.lr", "must be positive", "set it above 0"), True, False, State.EXIT),
    (NonFiniteGradient(12, [1], math.nan), True, False, State.EXIT),
], ids=["rollback", "rollback-not-kept", "park", "peer", "peer-not-kept", "peer-while-stopping", "own-failure",
        "config", "nan-stops"])
def test_where_a_broken_process_goes(exc: BaseException, in_process: bool, stop: bool, target: State) -> None:
    assert _after(exc, in_process, stop).target is target


def test_a_dead_loader_process_is_the_ranks_own_failure_also_when_it_is_reported_inside_a_collective() -> None:
    """torch reports a DataLoader worker's death from its SIGCHLD handler, wherever the main thread is: inside a gloo
    collective the traceback ends in torch.distributed, which read as a peer's failure (the rank was kept, seen in CI)."""
    namespace: dict[str, object] = {}
    exec(compile("def all_reduce():\n    raise RuntimeError('DataLoader worker (pid 30093) is killed by signal: Killed. ')\n",
                 "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", "exec"), namespace)
    try:
        namespace["all_reduce"]()  # type: ignore[operator]
    except RuntimeError as exc:
        assert _after(exc).target is State.EXIT
        assert _after(RuntimeError("gloo: Connection closed by peer")).target is State.REJOIN, "a peer's still is"


@pytest.mark.parametrize("exc", [
    STICKY, NonFiniteRollback(3, [0], "CUDA error: an illegal memory access was encountered"),
    MembershipChange("a node joins; CUDA error: device-side assert triggered"),
], ids=["nccl-wrapped", "during-a-rollback", "during-a-park"])
def test_a_sticky_device_error_always_exits_however_it_reads_and_whatever_else_happens(exc: BaseException) -> None:
    """NCCL wraps a sticky CUDA error in its own: it reads like a peer's failure, but the device's context is unusable
    until the process exits, so the process is never kept (its agent starts a new one)."""
    broken = _after(exc)
    assert broken.target is State.EXIT and broken.device_error is not None


def test_a_sticky_error_is_found_in_the_errors_causes_and_out_of_memory_is_not_sticky() -> None:
    try:
        try:
            raise RuntimeError("CUDA error: device-side assert triggered")
        except RuntimeError as inner:
            raise RuntimeError("the step failed") from inner
    except RuntimeError as wrapped:
        assert unusable_device(wrapped, torch.device("cpu")) == "CUDA error: device-side assert triggered"
    assert unusable_device(PEER, torch.device("cpu")) is None
    assert unusable_device(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), torch.device("cpu")) is None
