"""etcd-v3 rendezvous backend and c10d store for torchrun (``--rdzv_backend=etcd-v3``).

torch's own ``etcd``/``etcd-v2`` backends speak etcd's v2 API, which etcd 3.5 serves only with
``--enable-v2`` and etcd 3.6 removed; its ``c10d`` backend keeps the store inside one agent, so
losing that node loses the job. This package keeps torch's ``DynamicRendezvousHandler`` (the
protocol) and puts its shared state and its store on etcd's v3 API:

- ``options``  ``--rdzv_endpoint`` / ``--rdzv_conf`` parsing, one table of options with defaults.
- ``kv``       the narrow key-value interface the rest is written against (get, transaction with
               compare-and-swap, lease, delete, count, wait-for-change), its errors, leases.
- ``gateway``  that interface on etcd's HTTP/JSON gateway (``etcd3gw``) with retries, fail-over,
               TLS and auth. (An in-memory fake with the same semantics, the contract suites and a
               local etcd server for tests live in :mod:`elastic_runner.testing`.)
- ``backend``  ``RendezvousBackend``: the state under one key, ``set_state`` as one transaction
               that compares the key's ``mod_revision`` (the fencing token).
- ``store``    ``torch.distributed.Store`` on the same prefix; waits use etcd watches.
- ``handler``  torch's handler with one correction: after an etcd outage longer than the heartbeat
               window, live agents heartbeat again instead of dropping themselves from the record.
- ``plugin``   the ``torchrun.handlers`` entry point (kept import-light: torch's registry loads it
               while it is itself being imported).

Nothing here is imported by ``import elastic_runner.rendezvous``; import the submodules.
"""
