"""The chaos run's verdict: each invariant users rely on, checked against what the job recorded.

:func:`verify` judges a run from its audit and event log (:mod:`.verify` holds what it reads them with: the faults
injected, the attempts, which recovery followed which fault); besides the invariants every run must keep (finished,
exactly once, a constant global batch, resumes from the newest state, no orphans, the reference), each fault type that
kills nothing has a check of its own: a full volume, a slow node, a flipped bit, a NaN batch, a spare's takeover.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from ..observe.audit import AuditReport
from .verify import (LOSES_RECORDS, NAMED_WITHIN_S, Injected, Verdict, generations, generations_hit,
                     newest_snapshot_violations)


def verify(*, audit: AuditReport, events: list[dict[str, Any]], faults: list[Injected], leftover: list[int],
           finished: bool, reference: dict[str, Any] | None) -> Verdict:
    verdict = Verdict(ok=True)
    verdict.add("job finished", finished and audit.finished,
                f"the run reached its end at step {audit.final_step} and its last agents exited 0"
                if finished and audit.finished else f"agents finished: {finished}; audit end record: {audit.finished}")
    dup = sum(len(e.duplicates) for e in audit.epochs)
    missing = sum(len(e.missing) for e in audit.epochs)
    scope = (f"{len(audit.epochs)} epoch(s): {dup} duplicate(s), {missing} missing" if not audit.sources else
             "every rank's share of every step is the mixture's; " + ", ".join(
                 f"{s.label} {s.taken / s.samples:.2f} epochs" for s in audit.sources))
    verdict.add("no sample lost or duplicated", audit.ok,
                f"{scope}, {len(audit.violations)} other violation(s)"
                + (f": {audit.violations[:3]}" if audit.violations else ""))
    worlds = [e for e in events if e["kind"] == "world"]
    batches = {e["global_batch"] for e in worlds}
    products = {e["micro_batch"] * e["accumulation"] * e["world_size"] for e in worlds}
    constant = len(batches) == 1 and len(set(audit.global_batches)) <= 2
    verdict.add("global batch constant", constant,
                f"global batch {sorted(batches)} at world sizes {sorted({e['world_size'] for e in worlds})} "
                f"(micro x accumulation x world: {sorted(products)})")
    stale = newest_snapshot_violations(events, wiped_at=[f.at for f in faults if f.type == "corrupt-snapshot"])
    verdict.add("recoveries resumed from the newest snapshot", not stale, "; ".join(stale) or
                f"{sum(1 for f in faults if f.generation)} recoveries checked")
    fills = [f for f in faults if f.type == "fill-disk"]
    if fills:
        saved = sorted(e["time"] for e in events if e["kind"] == "snapshot_saved")
        failed = [e["time"] for e in events if e["kind"] == "snapshot_failed"]
        not_back = [f for f in fills if not any(t > f.at + f.lasts_s for t in saved)]
        during = sum(1 for t in failed if any(f.at <= t <= f.at + f.lasts_s + 5.0 for f in fills))
        verdict.add("snapshots durable again after a full volume", not not_back,
                    f"{during} durable write(s) failed while the volume was full ({len(fills)} time(s)); "
                    + ("a snapshot was saved after each" if not not_back else
                       f"none saved after the fill at {not_back[0].offset} s"))
    slowed = [f for f in faults if f.type == "slow-node"]
    if slowed:
        hung = {pid for f in faults if f.type == "hang" for pid in f.targets}
        verdict.add("slow nodes named stragglers, and only they", *_stragglers_check(events, slowed, hung))
    corrupted = [f for f in faults if f.type == "corrupt-param"]
    if corrupted:
        verdict.add("corrupted replicas named at the next fingerprint check", *_corruption_check(events, corrupted))
    poisoned = [f for f in faults if f.type == "nan-batch"]
    if poisoned:
        verdict.add("NaN batches rolled back at the next logging step and skipped",
                    *_nonfinite_check(events, poisoned, audit.skipped_steps))
    spares = [f for f in faults if f.type == "spare-takeover"]
    if spares:
        verdict.add("spares took lost nodes' places at the same world size", *_spare_check(events, spares))
    if audit.records_lost:  # a bucket's view only: each span must belong to a generation a lost node ended
        explained = generations_hit(events, [f for f in faults if f.type in LOSES_RECORDS])
        unexplained = [s for s in audit.records_lost if s["generation"] not in explained]
        verdict.add("records lost only with a lost node", not unexplained,
                    f"{len(audit.records_lost)} span(s) of records a lost node had not uploaded, each in a generation "
                    f"a {' or '.join(LOSES_RECORDS)} ended" if not unexplained else
                    f"records of generation(s) {sorted({s['generation'] for s in unexplained})} are missing, but no "
                    f"node was lost then: {unexplained[:3]}")
    verdict.add("no orphan processes", not leftover, f"left running: {leftover}" if leftover else "none left")
    if reference is not None:
        name = "bitwise at the end" if reference.get("mode") == "bitwise" else "matches the reference run"
        verdict.add(name, reference["ok"], reference["detail"])
    return verdict


#: Logging windows of one attempt, ending while its node was slow, that naming a straggler needs at the fewest: the
#: attempt's first (partial, after its restore), then two whole ones (one window counts for half of the straggler
#: window at most, :mod:`elastic_runner.observe.stragglers`).
WINDOWS_TO_NAME = 3


def _cut_short(fault: Injected, gens: dict[int, dict[str, Any]], windows: dict[int, list[float]],
               starts: dict[int, set[int]]) -> bool:
    """A new attempt began while the node was slow (another fault's recovery, a node joining): every rank's count of
    slow windows began again with it. Cut short when the last such attempt no longer ran a throttled worker (replaced
    by a new process, never throttled), or had fewer than :data:`WINDOWS_TO_NAME` logging windows of rank 0 ending
    before the node's slowness did."""
    end = fault.at + fault.lasts_s
    began = [g for g, info in gens.items() if fault.at <= info.get("start", -1.0) <= end]
    if not began:
        return False
    last = max(began, key=lambda g: gens[g]["start"])
    if not set(fault.targets) & starts.get(last, set()):
        return True
    first = gens[last].get("first_step")
    return first is None or sum(1 for t in windows.get(last, []) if first <= t <= end) < WINDOWS_TO_NAME


#: How much longer than the run's median start-up an agent's must have taken to show its machine was short of cores
#: (:func:`_started_beside`).
STARVED_STARTUP = 2.0


@dataclass(frozen=True)
class _Startup:
    """An agent's start-up (its interpreter, torch's import, its agent): from its process's start to its first
    round's start, from its first ``agent_rendezvous`` event (``startup_s``)."""

    host: str
    begin: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.begin


def _startups(events: list[dict[str, Any]]) -> list[_Startup]:
    ups = []
    for e in events:
        if e["kind"] == "agent_rendezvous" and e.get("startup_s") is not None:
            began = e["time"] - e.get("seconds", 0.0)
            ups.append(_Startup(e.get("host") or "", began - e["startup_s"], began))
    return ups


def _started_beside(named: dict[str, Any], startups: list[_Startup]) -> bool:
    """Whether the machine of a worker named a straggler was short of cores while it was slow: an agent on its host
    (named in both events) was starting during the stretch that named it (its straggler window before the naming),
    and took at least :data:`STARVED_STARTUP` times the run's median start-up. A start-up is seconds of a whole core
    (torch's import); one that long is itself starved, and the rank the scheduler serves least then is slow in
    earnest — a noisy neighbour, named as one should be, but no fault the soak injected. Only the long ones: a soak
    starts an agent every ~15 s, and start-ups of the usual length overlap half its run."""
    if not named.get("host") or not startups:
        return False
    usual = statistics.median(up.seconds for up in startups)
    since = named["time"] - float(named.get("window_s") or named.get("seconds", 0.0))
    return any(up.host == named["host"] and up.seconds >= STARVED_STARTUP * usual
               and up.begin <= named["time"] and up.end >= since for up in startups)


def _stragglers_check(events: list[dict[str, Any]], slowed: list[Injected], hung: set[int]) -> tuple[bool, str]:
    """Every slow node that training rode out had a worker named a straggler while it was slow (or within
    :data:`NAMED_WITHIN_S` after), unless another fault's recovery cut its slowness short (:func:`_cut_short`), and no
    worker that was never slowed (or hung: a hang long enough may name its worker) was named, unless an agent was
    starting on its machine then, starved of cores (:func:`_started_beside`: counted apart in the detail)."""
    named = [e for e in events if e["kind"] == "straggler" and e.get("status") == "named"]
    gens = generations(events)
    windows: dict[int, list[float]] = {}
    starts: dict[int, set[int]] = {}
    for e in events:
        if e["kind"] == "progress" and e.get("rank") == 0 and e.get("generation") is not None:
            windows.setdefault(e["generation"], []).append(e["time"])
        elif e["kind"] == "start" and e.get("generation") is not None:
            starts.setdefault(e["generation"], set()).add(e.get("pid"))
    ridden = [f for f in slowed if f.outcome == "absorbed"]
    excused = [f for f in ridden if _cut_short(f, gens, windows, starts)]
    missed = [f for f in ridden if f not in excused and not _still_named(f, events) and not any(
        e.get("pid") in f.targets and f.at <= e["time"] <= f.at + f.lasts_s + NAMED_WITHIN_S for e in named)]
    unslowed = [e for e in named if e.get("pid") not in hung and not any(e.get("pid") in f.targets for f in slowed)]
    startups = _startups(events)
    beside = [e for e in unslowed if _started_beside(e, startups)]
    wrong = [e for e in unslowed if e not in beside]
    if missed or wrong:
        return False, "; ".join(
            [f"the slow node at {f.offset} s (pids {f.targets}) was not named within {f.lasts_s + NAMED_WITHIN_S:g} s"
             f" ({_how_near(f, events)})" for f in missed] + [f"rank {e.get('rank')} (pid {e.get('pid')}) was named at step {e.get('step')} but "
                                 "never slowed" for e in wrong])
    return True, (f"{len(ridden) - len(excused)} of {len(slowed)} slow node(s) ridden out, each named a straggler "
                  f"({len(named)} naming(s))" + (f", {len(excused)} cut short by another fault's recovery"
                                                 if excused else "")
                  + (f", {len(beside)} worker(s) never slowed named while a starved agent started on their machine "
                     f"(at step(s) {[e.get('step') for e in beside]})" if beside else ""))


def _still_named(fault: Injected, events: list[dict[str, Any]]) -> bool:
    """Whether a worker of the slow node was still named a straggler when the node was slowed again: a named worker
    is not named a second time until it is cleared (a node throttled twice in a row by chance, named in the first)."""
    last: dict[Any, tuple[float, str]] = {}
    for e in events:
        if e["kind"] == "straggler" and e.get("pid") in fault.targets and e["time"] <= fault.at:
            if e.get("pid") not in last or e["time"] >= last[e.get("pid")][0]:
                last[e.get("pid")] = (e["time"], e.get("status") or "")
    return any(status == "named" for _, status in last.values())


def _how_near(fault: Injected, events: list[dict[str, Any]]) -> str:
    """How near a slow node that was not named came to it: its workers' local time per step over the median rank's
    (``local_ratios``) and their seconds at or above ``recovery.straggler_ratio`` (``slow_s``), as rank 0's logging
    windows recorded them while it was slow and up to :data:`NAMED_WITHIN_S` after."""
    ranks = {(e.get("generation"), e.get("pid")): e.get("rank") for e in events if e["kind"] == "start"}
    ratios: list[float] = []
    slow: list[float] = []
    for e in events:
        if e["kind"] != "progress" or e.get("rank") != 0 or not fault.at <= e["time"] <= (
                fault.at + fault.lasts_s + NAMED_WITHIN_S):
            continue
        for pid in fault.targets:
            rank = ranks.get((e.get("generation"), pid))
            if rank is not None and rank < len(e.get("local_ratios") or []):
                ratios.append(float(e["local_ratios"][rank]))
                slow.append(float((e.get("slow_s") or [0.0] * (rank + 1))[rank]))
    if not ratios:
        return "no logging window of rank 0 recorded its workers' ratios then"
    return (f"over {len(ratios)} logging window(s) its local time was {min(ratios):.2f}-{max(ratios):.2f}x the median "
            f"rank's (median {statistics.median(ratios):.2f}x), at most {max(slow):.1f} s at or above the straggler "
            "ratio")


def _spare_check(events: list[dict[str, Any]], spares: list[Injected]) -> tuple[bool, str]:
    """Every spare-takeover that a recovery followed: that recovery's world is the world the node was lost from, and
    the spare's agent (the fault's target) was seated in a round after having waited as a spare.

    The world the node was lost from is the full round the spare waited beside, in ranks: its ``agent_spare_waiting``
    event's ``max_nodes`` times the ranks per node (``local_world_size``). The last attempt that trained before the
    loss can be smaller, when a replacement sealed the round that filled it a moment before (the soak's supervisor
    starts one whenever an agent is lost)."""
    gens = generations(events)
    seated = {int(e["source"].rsplit("-", 1)[1]) for e in events
              if e["kind"] == "agent_rendezvous" and e.get("spare_s") is not None}
    full = {int(e["source"].rsplit("-", 1)[1]): int(e["max_nodes"]) * int(e.get("local_world_size") or 1)
            for e in events if e["kind"] == "agent_spare_waiting" and e.get("max_nodes") is not None}
    wrong = []
    for f in spares:
        if f.generation is None:
            continue
        before = [info for info in gens.values() if info.get("start", float("inf")) < f.at]
        size = next((full[pid] for pid in f.targets if full.get(pid) is not None), None) or \
            (max(before, key=lambda info: info["start"]).get("world_size") if before else None)
        if f.world_size != size or not set(f.targets) & seated:
            wrong.append(f"the spare takeover at {f.offset} s: world size {size} before, {f.world_size} after; the "
                         f"spare (pid {f.targets}) {'was' if set(f.targets) & seated else 'was not'} seated")
    if wrong:
        return False, "; ".join(wrong)
    taken = sum(1 for f in spares if f.generation is not None)
    return True, f"{taken} of {len(spares)} spare takeover(s) recovered at the same world size, the spare seated"


def _furthest_steps(events: list[dict[str, Any]]) -> dict[Any, int]:
    """Per generation, the furthest step rank 0 logged in it."""
    furthest_of: dict[Any, int] = {}
    for e in events:
        if e["kind"] == "progress" and e.get("rank") == 0:
            furthest_of[e.get("generation")] = max(furthest_of.get(e.get("generation"), 0), e["step"])
    return furthest_of


def _ended_first(mark: dict[str, Any], furthest_of: dict[Any, int], gens: dict[int, Any]) -> bool:
    """Whether the attempt of an injected fault's ``mark`` (its worker's chaos event) ended before the check due one
    interval after it (no step logged that far) and a later attempt followed: another fault's recovery came first."""
    generation, step = mark.get("generation"), mark["step"]
    return (furthest_of.get(generation, step) < step + max(1, int(mark.get("interval_steps") or 0))
            and any(g > (generation or 0) for g in gens))


def _corruption_check(events: list[dict[str, Any]], corrupted: list[Injected]) -> tuple[bool, str]:
    """Every flipped bit (the worker's ``chaos_corrupted`` event) was found by the first fingerprint check after it:
    a ``replica_mismatch`` (any rank's) of that attempt whose last agreeing check came before the flip, naming the corrupted
    rank (or nobody, which only two copies of the state — two replicas, or hsdp's two nodes —, or half against half, may
say). A flip whose attempt ended before its
    next check (another fault's recovery replaced the state) is excused, and so is a request whose worker was gone
    before its next step boundary (a new attempt followed the fault); any other request never carried out fails (is
    the hook armed?)."""
    flips = [e for e in events if e["kind"] == "chaos_corrupted"]
    # Any rank's: every rank records the mismatch as it finds it, and rank 0's node may be the next one lost.
    found = sorted((e for e in events if e["kind"] == "replica_mismatch"), key=lambda e: e["time"])
    gens, furthest_of = generations(events), _furthest_steps(events)
    problems, named, excused = [], 0, 0
    for fault in corrupted:
        flip = next((e for e in flips if e.get("pid") in fault.targets and e["time"] >= fault.at), None)
        if flip is None:
            if fault.generation is not None:  # its worker's attempt ended first
                excused += 1
            else:
                problems.append(f"the worker (pids {fault.targets}) asked at {fault.offset} s never flipped its bit")
            continue
        rank, step, generation = flip.get("rank"), flip["step"], flip.get("generation")
        match = next((e for e in found if e.get("generation") == generation and e["time"] >= flip["time"]), None)
        if match is None:
            # Excused if its attempt never reached the check due after the flip (another fault ended it first).
            furthest = furthest_of.get(generation, step)
            if _ended_first(flip, furthest_of, gens):
                excused += 1
            else:
                problems.append(f"rank {rank}'s bit flipped at step {step} was never found (its attempt went on to "
                                f"step {furthest})")
            continue
        # How many copies of the flipped state were compared: every rank's under ddp, a shard's under hsdp.
        copies = match.get("copies") or (gens.get(generation, {}).get("world_size") if generation is not None else None)
        first_check = match.get("verified_step", -1) < step <= match["step"]
        suspects = match.get("suspects") or []
        wrong = rank not in suspects if suspects else (copies is not None and copies >= 3)
        if not first_check or wrong:
            problems.append(f"rank {rank}'s bit flipped at step {step} was found at step {match['step']} (the last "
                            f"agreeing check: step {match.get('verified_step')}) naming {suspects or 'nobody'}"
                            + (f" among {copies} copies" if wrong and not suspects else ""))
        else:
            named += 1
    if problems:
        return False, "; ".join(problems)
    return True, (f"{named} of {len(corrupted)} flipped bit(s) found at the next check and rolled back"
                  + (f", {excused} ended first by another fault" if excused else ""))


def _nonfinite_check(events: list[dict[str, Any]], poisoned: list[Injected], skipped: list[int]) -> tuple[bool, str]:
    """Every NaN loss (the worker's ``chaos_nan`` event) was rolled back at the first logging step after it: rank 0's
    ``nonfinite_rollback`` of that attempt naming that step, status rolled_back. Excused as a flipped bit is: its
    attempt ended before that logging step, or its worker was gone before its next step. (Its samples: the audit's
    exactly-once holds them, skipped by rule where the final records skip the step; a later resume from before the
    rollback in a new process trains on them, the NaN being the chaos tool's, not the data's.)"""
    nans = [e for e in events if e["kind"] == "chaos_nan"]
    rolled = [e for e in events if e["kind"] == "nonfinite_rollback" and e.get("rank") == 0]
    gens, furthest_of = generations(events), _furthest_steps(events)
    problems, caught, excused = [], 0, 0
    for fault in poisoned:
        nan = next((e for e in nans if e.get("pid") in fault.targets and e["time"] >= fault.at), None)
        if nan is None:
            if fault.generation is not None:
                excused += 1
            else:
                problems.append(f"the worker (pids {fault.targets}) asked at {fault.offset} s never made its loss NaN")
            continue
        rank, step, generation = nan.get("rank"), nan["step"], nan.get("generation")
        match = next((e for e in rolled if e.get("generation") == generation and e["step"] == step), None)
        if match is None:
            furthest = furthest_of.get(generation, step)
            if _ended_first(nan, furthest_of, gens):
                excused += 1
            else:
                problems.append(f"rank {rank}'s NaN loss at step {step} was never rolled back (its attempt went on to "
                                f"step {furthest})")
        elif match.get("status") != "rolled_back":
            problems.append(f"rank {rank}'s NaN loss at step {step} stopped the job ({match.get('status')}): "
                            "recovery.max_rollbacks too low for the scenario")
        else:
            caught += 1
    if problems:
        return False, "; ".join(problems)
    return True, (f"{caught} of {len(poisoned)} NaN batch(es) rolled back at the next logging step; steps skipped by "
                  f"rule in the final records: {skipped or 'none'}" + (f", {excused} ended first by another fault"
                                                                        if excused else ""))
