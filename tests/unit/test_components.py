"""Component builders: batching layout, env, import paths, models, data, optimizers."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch

from elastic_runner.config import BatchConfig, ConfigError, DataConfig, ModelConfig, OptimConfig, ScheduleConfig
from elastic_runner.config.imports import resolve
from elastic_runner.data.datasets import build_datasets, load_digits_tensors
from elastic_runner.data.layout import layout_for, split_even, valid_world_sizes
from elastic_runner.env import EnvError, WorkerEnv
from elastic_runner.workload.models import build_model
from elastic_runner.workload.optim import build_optimizer, build_schedule
from elastic_runner.workload.tasks import per_sample_loss

# ---------------------------------------------------------------- batching


def test_global_batch_is_constant_across_world_sizes() -> None:
    cfg = BatchConfig(global_size=64, micro_size=16)
    for world in (1, 2, 3, 4, 5, 8):
        layout = layout_for(cfg, world)
        assert sum(layout.shares) == 64
        assert max(layout.shares) - min(layout.shares) <= 1
        assert layout.micro_size <= 16
        assert layout.micro_size * layout.accumulation >= max(layout.shares)
    assert layout_for(cfg, 1).accumulation == 4 and layout_for(cfg, 4).accumulation == 1


def test_refuse_policy_lists_valid_world_sizes() -> None:
    with pytest.raises(ConfigError, match=r"\[1, 2, 3, 4, 6, 8, 12, 16, 24, 48\]"):
        layout_for(BatchConfig(global_size=48, uneven="refuse"), 5)
    assert valid_world_sizes(12) == [1, 2, 3, 4, 6, 12]


def test_per_rank_policy_grows_the_batch_and_can_scale_the_lr() -> None:
    layout = layout_for(BatchConfig(global_size=None, per_rank_size=8, scale_lr="linear"), 4)
    assert layout.global_size == 32 and layout.lr_scale == 4.0


def test_split_even_covers_everything_in_order() -> None:
    parts = [list(p) for p in split_even(list(range(10)), 3)]
    assert parts == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert [list(p) for p in split_even([1], 3)] == [[1], [], []]


# ---------------------------------------------------------------- env


def test_env_reads_torchrun_variables() -> None:
    env = WorkerEnv.from_environ({
        "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
        "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_MAX_RESTARTS": "9", "TORCHELASTIC_RUN_ID": "job1",
        "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
    })
    assert (env.rank, env.local_rank, env.world_size, env.group_rank) == (3, 1, 4, 1)
    assert (env.restart_count, env.max_restarts, env.run_id, env.under_torchrun) == (2, 9, "job1", True)
    assert env.master_port == 29500 and not env.is_rank0 and not env.is_local_leader


def test_env_alone_is_world_size_one_and_accepts_legacy_local_rank() -> None:
    env = WorkerEnv.from_environ({}, legacy_local_rank=2)
    assert (env.rank, env.world_size, env.local_rank, env.under_torchrun) == (0, 1, 2, False)


def test_env_rejects_inconsistent_values() -> None:
    with pytest.raises(EnvError, match="RANK=4"):
        WorkerEnv.from_environ({"RANK": "4", "WORLD_SIZE": "2"})
    with pytest.raises(EnvError, match="not an integer"):
        WorkerEnv.from_environ({"WORLD_SIZE": "two"})


# ---------------------------------------------------------------- import paths


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "my_components.py").write_text(textwrap.dedent("""
        import torch
        from elastic_runner.data.datasets import TensorPairDataset

        class Tiny(torch.nn.Module):
            def __init__(self, num_classes, width=4):
                super().__init__()
                self.fc = torch.nn.Linear(3, num_classes)
            def forward(self, x):
                return self.fc(x)

        def dataset(size=20):
            g = torch.Generator().manual_seed(0)
            return TensorPairDataset(torch.randn(size, 3, generator=g), torch.arange(size) % 2)

        not_callable = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_components"
    sys.modules.pop("my_components", None)


def test_user_model_and_dataset_by_import_path(user_module: str) -> None:
    bundle = build_datasets(DataConfig(name=f"{user_module}:dataset", params={"size": 12}))
    assert bundle.num_train == 12 and bundle.input_shape == (3,) and bundle.num_classes == 2
    model = build_model(ModelConfig(name=f"{user_module}:Tiny"), bundle.input_shape, bundle.num_classes)
    assert model(torch.zeros(2, 3)).shape == (2, 2)


