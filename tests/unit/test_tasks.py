"""Losses and metrics as a user writes them: per-sample or weighted, checked on their first batch, metrics that follow the task."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from elastic_runner.config import ConfigError, EvalConfig, ModelConfig, load_config
from elastic_runner.workload.tasks import build_task, per_sample


def test_a_loss_that_is_neither_built_in_nor_an_import_path_says_what_to_write() -> None:
    with pytest.raises(ConfigError, match=r"model.loss: got 'smooth_l1', expected one of cross_entropy, mse or an import path"):
        load_config({"model": {"loss": "smooth_l1"}, "train": {"epochs": 1}})


def test_a_scalar_loss_is_refused_with_the_shape_it_must_have() -> None:
    with pytest.raises(ConfigError, match=r"returned a scalar \(shape \[\]\); it must return one loss per sample, shape \[8\]"):
        per_sample(torch.tensor(1.0), 8, "model.loss (mymods:loss)")
    with pytest.raises(ConfigError, match=r"returned shape \[8, 3\], expected \[8\]"):
        per_sample(torch.zeros(8, 3), 8, "model.loss")
    with pytest.raises(ConfigError, match=r"returned weights of shape \[4\], expected \[8\]"):
        per_sample((torch.zeros(8), torch.ones(4)), 8, "model.loss")


def test_metrics_follow_the_task() -> None:
    assert build_task(ModelConfig(loss="cross_entropy"), EvalConfig()).metrics == ["loss", "accuracy"]
    assert build_task(ModelConfig(loss="mse"), EvalConfig()).metrics == ["loss", "r2"]
    assert build_task(ModelConfig(name="gpt"), EvalConfig(), language_model=True).metrics == ["loss", "perplexity"]
    with pytest.raises(ConfigError, match="need a built-in loss"):
        build_task(ModelConfig(loss="torch.nn.functional:l1_loss"), EvalConfig(metrics=["accuracy"]))


def test_regression_metrics_are_exact_over_batches() -> None:
    task = build_task(ModelConfig(loss="mse"), EvalConfig(metrics=["mse", "r2"]))
    model = nn.Linear(3, 2)
    x, y = torch.randn(10, 3), torch.randn(10, 2)
    sums: dict[str, float] = {}
    for part in (slice(0, 4), slice(4, 10)):  # two batches, as two ranks or two chunks would give them
        for k, v in task.eval_sums(model, [x[part], y[part]], part.stop - part.start).items():
            sums[k] = sums.get(k, 0.0) + v
    out = task.finalize(sums, 10)
    with torch.no_grad():
        pred = model(x)
    mse = float(((pred - y) ** 2).mean())
    # float64 sums against a float32 reference: equal to float32 precision
    assert out["loss"] == pytest.approx(mse, rel=1e-5) and out["mse"] == pytest.approx(mse, rel=1e-5)
    assert out["r2"] == pytest.approx(1 - float(((pred - y) ** 2).sum() / ((y - y.mean()) ** 2).sum()), rel=1e-5)
    assert "accuracy" not in out
