"""Audit trail of consumed samples, and the checker that replays it.

With ``audit.samples: true`` each rank appends one JSON line per optimizer
step to ``RUN_DIR/audit/gen-<GEN>-rank-<RANK>.jsonl``::

    {"type": "step", "generation": 3, "epoch": 0, "step": 12, "rank": 1,
     "world_size": 2, "start": 704, "global_count": 64, "micro_batch": 32,
     "accumulation": 1, "indices": [17, 902, ...]}

The line is written and flushed *before* the step's first collective. A step
can only complete if every rank reached its collectives, so every completed
step has a record from every rank; a rank killed mid-write leaves at most a
torn last line, which the checker ignores. The first line of each file is a
``header`` (dataset size, seed, shuffle, partial-batch rule); rank 0 writes an
``end`` line when the run finishes.

Replay rule: for each step, the records of the newest generation that wrote
it win (a restart that resumed from an earlier snapshot re-does those steps).
The checker then reports per epoch: samples seen, duplicates, missing (and
samples outside the epoch's expected order); any of those, a step without
records from all its ranks, or a changing global batch is a violation.
"""

from __future__ import annotations

import json
import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from .sampler import epoch_permutation

AUDIT_DIR = "audit"


class AuditWriter:
    def __init__(self, run_dir: str | os.PathLike[str], *, generation: int, rank: int, world_size: int,
                 header: dict[str, Any]) -> None:
        directory = Path(run_dir) / AUDIT_DIR
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"gen-{generation:06d}-rank-{rank:05d}.jsonl"
        self.generation = generation
        self.rank = rank
        self.world_size = world_size
        self._fh: TextIO = open(self.path, "a", buffering=1)
        self._write({"type": "header", "generation": generation, "rank": rank, "world_size": world_size} | header)

    def _write(self, record: dict[str, Any]) -> None:
        self._fh.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._fh.flush()

    def step(self, *, step: int, epoch: int, start: int, global_count: int, indices: list[int],
             micro_batch: int, accumulation: int) -> None:
        self._write({
            "type": "step", "generation": self.generation, "epoch": epoch, "step": step, "rank": self.rank,
            "world_size": self.world_size, "start": start, "global_count": global_count,
            "micro_batch": micro_batch, "accumulation": accumulation, "indices": indices,
        })

    def end(self, step: int) -> None:
        self._write({"type": "end", "generation": self.generation, "step": step, "rank": self.rank})

    def close(self) -> None:
        self._fh.close()


# --------------------------------------------------------------------------- checking


@dataclass
class EpochReport:
    epoch: int
    complete: bool
    expected: int
    seen: int
    duplicates: list[int] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)
    unexpected: list[int] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (self.duplicates or self.missing or self.unexpected)


@dataclass
class AuditReport:
    epochs: list[EpochReport] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    finished: bool = False
    final_step: int = 0
    generations: list[int] = field(default_factory=list)
    world_sizes: dict[int, int] = field(default_factory=dict)  #: generation -> world size
    global_batches: list[int] = field(default_factory=list)
    torn_lines: int = 0
    steps_superseded: int = 0

    @property
    def ok(self) -> bool:
        return not self.violations and all(e.clean for e in self.epochs)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok, "finished": self.finished, "final_step": self.final_step,
            "generations": self.generations, "world_sizes": {str(k): v for k, v in self.world_sizes.items()},
            "global_batches": self.global_batches, "torn_lines": self.torn_lines,
            "steps_superseded": self.steps_superseded, "violations": self.violations,
            "epochs": [
                {"epoch": e.epoch, "complete": e.complete, "expected": e.expected, "seen": e.seen,
                 "duplicates": len(e.duplicates), "missing": len(e.missing), "unexpected": len(e.unexpected),
                 "examples": {"duplicates": e.duplicates[:10], "missing": e.missing[:10], "unexpected": e.unexpected[:10]}}
                for e in self.epochs
            ],
        }

    def render(self) -> str:
        lines = [
            f"audit: {'CLEAN' if self.ok else 'VIOLATIONS FOUND'} — {'finished' if self.finished else 'not finished'} "
            f"at step {self.final_step}; generations {self.generations}; world sizes "
            f"{sorted(set(self.world_sizes.values()))}; global batch {sorted(set(self.global_batches))}",
        ]
        for e in self.epochs:
            lines.append(
                f"  epoch {e.epoch}{'' if e.complete else ' (in progress)'}: seen {e.seen}/{e.expected}, "
                f"duplicates {len(e.duplicates)}, missing {len(e.missing)}, unexpected {len(e.unexpected)}"
            )
        for v in self.violations:
            lines.append(f"  violation: {v}")
        if self.torn_lines:
            lines.append(f"  note: {self.torn_lines} torn line(s) from killed writers were ignored")
        return "\n".join(lines)


