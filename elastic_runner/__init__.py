"""elastic_runner: elastic, fault-tolerant training for PyTorch under torchrun.

``elastic_runner.fit(model, train_data, loss=..., optimizer=..., config=...)`` trains a script's own
objects; ``elastic_runner.load_model(run_dir)`` gives a run's model with its newest weights (both
in :mod:`elastic_runner.api`); ``elastic_runner.Augmented`` and ``elastic_runner.sample_seed`` make a
dataset's random augmentation resume bitwise (:mod:`elastic_runner.data.images`). Importing the package
itself imports nothing else: torchrun loads it while it loads its rendezvous handlers.
"""

from typing import Any

__version__ = "0.1.0"

__all__ = ["Augmented", "__version__", "fit", "load_model", "sample_seed"]


def __getattr__(name: str) -> Any:
    if name in ("fit", "load_model"):
        from . import api

        return getattr(api, name)
    if name in ("Augmented", "sample_seed"):
        from .data import images

        return getattr(images, name)
    raise AttributeError(f"module 'elastic_runner' has no attribute {name!r}")
