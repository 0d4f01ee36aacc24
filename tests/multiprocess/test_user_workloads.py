"""Bring your own model and data, end to end: a user's module in the working directory, bad inputs,
metrics by task, a non-finite loss, the built-in language model."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from ..support import ROOT, events, run_bounded

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

USER_MODULE = textwrap.dedent("""
    import math
    import torch

    class Regression(torch.utils.data.Dataset):
        # y = x @ w + noise: no classes, a float target
        def __init__(self, size=256, nan_at=None):
            g = torch.Generator().manual_seed(1)
            self.x = torch.randn(size, 4, generator=g)
            self.y = self.x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(size, 1, generator=g)
            if nan_at is not None:
                self.x[nan_at] = math.nan
        def __len__(self):
            return len(self.x)
        def __getitem__(self, i):
            return self.x[i], self.y[i]

    def regression(size=256, nan_at=None):
        return Regression(size, nan_at), Regression(64)

    def linear():
        return torch.nn.Linear(4, 1)

    class Dicts(torch.utils.data.Dataset):
        def __len__(self):
            return 64
        def __getitem__(self, i):
            item = {"input_ids": torch.full((6,), i % 10), "labels": torch.tensor(i % 2)}
            return item if i != 1 else {"input_ids": torch.full((6,), 1)}

    def dicts():
        return Dicts()

    def dict_model():
        return torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Flatten(), torch.nn.Linear(24, 2))

    def scalar_loss(model, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)
