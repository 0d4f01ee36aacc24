"""A BatchNorm image model (torchvision's resnet18) with augmentation and DataLoader workers, under faults:
its whole state — every BatchNorm buffer included — resumes bitwise."""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from elastic_runner.observe.audit import check_audit

from ..support import (
    QUICKSTART,
    assert_bitwise_equal,
    continue_workers,
    events,
    exported_model,
    run_uninterrupted,
    stop_workers_at_step,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def resnet_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torchvision", reason="torchvision is not installed in this environment; scripts/test.sh "
                                              "runs these on torch 2.14.1 + torchvision 0.29.1")
    import torch
    from PIL import Image

    root = tmp_path_factory.mktemp("images")
    g = torch.Generator().manual_seed(0)
    for split, per_class in (("train", 30), ("test", 6)):
        for c in range(3):
            (root / split / f"class{c}").mkdir(parents=True)
            for i in range(per_class):
                pixels = (torch.rand(24, 24, 3, generator=g) * 255).to(torch.uint8).numpy()
                Image.fromarray(pixels).save(root / split / f"class{c}" / f"{i}.png")
    data = yaml.safe_load(QUICKSTART.read_text())
    data["data"] = {"name": "image_folder", "path": str(root), "params": {"image_size": 24}, "num_workers": 2,
                    "augment": [{"RandomCrop": {"size": 24, "padding": 3}}, "RandomHorizontalFlip",
                                {"Normalize": {"mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25]}}]}
    data["model"] = {"name": "torchvision.models:resnet18"}
    data["optim"] = {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4}
    data["batch"] = {"global_size": 16}
    data["train"] = {"epochs": 5, "eval_every_steps": 0}  # 90 images: 5 steps an epoch, 25 steps
    data["snapshot"] = {"every_steps": 5}
    data["logging"] = {"every_steps": 5}
    path = root / "resnet.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def resnet_reference(resnet_config: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    run_dir = run_uninterrupted(resnet_config, tmp_path_factory.mktemp("resnet-reference") / "run", timeout=240,
                                launcher="elastic-runner")
    yield exported_model(run_dir, tmp_path_factory.mktemp("resnet-export"))


@pytest.mark.parametrize("survivor", [True, False], ids=["from node memory", "from disk"])
def test_resnet18_with_batchnorm_resumes_every_buffer_bitwise(
        survivor: bool, resnet_config: Path, resnet_reference: dict, local_job, tmp_path: Path) -> None:  # noqa: ANN001
    step = random.Random().randint(6, 19)  # "a random step"; printed on failure
    job = local_job(config=str(resnet_config), nnodes="2:2", launcher="elastic-runner")
    job.start_agent()
    job.start_agent()
    if not survivor:
        # Losing every worker resumes from disk: the first durable snapshot (resnet18, written in the background)
        # must be complete before the loss, or there is nothing to resume and the run starts over.
        deadline = time.monotonic() + 180
        while not events(Path(job.run_dir), "snapshot_saved"):
            assert time.monotonic() < deadline, job.logs_tail()
            time.sleep(0.05)
    workers, reached = stop_workers_at_step(job, step, count=2, timeout=180)
    victims = [w for w in workers if w.rank == 1] if survivor else workers
    for w in victims:
        job.signal_worker(w, signal.SIGKILL)
    continue_workers(job, [w for w in workers if w not in victims])
    assert job.wait(timeout=240) == [0, 0], job.logs_tail()
    run_dir = Path(job.run_dir)
    resumes = [e for e in events(run_dir, "resume") if e["generation"] > 1]
    assert resumes, f"killed at step {reached}: the job never resumed"
    assert resumes[0]["tier"] == ("memory" if survivor else "disk"), (reached, resumes[0])
    report = check_audit(run_dir)
    assert report.ok and report.finished, report.render()
    model = exported_model(run_dir, tmp_path)
    buffers = [k for k in model if "running_" in k or "num_batches_tracked" in k]
    assert len(buffers) == 60, "resnet18's BatchNorm buffers are in the exported state"
    assert_bitwise_equal(model, resnet_reference)  # parameters and every buffer, killed at step {reached}
