"""Paths that need torchvision or a GPU: they run where those exist and skip with the reason elsewhere.

The full suite runs on torch 2.14.1 + torchvision 0.29.1 (scripts/test.sh), where the torchvision
tests run; the GPU tests run on a machine with a CUDA device (torch 2.11 + torchvision 0.26 there).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from elastic_runner.config import DataConfig, ModelConfig
from elastic_runner.data.datasets import build_datasets
from elastic_runner.workload.models import build_model

from ..support import end_events, run_bounded, write_config

pytestmark = pytest.mark.multiprocess


def torchvision_or_skip() -> None:
    try:
        import torchvision  # noqa: F401
    except Exception as exc:  # ImportError, or the CUDA wheel's RuntimeError on a CPU torch
        pytest.skip(f"torchvision does not import here ({type(exc).__name__}: {str(exc)[:120]}); "
                    "install the torchvision release that matches torch (pip install -e '.[vision]')")


def cuda_or_skip() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (NCCL is the production path; this machine has none)")


def image_tree(root: Path, classes: int = 3, per_class: int = 8) -> Path:
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    for split in ("train", "test"):
        for c in range(classes):
            d = root / split / f"class{c}"
            d.mkdir(parents=True)
            for i in range(per_class):
                pixels = (torch.rand(12, 12, 3, generator=g) * 255).to(torch.uint8).numpy()
                Image.fromarray(pixels).save(d / f"{i}.png")
    return root


def test_image_folder_and_a_torchvision_model_build_and_run(tmp_path: Path) -> None:
    torchvision_or_skip()
    bundle = build_datasets(DataConfig(name="image_folder", path=str(image_tree(tmp_path / "imgs")),
                                       params={"image_size": 32}))
    assert bundle.num_classes == 3 and bundle.num_train == 24 and bundle.input_shape == (3, 32, 32)
    model = build_model(ModelConfig(name="torchvision.models:resnet18"), bundle.input_shape, bundle.num_classes)
    # Two images: BatchNorm in training mode refuses a batch of one.
    x = torch.stack([bundle.train[0][0], bundle.train[1][0]])
    assert model(x).shape == (2, 3)


def test_image_folder_job_trains_and_resumes(tmp_path: Path) -> None:
    torchvision_or_skip()
    config = write_config(tmp_path / "vision.yaml", data={"name": "image_folder", "path": str(image_tree(tmp_path / "imgs")),
                                                           "params": {"image_size": 16}},
                          model={"name": "cnn", "params": {}}, batch={"global_size": 8},
                          train={"epochs": 2, "max_steps": None, "eval_every_steps": 0}, snapshot={"every_steps": 2})
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "elastic_runner.train", "--config", str(config), "--set", f"run.dir={run_dir}"]
    first = run_bounded(cmd + ["--set", "train.epochs=1"], timeout=240)
    assert first.returncode == 0, first.stdout[-3000:]
    second = run_bounded(cmd, timeout=240)
    assert second.returncode == 0, second.stdout[-3000:]
    (end,) = [e for e in end_events(run_dir) if e["generation"] == 2]  # finished ones only
    assert end["step"] == 6  # 24 images / 8 per step x 2 epochs


@pytest.mark.gpu
def test_gpu_job_trains_on_nccl_and_resumes_on_the_local_device(tmp_path: Path) -> None:
    cuda_or_skip()
    config = write_config(tmp_path / "gpu.yaml", dist={"backend": "auto", "device": "auto"},
                          train={"max_steps": 40, "epochs": None, "eval_every_steps": 0}, snapshot={"every_steps": 10})
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m",
           "elastic_runner.train", "--config", str(config), "--set", f"run.dir={run_dir}"]
    first = run_bounded(cmd + ["--set", "train.max_steps=20"], timeout=300)
    assert first.returncode == 0, first.stdout[-3000:]
    second = run_bounded(cmd, timeout=300)
    assert second.returncode == 0, second.stdout[-3000:]
    assert end_events(run_dir)[-1]["step"] == 40  # the final generation finished there
