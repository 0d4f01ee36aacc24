"""A node's health check: a device that is missing, or that computes a wrong, non-finite or no product, is named."""

from __future__ import annotations

import pytest
import torch

from elastic_runner.agent import health

CPU = torch.device("cpu")


def test_a_device_that_computes_right_passes() -> None:
    assert health.check_device(CPU) is None
    assert health.check_here("cpu", 4) is None


def test_one_wrong_entry_of_the_product_is_a_wrong_device() -> None:
    def one_bit_flipped(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        product = a @ b
        product.view(torch.int32)[17, 42] ^= 1 << 20  # a flipped mantissa bit, as a failing unit would make
        return product

    problem = health.check_device(CPU, one_bit_flipped)
    assert problem is not None and "wrong 64x64 matmul" in problem and "1 of 4096" in problem and "cpu" in problem


def test_a_product_off_by_a_fraction_is_wrong_too() -> None:
    """Small integers are exact in every format a matmul uses: a fraction is no rounding, it is a fault."""
    problem = health.check_device(CPU, lambda a, b: a @ b + 0.25 * (a[:, :1] == 2))
    assert problem is not None and "wrong" in problem


def test_non_finite_values_and_a_failing_device_are_named() -> None:
    assert "non-finite" in (health.check_device(CPU, lambda a, b: (a @ b) / (a @ b - (a @ b))) or "")

    def lost(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    problem = health.check_device(CPU, lost)
    assert problem is not None and "failed to compute" in problem and "illegal memory access" in problem


@pytest.mark.skipif(health.gpu_driver(), reason="this machine has a GPU driver")
def test_a_node_without_a_driver_fails_a_cuda_job_and_passes_an_auto_one() -> None:
    assert health.check_node("cuda", 2) == "dist.device is cuda, and this node has no GPU driver"
    assert health.check_node("auto", 2) is None and health.check_node("cpu", 2) is None


def test_the_child_process_answers_in_one_json_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert health.main(["--kind", "cpu", "--count", "2"]) == 0
    assert capsys.readouterr().out.strip() == '{"problem": null}'


@pytest.mark.gpu
def test_a_healthy_gpu_node_passes_through_the_child_process() -> None:
    if not torch.cuda.is_available() or not health.gpu_driver():
        pytest.skip("needs a CUDA device (the production path); none here")
    assert health.check_node("cuda", torch.cuda.device_count()) is None
    assert health.check_node("auto", 1) is None
    problem = health.check_node("cuda", torch.cuda.device_count() + 1)
    assert problem is not None and "CUDA devices, and it has" in problem
