"""Image datasets without downloads, and augmentation that resumes bitwise.

- ``image_folder``: ``PATH/train/<class>/<image>`` (and ``PATH/test`` or ``PATH/val`` with the same
  classes), decoded with torchvision; ``data.params.image_size`` (32) is the side every image is
  resized to.
- ``cifar10``: the standard python batches (``data_batch_1`` … ``data_batch_5``, ``test_batch``) from
  ``data.path`` or ``data.path/cifar-10-batches-py``, read with an unpickler that admits only what
  those files hold (a dict of bytes, lists and one NumPy array): a tampered file cannot run code.
- ``fake_images``: deterministic, learnable images (a pattern per class plus noise, a pure function
  of the sample index), for benchmarks and smoke tests; no torchvision needed.

``data.augment`` lists torchvision ``transforms.v2`` by name and parameters, e.g.
``[{RandomCrop: {size: 32, padding: 4}}, RandomHorizontalFlip, {Normalize: {mean: [...], std: [...]}}]``.
Every random draw of a sample's augmentation is seeded by (run seed, epoch, sample index)
(:func:`sample_seed`), never by the DataLoader worker or the rank, so a run resumed at the same or
another world size, with any ``data.num_workers``, sees the same augmented image for each sample.
``Normalize`` entries apply to the test split too; the random ones only to training.
"""

from __future__ import annotations

import contextlib
import io
import logging
import pickle
import random
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import Dataset

from ..config import ConfigError, DataConfig
from .sources import BadItem

log = logging.getLogger(__name__)


# -- seeding ------------------------------------------------------------------------------------------------------


def sample_seed_value(seed: int, epoch: int, index: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + index * 0x94D049BB133111EB + 1) % (2**63 - 1)


@contextlib.contextmanager
def sample_seed(seed: int, epoch: int, index: int) -> Iterator[None]:
    """Seed torch's, Python's and NumPy's global generators for one sample's random draws.

    The helper for your own dataset's augmentation: ``with sample_seed(seed, epoch, index):
    x = transform(x)``. Give the dataset a ``set_epoch(epoch)`` method and elastic_runner calls it
    before each epoch's batches are loaded (in the training process, before the workers start).
    torch's and Python's generators are restored afterwards; NumPy's is left seeded (restoring its
    state costs 90 µs a sample, more than the augmentation itself).
    """
    value = sample_seed_value(seed, epoch, index)
    py_state = random.getstate()
    random.seed(value)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(value % (2**32))
    with torch.random.fork_rng(devices=[]):
        # Not torch.manual_seed: it also queues a seed for every CUDA device (140 µs on a CUDA build).
        torch.default_generator.manual_seed(value)
        try:
            yield
        finally:
            random.setstate(py_state)


class Augmented(Dataset[Any]):
    """``(input, target)`` items with ``transform(input)`` drawn under :func:`sample_seed`."""

    def __init__(self, dataset: Any, transform: Callable[[Any], Any], seed: int) -> None:
        self.dataset, self.transform, self.seed = dataset, transform, seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        item = self.dataset[index]
        if isinstance(item, BadItem):
            return item
        x, y = item
        with sample_seed(self.seed, self.epoch, index):
            return self.transform(x), y

    def __getattr__(self, name: str) -> Any:  # classes, num_classes... of the wrapped dataset
        if name in ("dataset", "transform", "seed", "epoch"):
            raise AttributeError(name)
        return getattr(self.dataset, name)


# -- augmentation from the config ----------------------------------------------------------------------------------


def _v2() -> Any:
    try:
        from torchvision.transforms import v2
    except ImportError as exc:
        raise ConfigError("data.augment", f"needs torchvision, which cannot be imported ({exc})",
                          "Install the vision extra matching your torch build: pip install 'elastic-runner[vision]'") from exc
    return v2


