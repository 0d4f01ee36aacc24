"""The failure story: one line, cause first and outcome last, printed by rank 0 once the job steps again.

    rank 1 (node b, pid 4242) was killed by SIGKILL at step 225 → recovered in 0.87 s at world size 2,
    resumed step 225 from memory, 0 steps lost

("recovered in process" where rank 0 kept its process: in-process recovery.)

Pieced together from the run's event log: the agents' ``agent_worker_failed`` events name the processes
that failed (rank, pid, exit status or signal; our agent, under ``launch`` and plain torchrun), the
previous attempt's events its world size and furthest step, and this attempt's resume what it resumed
from. A worker that left because a peer failed (exit status 75, or its last event a broken collective) is an
effect, not a cause.
"""

from __future__ import annotations

import os
import re
import signal
from typing import Any

from ..lifecycle import EXIT_PEER_LOST
from .events import read_events, starts_a_session

#: What a worker's own failure says when it is the peer that went away (gloo, NCCL, the store, our watchdog).
_PEER_ERROR = re.compile(r"Connection (reset|closed|refused)|by peer|[Pp]eer|Broken pipe|timed out|Timeout|"
                         r"DistBackendError|NCCL|aborted", re.ASCII)


def _exit_words(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def failure_story(run_dir: str | os.PathLike[str], generation: int, world_size: int, resume: dict[str, Any],
                  now: float) -> str | None:
    """The story of what ended the attempt before ``generation`` and how this one recovered; None on a first
    start or when the log holds no earlier attempt."""
    events = read_events(run_dir)
    earlier = [e for e in events if isinstance(e.get("generation"), int) and e["generation"] < generation
               and str(e.get("source", "")).startswith("gen-")]
    if not earlier:
        return None
    previous = max(e["generation"] for e in earlier)
    of_previous = [e for e in earlier if e["generation"] == previous]
    previous_world = next((e["world_size"] for e in of_previous if e.get("kind") == "start"), None)
    began = min(e["time"] for e in of_previous)
    step = resume.get("furthest_step", resume.get("step"))

    starts = [e for e in events if e.get("kind") == "start" and e.get("generation") == generation]
    earlier_agents = {e["agent"] for e in earlier if e.get("kind") == "start" and e.get("agent")}
    if starts_a_session(starts, earlier_agents, of_previous):
        # Not a recovery: the job was started again (a command run again, a Job restarted) — at whatever size.
        before = f", world size {previous_world} before" if previous_world not in (None, world_size) else ""
        return (f"the job was started again (new agents on every node{before}) → training at world size "
                f"{world_size}, resumed step {resume.get('step')} from {resume.get('tier', 'a snapshot')}")
    failures = [(e, f) for e in events if e.get("kind") == "agent_worker_failed" and began <= e["time"] <= now
                for f in e.get("failures", [])]
    # Effects, not causes: workers that left because a peer went away (status 75, or their own last words
    # were a broken collective). Killed processes come first: nothing else kills a worker by a signal.
    broken = {e.get("pid") for e in of_previous if e.get("kind") == "failure" and _PEER_ERROR.search(str(e.get("error")))}
    signalled = [(e, f) for e, f in failures if f.get("exitcode", 0) < 0]
    causes = signalled or [(e, f) for e, f in failures
                           if f.get("exitcode") != EXIT_PEER_LOST and f.get("pid") not in broken]
    mismatch = next((e for e in of_previous if e.get("kind") == "replica_mismatch" and e.get("rank") == 0), None)
    nonfinite = next((e for e in of_previous if e.get("kind") == "nonfinite_rollback" and e.get("rank") == 0), None)
    if nonfinite is not None:  # every worker left the attempt on purpose, in its process
        first_at, step = nonfinite["time"], nonfinite["step"]
        who = ", ".join(f"rank {r}" for r in nonfinite.get("ranks") or []) or "an overflow"
        cause = f"the loss of step {step} was not finite ({who}), a rollback that skips its batch"
    elif mismatch is not None:  # every worker left on purpose: the rollback is the cause, not their exit statuses
        first_at = mismatch["time"]
        suspects = ", ".join(f"rank {r}" for r in mismatch.get("suspects") or []) or "no majority"
        cause = (f"the replicas' fingerprints differed at step {mismatch['step']} (suspect: {suspects}; the last "
                 f"check that agreed: step {mismatch['verified_step']}), a rollback")
        step = mismatch["step"]
    elif causes:
        first_at = min(e["time"] for e, _ in causes)
        parts = [f"rank {f['rank']} (node {e.get('host', '?')}, pid {f['pid']}) {_exit_words(f['exitcode'])}"
                 for e, f in sorted(causes, key=lambda c: c[1]["rank"])]
        cause = (", ".join(parts[:3]) + (f" and {len(parts) - 3} more" if len(parts) > 3 else "")
                 + f" at step {step}")
    elif previous_world is not None and previous_world > world_size:
        # Detected by a worker's failure, by an agent that saw the member gone (its workers were waiting for it), or
        # by a survivor's broken collective (in process: no worker fails for its agent to report).
        gone = [e["time"] for e in events if e.get("kind") == "agent_member_gone" and began <= e["time"] <= now]
        noticed = [e["time"] for e in of_previous if e.get("kind") == "failure"]
        first_at = min([e["time"] for e, _ in failures] + gone + noticed, default=None)
        cause = f"a node left (world size {previous_world} → {world_size}) at step {step}"
    elif previous_world is not None and previous_world < world_size:
        first_at = None
        cause = f"a node joined (world size {previous_world} → {world_size}) at step {step}"
    else:
        first_at = min((e["time"] for e, _ in failures), default=None)
        cause = f"the attempt before ended at step {step}"
    took = f" in {now - first_at:.2f} s" if first_at is not None else ""
    lost = resume.get("steps_recomputed")
    verb = ("training" if previous_world is not None and previous_world < world_size and not causes
            and mismatch is None else "recovered")
    # In-process recovery: this rank kept the process it had in the attempt before (its peers kept theirs).
    mine = {e.get("pid") for e in events if e.get("kind") == "start" and e.get("generation") == generation
            and e.get("rank") == 0}
    if verb == "recovered" and mine & {e.get("pid") for e in of_previous if e.get("kind") == "start"}:
        verb = "recovered in process"
    return (f"{cause} → {verb}{took} at world size {world_size}, resumed step {resume.get('step')} from "
            f"{resume.get('tier', 'a snapshot')}" + (f", {lost} steps lost" if lost is not None else ""))
