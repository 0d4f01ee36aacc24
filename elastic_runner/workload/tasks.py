"""What a step optimises and what an evaluation reports: losses and metrics.

The contract with a user's code (docs/guides/bring-your-own.md):

- A **loss** is ``fn(model, batch)``: the batch exactly as collated, already on the device, and the
  model to call (the DDP-wrapped one while training). It returns per-sample losses, shape ``[B]``,
  or ``(losses [B], weights [B])`` for a weighted mean (token counts of padded sequences). The step
  then optimises the exact mean over the *global* batch: ``sum(losses) / global batch`` or
  ``sum(weights * losses) / sum(weights over every rank and micro-batch)``, so the gradient does
  not depend on the world size or on how a rank's share is split into micro-batches.
- The built-in ``cross_entropy`` and ``mse`` take ``(input, target)`` items. ``cross_entropy`` on a
  sequence (output ``[B, T, V]``, target ``[B, T]``) is a token-weighted loss (tokens equal to
  ``-100`` are ignored), the language-model loss.
- A **metric** is ``fn(model, batch) -> {name: per-sample values [B]}``, averaged over the test set;
  the built-ins are computed from one forward with the loss.

Nothing here knows about distribution: evaluation returns local sums, the loop adds them up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..config import BUILTIN_LOSSES, ConfigError, EvalConfig, ModelConfig
from ..config.imports import resolve
from ..data.sources import describe

LossFn = Callable[[nn.Module, Any], Any]
MetricFn = Callable[[nn.Module, Any], dict[str, torch.Tensor]]
IGNORE_INDEX = -100


class LossOutputError(ConfigError):
    """A loss or metric function returned something other than per-sample values."""


# -- built-in losses ------------------------------------------------------------------------------------


def _pair(batch: Any, name: str) -> tuple[Any, torch.Tensor]:
    if isinstance(batch, (list, tuple)) and len(batch) == 2:
        return batch[0], batch[1]
    raise ConfigError(
        "model.loss", f"the built-in {name} loss needs (input, target) items, the dataset gives {describe(batch)}",
        "Set model.loss to an import path fn(model, batch) -> per-sample losses [B]")


def cross_entropy_of(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-sample cross entropy; for sequences (``[B, T, V]`` vs ``[B, T]``) the per-sample token sum and
    token count (weights), so that the mean is over tokens, padded ones (``-100``) excluded."""
    if output.dim() == 3 and target.dim() == 2:
        b, t, v = output.shape
        per_token = nn.functional.cross_entropy(output.reshape(b * t, v).float(), target.reshape(b * t),
                                                reduction="none", ignore_index=IGNORE_INDEX).view(b, t)
        counts = (target != IGNORE_INDEX).sum(1).to(per_token.dtype)
        return per_token.sum(1) / counts.clamp(min=1), counts
    return nn.functional.cross_entropy(output, target, reduction="none")


def mse_of(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target.to(output.dtype), reduction="none").flatten(1).mean(1)


def builtin_loss(name: str) -> LossFn:
    of = {"cross_entropy": cross_entropy_of, "mse": mse_of}[name]

    def loss(model: nn.Module, batch: Any) -> Any:
        x, y = _pair(batch, name)
        return of(model(x), y)

    loss.__qualname__ = name
    return loss


