"""The baseline: a DDP training script as the standard tutorials teach it (``--parallel fsdp``: the same script
with FSDP2 and torch.distributed.checkpoint, as torchtitan sets them up).

DistributedSampler with ``set_epoch``, rank 0 ``torch.save`` of model and
optimizer every K steps, ``torch.load(map_location=...)`` at start, run under
plain ``torchrun``. Same model, data, batch and optimizer as elastic_runner's
benchmark configs, so the two differ only in how they handle faults.

The lines marked ``# timing`` are benchmark instrumentation (one JSON line per
event into RUN_DIR/timing/), not part of what a user would write.

    torchrun --nnodes=1:4 --nproc_per_node=1 --rdzv_backend=c10d --rdzv_endpoint=HOST:PORT \\
        benchmarks/baseline_ddp.py --run-dir runs/base --data digits --steps 2000
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from elastic_runner.config import DataConfig, ModelConfig
from elastic_runner.data.datasets import build_datasets
from elastic_runner.workload.models import build_model


class Timing:  # timing: benchmark instrumentation
    def __init__(self, run_dir: str, rank: int) -> None:
        os.makedirs(os.path.join(run_dir, "timing"), exist_ok=True)
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.fh = open(os.path.join(run_dir, "timing", f"rank{rank}-pid{os.getpid()}.jsonl"), "a", buffering=1)
        self.base = {"rank": rank, "pid": os.getpid(), "restart": int(restart),
                     "world_size": int(os.environ.get("WORLD_SIZE", "1"))}

    def __call__(self, kind: str, **fields: object) -> None:
        self.fh.write(json.dumps({"time": time.time(), "kind": kind} | self.base | fields) + "\n")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--data", default="digits", choices=["digits", "synthetic", "tokens", "fake_images"])
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--augment", action="store_true", help="fake_images: random crop and flip in the workers")
    p.add_argument("--tokens-dir", default=None, help="--data tokens: a directory from elastic-runner data prepare-text")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--gpt", default="4,4,128", help="--model gpt: n_layer,n_head,n_embd")
    p.add_argument("--optim", default="sgd", choices=["sgd", "adamw"])
    p.add_argument("--synthetic-size", type=int, default=8192)
    p.add_argument("--synthetic-shape", default="3,32,32")
    p.add_argument("--model", default="cnn")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--channels", type=int, default=16)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--batch-per-rank", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--epochs", type=int, default=1000)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--log-every", type=int, default=1, help="timing line every N steps (first step always)")
    p.add_argument("--parallel", default="ddp", choices=["ddp", "fsdp"],
                   help="fsdp: FSDP2 as torchtitan sets it up (fully_shard on every GPT block, then the root; "
                        "the optimizer over the sharded parameters; checkpoints through torch.distributed.checkpoint)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: one GPU per rank, NCCL")
    p.add_argument("--bf16", action="store_true", help="--parallel fsdp: bfloat16 compute, float32 shards and reduction")
    args = p.parse_args()

    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    timing = Timing(args.run_dir, rank)  # timing
    timing("pg_up")  # timing

    torch.manual_seed(0)
    if args.data == "tokens":  # the tiny GPT on token windows (next-token loss, mean over tokens)
        from pathlib import Path

        from elastic_runner.data.tokens import token_datasets
        from elastic_runner.workload.gpt import GPT

        train, _, meta = token_datasets(Path(args.tokens_dir), args.block_size)
        n_layer, n_head, n_embd = (int(v) for v in args.gpt.split(","))
        model = GPT(meta["vocab_size"], args.block_size, n_layer, n_head, n_embd)
    elif args.data == "fake_images":  # a torchvision model on images, augmented in the DataLoader's workers
        import torchvision
        from torchvision.transforms import v2

        from elastic_runner.data.images import FakeImages

        side = int(args.synthetic_shape.split(",")[-1])
        steps = [v2.RandomCrop(side, padding=4), v2.RandomHorizontalFlip()] if args.augment else []
        transform = v2.Compose(steps + [v2.Normalize([0.5] * 3, [0.25] * 3)])
        images = FakeImages(args.synthetic_size, 10, side, 0.7, seed=1234)

        class Augmented(torch.utils.data.Dataset):  # as tutorials write it: the transform in __getitem__
            def __len__(self) -> int:
                return len(images)

            def __getitem__(self, i: int):  # noqa: ANN204
                x, y = images[i]
                return transform(x), y

        train = Augmented()
        model = getattr(torchvision.models, args.model)(num_classes=10)
    else:
        if args.data == "digits":
            data_cfg = DataConfig(name="digits")
        else:
            data_cfg = DataConfig(name="synthetic", params={"size": args.synthetic_size,
                                                            "shape": [int(s) for s in args.synthetic_shape.split(",")]})
        bundle = build_datasets(data_cfg)
        train = TensorDataset(bundle.train.x, bundle.train.y)  # type: ignore[attr-defined]
        params = {"hidden": args.hidden} | ({"channels": args.channels} if args.model == "cnn" else {"depth": args.depth})
        model = build_model(ModelConfig(name=args.model, params=params), bundle.input_shape, bundle.num_classes)
    model = model.to(device)
    if args.parallel == "fsdp":  # before the optimizer: it holds the shards
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if args.bf16 else {}
        blocks = getattr(model, "blocks", None)  # the GPT's transformer blocks; any other model: its children
        for block in blocks if blocks is not None else [c for c in model.children() if any(True for _ in c.parameters())]:
            fully_shard(block, **mp)
        fully_shard(model, **mp)
    # FSDP2's parameters are DTensors, for which torch picks the per-tensor loop: torchtitan asks for foreach.
    multi = {"foreach": True} if args.parallel == "fsdp" else {}
    if args.optim == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4, **multi)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4, **multi)

    ckpt = os.path.join(args.run_dir, "checkpoint.pt")
    start_epoch, step = 0, 0
    if args.parallel == "fsdp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        ckpt = os.path.join(args.run_dir, "checkpoint-dcp")
        if os.path.exists(os.path.join(ckpt, ".metadata")):
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optimizer": optim_sd, "epoch": 0, "step": 0}
            dcp.load(state, checkpoint_id=ckpt)
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
            start_epoch, step = state["epoch"], state["step"]
            timing("resume", step=step)  # timing
    elif os.path.exists(ckpt):
        state = torch.load(ckpt, map_location=device)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch, step = state["epoch"], state["step"]
        timing("resume", step=step)  # timing

    if args.parallel == "ddp":
        model = DDP(model)
    sampler = DistributedSampler(train, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=args.batch_per_rank, sampler=sampler, drop_last=True, num_workers=args.workers,
                        pin_memory=args.device == "cuda")
    first = True
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            out = model(x)
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if first or step % args.log_every == 0:  # timing
                if args.device == "cuda":  # timing: the time the GPU finished the step, not when it was queued
                    torch.cuda.synchronize()
                timing("first_step" if first else "step", step=step)  # timing
            first = False
            if args.parallel == "fsdp" and step % args.save_every == 0:  # every rank writes its shards
                t_save = time.perf_counter()  # timing
                model_sd, optim_sd = get_state_dict(model, optimizer)
                dcp.save({"model": model_sd, "optimizer": optim_sd, "epoch": epoch, "step": step}, checkpoint_id=ckpt)
                timing("save", step=step, seconds=time.perf_counter() - t_save)  # timing
            elif rank == 0 and step % args.save_every == 0:
                t_save = time.perf_counter()  # timing
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "epoch": epoch, "step": step}, ckpt)
                timing("save", step=step, seconds=time.perf_counter() - t_save)  # timing
            if step >= args.steps:
                break
        if step >= args.steps:
            break
    timing("end", step=step)  # timing
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
