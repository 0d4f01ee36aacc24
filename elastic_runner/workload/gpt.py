"""A small decoder-only transformer (GPT), the built-in language model (``model.name: gpt``).

nanoGPT's architecture: token and position embeddings, ``n_layer`` pre-norm blocks of causal
self-attention (``scaled_dot_product_attention``, so the fused kernels are used where available)
and an MLP, a final LayerNorm and an output head tied to the token embedding. ``forward(idx)``
maps token ids ``[B, T]`` to logits ``[B, T, vocab]``; the built-in ``cross_entropy`` loss then
gives each window its mean token loss, weighted by its token count.

Models know nothing about distribution: no torch.distributed here.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from ..config import ConfigError


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_dropout(self.proj(y.transpose(1, 2).contiguous().view(b, t, c)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd, bias=bias), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd, bias=bias), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, block_size: int = 128, n_layer: int = 4, n_head: int = 4, n_embd: int = 128,
                 dropout: float = 0.0, bias: bool = True) -> None:
        super().__init__()
        for key, value in (("vocab_size", vocab_size), ("block_size", block_size), ("n_layer", n_layer),
                           ("n_head", n_head), ("n_embd", n_embd)):
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"model.params.{key}", f"got {value!r}, must be a positive integer",
                                  f"Set model.params.{key} to e.g. 4")
        if n_embd % n_head:
            raise ConfigError("model.params.n_embd", f"{n_embd} is not divisible by model.params.n_head={n_head}",
                              f"Set n_embd to a multiple of n_head, e.g. {n_head * max(1, round(n_embd / n_head))}")
        if not 0.0 <= dropout < 1.0:
            raise ConfigError("model.params.dropout", f"got {dropout!r}, must be in [0, 1)", "Set it to e.g. 0.1")
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout, bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.wte.weight  # weight tying
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):  # scaled residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence of {t} tokens is longer than model.params.block_size={self.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int, temperature: float = 1.0) -> torch.Tensor:
        """Sample ``new_tokens`` tokens after ``idx`` ([B, T])."""
        for _ in range(new_tokens):
            logits = self(idx[:, -self.block_size:])[:, -1, :] / max(temperature, 1e-6)
            idx = torch.cat([idx, torch.multinomial(F.softmax(logits, dim=-1), 1)], dim=1)
        return idx