def per_sample_loss(name: str, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Unreduced built-in loss of an output (the token mean for sequences)."""
    result = {"cross_entropy": cross_entropy_of, "mse": mse_of}[name](output, target)
    return result[0] if isinstance(result, tuple) else result


# -- checking what a function returned ----------------------------------------------------------------------


def per_sample(result: Any, batch_size: int, where: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(losses [B], weights [B] or None)`` from a loss function's result, or a clear error."""
    weights = None
    if isinstance(result, (tuple, list)):
        if len(result) != 2:
            raise LossOutputError(where, f"returned a {type(result).__name__} of {len(result)} items",
                                  "Return per-sample losses [B], or (losses [B], weights [B])")
        result, weights = result
    if not isinstance(result, torch.Tensor):
        raise LossOutputError(where, f"returned {type(result).__name__}, not a tensor",
                              "Return per-sample losses as a tensor of shape [B]")
    if result.dim() == 0:
        raise LossOutputError(
            where, f"returned a scalar (shape []); it must return one loss per sample, shape [{batch_size}]",
            "Compute the loss with reduction='none' (and average over non-batch dimensions)")
    if tuple(result.shape) != (batch_size,):
        raise LossOutputError(where, f"returned shape {list(result.shape)}, expected [{batch_size}] (one loss per sample)",
                              "Reduce every dimension but the batch dimension, e.g. losses.flatten(1).mean(1)")
    if weights is not None:
        if not isinstance(weights, torch.Tensor) or tuple(weights.shape) != (batch_size,):
            shape = list(weights.shape) if isinstance(weights, torch.Tensor) else type(weights).__name__
            raise LossOutputError(where, f"returned weights of shape {shape}, expected [{batch_size}] like the losses",
                                  "Return (losses [B], weights [B]), e.g. weights = token counts per sample")
    return result, weights


# -- metrics ----------------------------------------------------------------------------------------------------


@dataclass
class Task:
    """The loss and the evaluation of one workload."""

    loss: LossFn
    loss_name: str  #: as configured, for messages
    builtin: str | None = None  #: cross_entropy / mse when the loss is built in
    metrics: list[str] = field(default_factory=list)  #: built-in metric names
    metric_fns: dict[str, MetricFn] = field(default_factory=dict)  #: import paths
    language_model: bool = False

    @property
    def where(self) -> str:
        return f"model.loss ({self.loss_name})"

    def compute_loss(self, model: nn.Module, batch: Any, batch_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        return per_sample(self.loss(model, batch), batch_size, self.where)

    def eval_sums(self, model: nn.Module, batch: Any, batch_size: int) -> dict[str, float]:
        """This batch's contribution to every metric: sums of per-sample values (and of weights)."""
        sums: dict[str, float] = {}
        if self.builtin is not None and self.builtin_metrics_from_output():
            x, y = _pair(batch, self.builtin)
            out = model(x)
            losses, weights = per_sample({"cross_entropy": cross_entropy_of, "mse": mse_of}[self.builtin](out, y),
                                         batch_size, self.where)
            _add_loss(sums, losses, weights)
            if "accuracy" in self.metrics:
                if out.dim() == 2 and y.dim() == 1:
                    sums["accuracy"] = float((out.argmax(1) == y).double().sum())
            if "mse" in self.metrics or "r2" in self.metrics:
                _add_regression(sums, out, y)
        else:
            losses, weights = self.compute_loss(model, batch, batch_size)
            _add_loss(sums, losses, weights)
        for name, fn in self.metric_fns.items():
            values = fn(model, batch)
            if not isinstance(values, dict):
                raise LossOutputError(f"eval.metrics ({name})", f"returned {type(values).__name__}, not a dict",
                                      "Return {name: per-sample values [B]}")
            for key, value in values.items():
                value, _ = per_sample(value, batch_size, f"eval.metrics ({name}: {key})")
                sums[key] = sums.get(key, 0.0) + float(value.detach().double().sum())
        return sums

    def builtin_metrics_from_output(self) -> bool:
        return self.builtin is not None

    def finalize(self, sums: dict[str, float], samples: float) -> dict[str, float]:
        """Totals over the test set (all ranks) → the reported metrics."""
        n = max(samples, 1.0)
        out: dict[str, float] = {}
        weight = sums.get("loss_weight", n) or 1.0
        if "loss_sum" in sums:
            out["loss"] = sums["loss_sum"] / weight
        if "accuracy" in self.metrics and "accuracy" in sums:
            out["accuracy"] = sums["accuracy"] / n
        if "mse" in self.metrics and "se" in sums:
            out["mse"] = sums["se"] / max(sums["elements"], 1.0)
        if "r2" in self.metrics and "se" in sums:
            elements = max(sums["elements"], 1.0)
            total_variance = sums["y2"] - sums["y"] ** 2 / elements
            out["r2"] = 1.0 - sums["se"] / total_variance if total_variance > 0 else float("nan")
        if "perplexity" in self.metrics and "loss" in out:
            out["perplexity"] = math.exp(min(out["loss"], 700.0))
        for key, value in sums.items():
            if key not in _INTERNAL and key not in out:
                out[key] = value / n
        return out


_INTERNAL = {"loss_sum", "loss_weight", "accuracy", "se", "y", "y2", "elements"}


def _add_loss(sums: dict[str, float], losses: torch.Tensor, weights: torch.Tensor | None) -> None:
    losses = losses.detach().double()
    if weights is None:
        sums["loss_sum"] = sums.get("loss_sum", 0.0) + float(losses.sum())
        sums["loss_weight"] = sums.get("loss_weight", 0.0) + float(losses.numel())
    else:
        w = weights.detach().double()
        sums["loss_sum"] = sums.get("loss_sum", 0.0) + float((losses * w).sum())
        sums["loss_weight"] = sums.get("loss_weight", 0.0) + float(w.sum())


def _add_regression(sums: dict[str, float], out: torch.Tensor, y: torch.Tensor) -> None:
    o, t = out.detach().double().flatten(), y.detach().to(out.device).double().flatten()
    for key, value in (("se", ((o - t) ** 2).sum()), ("y", t.sum()), ("y2", (t ** 2).sum())):
        sums[key] = sums.get(key, 0.0) + float(value)
    sums["elements"] = sums.get("elements", 0.0) + float(t.numel())


def build_task(model_cfg: ModelConfig, eval_cfg: EvalConfig, *, language_model: bool = False,
               loss: LossFn | None = None, metric_fns: dict[str, MetricFn] | None = None) -> Task:
    """The task of a config (or of a script's own loss and metric functions)."""
    if loss is not None:
        task = Task(loss=loss, loss_name=getattr(loss, "__qualname__", "loss"))
    elif model_cfg.loss in BUILTIN_LOSSES:
        task = Task(loss=builtin_loss(model_cfg.loss), loss_name=model_cfg.loss, builtin=model_cfg.loss)
    else:
        task = Task(loss=resolve(model_cfg.loss, "model.loss"), loss_name=model_cfg.loss)
    task.language_model = language_model
    if eval_cfg.metrics == "auto":
        if task.builtin == "cross_entropy":
            task.metrics = ["loss", "perplexity"] if language_model else ["loss", "accuracy"]
        elif task.builtin == "mse":
            task.metrics = ["loss", "r2"]
        else:
            task.metrics = ["loss"]
    else:
        task.metrics = ["loss"] + [m for m in eval_cfg.metrics if ":" not in m and m != "loss"]
        for ref in (m for m in eval_cfg.metrics if ":" in m):
            task.metric_fns[ref] = resolve(ref, "eval.metrics")
        needs_builtin = {"accuracy", "mse", "r2"} & set(task.metrics)
        if needs_builtin and task.builtin is None:
            raise ConfigError("eval.metrics", f"{sorted(needs_builtin)} need a built-in loss (cross_entropy or mse); "
                              f"model.loss is {task.loss_name}",
                              "Compute them in your own metric function: 'package.module:fn' -> {name: values [B]}")
    task.metric_fns.update(metric_fns or {})
    return task
