"""The audit of a mixture (``data.sources``): every step's window is the mixture's, so every source is used exactly
once per its own epoch, in its exact share.

The audit trail of a mixture says in its header each source's label, size and exact weight, and in each step record
what the step took from each source (``segments``: source, its epoch, position, count) beside the rank's global ids.
From the owning records of steps 1, 2, ... in order (:func:`~.audit.check_audit`'s first pass) this replays the
mixture: the samples taken from each source so far decide the next step's slots (:func:`~elastic_runner.data.
mixture.quota_slots`), and so its segments and its window, which each rank's ids must equal — ``window[r::W]``. Since
each source's epoch is a permutation of its samples and its positions advance without a gap, equal windows mean each
source's samples are used exactly once per epoch; the proportions are checked as such (within one sample of the
weight times the slots given out, after every step). A rank whose records were lost with its node is counted by the
same rule, as for one dataset.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from ..data.mixture import MixtureSampler
from ..printable import printable


@dataclass
class SourceReport:
    """What a run took from one source."""

    label: str
    weight: str  #: the exact share, "W/Q"
    samples: int  #: its size (windows or items)
    taken: int = 0
    share: float = 0.0  #: of every sample taken, what came from here
    epochs_complete: int = 0
    worst_deviation: float = 0.0  #: the largest |taken - weight x slots| after any step
    per_epoch: dict[int, int] = field(default_factory=dict)
    #: Of ``taken``: samples of steps skipped by rule (consumed, not trained on), and by this source's epoch.
    skipped: int = 0
    skipped_per_epoch: dict[int, int] = field(default_factory=dict)

    @property
    def weight_share(self) -> float:
        top, _, bottom = self.weight.partition("/")
        return int(top) / int(bottom or 1)

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "weight": self.weight, "samples": self.samples, "taken": self.taken,
                "share": round(self.share, 6), "epochs_complete": self.epochs_complete,
                "worst_deviation": round(self.worst_deviation, 6), "skipped": self.skipped,
                "skipped_per_epoch": {str(epoch): n for epoch, n in sorted(self.skipped_per_epoch.items())}}

    def line(self) -> str:
        left = self.taken - self.epochs_complete * self.samples
        part = f" + {left / self.samples:.0%}" if left else ""
        return (f"  source {self.label}: weight {self.weight_share:.4g}, took {self.taken:,} samples ({self.share:.4f} "
                f"of all), {self.epochs_complete} epoch{'s' if self.epochs_complete != 1 else ''} of {self.samples:,}"
                f"{part}, every step within {self.worst_deviation:.3f} of its share"
                + (f"; {self.skipped:,} skipped by rule (consumed, not trained on: "
                   + ", ".join(f"epoch {e}: {n:,}" for e, n in sorted(self.skipped_per_epoch.items())) + ")"
                   if self.skipped else ""))


def check_mixture(header: dict[str, Any], final_step: int, owner: dict[int, int],
                  segments_of: dict[tuple[int, int], tuple[tuple[int, int, int, int], ...]],
                  records: Iterable[dict[str, Any]], first_step: int = 1,
                  taken_at_start: list[int] | None = None,
                  skipped_steps: Iterable[int] = ()) -> tuple[list[SourceReport], list[str]]:
    """The sources' reports and every violation (see the module docstring). ``first_step``, ``taken_at_start``: where
    a run that started from another run's snapshot began (what each source had given by then); ``skipped_steps``: the
    owning generations' steps skipped by rule (their samples are counted as taken, and as skipped)."""
    skipped = set(skipped_steps)
    sources = header.get("sources") or []
    violations: list[str] = []
    try:
        sampler = MixtureSampler([int(s["samples"]) for s in sources], [str(s["weight"]) for s in sources],
                                 int(header["global_batch"]), seed=int(header["seed"]), shuffle=bool(header["shuffle"]),
                                 labels=[printable(s["label"], 500) for s in sources])
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        return [], [f"the audit trail's mixture cannot be read back ({type(exc).__name__}: {exc})"]
    reports = [SourceReport(printable(s["label"], 500), str(s["weight"]), int(s["samples"])) for s in sources]
    weights = [w / sampler.denominator for w in sampler.weights]
    taken = list(taken_at_start) if taken_at_start and len(taken_at_start) == len(sources) else [0] * len(sources)
    taken_before: dict[int, tuple[int, ...]] = {}
    for step in range(first_step, final_step + 1):
        generation = owner.get(step)
        if generation is None:
            continue  # said in the first pass
        taken_before[step] = tuple(taken)
        _, expected = sampler.window(taken)
        recorded = segments_of.get((step, generation), ())
        if recorded != tuple((g.source, g.epoch, g.start, g.count) for g in expected):
            violations.append(f"step {step}: took {list(recorded)} from the sources, the mixture gives "
                              f"{[(g.source, g.epoch, g.start, g.count) for g in expected]}")
        for g in expected:
            taken[g.source] += g.count
            reports[g.source].per_epoch[g.epoch] = reports[g.source].per_epoch.get(g.epoch, 0) + g.count
            if step in skipped:
                reports[g.source].skipped += g.count
                reports[g.source].skipped_per_epoch[g.epoch] = reports[g.source].skipped_per_epoch.get(g.epoch, 0) \
                    + g.count
        slots = sum(taken)
        for s, report in enumerate(reports):
            report.worst_deviation = max(report.worst_deviation, abs(taken[s] - weights[s] * slots))
    total = sum(taken) or 1
    for s, report in enumerate(reports):
        report.taken, report.share = taken[s], taken[s] / total
        report.epochs_complete = taken[s] // report.samples
        if report.worst_deviation >= 1:
            violations.append(f"source {report.label}: {report.worst_deviation:.3f} samples off its share after "
                              "some step (the mixture keeps every source within one)")
    # The ranks' ids against the windows, one step at a time (a window is a few hundred ids: none is kept).
    window_of: dict[int, list[int]] = {}
    wrong = 0
    for r in records:
        step = r.get("step")
        if r.get("type") != "step" or owner.get(step) != r.get("generation") or step not in taken_before:
            continue
        if step not in window_of:
            if len(window_of) > 64:
                window_of.clear()
            window_of[step] = sampler.window(taken_before[step])[0]
        expected_ids = window_of[step][r["rank"]::r["world_size"]]
        if r["indices"] != expected_ids:
            wrong += 1
            if wrong <= 5:
                extra = sorted(set(r["indices"]) - set(expected_ids))[:5]
                violations.append(f"step {step}, rank {r['rank']} of {r['world_size']}: its samples are not its "
                                  f"share of the mixture's window (e.g. {extra or 'another order'})")
    if wrong > 5:
        violations.append(f"... {wrong - 5} more ranks' steps with samples that are not their share")
    return reports, violations
