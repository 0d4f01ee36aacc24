"""After the chaos: the faults injected, the attempts that followed, and each recovery measured.

Everything is read back from what the job itself recorded (the event log and the audit trail), so the same checks
apply to any run directory; :mod:`.verdict` checks the invariants users rely on from the same records.
"""

from __future__ import annotations

import bisect
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence



@dataclass
class Injected:
    type: str
    at: float  #: wall-clock time of the injection
    offset: float  #: seconds since the job first stepped
    description: str
    recovery_s: float | None = None
    generation: int | None = None
    world_size: int | None = None
    resumed_step: int | None = None
    resumed_tier: str | None = None
    steps_recomputed: int | None = None
    interrupted: bool = True
    lasts_s: float = 0.0  #: how long the fault goes on after its injection (a hang, a full volume, a slow node)
    targets: list[int] = field(default_factory=list)  #: the PIDs it acted on, where the verdict needs them
    #: "recovered" (a new attempt stepped), "absorbed" (training went on in the same attempt: a hang shorter
    #: than the heartbeat, a hang with no peer to notice, an etcd restart) or "job ended" (it landed as the
    #: job finished); None while undecided.
    outcome: str | None = None


@dataclass
class Verdict:
    ok: bool
    checks: dict[str, tuple[bool, str]] = field(default_factory=dict)

    def add(self, name: str, ok: bool, detail: str) -> None:
        self.checks[name] = (ok, detail)
        self.ok = self.ok and ok


@dataclass
class History:
    """What judging a fault needs from the event log, kept up to date from the new events only (a soak
    writes ~10^5 events and is watched every 0.1 s)."""

    #: Per generation: start time, world size, first step time, resume details (rank 0's view).
    gens: dict[int, dict[str, Any]] = field(default_factory=dict)
    #: Per generation, the time of its last sign of training (a step, a snapshot, an evaluation, the end).
    stepped: dict[int, float] = field(default_factory=dict)
    finished: list[float] = field(default_factory=list)  #: times of "finished" end events
    #: Per generation, the time it rolled back (a non-finite loss, replicas that disagreed): its attempt ends there.
    rolled_back: dict[int, float] = field(default_factory=dict)

    def add(self, events: list[dict[str, Any]]) -> History:
        for e in events:
            g = e.get("generation")
            kind = e["kind"]
            if kind == "end" and e.get("status") == "finished":
                self.finished.append(e["time"])
            if g is None or e.get("role") == "agent":
                continue
            if kind in ("progress", "snapshot_saved", "eval", "end"):
                self.stepped[g] = max(self.stepped.get(g, e["time"]), e["time"])
            info = self.gens.setdefault(g, {})
            if kind == "start":
                info["start"] = min(info.get("start", e["time"]), e["time"])
                info["world_size"] = e["world_size"]
            elif kind == "first_step":
                info["first_step"] = max(info.get("first_step", 0.0), e["time"])  # all ranks stepping
            elif kind == "resume":
                info["resume"] = e
            elif kind == "world":
                info["world_size"] = e["world_size"]
            elif kind in ("nonfinite_rollback", "replica_mismatch") and e.get("status") == "rolled_back":
                self.rolled_back[g] = max(self.rolled_back.get(g, e["time"]), e["time"])  # (not a stop)
        return self


