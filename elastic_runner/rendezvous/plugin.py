"""The ``--rdzv_backend=etcd-v3`` handler that torchrun creates (through the entry point in
:mod:`elastic_runner.torchrun_handlers`).

torch calls the entry point while ``torch.distributed.elastic.rendezvous`` is itself being imported
(``_register_out_of_tree_handlers``): importing torch's rendezvous modules here at module level would import a
half-initialised package (a circular import), so this module imports only the standard library and defers
everything else to the moment torchrun creates the handler.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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
