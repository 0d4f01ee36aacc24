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
            "scaler": scaler_state(self.scaler) if self.scaler is not None else None,
            "train": self.state.state_dict(), "sampler": self.sampler.state_dict(), "rng": self.rng.state_dict(),
        }


def scaler_state(scaler: Any) -> dict[str, Any]:
    """fp16's gradient scaler's state with its scale and growth tracker as the live tensors: ``GradScaler.state_dict``
    reads both into Python numbers, two host synchronisations at every capture on a GPU (the capture copies the
    tensors off the step's stream instead; :func:`scaler_numbers` turns them back on load). A scaler without those
    attributes (another torch) gives its own state_dict."""
    names = ("_enabled", "_scale", "_init_scale", "_growth_tracker", "_init_growth_tracker", "_growth_factor",
             "_backoff_factor", "_growth_interval")
    if not all(hasattr(scaler, name) for name in names):
        return scaler.state_dict()
    if not scaler._enabled:
        return {}
    return {"scale": scaler._scale if scaler._scale is not None else scaler._init_scale,
            "growth_factor": scaler._growth_factor, "backoff_factor": scaler._backoff_factor,
            "growth_interval": scaler._growth_interval,
            "_growth_tracker": scaler._growth_tracker if scaler._growth_tracker is not None
            else scaler._init_growth_tracker}


def scaler_numbers(state: dict[str, Any]) -> dict[str, Any]:
    """A saved scaler state as ``GradScaler.load_state_dict`` takes it: numbers, not tensors (read at a resume)."""
    return {key: (value.item() if isinstance(value, torch.Tensor) else value) for key, value in state.items()}