@pytest.mark.parametrize(("reference", "message"), [
    ("no_such_pkg.mod:thing", "cannot import module 'no_such_pkg.mod'"),
    ("my_components:Missing", "has no attribute 'Missing'"),
    ("my_components:not_callable", "is not callable"),
    ("torchvision.models:resnet18", "cannot import module"),
])
def test_import_path_errors_name_the_key_and_problem(user_module: str, reference: str, message: str) -> None:
    try:
        import torchvision  # noqa: F401
        if reference.startswith("torchvision"):
            pytest.skip("torchvision imports on this machine")
    except Exception:
        pass
    with pytest.raises(ConfigError, match=message) as info:
        resolve(reference, "model.name")
    assert "model.name" in str(info.value)


def test_wrong_keyword_for_a_user_factory_names_the_params_key(user_module: str) -> None:
    with pytest.raises(ConfigError, match="model.params"):
        build_model(ModelConfig(name=f"{user_module}:Tiny", params={"depth": 3}), (3,), 2)


# ---------------------------------------------------------------- data and models


def test_digits_ship_with_the_package_and_split_deterministically() -> None:
    x, y = load_digits_tensors()
    assert x.shape == (1797, 1, 8, 8) and 0.0 <= float(x.min()) and float(x.max()) <= 1.0
    assert sorted(set(y.tolist())) == list(range(10))
    a = build_datasets(DataConfig(name="digits"))
    b = build_datasets(DataConfig(name="digits"))
    assert a.num_train + len(a.test) == 1797  # type: ignore[arg-type]
    assert torch.equal(a.train.x, b.train.x)  # type: ignore[attr-defined]


def test_synthetic_is_deterministic_and_validated() -> None:
    cfg = DataConfig(name="synthetic", params={"size": 64, "shape": [3, 4, 4], "num_classes": 5})
    a, b = build_datasets(cfg), build_datasets(cfg)
    assert a.input_shape == (3, 4, 4) and a.num_classes == 5 and a.num_train == 64
    assert torch.equal(a.train.x, b.train.x)  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="data.params"):
        build_datasets(DataConfig(name="synthetic", params={"sise": 3}))
    with pytest.raises(ConfigError, match="data.params.shape"):
        build_datasets(DataConfig(name="synthetic", params={"shape": [0]}))


def test_torchvision_datasets_explain_the_missing_extra(tmp_path: Path) -> None:
    try:
        import torchvision  # noqa: F401
        pytest.skip("torchvision imports here: this is checked in the torch 2.13.0 run (scripts/test.sh), which has none")
    except Exception:
        pass
    with pytest.raises(ConfigError, match=r"elastic-runner\[vision\]"):
        build_datasets(DataConfig(name="image_folder", path=str(tmp_path)))


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_builtin_models_fit_digits(name: str) -> None:
    model = build_model(ModelConfig(name=name, params={"hidden": 16}), (1, 8, 8), 10)
    out = model(torch.zeros(4, 1, 8, 8))
    assert out.shape == (4, 10)
    assert per_sample_loss("cross_entropy", out, torch.zeros(4, dtype=torch.long)).shape == (4,)


def test_cnn_refuses_flat_inputs() -> None:
    with pytest.raises(ConfigError, match="mlp"):
        build_model(ModelConfig(name="cnn"), (64,), 10)


def test_the_workload_never_imports_torch_distributed() -> None:
    """Models, tasks and optimizers know nothing of distribution (the training room wraps them)."""
    import ast

    workload = Path(__file__).resolve().parents[2] / "elastic_runner" / "workload"
    offenders = {}
    for source in sorted(workload.glob("*.py")):
        imported = set()
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                imported.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
                imported.update(f"{node.module}.{a.name}" for a in node.names)
        bad = [m for m in imported if m.startswith("torch.distributed") or m == "torch.nn.parallel"]
        if bad:
            offenders[source.name] = bad
    assert not offenders


def test_optimizers_and_schedules() -> None:
    params = [torch.nn.Parameter(torch.zeros(2))]
    sgd = build_optimizer(OptimConfig(name="sgd", lr=0.1), params)
    assert isinstance(sgd, torch.optim.SGD)
    adamw = build_optimizer(OptimConfig(name="adamw", lr=0.01, params={"betas": [0.8, 0.9]}), params, lr_scale=2.0)
    assert adamw.param_groups[0]["lr"] == 0.02
    sched = build_schedule(ScheduleConfig(name="cosine", warmup_steps=10), sgd, total_steps=100)
    lrs = []
    for _ in range(100):
        lrs.append(sgd.param_groups[0]["lr"])
        sgd.step()
        sched.step()
    assert lrs[0] == pytest.approx(0.01) and max(lrs) == pytest.approx(0.1) and lrs[-1] < 0.001
    with pytest.raises(ConfigError, match="optim.params"):
        build_optimizer(OptimConfig(name="sgd", params={"bogus": 1}), params)
    custom = build_optimizer(OptimConfig(name="torch.optim:RMSprop", lr=0.01), params)
    assert isinstance(custom, torch.optim.RMSprop)
