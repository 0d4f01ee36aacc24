"""TrainingParts: what one optimizer step changes and a snapshot holds, in one small typed object.

The worker builds the parts once per attempt and hands the same object to the loop (which changes
them, under the Checkpointer's step lock) and to the Checkpointer (which reads them to save and
writes them to restore). Nobody asks the Checkpointer for a part: the data flows one way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .rng import RNGState
from .state import TrainState


@dataclass
class TrainingParts:
    model: nn.Module  #: the un-wrapped model (state_dict keys without ``module.``)
    optimizer: torch.optim.Optimizer
    scheduler: Any  #: an LRScheduler (built-in or the user's)
    scaler: Any  #: torch.amp.GradScaler for fp16, else None
    sampler: Any  #: ElasticSampler, or a user's sampler with the same interface
    state: TrainState
    rng: RNGState = field(default_factory=RNGState)

    def state_dict(self, model_state: dict[str, Any] | None = None) -> dict[str, Any]:
        """Every part's state with live tensors (``model_state``: the model's, if the caller has it already)."""
        return {
            "model": self.model.state_dict() if model_state is None else model_state,
            "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "train": self.state.state_dict(), "sampler": self.sampler.state_dict(), "rng": self.rng.state_dict(),
        }