def build_augment(entries: list[Any] | None) -> tuple[Callable[[Any], Any] | None, Callable[[Any], Any] | None]:
    """(the training transform, the test transform: its Normalize steps) from ``data.augment``."""
    if not entries:
        return None, None
    v2 = _v2()
    names = sorted(n for n in dir(v2) if n[:1].isupper() and callable(getattr(v2, n)))
    train, test = [], []
    for i, entry in enumerate(entries):
        key = f"data.augment[{i}]"
        if isinstance(entry, str):
            name, params = entry, {}
        elif isinstance(entry, dict) and len(entry) == 1:
            name, params = next(iter(entry.items()))
            params = params or {}
        else:
            raise ConfigError(key, f"got {entry!r}", "Write each entry as a transform name or {Name: {param: value}}")
        if name not in names or not isinstance(params, dict):
            raise ConfigError(key, f"unknown transform {name!r}" if name not in names else f"{name}: params {params!r} "
                              "are not a mapping", f"Use a torchvision.transforms.v2 name, e.g. RandomResizedCrop, "
                              f"RandomCrop, RandomHorizontalFlip, ColorJitter, Normalize (all: {', '.join(names[:60])})")
        try:
            transform = getattr(v2, name)(**params)
        except (TypeError, ValueError) as exc:
            raise ConfigError(key, f"{name}({', '.join(f'{k}={v!r}' for k, v in params.items())}) is refused: {exc}",
                              f"Give {name} the parameters torchvision.transforms.v2.{name} takes") from exc
        train.append(transform)
        if name == "Normalize":
            test.append(transform)
    return v2.Compose(train), (v2.Compose(test) if test else None)


# -- datasets -------------------------------------------------------------------------------------------------------


class ImageFiles(Dataset[Any]):
    """torchvision's ImageFolder layout, decoded to float tensors of one size (3 x S x S)."""

    def __init__(self, root: Path, size: int, skip_bad: bool) -> None:
        from torchvision import datasets
        from torchvision.transforms import v2

        folder = datasets.ImageFolder(str(root))
        self.classes = folder.classes
        self.samples = folder.samples
        self.tensor = v2.Compose([v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Resize((size, size))])
        if skip_bad:
            kept = [s for s in self.samples if _decodes(s[0])]
            if len(kept) < len(self.samples):
                log.warning("data.bad_images: skip: %d image(s) under %s cannot be decoded and are left out: %s",
                            len(self.samples) - len(kept), root, ", ".join(s[0] for s in self.samples if s not in kept)[:500])
            self.samples = kept

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Any:
        from PIL import Image

        path, label = self.samples[index]
        try:
            with Image.open(path) as img:
                image = img.convert("RGB")
        except Exception as exc:  # noqa: BLE001 - any decoder error: name the file
            return BadItem(path, f"{type(exc).__name__}: {exc}")
        return self.tensor(image), label


def _decodes(path: str) -> bool:
    from PIL import Image

    try:
        with Image.open(path) as img:
            img.convert("RGB")
        return True
    except Exception:  # noqa: BLE001
        return False


def image_folder(cfg: DataConfig, seed: int) -> tuple[Any, Any, tuple[int, ...], int, str]:
    _v2()
    size = int(cfg.params.get("image_size", 32))
    root = Path(cfg.path or "")
    train_dir = root / "train" if (root / "train").is_dir() else root
    test_dir = next((root / d for d in ("test", "val") if (root / d).is_dir()), None)
    skip = cfg.bad_images == "skip"
    try:
        train = ImageFiles(train_dir, size, skip)
        test = ImageFiles(test_dir, size, skip) if test_dir else None
    except (FileNotFoundError, RuntimeError) as exc:
        raise ConfigError("data.path", f"no images found under {str(train_dir)!r} ({exc})",
                          "Use one sub-directory per class: PATH/train/<class>/<image>") from exc
    if test is not None and test.classes != train.classes:
        raise ConfigError("data.path", f"the classes of {train_dir} ({', '.join(train.classes)}) and of {test_dir} "
                          f"({', '.join(test.classes)}) differ", "Give both splits the same class directories")
    augmented, evaluated = augment_pair(cfg.augment, train, test, seed)
    return augmented, evaluated, (3, size, size), len(train.classes), f"image_folder {root} ({len(train)} images)"


def augment_pair(entries: list[Any] | None, train: Any, test: Any, seed: int) -> tuple[Any, Any]:
    train_tf, test_tf = build_augment(entries)
    if train_tf is not None:
        train = Augmented(train, train_tf, seed)
    if test is not None and test_tf is not None:
        test = Augmented(test, test_tf, seed)
    return train, test


# -- CIFAR-10 ------------------------------------------------------------------------------------------------------------

CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


class _CifarUnpickler(pickle.Unpickler):
    """Admits only what a CIFAR-10 python batch holds: builtins containers and one NumPy array."""

    ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a CIFAR-10 batch")
        return super().find_class(module, name)


