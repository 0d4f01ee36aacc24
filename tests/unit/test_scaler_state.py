"""fp16's gradient scaler in a snapshot: captured as its live tensors (``GradScaler.state_dict`` reads two numbers into
the host, a synchronisation at every capture on a GPU), loaded back as the numbers torch's scaler takes."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from elastic_runner.training.parts import scaler_numbers, scaler_state


class CountsHostReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


def stepped_scaler() -> torch.amp.GradScaler:
    try:
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    except (RuntimeError, TypeError):
        pytest.skip("this torch has no CPU gradient scaler")
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        scaler.scale((weight * 2).sum()).backward()
        scaler.step(optimizer)
        scaler.update()
    return scaler


def test_the_captured_scaler_state_reads_nothing_into_the_host_and_loads_as_torchs_own() -> None:
    scaler = stepped_scaler()
    with CountsHostReads() as probe:
        captured = scaler_state(scaler)
    assert probe.reads == 0, "no host read in a capture"
    assert isinstance(captured["scale"], torch.Tensor) and captured["scale"] is scaler._scale, "the live tensor"
    expected = scaler.state_dict()
    assert scaler_numbers(captured) == expected
    fresh = torch.amp.GradScaler("cpu")
    fresh.load_state_dict(scaler_numbers({k: (v.clone() if isinstance(v, torch.Tensor) else v)
                                          for k, v in captured.items()}))
    assert fresh.state_dict() == expected


def test_a_scaler_before_its_first_step_and_a_disabled_one_are_saved_as_torch_saves_them() -> None:
    assert scaler_state(torch.amp.GradScaler("cpu", init_scale=8.0)) == torch.amp.GradScaler("cpu", init_scale=8.0).state_dict()
    assert scaler_state(torch.amp.GradScaler("cpu", enabled=False)) == {}
