"""Built-in small models (mlp, cnn; gpt in :mod:`elastic_runner.workload.gpt`), and user models by import path.

Models know nothing about distribution: no torch.distributed here.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Sequence

import torch
from torch import nn

from ..config import ConfigError, ModelConfig
from ..config.imports import call, resolve


class MLP(nn.Module):
    def __init__(self, input_shape: Sequence[int], num_classes: int, hidden: int = 128,
                 depth: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = math.prod(input_shape)
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            if dropout:
                layers.append(nn.Dropout(dropout))
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class SmallCNN(nn.Module):
    """Two conv layers and a classifier head; works for any image size."""

    def __init__(self, input_shape: Sequence[int], num_classes: int, channels: int = 16,
                 hidden: int = 128, dropout: float = 0.0) -> None:
        super().__init__()
        if len(input_shape) != 3:
            raise ConfigError(
                "model.name", f"cnn needs image inputs (channels, height, width), the dataset gives shape {tuple(input_shape)}",
                "Use model.name: mlp for flat features",
            )
        in_ch = input_shape[0]
        self.features = nn.Sequential(
            nn.Conv2d(in_ch, channels, 3, padding=1), nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU(),
            nn.AdaptiveMaxPool2d(4),
        )
        self.head = nn.Sequential(
            nn.Flatten(), nn.Linear(2 * channels * 16, hidden), nn.ReLU(),
            nn.Dropout(dropout) if dropout else nn.Identity(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


BUILTIN = {"mlp": MLP, "cnn": SmallCNN}


def build_model(cfg: ModelConfig, input_shape: Sequence[int] | None, num_classes: int | None, *,
                vocab_size: int | None = None, block_size: int | None = None) -> nn.Module:
    """The configured model; ``input_shape``, ``num_classes``, ``vocab_size`` and ``block_size`` are
    what the dataset tells (a built-in model takes what it needs, an import path gets
    ``num_classes`` when it accepts it and the config does not set it)."""
    params: dict[str, Any] = dict(cfg.params)
    if cfg.name in BUILTIN:
        if num_classes is None and "num_classes" not in params:
            raise ConfigError("model.name", f"{cfg.name} needs the number of classes, which the dataset does not tell",
                              "Give the dataset a 'num_classes' or 'classes' attribute, or set model.params.num_classes")
        if not input_shape:
            raise ConfigError("model.name", f"{cfg.name} needs (input, target) items with a tensor input",
                              "Use your own model (an import path) for this dataset")
        params.setdefault("num_classes", num_classes)
        return call(BUILTIN[cfg.name], params, "model.params", cfg.name, tuple(input_shape))
    if cfg.name == "gpt":
        from .gpt import GPT

        if vocab_size is None and "vocab_size" not in params:
            raise ConfigError("model.name", "gpt needs the vocabulary size, which the dataset does not tell",
                              "Use data.name: tokens, or set model.params.vocab_size")
        params.setdefault("vocab_size", vocab_size)
        if block_size is not None:
            params.setdefault("block_size", block_size)
        return call(GPT, params, "model.params", "gpt")
    factory = resolve(cfg.name, "model.name")
    # Most vision constructors take num_classes; pass the dataset's unless the user chose. torchvision's
    # builders (resnet18(*, weights, progress, **kwargs)) take it through **kwargs.
    try:
        parameters = inspect.signature(factory).parameters
        accepts = "num_classes" in parameters or (
            getattr(factory, "__module__", "").startswith("torchvision.models")
            and any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()))
    except (TypeError, ValueError):
        accepts = False
    if accepts and "num_classes" not in params and num_classes is not None:
        params["num_classes"] = num_classes
    model = call(factory, params, "model.params", cfg.name)
    if not isinstance(model, nn.Module):
        raise ConfigError("model.name", f"{cfg.name} returned {type(model).__name__}, not a torch.nn.Module", "Point model.name at a model class or factory")
    return model
