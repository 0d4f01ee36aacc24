"""The standby worker's side (:mod:`elastic_runner.worker.standby`): what it builds ahead from the workers' command
line, and the hand-over of that to the worker it becomes (the agent's side: ``test_worker_context``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from elastic_runner.agent.zygote import worker_config
from elastic_runner.config import load_config
from elastic_runner.training.compiling import CACHE_VAR, compiled_forward
from elastic_runner.worker import standby

pytestmark = [pytest.mark.timeout(300)]

CONFIG = """
run: {{dir: {run_dir}, deterministic: {deterministic}}}
data: {{name: digits}}
model: {{name: mlp, compile: {compile}}}
batch: {{global_size: 16}}
train: {{epochs: 1}}
recovery: {{in_process: {in_process}, standby: {standby}}}
"""


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv(CACHE_VAR, str(tmp_path / "compile-cache"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    deterministic = torch.are_deterministic_algorithms_enabled()
    yield
    standby._prepared, standby._placed_at = None, None
    torch.use_deterministic_algorithms(deterministic)


def _config(tmp_path: Path, *, compile: bool = False, in_process: bool = True, wanted: bool = True,
            deterministic: bool = False) -> list[str]:
    path = tmp_path / "x.yaml"
    path.write_text(CONFIG.format(run_dir=tmp_path / "run", compile=str(compile).lower(),
                                  in_process=str(in_process).lower(), standby=str(wanted).lower(),
                                  deterministic=str(deterministic).lower()))
    return ["--config", str(path), "--set", "optim.lr=0.05"]


def test_the_workload_built_ahead_is_handed_once_to_the_worker_that_reads_the_same_config(tmp_path: Path) -> None:
    argv = _config(tmp_path)
    assert standby.prepare(worker_config(argv))
    cfg = load_config(argv[1], [argv[3]])
    workload = standby.take(cfg)
    assert workload is not None and isinstance(workload.model, torch.nn.Module) and workload.num_train > 0
    assert standby.take(cfg) is None, "handed over once: a second attempt builds its own (or keeps the first)"


def test_a_config_changed_since_the_standby_read_it_is_built_again(tmp_path: Path) -> None:
    argv = _config(tmp_path)
    assert standby.prepare(worker_config(argv))
    assert standby.take(load_config(argv[1], ["optim.lr=0.5"])) is None


@pytest.mark.parametrize("in_process, wanted", [(False, True), (True, False)])
def test_nothing_is_built_unless_the_config_wants_a_standby(tmp_path: Path, in_process: bool, wanted: bool) -> None:
    argv = _config(tmp_path, in_process=in_process, wanted=wanted)
    assert not standby.prepare(worker_config(argv))
    assert standby.take(load_config(argv[1], [argv[3]])) is None


def test_a_config_that_does_not_load_or_build_leaves_the_error_to_the_worker(tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text("model: {name: no-such-model}\n")
    assert worker_config(["--config", str(tmp_path / "bad.yaml")]) is None
    assert worker_config(["--no-such-option"]) is None
    assert worker_config(["--config", str(tmp_path / "missing.yaml")]) is None
    cfg = worker_config(_config(tmp_path))
    cfg.data.name = "no-such-dataset"  # loads, but does not build
    assert not standby.prepare(cfg) and standby.take(cfg) is None


def test_the_worker_s_start_is_when_the_standby_took_its_place() -> None:
    assert standby.placed_at() is None, "a worker started as one"
    standby.placed()
    assert standby.placed_at() is not None and abs(standby.placed_at() - __import__("time").time()) < 5


@pytest.mark.slow
def test_a_compiled_model_is_traced_ahead_so_that_the_worker_s_first_step_compiles_nothing(tmp_path: Path) -> None:
    from torch._dynamo.utils import counters

    from elastic_runner.data.sources import collate_items

    torch._dynamo.reset()
    argv = _config(tmp_path, compile=True, deterministic=True)
    try:
        assert standby.prepare(worker_config(argv))
        traced = counters["stats"]["unique_graphs"]
        assert traced >= 1, "the standby traced the model"
        workload = standby.take(load_config(argv[1], [argv[3]]))
        assert workload is not None and all(p.grad is None for p in workload.model.parameters())
        # The worker's first step: a new compiled wrapper of the same model, the micro-batch of world size 2.
        forward: Any = compiled_forward(workload.model, True)
        batch = collate_items(workload.train, list(range(8)), workload.collate)
        losses, _ = workload.task.compute_loss(forward, batch, 8)
        losses.sum().backward()
        assert counters["stats"]["unique_graphs"] == traced, "the worker found the standby's graphs"
    finally:
        torch._dynamo.reset()
