"""Image datasets and their augmentation; exact state at step boundaries for models with buffers."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

from elastic_runner.config import BatchConfig, ConfigError, DataConfig
from elastic_runner.data.datasets import build_datasets
from elastic_runner.data.images import read_cifar_batch, sample_seed
from elastic_runner.data.sources import LoaderSource, collate_items
from elastic_runner.training.boundary import StepBoundary
from elastic_runner.training.loop import state_digest
from elastic_runner.workload.spec import check_batchnorm


@pytest.fixture
def vision() -> None:
    pytest.importorskip("torchvision", reason="torchvision is not installed in this environment; scripts/test.sh "
                                              "runs these on torch 2.14.1 + torchvision 0.29.1")

AUGMENT = [{"RandomResizedCrop": {"size": 16, "scale": [0.5, 1.0], "antialias": True}}, "RandomHorizontalFlip",
           {"Normalize": {"mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25]}}]


def image_tree(root: Path, classes: tuple[str, ...] = ("cat", "dog"), test_classes: tuple[str, ...] | None = None,
               per_class: int = 4) -> Path:
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    for split, names in (("train", classes), ("test", test_classes or classes)):
        for name in names:
            (root / split / name).mkdir(parents=True)
            for i in range(per_class):
                pixels = (torch.rand(20, 20, 3, generator=g) * 255).to(torch.uint8).numpy()
                Image.fromarray(pixels).save(root / split / name / f"{i}.png")
    return root


def test_every_augmentation_draw_is_seeded_by_seed_epoch_and_sample(vision: None, tmp_path: Path) -> None:
    cfg = DataConfig(name="image_folder", path=str(image_tree(tmp_path)), params={"image_size": 20}, augment=AUGMENT)
    bundle = build_datasets(cfg, seed=7)
    first = bundle.train[3][0]
    assert first.shape == (3, 16, 16)
    torch.rand(100)  # whatever the global generators did in between
    assert torch.equal(bundle.train[3][0], first), "the same sample, the same epoch: the same image"
    bundle.train.set_epoch(1)
    assert not torch.equal(bundle.train[3][0], first), "another epoch, another draw"
    bundle.train.set_epoch(0)
    # Loaded by DataLoader workers in any number, as another world size would shard it: the same images.
    inline = list(LoaderSource(bundle.train, torch.device("cpu"), 0, seed=1).batches([[3, 5]], epoch=0))[0]
    workers = list(LoaderSource(bundle.train, torch.device("cpu"), 2, seed=99).batches([[1], [3, 5]], epoch=0))[1]
    assert torch.equal(inline[0], workers[0]) and torch.equal(inline[0][0], first)


def test_sample_seed_restores_the_generators_it_borrowed() -> None:
    torch.manual_seed(1)
    expected = torch.rand(3)
    torch.manual_seed(1)
    with sample_seed(0, 0, 5):
        torch.rand(10)
    assert torch.equal(torch.rand(3), expected)


def test_bad_augment_entries_name_the_entry_and_the_valid_transforms(vision: None, tmp_path: Path) -> None:
    root = str(image_tree(tmp_path))
    with pytest.raises(ConfigError, match=r"data.augment\[1\]: unknown transform 'RandomFlop'.*RandomHorizontalFlip"):
        build_datasets(DataConfig(name="image_folder", path=root, augment=["RandomHorizontalFlip", "RandomFlop"]))
    with pytest.raises(ConfigError, match=r"data.augment\[0\]: RandomCrop\(sise=32\) is refused"):
        build_datasets(DataConfig(name="image_folder", path=root, augment=[{"RandomCrop": {"sise": 32}}]))


def test_train_and_test_classes_must_agree(vision: None, tmp_path: Path) -> None:
    root = image_tree(tmp_path, classes=("cat", "dog"), test_classes=("cat", "cow"))
    with pytest.raises(ConfigError, match=r"the classes of .*train \(cat, dog\) and of .*test \(cat, cow\) differ"):
        build_datasets(DataConfig(name="image_folder", path=str(root)))


def test_an_undecodable_image_is_named_or_left_out(vision: None, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = image_tree(tmp_path)
    broken = root / "train" / "dog" / "2.png"
    broken.write_bytes(b"not a png at all")
    bundle = build_datasets(DataConfig(name="image_folder", path=str(root)))
    index = [p for p, _ in bundle.train.samples].index(str(broken))
    with pytest.raises(ConfigError, match=rf"dataset item {index}: {broken} cannot be decoded.*data.bad_images: skip"):
        collate_items(bundle.train, [0, index], None)
    skipped = build_datasets(DataConfig(name="image_folder", path=str(root), bad_images="skip"))
    assert len(skipped.train) == len(bundle.train) - 1 and str(broken) in caplog.text


def cifar_batch(path: Path, n: int, seed: int) -> None:
    import numpy as np

    rng = np.random.default_rng(seed)
    data = {b"batch_label": b"fake", b"labels": [int(v) for v in rng.integers(0, 10, n)],
            b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), b"filenames": [b"x.png"] * n}
    path.write_bytes(pickle.dumps(data, protocol=2))


def test_cifar10_reads_the_python_batches_without_trusting_the_pickle(vision: None, tmp_path: Path) -> None:
    root = tmp_path / "cifar-10-batches-py"
    root.mkdir()
    for i in range(1, 6):
        cifar_batch(root / f"data_batch_{i}", 6, i)
    with pytest.raises(ConfigError, match=r"CIFAR-10 batch .*test_batch not found"):
        build_datasets(DataConfig(name="cifar10", path=str(tmp_path)))
    cifar_batch(root / "test_batch", 4, 9)
    bundle = build_datasets(DataConfig(name="cifar10", path=str(tmp_path)))
    assert bundle.num_train == 30 and len(bundle.test) == 4 and bundle.num_classes == 10
    assert bundle.train[0][0].shape == (3, 32, 32)

    class Exploit:
        def __reduce__(self):  # noqa: ANN204
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    (root / "data_batch_1").write_bytes(pickle.dumps({b"data": Exploit(), b"labels": []}, protocol=2))
    with pytest.raises(ConfigError, match=r"is not a CIFAR-10 python batch.*is not part of a CIFAR-10 batch"):
        read_cifar_batch(root / "data_batch_1")
    assert not (tmp_path / "pwned").exists()


def test_fake_images_are_a_pure_function_of_the_index() -> None:
    a = build_datasets(DataConfig(name="fake_images", params={"size": 40, "num_classes": 4, "image_size": 8}))
    b = build_datasets(DataConfig(name="fake_images", params={"size": 40, "num_classes": 4, "image_size": 8}))
    assert torch.equal(a.train[17][0], b.train[17][0]) and a.train[17][1] == 17 % 4
    assert a.input_shape == (3, 8, 8) and a.num_classes == 4 and len(a.test) == 256


def small_bn_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.LazyLinear(2))


def test_batchnorm_needs_two_samples_per_rank_at_the_largest_world_size() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    check_batchnorm(model, torch.device("cpu"), BatchConfig(global_size=16), largest=8, current=2, num_train=160,
                    partial=False)
    with pytest.raises(ConfigError, match=r"batch.global_size: at world size 12 .*some rank gets 1 sample.*at least 24"):
        check_batchnorm(model, torch.device("cpu"), BatchConfig(global_size=16), largest=12, current=2,
                        num_train=160, partial=False)
    with pytest.raises(ConfigError, match=r"data.partial_batch: the last step of an epoch holds 5 samples"):
        check_batchnorm(model, torch.device("cpu"), BatchConfig(global_size=16), largest=4, current=2,
                        num_train=165, partial=True)
    with pytest.raises(ConfigError, match=r"model.sync_batchnorm: needs CUDA devices"):
        check_batchnorm(nn.SyncBatchNorm.convert_sync_batchnorm(model), torch.device("cpu"),
                        BatchConfig(global_size=16), largest=2, current=2, num_train=160, partial=False)


def test_a_step_boundary_keeps_the_buffers_a_forward_in_flight_changed() -> None:
    model = small_bn_net()
    model(torch.randn(4, 3, 6, 6))  # materialise the lazy layer
    boundary = StepBoundary(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model(torch.randn(4, 3, 6, 6))  # the forward of a step that never completes
    kept = boundary.overlay(model.state_dict())
    assert int(model[1].num_batches_tracked) == 2 and not torch.equal(model[1].running_mean, before["1.running_mean"])
    assert all(torch.equal(kept[k], before[k]) for k in before), "the state after the last completed step"
    boundary.mark()  # the step completed
    assert torch.equal(boundary.overlay(model.state_dict())["1.running_mean"], model[1].running_mean)
    assert len(state_digest(model)) == 64, "0-dim integer buffers (num_batches_tracked) are digested too"
