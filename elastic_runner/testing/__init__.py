"""What tests, the chaos tool and the benchmarks share, and training never imports.

- ``localjob``     local multi-agent jobs on loopback (plain torchrun or ``elastic-runner launch``):
                   start agents, find workers, inject faults by PID, clean up exactly what was started.
- ``etcd_server``  a local etcd: start, stop, kill, restart on the same data (installs Debian's
                   ``etcd-server`` as root when missing).
- ``memory_etcd``  an in-memory etcd with the semantics the rendezvous relies on (revisions,
                   leases, watches), for fast and deterministic tests.
- ``contracts``    the backend and store contract suites (pytest classes) that every ``KVClient``
                   must pass; run them against your own etcd client too.

``import elastic_runner.train`` imports none of this (a test checks it); import the submodules.
"""
