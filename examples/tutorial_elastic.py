"""examples/tutorial_ddp.py on elastic_runner: the same model and data, handed to elastic_runner.fit.

    torchrun --standalone --nproc_per_node=2 examples/tutorial_elastic.py
    elastic-runner launch --nnodes=1:4 --nproc_per_node=1 --rdzv_backend=c10d --rdzv_endpoint=HOST:29400 \\
        --rdzv_id=toy --max_restarts=100 examples/tutorial_elastic.py

What changes: no process group, sampler, DDP wrapper or checkpoint code of our own; the loss is
per sample. What it gains: snapshots every 20 steps (atomic, verified) and in node memory when a
worker fails, resume from the newest after any restart or membership change with every sample of
an epoch seen exactly once and the global batch of 64 kept, a peer watchdog, metrics, an audit.
"""

import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

import elastic_runner

EPOCHS, BATCH = 5, 32


class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1, self.relu, self.net2 = nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


def toy_data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 10, generator=g)
    return TensorDataset(x, torch.tanh(x @ torch.randn(10, 5, generator=g)))


def per_sample_mse(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y, reduction="none").mean(1)


def main() -> int:
    return elastic_runner.fit(
        ToyModel(), toy_data(), loss=per_sample_mse,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.05),
        config={"run": {"dir": "runs/tutorial-elastic"}, "batch": {"global_size": 2 * BATCH},
                "train": {"epochs": EPOCHS}, "snapshot": {"every_steps": 20}},
    )


if __name__ == "__main__":
    sys.exit(main())
