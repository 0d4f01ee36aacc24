"""Built-in small models, and user models by import path.

Models know nothing about distribution: no torch.distributed here.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Sequence

import torch
from torch import nn

from .config import ConfigError, ModelConfig
from .imports import call, resolve


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


def build_model(cfg: ModelConfig, input_shape: Sequence[int], num_classes: int) -> nn.Module:
    params: dict[str, Any] = dict(cfg.params)
    if cfg.name in BUILTIN:
        cls = BUILTIN[cfg.name]
        return call(cls, params, "model.params", cfg.name, tuple(input_shape), num_classes)
    factory = resolve(cfg.name, "model.name")
    # Most vision constructors take num_classes; pass the dataset's unless the user chose.
    try:
        accepts = "num_classes" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        accepts = False
    if accepts and "num_classes" not in params:
        params["num_classes"] = num_classes
    model = call(factory, params, "model.params", cfg.name)
    if not isinstance(model, nn.Module):
        raise ConfigError("model.name", f"{cfg.name} returned {type(model).__name__}, not a torch.nn.Module", "Point model.name at a model class or factory")
    return model


def per_sample_loss(name: str, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Unreduced loss, so the loop can normalise by the *global* batch size."""
    if name == "cross_entropy":
        return nn.functional.cross_entropy(output, target, reduction="none")
    if name == "mse":
        return nn.functional.mse_loss(output, target.to(output.dtype), reduction="none").flatten(1).mean(1)
    raise ConfigError("model.loss", f"unknown loss {name!r}", "Use cross_entropy or mse")
