"""The save path's sharded strategy (:mod:`elastic_runner.training.save_path`): node memory for the shards is on for
every rank or for none — its exchange group and every refresh are collectives, so a node whose memory directory is
refused (planted, another user's) must not leave the others alone inside one."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from elastic_runner.training import save_path


class FakeDist:
    """A group of ``world`` ranks seen from rank 0, where ``peers_with_memory`` of the other ranks opened theirs."""

    def __init__(self, world: int, peers_with_memory: int) -> None:
        self.rank, self.device, self.world, self.peers = 0, torch.device("cpu"), world, peers_with_memory

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor += self.peers
        return tensor


def _checkpointer(world: int, peers_with_memory: int, has_memory: bool = True) -> Any:
    cfg = SimpleNamespace(snapshot=SimpleNamespace(in_memory=True, memory_every_steps=5),
                          dist=SimpleNamespace(timeout_seconds=30))
    return SimpleNamespace(env=SimpleNamespace(world_size=world), cfg=cfg, dist=FakeDist(world, peers_with_memory),
                           memory=object() if has_memory else None)


@pytest.fixture
def exchanges(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The exchange groups made (each a collective every rank must enter), and no real shard memory behind them."""
    made: list[float] = []
    monkeypatch.setattr(save_path, "exchange_group", lambda timeout: made.append(timeout) or "group")
    monkeypatch.setattr(save_path, "ShardedMemory", lambda memory, layout, group, schedule: ("shards", group))
    monkeypatch.setattr(save_path.Sharded, "_schedule", lambda self, ckpt: None)
    return made


def _sharded() -> save_path.Sharded:
    strategy = object.__new__(save_path.Sharded)
    strategy.layout, strategy.memory = None, None  # type: ignore[assignment]
    return strategy


def test_when_every_rank_opened_its_node_memory_the_shards_are_kept_there(exchanges: list[float]) -> None:
    ckpt, strategy = _checkpointer(world=4, peers_with_memory=3), _sharded()
    strategy.start(ckpt)
    assert exchanges == [30] and strategy.memory == ("shards", "group") and ckpt.memory is not None


def test_one_node_without_node_memory_turns_it_off_for_every_rank_and_rank_0_says_so(
        exchanges: list[float], caplog: pytest.LogCaptureFixture) -> None:
    ckpt, strategy = _checkpointer(world=4, peers_with_memory=2), _sharded()  # one peer's directory was refused
    with caplog.at_level(logging.WARNING, logger="elastic_runner.training.save_path"):
        strategy.start(ckpt)
    assert exchanges == [], "no exchange group: the rank without memory would never enter it"
    assert strategy.memory is None and ckpt.memory is None
    assert "1 of 4 ranks could not open their node-memory directory" in caplog.text


def test_the_rank_whose_directory_was_refused_agrees_too(exchanges: list[float]) -> None:
    ckpt, strategy = _checkpointer(world=2, peers_with_memory=1, has_memory=False), _sharded()
    strategy.start(ckpt)
    assert exchanges == [] and strategy.memory is None
