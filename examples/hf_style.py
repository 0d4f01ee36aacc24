"""A HuggingFace-style workload: dict batches, padded variable-length sequences, an attention mask,
and a token-weighted loss — with no download (the lines of a shipped Shakespeare text).

Run it as a script (the script API)::

    torchrun --standalone --nproc_per_node=2 examples/hf_style.py --run-dir runs/hf
    torchrun --standalone --nproc_per_node=2 examples/hf_style.py --run-dir runs/hf-fsdp --parallel fsdp  # sharded

or through a config that names these functions by import path (from the ``examples`` directory,
which is then on ``sys.path`` as the working directory)::

    cd examples && elastic-runner launch --standalone --nproc_per_node=2 -m elastic_runner.train \\
        --config hf_style.yaml

Items are ``{"input_ids": LongTensor[L]}`` with L from 8 to 96 characters. ``collate`` pads a batch
to its longest item, builds the attention mask and the labels (``-100`` on padding), and
``token_loss`` returns each sequence's mean token loss *and its token count*, so that
elastic_runner optimises the exact mean over every real token of the global batch, whatever the
world size, the micro-batching, and however many pad tokens each rank's share happens to have.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

TEXT = Path(__file__).resolve().parent / "data" / "shakespeare.txt"
PAD = 0


class Lines(torch.utils.data.Dataset):
    """Non-empty lines of a text as character ids (1..V; 0 is padding), 8 to 96 characters long."""

    def __init__(self, text: Path = TEXT, split: str = "train", limit: int | None = None) -> None:
        lines = [ln.strip() for ln in text.read_text(encoding="utf-8").splitlines()]
        lines = [ln[:96] for ln in lines if len(ln) >= 8]
        chars = sorted({c for ln in lines for c in ln})
        self.vocab = {c: i + 1 for i, c in enumerate(chars)}
        cut = int(len(lines) * 0.95)
        self.lines = lines[:cut] if split == "train" else lines[cut:]
        if limit is not None:
            self.lines = self.lines[:limit]

    @property
    def vocab_size(self) -> int:
        return len(self.vocab) + 1

    def __len__(self) -> int:
        return len(self.lines)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.tensor([self.vocab[c] for c in self.lines[index]], dtype=torch.long)}


def dataset(limit: int | None = 4096, eval_limit: int | None = 512) -> tuple[Lines, Lines]:
    """``data.name: hf_style:dataset`` — a (train, test) pair."""
    return Lines(split="train", limit=limit), Lines(split="test", limit=eval_limit)


def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """``data.collate: hf_style:collate`` — pad to the longest item; mask and labels for padding."""
    longest = max(len(item["input_ids"]) for item in items)
    ids = torch.full((len(items), longest), PAD, dtype=torch.long)
    for row, item in enumerate(items):
        ids[row, :len(item["input_ids"])] = item["input_ids"]
    mask = ids != PAD
    labels = ids.masked_fill(~mask, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class TinyLM(nn.Module):
    """``model.name: hf_style:TinyLM`` — a small causal transformer with an HF-like forward."""

    #: As a HuggingFace model says which blocks must stay whole: under parallel.strategy fsdp each is one shard unit.
    _no_split_modules = ["TransformerEncoderLayer"]

    def __init__(self, vocab_size: int = 80, d_model: int = 64, n_layer: int = 2, n_head: int = 4,
                 max_len: int = 96) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        layer = nn.TransformerEncoderLayer(d_model, n_head, 4 * d_model, dropout=0.1, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, n_layer, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        length = input_ids.shape[1]
        x = self.embed(input_ids) + self.pos(torch.arange(length, device=input_ids.device))
        causal = torch.triu(torch.ones(length, length, dtype=torch.bool, device=input_ids.device), diagonal=1)
        x = self.blocks(x, mask=causal, src_key_padding_mask=~attention_mask)
        return self.head(self.norm(x))


def token_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``model.loss: hf_style:token_loss`` — per sequence: mean next-token loss, and its token count."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])[:, :-1]
    labels = batch["labels"][:, 1:]
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                                reduction="none", ignore_index=-100).view(labels.shape)
    counts = (labels != -100).sum(1)
    return per_token.sum(1) / counts.clamp(min=1), counts.to(per_token.dtype)


def main(argv: list[str] | None = None) -> int:
    import elastic_runner

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", default="runs/hf-style")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--parallel", choices=["ddp", "fsdp", "hsdp"], default=None,
                   help="replicate the model (ddp, the default) or shard it (fsdp; hsdp: within each node)")
    args = p.parse_args(argv)
    train, test = dataset()
    torch.manual_seed(0)
    model = TinyLM(vocab_size=train.vocab_size)
    config = {"run": {"dir": args.run_dir}, "batch": {"global_size": 32}, "train": {"epochs": 1},
              "snapshot": {"every_steps": 20}, "logging": {"every_steps": 20}, "schedule": {"name": "cosine", "warmup_steps": 10}}
    status = elastic_runner.fit(model, train, eval_data=test, loss=token_loss, collate=collate,
                                optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01),
                                config=config, overrides=args.overrides, parallel=args.parallel)
    return status


if __name__ == "__main__":
    sys.exit(main())
