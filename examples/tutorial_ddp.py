"""The DDP tutorial script people write today (the seed notes, pytorch.org's DDP tutorial).

    torchrun --standalone --nproc_per_node=2 examples/tutorial_ddp.py

DistributedSampler with set_epoch, a checkpoint saved by rank 0 at the end of every epoch, loaded
with map_location at start. What it loses on a failure: everything since the last epoch; a
restart at another world size reshuffles the epoch (samples are seen twice or not at all); a
checkpoint written while the process dies is torn. Compare examples/tutorial_elastic.py.
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EPOCHS, BATCH, CHECKPOINT = 5, 32, "runs/tutorial-ddp/checkpoint.pt"


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


def main() -> None:
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, local_rank = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    model = ToyModel().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    start = 0
    if os.path.exists(CHECKPOINT):
        state = torch.load(CHECKPOINT, map_location=device)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["epoch"] + 1
    ddp = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    data = toy_data()
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler)
    for epoch in range(start, EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = nn.functional.mse_loss(ddp(x.to(device)), y.to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if rank == 0:
            os.makedirs(os.path.dirname(CHECKPOINT), exist_ok=True)
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}, CHECKPOINT)
            print(f"epoch {epoch} loss {loss.item():.4f}")
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
