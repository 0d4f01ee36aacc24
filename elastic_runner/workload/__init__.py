"""The workload: what is trained — model, task (loss and metrics), optimizer and schedule factories.

Nothing here knows about distribution (no ``torch.distributed``; a test checks it).

- ``spec``    :class:`~.spec.Workload` from a config or a script's objects, checked on its first items.
- ``models``  the built-in mlp and cnn, and user models by import path.
- ``gpt``     a small decoder-only transformer, the built-in language model.
- ``tasks``   losses (per sample, or weighted) and evaluation metrics.
- ``optim``   optimizers and learning-rate schedules from config.
"""
