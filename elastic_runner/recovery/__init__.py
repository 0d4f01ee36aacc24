"""The recovery protocol, owned in one place: what a process does when the job breaks, and what crosses between the
agents and their workers while it does.

- ``states``     the worker's state machine: after each attempt, training -> broken -> training | rejoin | park | exit
  (its transition table is its docstring); ``worker.process`` carries it out.
- ``policy``     the agent's side: for each failure of its workers, decided once: the job is done, stops, has the
  failed workers replaced alone, or restarts every worker (its rule table is its docstring).
- ``channel``    the protocol's messages, typed: in the job's store (beats, announcements, generations, handles, the
  watchdog's counters and abort), signed with the job's key; between an agent and its own workers (ready, park,
  parked, place) in the agent's private directory.
- ``rebuild``    the process group rebuilt for a new membership in the same process (in-process recovery's core).
- ``regroup``    who waits for whom at an unchanged membership: survivors, a failed peer's replacement, the agents'
  beats and announcements in the job's store.
- ``liveness``   whether group rank 0's agent is alive once the job's store is gone with its worker (a signed
  challenge on the agent's own port): its node's loss counted out at once.
- ``handover``   a kept worker's place in the agent's next round: the channel's ready, park, parked and place
  messages for one local rank.

The worker (``elastic_runner.worker``) and the agent (``elastic_runner.agent``) sit above this floor and both use
it; it knows neither (a type that two floors need lives on the lower one). Between an agent and its own workers the
hand-over's messages are the channel's, over the agent's private directory (mode 0700) instead of the job's store.
Still outside the channel: in ``elastic_runner.env`` (the ground floor, below this one and its signer), a worker's
word that it finished, its request to exclude its node, and the agent's word that it stops them and why (read in the
worker's SIGTERM handler), JSON files in the same directory; the agent's park decisions (``agent/kept_round.py``);
and the zygote's pipe.
"""
