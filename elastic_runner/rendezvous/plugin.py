"""torchrun entry point for ``--rdzv_backend=etcd-v3``.

pyproject.toml registers ``handler_factory`` in the ``torchrun.handlers`` entry-point group. torch
calls every such entry point while ``torch.distributed.elastic.rendezvous`` is itself being
imported (``_register_out_of_tree_handlers``), registering ``handler_factory()`` under the entry
point's name. Importing torch's rendezvous modules here at module level would therefore import a
half-initialised package (a circular import); this module imports only the standard library and
defers everything else to the moment torchrun creates the handler.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters


def create_handler(params: "RendezvousParameters") -> "RendezvousHandler":
    """The etcd-v3 rendezvous: by default the lease protocol (see ``leases``); with ``protocol=state``
    torch's ``DynamicRendezvousHandler`` protocol with its state in etcd (see ``backend``), tolerant of
    etcd outages (see ``handler``). Both trust nothing they read unchecked (see ``seal``)."""
    from .backend import CheckedStates, create_backend, parse

    options = parse(params)
    backend, store = create_backend(params, options)
    if options.protocol == "state":
        from .handler import create_handler as etcd_handler

        # torch unpickles every state it reads: only states that unpickle with a state's classes reach it.
        return etcd_handler(store, CheckedStates(backend), params)
    from .leases import LeaseRendezvousHandler
    from .rounds import settings_from

    try:
        settings = settings_from(params)
    except ValueError as exc:
        from .backend import EtcdRendezvousOptionError

        backend.client.close()
        raise EtcdRendezvousOptionError(f"--rdzv_backend=etcd-v3: {exc}") from exc
    return LeaseRendezvousHandler(backend.client, backend.run_prefix, settings, store, params.local_addr,
                                  leases=backend.leases, sealer=backend.sealer)


def handler_factory() -> Callable[["RendezvousParameters"], "RendezvousHandler"]:
    """The ``torchrun.handlers`` entry point: returns the factory ``(RendezvousParameters) -> handler``.

    Always the same function object, so registering it twice in one process is harmless. Also the
    moment a plain torchrun agent that runs elastic_runner's worker is set up like ``elastic-runner
    launch``'s (:mod:`elastic_runner.agent.torchrun_hook`; nothing changes for other programs).
    """
    from ..agent import torchrun_hook

    try:
        torchrun_hook.install()
    except Exception:  # noqa: BLE001 - torch would log this as a failed plugin: keep the handler
        import logging

        logging.getLogger(__name__).warning("elastic_runner could not set up this torchrun agent; it runs as "
                                            "plain torchrun", exc_info=True)
    return create_handler
