"""Any batch structure a user's dataset gives: nested items collate and move to the device whole; mismatches name the indices and the fix."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from elastic_runner.config import ConfigError
from elastic_runner.data.sources import collate_items, to_device


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
