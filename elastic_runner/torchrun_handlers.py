"""The ``torchrun.handlers`` entry point, a door: pyproject.toml registers :func:`handler_factory` under the name
``etcd-v3``, and torch calls every such entry point while ``torch.distributed.elastic.rendezvous`` is itself being
imported (``_register_out_of_tree_handlers``), registering ``handler_factory()`` under the entry point's name.

It imports only the standard library and :mod:`elastic_runner.rendezvous.plugin` (which defers torch to the moment
torchrun creates the handler); torchrun's agent is set up (:mod:`elastic_runner.agent.torchrun_hook`) when torch
calls it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from .rendezvous.plugin import create_handler

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters


def handler_factory() -> Callable[["RendezvousParameters"], "RendezvousHandler"]:
    """The ``torchrun.handlers`` entry point: returns the factory ``(RendezvousParameters) -> handler``.

    Always the same function object, so registering it twice in one process is harmless. Also the
    moment a plain torchrun agent that runs elastic_runner's worker is set up like ``elastic-runner
    launch``'s (:mod:`elastic_runner.agent.torchrun_hook`; nothing changes for other programs).
    """
    from .agent import torchrun_hook

    try:
        torchrun_hook.install()
    except Exception:  # noqa: BLE001 - torch would log this as a failed plugin: keep the handler
        import logging

        logging.getLogger(__name__).warning("elastic_runner could not set up this torchrun agent; it runs as "
                                            "plain torchrun", exc_info=True)
    return create_handler
