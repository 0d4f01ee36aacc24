"""The agent side of ``elastic-runner launch``: zygote workers, our elastic agent,
faster rendezvous completion, and agent-level metrics.

Everything here runs in the torchrun agent process (or the zygote it forks
workers from), never in the training loop.

- ``launch``           ``elastic-runner launch``: torchrun's flags, elastic defaults, our agent.
- ``torchrun_hook``    a plain ``torchrun -m elastic_runner.train`` gets the same agent (entry point).
- ``adopt``            the one set-up both of those run.
- ``agent``            ``ElasticRunnerAgent``: torch's ``LocalElasticAgent`` with corrections and observers.
- ``fast_rendezvous``  rendezvous rounds that complete as soon as everyone known is back.
- ``zygote``, ``warm`` workers forked from a pre-imported process.
- ``worker_context``   the node's workers kept when one fails, that one replaced (in-process recovery's agent side).
- ``metrics``          the agent's Prometheus metrics and events.
- ``terminal``         what the agent prints, and what it keeps quiet.

Every private torch internal it changes or relies on is listed, with its canary, in ``elastic_runner.torch_patches``
(the ground floor: the worker's regroup and the rendezvous rely on some too).
"""
