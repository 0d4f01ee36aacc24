"""Bring your own training: any batch structure, your loss and metrics, token data, YAML as people write it."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from elastic_runner.config import ConfigError, EvalConfig, ModelConfig, load_config
from elastic_runner.data.sources import collate_items, to_device
from elastic_runner.data.tokens import prepare_text, read_meta, token_datasets
from elastic_runner.workload.gpt import GPT
from elastic_runner.workload.tasks import build_task, per_sample

# ---------------------------------------------------------------- YAML as people write it


def test_yaml_1_2_floats_and_on_off_words_are_understood(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("optim: {lr: 3e-4, weight_decay: 1e-2}\nschedule: {gamma: 1.5E+3}\n"
                    "logging: {progress_bar: off}\ntrain: {epochs: 1}\n")
    cfg = load_config(path)
    assert (cfg.optim.lr, cfg.optim.weight_decay, cfg.schedule.gamma) == (3e-4, 1e-2, 1500.0)
    assert cfg.logging.progress_bar == "off"
    assert load_config(path, ["logging.progress_bar=on", "optim.lr=5e-5"]).logging.progress_bar == "on"
    assert load_config(path, ["optim.lr=5e-5"]).optim.lr == 5e-5
    assert load_config({"optim": {"lr": "3e-4"}, "train": {"epochs": 1}}).optim.lr == 3e-4  # a mapping built in Python


def test_a_loss_that_is_neither_built_in_nor_an_import_path_says_what_to_write() -> None:
    with pytest.raises(ConfigError, match=r"model.loss: got 'smooth_l1', expected one of cross_entropy, mse or an import path"):
        load_config({"model": {"loss": "smooth_l1"}, "train": {"epochs": 1}})


# ---------------------------------------------------------------- batches of any structure


@dataclass
class Pair:
    features: torch.Tensor
    score: float


def test_nested_items_collate_and_move_to_the_device_whole() -> None:
    items = [{"ids": torch.arange(3), "meta": (torch.ones(2), 7), "pair": Pair(torch.zeros(4), 0.5)} for _ in range(4)]
    batch = to_device(collate_items(items, [0, 1, 2], None), torch.device("cpu"))
    assert batch["ids"].shape == (3, 3) and batch["meta"][0].shape == (3, 2) and batch["meta"][1].tolist() == [7] * 3
    assert isinstance(batch["pair"], Pair) and batch["pair"].features.shape == (3, 4)


def test_items_of_different_structures_name_both_indices_and_structures() -> None:
    items = [{"input_ids": torch.zeros(4, dtype=torch.long), "labels": torch.zeros(4, dtype=torch.long)}] * 5
    items = items[:3] + [{"input_ids": torch.zeros(4, dtype=torch.long)}] + items[3:]
    with pytest.raises(ConfigError) as err:
        collate_items(items, [0, 1, 2, 3], None)
    text = str(err.value)
    assert "dataset items 0 and 3 have different structures" in text
    assert "{input_ids: Tensor[4] int64, labels: Tensor[4] int64} vs {input_ids: Tensor[4] int64}" in text


def test_sequences_of_different_lengths_point_at_data_collate() -> None:
    items = [torch.zeros(5), torch.zeros(5), torch.zeros(7)]
    with pytest.raises(ConfigError, match=r"items 0 and 2 hold tensors of different shapes at item: \[5\] vs \[7\].*data.collate"):
        collate_items(items, [0, 1, 2], None)


# ---------------------------------------------------------------- losses and metrics


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


# ---------------------------------------------------------------- token-weighted gradients are exact


def _padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 11, (8, 9), generator=g)
    lengths = torch.tensor([9, 3, 5, 9, 2, 7, 4, 6])
    labels = ids.clone()
    for row, n in enumerate(lengths):
        labels[row, n:] = -100
    return ids, labels


def _token_loss(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    ids, labels = batch
    logits = model(ids)
    per_token = nn.functional.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1), reduction="none",
                                            ignore_index=-100).view(labels.shape)
    counts = (labels != -100).sum(1).double()
    return per_token.sum(1) / counts, counts


def _worker_gradient(rank: int, world: int, micro: int, store_path: str, out: str) -> None:
    import gc

    import torch._dynamo  # noqa: F401 - before the process group, as Dist.up does (gloo threads end with it)
    import torch.distributed as tdist

    from elastic_runner.data.layout import split_even
    from elastic_runner.training.gradients import StepGradients
    from elastic_runner.training.parallel import EMPTY, Replica
    from elastic_runner.workload.tasks import per_sample

    tdist.init_process_group("gloo", store=tdist.FileStore(store_path, world), rank=rank, world_size=world)

    class Dist:
        world_size = world

        @staticmethod
        def sum_floats(values: list[float]) -> list[float]:
            t = torch.tensor(values, dtype=torch.float64)
            tdist.all_reduce(t)
            return t.tolist()

        @staticmethod
        def all_gather_object(obj: Any) -> list[Any]:
            box: list[Any] = [None] * world
            tdist.all_gather_object(box, obj)
            return box

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 6), nn.Linear(6, 11)).double()
    ddp = torch.nn.parallel.DistributedDataParallel(Replica(model))
    grads = StepGradients(Dist, model, None, "stop", None)
    ids, labels = _padded_batch()
    mine = list(range(8))[rank::world]  # the elastic sampler's share of this rank
    for i, part in enumerate(split_even(mine, micro)):
        with ddp.no_sync() if i < micro - 1 else torch.enable_grad():
            if part:
                losses, weights = per_sample(_token_loss(ddp, (ids[list(part)], labels[list(part)])), len(part), "loss")
                loss = grads.loss_for_backward(losses, weights, 8, "loss")
            else:
                loss = ddp(EMPTY)
            loss.backward()
    grads.finish(1, True, torch.tensor([0.0, float(sum(int((labels[j] != -100).sum()) for j in mine))], dtype=torch.float64),
                 torch.optim.SGD(model.parameters(), lr=0.1))
    if rank == 0:
        torch.save([p.grad for p in model.parameters()], out)
    del ddp
    gc.collect()
    tdist.destroy_process_group()


def _gradient(world: int, micro: int, tmp: Path) -> list[torch.Tensor]:
    store = tempfile.mktemp(dir=tmp)
    out = str(tmp / f"grad-{world}-{micro}.pt")
    mp.start_processes(_worker_gradient, args=(world, micro, store, out), nprocs=world, start_method="spawn")
    return torch.load(out)


def test_token_weighted_gradient_is_the_same_at_any_world_size_and_micro_batching(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 6), nn.Linear(6, 11)).double()
    ids, labels = _padded_batch()
    losses, counts = _token_loss(model, (ids, labels))
    ((losses * counts).sum() / counts.sum()).backward()  # the mean over every real token of the batch
    expected = [p.grad for p in model.parameters()]
    for world, micro in ((1, 3), (3, 4)):  # 3 ranks x 4 micro-steps: some are empty
        got = _gradient(world, micro, tmp_path)
        for e, g in zip(expected, got):
            assert torch.allclose(e, g, atol=1e-12), f"world {world}, {micro} micro-batches"


# ---------------------------------------------------------------- token files and the GPT


def test_prepare_text_writes_token_files_that_read_back_as_windows(tmp_path: Path) -> None:
    text = tmp_path / "in.txt"
    text.write_text("hello world, " * 200, encoding="utf-8")
    meta = prepare_text(text, tmp_path / "tok", val_fraction=0.1)
    assert meta["vocab_size"] == len(set("hello world, ")) and read_meta(tmp_path / "tok")["dtype"] == "uint16"
    train, val, _ = token_datasets(tmp_path / "tok", block_size=16)
    x, y = train[3]
    assert x.shape == y.shape == (16,) and torch.equal(x[1:], y[:-1])
    assert torch.equal(train[4][0][0], y[-1]), "windows are contiguous: exactly once per epoch"
    assert len(train) == (meta["train_tokens"] - 1) // 16 and len(val) > 0


def test_bad_token_inputs_name_the_file_and_the_fix(tmp_path: Path) -> None:
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf".encode() + b"\xe9 au lait")
    with pytest.raises(ConfigError, match=r"latin1.txt: is not UTF-8: byte 3 \(0xe9\) cannot be decoded"):
        prepare_text(bad, tmp_path / "out")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"has no meta.json.*prepare-text"):
        read_meta(empty)
    (empty / "meta.json").write_text(json.dumps({"vocab_size": 70000, "dtype": "uint16"}))
    with pytest.raises(ConfigError, match=r"vocab_size 70000 does not fit dtype uint16"):
        read_meta(empty)


def test_gpt_checks_its_shape_and_predicts_every_position() -> None:
    with pytest.raises(ConfigError, match=r"model.params.n_embd: 100 is not divisible by model.params.n_head=3"):
        GPT(vocab_size=10, n_embd=100, n_head=3)
    model = GPT(vocab_size=10, block_size=8, n_layer=1, n_head=2, n_embd=16)
    assert model(torch.zeros(2, 8, dtype=torch.long)).shape == (2, 8, 10)
    assert model.head.weight is model.wte.weight, "weight tying"


def test_bf16_autocast_runs_the_gpt_on_the_cpu() -> None:
    model = GPT(vocab_size=10, block_size=8, n_layer=1, n_head=2, n_embd=16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(torch.zeros(2, 8, dtype=torch.long))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()