""")


def write_job(tmp_path: Path, **sections: dict) -> Path:
    """A working directory with mymods.py and a config; returns the config path."""
    (tmp_path / "mymods.py").write_text(USER_MODULE)
    config = {"run": {"dir": str(tmp_path / "run")}, "batch": {"global_size": 16}, "train": {"epochs": 1},
              "logging": {"every_steps": 8}, "snapshot": {"every_steps": 8}, "model": {"name": "mymods:linear",
                                                                                       "loss": "mse"},
              "data": {"name": "mymods:regression"}}
    for name, values in sections.items():
        config.setdefault(name, {}).update(values)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def worker(config: Path, *overrides: str, cwd: Path | None = None, timeout: float = 120):  # noqa: ANN201
    cmd = [sys.executable, "-m", "elastic_runner.train", "--config", str(config)]
    for item in overrides:
        cmd += ["--set", item]
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    old = os.getcwd()
    os.chdir(cwd or config.parent)
    try:
        return run_bounded(cmd, timeout, env=env)
    finally:
        os.chdir(old)


def test_regression_reports_loss_and_r2_and_never_an_accuracy(tmp_path: Path) -> None:
    result = worker(write_job(tmp_path, train={"epochs": 6}))
    assert result.returncode == 0, result.stdout[-3000:]
    [final] = [line for line in result.stdout.splitlines() if "finished step=" in line]
    assert "test_loss=" in final and "test_r2=" in final and "accuracy" not in final
    [end] = events(tmp_path / "run", "end")
    assert end["eval_r2"] > 0.9 and "eval_accuracy" not in end  # y = x @ w + small noise: a line fits it


@pytest.mark.parametrize(("sections", "message"), [
    ({"model": {"name": "mymods:dict_model", "loss": "cross_entropy"}, "data": {"name": "mymods:dicts"}},
     "data.name: dataset items 0 and 1 have different structures: {input_ids: Tensor[6] int64, labels: Tensor[] int64} "
     "vs {input_ids: Tensor[6] int64}"),
    ({"model": {"loss": "mymods:scalar_loss"}},
     "model.loss (mymods:scalar_loss): returned a scalar (shape []); it must return one loss per sample, shape [2]"),
    ({"model": {"name": "gpt", "params": {"n_embd": 30, "n_head": 4}}, "data": {"name": "tokens", "path": "."}},
     "data.path: . has no meta.json"),
    ({"model": {"name": "gpt", "params": {"n_embd": 30, "n_head": 4, "vocab_size": 10}}},
     "model.params.n_embd: 30 is not divisible by model.params.n_head=4"),
    ({"data": {"collate": "mymods:no_such_function"}}, "data.collate: module 'mymods' has no attribute 'no_such_function'"),
], ids=["mixed item structures", "scalar loss", "tokens without meta.json", "gpt shape", "missing collate"])
def test_a_bad_input_is_one_line_exit_2_and_nothing_in_run_dir(tmp_path: Path, sections: dict, message: str) -> None:
    result = worker(write_job(tmp_path, **sections))
    assert result.returncode == 2, result.stdout[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], result.stdout[-3000:]
    assert not (tmp_path / "run").exists(), "nothing may be written for a bad input"


def test_config_command_imports_every_import_path(tmp_path: Path) -> None:
    config = write_job(tmp_path, model={"loss": "mymods:nothing_here"})
    run = [sys.executable, "-m", "elastic_runner", "config", str(config)]
    os.chdir(tmp_path)
    try:
        bad = run_bounded(run, 60)
        good = run_bounded([sys.executable, "-m", "elastic_runner", "config", str(write_job(tmp_path))], 60)
    finally:
        os.chdir(ROOT)
    assert bad.returncode == 2 and bad.stdout.strip().count("\n") == 0
    assert "model.loss: module 'mymods' has no attribute 'nothing_here'" in bad.stdout
    assert good.returncode == 0, good.stdout


def test_launch_workers_import_the_users_module_from_the_working_directory(tmp_path: Path) -> None:
    config = write_job(tmp_path)
    os.chdir(tmp_path)
    try:
        result = run_bounded([sys.executable, "-m", "elastic_runner", "launch", "--standalone", "--nproc_per_node=2",
                              "-m", "elastic_runner.train", "--config", str(config)], 180,
                             env=os.environ | {"PYTHONUNBUFFERED": "1"})
    finally:
        os.chdir(ROOT)
    assert result.returncode == 0, result.stdout[-3000:]
    assert all(e["zygote"] for e in events(tmp_path / "run", "start")), "forked from the warm zygote"


def test_a_nonfinite_loss_stops_every_rank_with_one_line_naming_step_and_rank(tmp_path: Path) -> None:
    from elastic_runner.data.order import FeistelOrder

    # The sample that epoch 0 reaches in step 12 (a global batch of 16): after the snapshot of step 8.
    bad = FeistelOrder(256, seed=0, epoch=0).index(11 * 16 + 5)
    config = write_job(tmp_path, data={"params": {"nan_at": bad}}, audit={"samples": True})
    os.chdir(tmp_path)
    try:
        result = run_bounded([sys.executable, "-m", "elastic_runner", "launch", "--standalone", "--nproc_per_node=2",
                              "--max_restarts=3", "-m", "elastic_runner.train", "--config", str(config)], 180,
                             env=os.environ | {"PYTHONUNBUFFERED": "1"})
    finally:
        os.chdir(ROOT)
    assert result.returncode == 3, result.stdout[-3000:]
    records = [r for r in _audit_records(tmp_path / "run") if bad in r["indices"]]
    step, rank = records[0]["step"], records[0]["rank"]
    lines = [line for line in result.stdout.splitlines() if "elastic_runner: step" in line]
    assert len(lines) == 1 and f"step {step}: the loss of rank {rank} was nan" in lines[0], result.stdout[-3000:]
    assert "Traceback" not in result.stdout and "worker_main FAILED" not in result.stdout, result.stdout[-3000:]
    saved = [e["step"] for e in events(tmp_path / "run", "snapshot_saved")]
    assert saved and max(saved) < step, "no snapshot of the diverged state"
    assert len({e["generation"] for e in events(tmp_path / "run", "start")}) == 1, "not restarted"

    skip = write_job(tmp_path, data={"params": {"nan_at": bad}}, train={"on_nonfinite": "skip"},
                     run={"dir": str(tmp_path / "skip")})
    result = worker(skip)
    assert result.returncode == 0, result.stdout[-3000:]
    # The same global window holds the bad sample at any world size: the same step is skipped, once.
    assert [e["step"] for e in events(tmp_path / "skip", "nonfinite_skipped")] == [step]
    assert "finished step=" in result.stdout


def test_a_fused_optimizer_skips_a_nonfinite_step_on_the_device_and_the_logging_step_counts_it(
        tmp_path: Path) -> None:
    """train.on_nonfinite: skip without reading the device at every step: the fused AdamW skips the update itself
    (torch's found_inf); the step is counted at the next logging step and training ends with finite weights."""
    from elastic_runner.data.order import FeistelOrder

    bad = FeistelOrder(256, seed=0, epoch=0).index(11 * 16 + 5)  # in step 12
    config = write_job(tmp_path, data={"params": {"nan_at": bad}}, train={"on_nonfinite": "skip"},
                       optim={"name": "adamw", "lr": 0.01, "params": {"fused": True}})
    result = worker(config)
    assert result.returncode == 0, result.stdout[-3000:]
    skipped = events(tmp_path / "run", "nonfinite_skipped")
    assert [(e["step"], e["count"], e["on_device"]) for e in skipped] == [(16, 1, True)], skipped
    import torch

    from elastic_runner import load_model

    model = load_model(str(tmp_path / "run"), _user_model(tmp_path))
    assert all(torch.isfinite(p).all() for p in model.parameters()), "the non-finite step changed no weight"


def _user_model(tmp_path: Path):  # noqa: ANN202
    import importlib
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        return importlib.import_module("mymods").linear()
    finally:
        sys.path.remove(str(tmp_path))


def _audit_records(run_dir: Path) -> list[dict]:
    import json

    out = []
    for path in sorted((run_dir / "audit").glob("*.jsonl")):
        out += [r for r in map(json.loads, path.read_text().splitlines()) if r.get("type") == "step"]
    return out


@pytest.mark.slow
def test_the_tiny_language_model_learns_from_the_shipped_text(tmp_path: Path) -> None:
    from elastic_runner.data.tokens import prepare_text

    prepare_text(ROOT / "examples" / "data" / "shakespeare.txt", tmp_path / "tokens")
    result = run_bounded([sys.executable, "-m", "elastic_runner", "launch", "--standalone", "--nproc_per_node=2",
                          "-m", "elastic_runner.train", "--config", str(ROOT / "configs" / "tiny-lm.yaml"),
                          "--set", f"run.dir={tmp_path / 'run'}", "--set", f"data.path={tmp_path / 'tokens'}",
                          "--set", "train.max_steps=250", "--set", "train.eval_every_steps=0"], 230,
                         env=os.environ | {"PYTHONUNBUFFERED": "1"})
    assert result.returncode == 0, result.stdout[-3000:]
    [end] = [e for e in events(tmp_path / "run", "end") if e["rank"] == 0]
    # A uniform guess over 76 characters is ln(76) = 4.33; 250 steps reach about 2.3 on 2 CPU cores.
    assert end["eval_loss"] < 2.5 and end["eval_perplexity"] < 12.2


def _launch(config: Path, run_dir: Path, tokens: Path, nproc: int, *overrides: str) -> subprocess.CompletedProcess[str]:
    return run_bounded([sys.executable, "-m", "elastic_runner", "launch", "--standalone", f"--nproc_per_node={nproc}",
                        "-m", "elastic_runner.train", "--config", str(config), "--set", f"run.dir={run_dir}",
                        "--set", f"data.path={tokens}", "--set", "train.eval_every_steps=0",
                        "--set", "audit.samples=true", "--set", "snapshot.every_steps=20", *overrides], 230,
                       env=os.environ | {"PYTHONUNBUFFERED": "1"})


@pytest.mark.slow
def test_the_gpt_sharded_with_fsdp_trains_as_replicated_and_resumes_at_another_world_size(tmp_path: Path) -> None:
    """configs/gpt-fsdp.yaml: the same losses as the replicated GPT (same data, same exact mean gradient), every rank
    writing its own shards; the sharded snapshot resumes at 3 ranks, every sample of the run exactly once."""
    from elastic_runner.data.tokens import prepare_text
    from elastic_runner.observe.audit import check_audit

    prepare_text(ROOT / "examples" / "data" / "shakespeare.txt", tmp_path / "tokens")
    config = ROOT / "configs" / "gpt-fsdp.yaml"
    sharded, replicated = tmp_path / "fsdp", tmp_path / "ddp"
    for run_dir, strategy in ((sharded, "fsdp"), (replicated, "ddp")):
        result = _launch(config, run_dir, tmp_path / "tokens", 2, "--set", "train.max_steps=40",
                         "--set", f"parallel.strategy={strategy}")
        assert result.returncode == 0, result.stdout[-3000:]
    losses = {name: [e["loss"] for e in events(run_dir, "progress")]
              for name, run_dir in (("fsdp", sharded), ("ddp", replicated))}
    assert losses["fsdp"] and len(losses["fsdp"]) == len(losses["ddp"])
    assert max(abs(a - b) for a, b in zip(losses["fsdp"], losses["ddp"])) < 1e-4, losses
    newest = sorted((sharded / "snapshots").glob("step-*"))[-1]
    assert sorted(p.name for p in newest.glob("part-*.bin")) == ["part-00000.bin", "part-00001.bin"]
    result = _launch(config, sharded, tmp_path / "tokens", 3, "--set", "train.max_steps=60")
    assert result.returncode == 0, result.stdout[-3000:]
    [resumed] = [e for e in events(sharded, "resume")]
    assert resumed["step"] == 40 and resumed["tier"] == "disk"
    report = check_audit(sharded)
    assert report.ok and report.finished and report.final_step == 60, report.render()