def read_cifar_batch(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(images uint8 [N, 3, 32, 32], labels int64 [N]) of one python batch file."""
    try:
        raw = _CifarUnpickler(io.BytesIO(path.read_bytes()), encoding="bytes").load()
        data, labels = raw[b"data"], raw[b"labels"]
        images = torch.as_tensor(data, dtype=torch.uint8).reshape(-1, 3, 32, 32)
        targets = torch.as_tensor(labels, dtype=torch.long)
    except FileNotFoundError:
        raise
    except Exception as exc:  # noqa: BLE001 - a damaged or foreign file
        raise ConfigError("data.path", f"{path} is not a CIFAR-10 python batch ({type(exc).__name__}: {exc})",
                          "Extract the original cifar-10-python.tar.gz there") from exc
    if len(images) != len(targets):
        raise ConfigError("data.path", f"{path}: {len(images)} images but {len(targets)} labels",
                          "Extract the original cifar-10-python.tar.gz there")
    return images, targets


class CifarImages(Dataset[Any]):
    """CIFAR images as float tensors in [0, 1] (uint8 in memory: 150 MB, not 600)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images, self.labels = images, labels
        self.classes = [str(i) for i in range(10)]

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index].float() / 255.0, self.labels[index]


def cifar10(cfg: DataConfig, seed: int) -> tuple[Any, Any, tuple[int, ...], int, str]:
    root = Path(cfg.path or "")
    if (root / "cifar-10-batches-py").is_dir():
        root = root / "cifar-10-batches-py"
    parts = []
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        path = root / name
        if not path.is_file():
            raise ConfigError("data.path", f"CIFAR-10 batch {path} not found",
                              "Extract cifar-10-python.tar.gz so that PATH/cifar-10-batches-py/data_batch_1..5 and "
                              "test_batch exist")
        parts.append(read_cifar_batch(path))
    train = CifarImages(torch.cat([p[0] for p in parts[:5]]), torch.cat([p[1] for p in parts[:5]]))
    test = CifarImages(*parts[5])
    augment = cfg.augment if cfg.augment is not None else [{"Normalize": {"mean": list(CIFAR_MEAN), "std": list(CIFAR_STD)}}]
    train, test = augment_pair(augment, train, test, seed)
    return train, test, (3, 32, 32), 10, f"cifar10 {root} ({len(train)} train / {len(test)} test)"


# -- fake images ----------------------------------------------------------------------------------------------------------

FAKE_DEFAULTS: dict[str, Any] = {"size": 1024, "test_size": 256, "num_classes": 10, "image_size": 32, "noise": 0.6}


class FakeImages(Dataset[Any]):
    """Item ``i``: a class pattern (``i % num_classes``) plus noise, both pure functions of the seed and ``i``."""

    def __init__(self, size: int, num_classes: int, image_size: int, noise: float, seed: int, offset: int = 0) -> None:
        self.size, self.num_classes, self.image_size, self.noise = size, num_classes, image_size, noise
        self.seed, self.offset = seed, offset
        g = torch.Generator().manual_seed(seed)
        # Smooth patterns (4x4 colour fields, upsampled): a class stays recognisable under crops and flips.
        coarse = torch.rand((num_classes, 3, 4, 4), generator=g)
        self.patterns = torch.nn.functional.interpolate(coarse, size=(image_size, image_size), mode="bilinear",
                                                        align_corners=False)
        self.classes = [str(c) for c in range(num_classes)]

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.size:
            raise IndexError(index)
        label = (index + self.offset) % self.num_classes
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.offset + index)
        noise = torch.rand((3, self.image_size, self.image_size), generator=g)
        return ((1 - self.noise) * self.patterns[label] + self.noise * noise).clamp(0, 1), label


def fake_images(cfg: DataConfig, seed: int) -> tuple[Any, Any, tuple[int, ...], int, str]:
    unknown = set(cfg.params) - set(FAKE_DEFAULTS)
    if unknown:
        raise ConfigError("data.params", f"unknown fake_images parameter(s) {sorted(unknown)}",
                          f"Valid parameters: {', '.join(FAKE_DEFAULTS)}")
    p = FAKE_DEFAULTS | cfg.params
    for key in ("size", "test_size", "num_classes", "image_size"):
        if not isinstance(p[key], int) or p[key] <= 0:
            raise ConfigError(f"data.params.{key}", f"got {p[key]!r}, must be a positive integer",
                              f"Set data.params.{key} to e.g. {FAKE_DEFAULTS[key]}")
    train = FakeImages(p["size"], p["num_classes"], p["image_size"], float(p["noise"]), seed=1234)
    test = FakeImages(p["test_size"], p["num_classes"], p["image_size"], float(p["noise"]), seed=1234, offset=p["size"])
    train, test = augment_pair(cfg.augment, train, test, seed)
    side = p["image_size"]
    return train, test, (3, side, side), p["num_classes"], f"fake_images ({p['size']} x 3x{side}x{side})"
