"""Rendezvous rounds that complete as soon as everyone known is back.

torch's ``DynamicRendezvousHandler`` completes a round ``last_call_timeout``
after the minimum number of nodes joined (an integer, 30 s by default), and
every waiting node re-reads the shared state once per second. After a worker
failure every node of the previous round rejoins within milliseconds, yet the
round still waits out the last call and the polling.

Two changes, applied only inside the ``elastic-runner launch`` agent process:

- **Complete when the previous round is back.** A node that rejoins knows
  the participants of the round it was part of. When all of them are
  participants again, the minimum is met, and nobody is waiting to join, the
  round is marked complete at once. Otherwise (a node of the previous round
  is gone, or this node has no previous round) torch's rule applies
  unchanged: wait for the last call. The rule never completes a round that
  torch's rule would not also complete with the same members; it only skips
  the wait. (A faster rule for node loss — treat a previous participant that
  is briefly absent from the shared state as dead — was tried and dropped: a
  live agent that is slow to rejoin looks the same, and one round completed
  without it.)
- **Poll faster.** The 1 s state re-read becomes ``ELASTIC_RUNNER_RDZV_POLL``
  seconds (default 0.1). Each poll is one read of the rendezvous state, so a
  job of N nodes costs the backend about N/poll reads per second while a
  round is forming, and nothing while training.

Both hook torch internals (``_RendezvousJoinOp``, ``_delay``) that have been
stable since torch 1.9; :func:`install` checks they exist and otherwise
leaves torch's behaviour alone with a warning.
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger(__name__)

#: Participants of the last round this agent completed (set by the agent before rejoining).
_previous: frozenset[Any] = frozenset()
_installed = False
#: True when the last round this agent joined was completed by the rule above.
completed_early = False


def set_previous_participants(nodes: Any) -> None:
    global _previous, completed_early
    _previous = frozenset(nodes)
    completed_early = False


def poll_interval() -> float:
    try:
        return max(0.01, float(os.environ.get("ELASTIC_RUNNER_RDZV_POLL", "0.1")))
    except ValueError:
        return 0.1


def install() -> bool:
    """Patch the running process's torch rendezvous (idempotent); False if not possible."""
    global _installed
    if _installed:
        return True
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    required = ("_RendezvousJoinOp", "_Action", "_delay")
    if not all(hasattr(dr, name) for name in required):
        log.warning("this torch version's rendezvous internals differ; using torch's rendezvous timing unchanged")
        return False
    base_join, action, original_delay = dr._RendezvousJoinOp, dr._Action, dr._delay
    waiting = {action.SYNC, action.KEEP_ALIVE}

    class FastJoinOp(base_join):  # type: ignore[misc, valid-type]
        def __call__(self, ctx: Any, deadline: float) -> Any:
            decision = super().__call__(ctx, deadline)
            state = ctx.state
            if (
                decision in waiting
                and _previous
                and not state.complete
                and ctx.node in state.participants
                and len(state.participants) >= ctx.settings.min_nodes
                and not state.wait_list
                and _previous <= set(state.participants)
            ):
                global completed_early
                completed_early = True
                log.info("rendezvous: all %d nodes of the previous round are back; completing without the last call",
                         len(_previous))
                return action.MARK_RENDEZVOUS_COMPLETE
            return decision

    def fast_delay(seconds: float | tuple[float, float]) -> None:
        # torch sleeps exactly 1 s between state polls; keep its other delays.
        original_delay(poll_interval() if seconds == 1 else seconds)

    dr._RendezvousJoinOp = FastJoinOp
    dr._delay = fast_delay
    _installed = True
    return True