def generations(events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per generation: start time, world size, first step time, resume details (rank 0's view)."""
    return History().add(events).gens


#: Faults the job is built to ride out without a new attempt: a new attempt that follows one is usually another's.
RIDDEN_OUT = ("restart-etcd", "fill-disk", "slow-node")
#: Faults found only at the job's next check (a logging step, a fingerprint check), which its attempt steps on until:
#: one that attempt then rolled back for was not absorbed, however long it stepped first.
FOUND_AT_A_CHECK = ("nan-batch", "corrupt-param")

#: Seconds after a slow node's end within which its workers must have been named stragglers (the logging window
#: under way when the throttle ends can still complete the count).
NAMED_WITHIN_S = 5.0

#: Seconds after a fault (after a hang: after it ends) from which a step of the same attempt proves it absorbed.
ABSORB_AFTER_S = 2.0


def attribute_recoveries(faults: list[Injected], events: list[dict[str, Any]] | History,
                         hang_seconds: float = 0.0) -> None:
    """Fill in, for every fault, the generation that recovered from it and how long it took, or that the
    job absorbed it or ended under it (see :attr:`Injected.outcome`). Pass a :class:`History` to judge
    a live run over and over without re-reading its events."""
    history = events if isinstance(events, History) else History().add(events)
    gens, stepped, finished = history.gens, history.stepped, history.finished
    starts = sorted((info["start"], g) for g, info in gens.items() if "start" in info)
    start_times = [t for t, _ in starts]
    for i, fault in enumerate(faults):
        cut = bisect.bisect_right(start_times, fault.at)
        before, later = [g for _, g in starts[:cut]], [g for _, g in starts[cut:]]
        nxt = faults[i + 1].at if i + 1 < len(faults) else float("inf")
        size_before = gens[before[-1]].get("world_size") if before else None
        settle = fault.at + ABSORB_AFTER_S + max(fault.lasts_s, hang_seconds if fault.type == "hang" else 0.0)
        # The attempt it hit stepped on well after it: not interrupted, whatever a later attempt
        # (started for the next fault) looks like. A join always starts a new attempt, and so does a rollback for a
        # fault found at a check (seen: a NaN requested as a join's attempt began struck its first step, and the
        # logging step that found it came more than 2 s after the request).
        found = (fault.type in FOUND_AT_A_CHECK and bool(before)
                 and history.rolled_back.get(before[-1], -1.0) >= fault.at)
        if fault.type != "join" and not found and before and stepped.get(before[-1], -1.0) > settle:
            fault.interrupted, fault.recovery_s, fault.outcome = False, 0.0, "absorbed"
            fault.generation = None
            continue
        chosen = None
        for g in later:
            info = gens[g]
            if "first_step" not in info:
                continue
            if fault.type == "join" and size_before is not None and info.get("world_size", 0) <= size_before:
                continue
            chosen = g
            break
        if chosen is None or gens[chosen]["start"] > nxt + 60:
            if fault.type == "restart-etcd":
                fault.interrupted, fault.recovery_s, fault.outcome = False, 0.0, "absorbed"
            elif not later and any(t >= fault.at - 1.0 for t in finished):
                fault.interrupted, fault.outcome = False, "job ended"
            continue
        info = gens[chosen]
        # Workers never talk to etcd, and training goes on through failed snapshot writes: such a fault
        # interrupts training only if a new attempt starts soon after it and before the next fault (which
        # would otherwise get the credit), and not at a larger world (a node joining meanwhile, e.g. a
        # supervisor's replacement, starts that one).
        grew = size_before is not None and info.get("world_size", 0) > size_before
        if fault.type in RIDDEN_OUT and (info["start"] > fault.at + 30 or info["start"] > nxt or grew):
            fault.interrupted, fault.recovery_s, fault.outcome = False, 0.0, "absorbed"
            continue
        fault.generation, fault.outcome = chosen, "recovered"
        fault.recovery_s = round(info["first_step"] - fault.at, 3)
        fault.world_size = info.get("world_size")
        resume = info.get("resume") or {}
        fault.resumed_step = resume.get("step")
        fault.resumed_tier = resume.get("tier")
        fault.steps_recomputed = resume.get("steps_recomputed")


#: Seconds after a memory wipe's injection within which the dying workers' last "kept in memory" records count
#: as wiped (the fault kills every worker first: none can keep anything after it).
WIPE_WINDOW_S = 1.0


def newest_snapshot_violations(events: list[dict[str, Any]], wiped_at: Sequence[float] = ()) -> list[str]:
    """Every resume must use the newest state that existed (by generation, then step) before its
    generation started: a disk snapshot of any earlier generation that was not rejected, or what the
    survivors of the generation just before kept in memory (an older memory copy was taken over by that
    generation and, when that one stepped and died without survivors, went with it), unless a fault wiped every
    node's memory at one of ``wiped_at`` (corrupt-snapshot) before the resume. A memory copy lives on its node: it
    counts only for a generation that node's agent is part of (a node lost after it parked took its copy with it).
    One pass over the states in time order: a soak has thousands of resumes."""
    # Rejected at a resume, or moved aside by a rollback (taken after the last check whose fingerprints agreed).
    rejected = {e["snapshot"] for e in events if e["kind"] == "snapshot_rejected"} | {
        name for e in events if e["kind"] == "replica_mismatch" for name in e.get("moved_aside") or ()}
    states = sorted(
        (e["time"], e["kind"] == "kept_in_memory", e["generation"], e["step"],
         e["snapshot"] if e["kind"] == "snapshot_saved" else f"memory step {e['step']}")
        for e in events if e.get("generation") is not None and (
            (e["kind"] == "snapshot_saved" and e["snapshot"] not in rejected) or e["kind"] == "kept_in_memory"))
    wipes = sorted(wiped_at)
    # Which node (agent) ran each rank of each generation; None where the events do not say (a plain torchrun).
    agent_of = {(e["generation"], e.get("rank")): e.get("agent") for e in events
                if e["kind"] == "start" and e.get("generation") is not None}
    agents_in: dict[int, set[str]] = {}
    for (sg, _), agent in agent_of.items():
        if agent is not None:
            agents_in.setdefault(sg, set()).add(agent)
    holder_of = {(e["time"], e["generation"], e["step"]): agent_of.get((e["generation"], e.get("rank")))
                 for e in events if e["kind"] == "kept_in_memory" and e.get("generation") is not None}
    newest_on_disk: dict[int, tuple[int, int, str]] = {}  #: generation -> its newest durable snapshot so far
    #: (generation, node) -> the newest state that node's survivors kept, and when
    kept: dict[tuple[int, str | None], tuple[tuple[int, int, str], float]] = {}
    problems = []
    seen = 0
    gens = generations(events)
    previous_of = dict(zip(sorted(gens)[1:], sorted(gens)))
    for start, g in sorted((info["start"], g) for g, info in gens.items() if info.get("resume") and "start" in info):
        while seen < len(states) and states[seen][0] < start:
            t, in_memory, sg, step, name = states[seen]
            seen += 1
            if not in_memory:
                newest_on_disk[sg] = max(newest_on_disk.get(sg, (sg, step, name)), (sg, step, name))
            elif not any(t <= w + WIPE_WINDOW_S and w < start for w in wipes):  # else gone with the wipe
                key = (sg, holder_of.get((t, sg, step)))
                if key not in kept or kept[key][0] < (sg, step, name):
                    kept[key] = ((sg, step, name), t)
        # A copy kept before a generation that started just ahead of a wipe, and gone with that wipe (in-process
        # recovery starts the next attempt within a fraction of a second of the park that kept it).
        for key in [key for key, (_, t) in kept.items() if any(t <= w + WIPE_WINDOW_S and w < start for w in wipes)]:
            kept.pop(key)
        candidates = [state for sg, state in newest_on_disk.items() if sg < g]
        # Only the nodes of this generation report their memory; unknown nodes are given the benefit of the doubt.
        nodes = agents_in.get(g)
        # What survivors kept is taken over by the next attempt; one that died before its first step kept
        # nothing newer (and says nothing), so the copy before it still counts.
        previous = previous_of.get(g)
        while previous is not None:
            candidates += [state for (sg, node), (state, _) in kept.items()
                           if sg == previous and (node is None or nodes is None or node in nodes)]
            if "first_step" in gens[previous]:
                break
            previous = previous_of.get(previous)
        if not candidates:
            continue
        newest = max(candidates)
        resume = gens[g]["resume"]
        if (resume.get("step") or 0) < newest[1]:
            problems.append(f"generation {g} resumed at step {resume.get('step')} but {newest[2]} "
                            f"(generation {newest[0]}, step {newest[1]}) was available")
    return problems


#: Faults after which a node's last records may never reach the bucket (its processes SIGKILLed; with
#: ``--private-dirs`` kill-node also deletes its directory, and no later worker of the node uploads it).
LOSES_RECORDS = ("kill-node", "kill-agent")


def generations_hit(events: list[dict[str, Any]], faults: Sequence[Injected]) -> set[int]:
    """The generations that were running when each of ``faults`` was injected."""
    starts = sorted((info["start"], g) for g, info in generations(events).items() if "start" in info)
    times = [t for t, _ in starts]
    return {starts[i - 1][1] for f in faults if (i := bisect.bisect_right(times, f.at)) > 0}


def recovery_stats(faults: list[Injected]) -> dict[str, Any]:
    times = [f.recovery_s for f in faults if f.recovery_s is not None and f.interrupted]
    if not times:
        return {"count": 0}
    return {"count": len(times), "min_s": min(times), "median_s": round(statistics.median(times), 3),
            "max_s": max(times), "sum_s": round(sum(times), 3)}


def as_dicts(faults: list[Injected]) -> list[dict[str, Any]]:
    return [asdict(f) for f in faults]
