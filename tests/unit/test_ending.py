"""How an attempt ends decides what it leaves for the next: a state after a non-finite step is never left."""

from __future__ import annotations

import math

from elastic_runner.training.gradients import NonFiniteGradient, NonFiniteRollback
from elastic_runner.worker.ending import ending_for
from elastic_runner.lifecycle import EXIT_DIVERGED


def test_a_diverged_attempt_keeps_nothing_and_a_stop_then_saves_no_snapshot() -> None:
    """A stop or park read the non-finite step on one rank (stop_here): with state kept, the stop would write the
    diverged state as its snapshot and the next start would resume from it."""
    for stop_requested in (False, True):
        ending = ending_for(NonFiniteGradient(12, [1], math.nan), stop_requested)
        assert (ending.exit_code, ending.keeps_state, ending.status) == (EXIT_DIVERGED, False, "failed")


def test_a_non_finite_rollback_keeps_nothing_and_is_said_once_for_the_job() -> None:
    ending = ending_for(NonFiniteRollback(12, [1], "step 12: ..."), False)
    assert (ending.status, ending.keeps_state, ending.said_by) == ("rolled_back", False, "job")


class _FakeDist:
    """What peer_failure reads of a Dist: in-process recovery on, a CPU device."""

    def __init__(self) -> None:
        import torch

        self.in_process = object()
        self.device = torch.device("cpu")


def test_a_sticky_device_error_is_this_ranks_own_failure_however_it_reads() -> None:
    """NCCL wraps a sticky CUDA error in its own: it reads like a peer's failure, but the device's context is unusable
    until the process exits, so the process is never kept."""
    import torch

    from elastic_runner.worker.ending import peer_failure, unusable_device

    nccl = RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error (run with NCCL_DEBUG=INFO for "
                        "details), NCCL version 2.28.9\nncclUnhandledCudaError: Call to CUDA function failed.\nLast "
                        "error:\nCuda failure 'an illegal memory access was encountered'")
    assert unusable_device(nccl, torch.device("cpu")) is not None
    assert not peer_failure(nccl, _FakeDist(), False), "kept, it would fail again in every attempt"
    try:
        try:
            raise RuntimeError("CUDA error: device-side assert triggered")
        except RuntimeError as inner:
            raise RuntimeError("the step failed") from inner
    except RuntimeError as wrapped:
        assert unusable_device(wrapped, torch.device("cpu")) == "CUDA error: device-side assert triggered"
    peer = RuntimeError("NCCL communicator was aborted on rank 0: Connection reset by peer")
    assert unusable_device(peer, torch.device("cpu")) is None and peer_failure(peer, _FakeDist(), False)
    oom = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert unusable_device(oom, torch.device("cpu")) is None, "out of memory is not sticky"


def test_a_process_whose_device_is_unusable_exits_failed_with_one_line() -> None:
    from elastic_runner.worker.ending import DeviceUnusable

    ending = ending_for(DeviceUnusable("rank 1: the device is unusable (...)"), False)
    assert (ending.status, ending.exit_code, ending.say) == ("failed", 1, True)
