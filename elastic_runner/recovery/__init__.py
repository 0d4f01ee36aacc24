"""The recovery protocol, owned in one place: what a process does when the job breaks, and what crosses between the
agents and their workers while it does.

- ``states``     the worker's state machine: after each attempt, training -> broken -> training | rejoin | park | exit
  (its transition table is its docstring); ``worker.process`` carries it out.
- ``policy``     the agent's side: for each failure of its workers, decided once: the job is done, stops, has the
  failed workers replaced alone, or restarts every worker (its rule table is its docstring).
- ``channel``    the protocol's messages in the job's store (beats, announcements, generations, handles, the
  watchdog's counters and abort): typed, and signed with the job's key.
- ``regroup``    the process group rebuilt for a new membership in the same process (in-process recovery's core).
- ``liveness``   whether group rank 0's agent is alive once the job's store is gone with its worker (a signed
  challenge on the agent's own port): its node's loss counted out at once.
- ``handover``   a kept worker's place in the agent's next round (a file the agent writes, the worker reads).

The worker (``elastic_runner.worker``) and the agent (``elastic_runner.agent``) sit above this floor and both use
it; it knows neither (a type that two floors need lives on the lower one). Between an agent and its own workers the
messages are files in the agent's private directory (mode 0700): the hand-over's (``handover``), and, in
``elastic_runner.env``, a worker's word that it finished, its request to exclude its node, and the agent's word that it
stops them and why (read in the worker's SIGTERM handler). Still outside this floor, and next in line: the agent's park
decisions (``agent/kept_round.py``) and the zygote's pipe, which are not typed messages yet.
"""
