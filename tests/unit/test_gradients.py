"""The gradient of a step: the exact (weighted) mean over the global batch whatever the world size and
micro-batching, and — with the ordered gradient sync — exactly the same arithmetic in a process that
resumed as in one that never stopped, at every world size.

Each case runs the real step (:class:`~elastic_runner.training.step.TrainStep`) in W new processes
on a gloo process group.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from elastic_runner.config import EvalConfig, ModelConfig
from elastic_runner.data.layout import BatchLayout, split_even
from elastic_runner.data.sampler import StepPlan
from elastic_runner.training.gradients import StepGradients
from elastic_runner.training.parallel import BUCKET_BYTES, OrderedGradientSync, replicate
from elastic_runner.training.parts import TrainingParts
from elastic_runner.training.state import TrainState
from elastic_runner.training.step import TrainStep
from elastic_runner.workload.tasks import build_task

from ..support import start_ranks

GLOBAL = 8


def _padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 11, (GLOBAL, 9), generator=g)
    lengths = torch.tensor([9, 3, 7, 1, 5, 9, 2, 6])
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


class _Dist:
    """The collectives StepGradients uses, on the default process group."""

    def __init__(self, world: int) -> None:
        self.world_size = world

    @property
    def rank(self) -> int:
        import torch.distributed as tdist

        return tdist.get_rank()

    @staticmethod
    def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
        import torch.distributed as tdist

        tdist.all_reduce(tensor)
        return tensor

    def all_gather_object(self, obj: Any) -> list[Any]:
        import torch.distributed as tdist

        box: list[Any] = [None] * self.world_size
        tdist.all_gather_object(box, obj)
        return box


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, sync_kind: str, world: int, rank: int, micro: int,
          loss: Any, weighted: bool) -> TrainStep:
    layout = BatchLayout(world, GLOBAL, max(1, -(-GLOBAL // world) // micro), micro,
                         tuple(len(range(r, GLOBAL, world)) for r in range(world)))
    parts = TrainingParts(model=model, optimizer=optimizer, scheduler=None, scaler=None, sampler=None,
                          state=TrainState())
    sync = replicate(model, torch.device("cpu"), sync_kind)
    gradients = StepGradients(_Dist(world), model, None, "stop", None, averages_over=sync.averages_over)
    task = build_task(ModelConfig(loss="cross_entropy"), EvalConfig(), loss=loss)
    return TrainStep(parts, sync, task, layout, gradients, seed=0, rank=rank, device=torch.device("cpu"),
                     precision="fp32")


def _run_worker(rank: int, world: int, store_path: str, job: dict[str, Any]) -> None:
    """``job``: what to build and which steps to run; rank 0 saves the result to ``job['out']``."""
    import gc

    import torch._dynamo  # noqa: F401 - before the process group, as worker.group.up does (gloo threads end with it)
    import torch.distributed as tdist

    tdist.init_process_group("gloo", store=tdist.FileStore(store_path, world), rank=rank, world_size=world)
    torch.manual_seed(0)
    model = job["model"]().double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if job.get("resume"):
        saved = torch.load(job["resume"])
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
    step = _step(model, optimizer, job["sync"], world, rank, job["micro"], job["loss"], job["weighted"])
    data = job["data"]()
    for number in range(job["first"], job["last"] + 1):
        mine = list(range(GLOBAL))[rank::world]  # the elastic sampler's share of this rank
        plan = StepPlan(epoch=0, start=0, global_count=GLOBAL, indices=mine)
        batches = iter([job["collate"](data, number, list(part)) for part in split_even(mine, job["micro"]) if part])
        result = step.compute(number, plan, batches)
        if job.get("update", True):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        elif rank == 0:
            torch.save([p.grad for p in model.parameters()], job["out"])
    if rank == 0 and job.get("update", True):
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, job["out"])
    del step, result
    gc.collect()
    tdist.destroy_process_group()


def _run(world: int, tmp: Path, **job: Any) -> Any:
    job.setdefault("out", str(tmp / f"out-{world}-{len(list(tmp.iterdir()))}.pt"))
    store = tempfile.mktemp(dir=tmp)
    start_ranks(_run_worker, (world, store, job), world)
    return torch.load(job["out"])


# -- the workloads (module level: the rank processes import them) --------------------------------------------


def _token_model() -> nn.Module:
    return nn.Sequential(nn.Embedding(11, 6), nn.Linear(6, 11))


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    return _padded_batch()


def _token_rows(data: tuple[torch.Tensor, torch.Tensor], step: int, rows: list[int]) -> Any:
    ids, labels = data
    return ids[rows], labels[rows]


def _cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.ReLU(), nn.Flatten(),
                         nn.Linear(8 * 4 * 4, 32), nn.ReLU(), nn.Linear(32, 10))


def _images() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return torch.randn(12, GLOBAL, 1, 8, 8, generator=g, dtype=torch.float64), \
        torch.randint(0, 10, (12, GLOBAL), generator=g)


def _image_rows(data: tuple[torch.Tensor, torch.Tensor], step: int, rows: list[int]) -> Any:
    x, y = data
    return x[step % len(x)][rows], y[step % len(y)][rows]


def _cross_entropy(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y, reduction="none")


# -- the tests ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sync", ["ordered", "ddp"])
def test_token_weighted_gradient_is_the_same_at_any_world_size_and_micro_batching(tmp_path: Path, sync: str) -> None:
    torch.manual_seed(0)
    model = _token_model().double()
    ids, labels = _padded_batch()
    losses, counts = _token_loss(model, (ids, labels))
    ((losses * counts).sum() / counts.sum()).backward()  # the mean over every real token of the batch
    expected = [p.grad for p in model.parameters()]
    for world, micro in ((1, 3), (3, 4)):  # 3 ranks x 4 micro-steps: some are empty
        got = _run(world, tmp_path, model=_token_model, data=_tokens, collate=_token_rows, loss=_token_loss,
                   weighted=True, sync=sync, micro=micro, first=1, last=1, update=False)
        for e, g in zip(expected, got):
            assert torch.allclose(e, g, atol=1e-12), f"{sync}: world {world}, {micro} micro-batches"


@pytest.mark.slow
@pytest.mark.parametrize("world", [3, 4])
def test_a_resumed_process_does_exactly_the_arithmetic_of_one_that_never_stopped(tmp_path: Path, world: int) -> None:
    """4 steps, new processes with the saved state, 4 more: bitwise the 8 uninterrupted steps (ordered sync)."""
    job = dict(model=_cnn, data=_images, collate=_image_rows, loss=_cross_entropy, weighted=False, sync="ordered",
               micro=2)
    through = _run(world, tmp_path, **job, first=1, last=8)
    half = _run(world, tmp_path, **job, first=1, last=4)
    torch.save(half, tmp_path / "half.pt")
    resumed = _run(world, tmp_path, **job, first=5, last=8, resume=str(tmp_path / "half.pt"))
    differing = [k for k in through["model"] if not torch.equal(through["model"][k], resumed["model"][k])]
    assert not differing, f"world {world}: {len(differing)} of {len(through['model'])} tensors differ: {differing}"


def test_buckets_follow_the_model_alone() -> None:
    """Reverse registration order, one dtype per bucket, cut at the cap; a tied parameter once."""
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        embed = nn.Embedding(1000, 64)
        head = nn.Linear(64, 1000, bias=False)
        head.weight = embed.weight  # tied, as in GPT
        model = nn.Sequential(embed, nn.Linear(64, 64), head, nn.Linear(1000, 3).half())
        sync = OrderedGradientSync(model, bucket_bytes=64 * 64 * 4 + 64 * 4)
        layout = [[tuple(p.shape) for p in b.params] for b in sync.buckets]
        assert layout == [[(3,), (3, 1000)], [(64,), (64, 64)], [(1000, 64)]]
        assert sum(len(b.params) for b in sync.buckets) == len(list(model.parameters()))
        assert OrderedGradientSync(model).buckets[0].numel == 3 + 3000, "a new sync lays out the same buckets"
        assert BUCKET_BYTES == 25 << 20
        sync.close()
    finally:
        torch.distributed.destroy_process_group()
