"""etcd-v3 rendezvous and store for torchrun (``--rdzv_backend=etcd-v3``).

torch's own ``etcd``/``etcd-v2`` backends speak etcd's v2 API, which etcd 3.5 serves only with
``--enable-v2`` and etcd 3.6 removed; its ``c10d`` backend keeps the store inside one agent, so
losing that node loses the job. This package puts the rendezvous and its store on etcd's v3 API:

- ``options``  ``--rdzv_endpoint`` / ``--rdzv_conf`` parsing, one table of options with defaults.
- ``kv``       the narrow key-value interface the rest is written against (get, prefix read,
               transaction with compare-and-swap, leases, watches of a key or a prefix), its errors.
- ``gateway``  that interface on etcd's HTTP/JSON gateway (``etcd3gw``) with retries, fail-over,
               TLS and auth. (An in-memory fake with the same semantics, the contract suites and a
               local etcd server for tests live in :mod:`elastic_runner.testing`.)
- ``rounds``   the lease protocol (``protocol=leases``, the default): keys, values, sealing rules,
               and why two rounds can never both be current.
- ``values``   its values: strict JSON, signed with the job's key and bound to their round, incarnation and
               lease, so that a value captured earlier and put back is void; rate-limited warnings.
- ``leases``   its handler (torch's ``RendezvousHandler``): join, take the seat, close; ``sealing``: what an agent
               does as a round's sealer; ``heartbeat``: its liveness lease.
- ``watch``    what an agent that trains watches (``num_nodes_waiting`` answers from it).
- ``store``    ``torch.distributed.Store`` on the same prefix; waits use etcd watches.
- ``backend``  torch's protocol (``protocol=state``): ``RendezvousBackend`` with the state under one
               key, ``set_state`` as one transaction that compares the key's ``mod_revision``.
- ``handler``  torch's handler for it with one correction: after an etcd outage longer than the
               heartbeat window, live agents heartbeat again instead of dropping themselves.
- ``seal``     signatures with the job's key, bounded decompression, the restricted unpickler.
- ``plugin``   the ``torchrun.handlers`` entry point (kept import-light: torch's registry loads it
               while it is itself being imported).

Nothing here is imported by ``import elastic_runner.rendezvous``; import the submodules.
"""