def _read_records(directory: Path) -> tuple[list[dict[str, Any]], int]:
    records: list[dict[str, Any]] = []
    torn = 0
    for path in sorted(directory.glob("gen-*-rank-*.jsonl")):
        with open(path) as fh:
            for line in fh:
                if not line.endswith("\n"):
                    torn += 1
                    continue
                try:
                    records.append(json.loads(line))
                except ValueError:
                    torn += 1
    return records, torn


def check_audit(run_dir: str | os.PathLike[str]) -> AuditReport:
    directory = Path(run_dir) / AUDIT_DIR
    report = AuditReport()
    if not directory.is_dir():
        report.violations.append(f"no audit trail in {directory} (run with audit.samples: true)")
        return report
    records, report.torn_lines = _read_records(directory)
    headers = [r for r in records if r.get("type") == "header"]
    if not headers:
        report.violations.append("the audit trail has no header records")
        return report
    dataset_keys = ("num_samples", "seed", "shuffle", "partial_batch")
    variants = {tuple(h.get(k) for k in dataset_keys) for h in headers}
    if len(variants) > 1:
        report.violations.append(f"the dataset or order changed between generations: {sorted(variants, key=str)}")
    header = headers[-1]
    num_samples, seed, shuffle, partial = (header[k] for k in dataset_keys)
    report.world_sizes = {h["generation"]: h["world_size"] for h in headers}
    report.generations = sorted(report.world_sizes)

    by_step: dict[int, dict[int, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        if r.get("type") == "step":
            by_step[r["step"]][r["generation"]].append(r)
    ends = [r for r in records if r.get("type") == "end"]
    if ends:
        final = max(ends, key=lambda r: (r["generation"], r["step"]))
        report.finished = True
        report.final_step = final["step"]
    else:
        report.final_step = max(by_step, default=0)

    batch_of = {h["generation"]: h["global_batch"] for h in headers}
    epochs: dict[int, list[int]] = defaultdict(list)
    epoch_end: dict[int, tuple[int, int]] = {}  # epoch -> (end position, global batch there)
    for step in range(1, report.final_step + 1):
        gens = by_step.get(step)
        if not gens:
            report.violations.append(f"step {step} has no records")
            continue
        newest = max(gens)
        report.steps_superseded += sum(1 for g in gens if g != newest)
        recs = gens[newest]
        world = recs[0]["world_size"]
        ranks = sorted(r["rank"] for r in recs)
        if ranks != list(range(world)):
            report.violations.append(f"step {step} (generation {newest}) has records from ranks {ranks}, expected 0..{world - 1}")
        shape = {(r["epoch"], r["start"], r["global_count"]) for r in recs}
        if len(shape) != 1:
            report.violations.append(f"step {step}: ranks disagree on (epoch, start, global batch): {sorted(shape)}")
            continue
        epoch, start, count = shape.pop()
        consumed = sum(len(r["indices"]) for r in recs)
        if consumed != count:
            report.violations.append(f"step {step}: ranks consumed {consumed} samples, the global batch is {count}")
        nominal = batch_of.get(newest, count)
        last_partial = partial == "partial" and start + count == num_samples and count < nominal
        if count != nominal and not last_partial:
            report.violations.append(f"step {step}: global batch {count}, generation {newest} promised {nominal}")
        report.global_batches.append(count)
        for r in sorted(recs, key=lambda r: r["rank"]):
            epochs[epoch].extend(r["indices"])
        end = start + count
        if end >= epoch_end.get(epoch, (0, 0))[0]:
            epoch_end[epoch] = (end, nominal)

    canonical = header.get("sampler", "elastic") == "elastic"
    last_epoch = max(epochs, default=-1)
    for epoch in sorted(epochs):
        perm = epoch_permutation(num_samples, seed, epoch, shuffle).tolist()
        seen = epochs[epoch]
        counts = Counter(seen)
        usable, nominal = epoch_end[epoch]
        left = num_samples - usable
        complete = left == 0 or (partial == "drop" and left < nominal)
        if epoch < last_epoch and not complete:
            report.violations.append(f"epoch {epoch} ended after {usable} of {num_samples} samples")
        seen_set = set(counts)
        if canonical:
            expected = set(perm[:usable])
        else:
            # A custom sampler's order is unknown: hold it to exactly-once within the dataset.
            expected = set(range(num_samples)) if (complete and partial == "partial") else seen_set & set(range(num_samples))
            if complete and len(seen_set) != usable:
                report.violations.append(f"epoch {epoch}: {len(seen_set)} distinct samples, expected {usable}")
        report.epochs.append(EpochReport(
            epoch=epoch, complete=complete, expected=len(expected), seen=len(seen),
            duplicates=sorted(i for i, c in counts.items() if c > 1),
            missing=sorted(expected - seen_set),
            unexpected=sorted(seen_set - expected),
        ))
    return report
