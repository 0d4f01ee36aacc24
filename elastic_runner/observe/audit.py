"""Audit trail of consumed samples, and the checker that replays it.

With ``audit.samples: true`` each rank appends one JSON line per optimizer
step to ``RUN_DIR/audit/gen-<GEN>-rank-<RANK>.jsonl``::

    {"type": "step", "generation": 3, "epoch": 0, "step": 12, "rank": 1,
     "world_size": 2, "start": 704, "global_count": 64, "micro_batch": 32,
     "accumulation": 1, "indices": [17, 902, ...]}

A step skipped by rule (``train.skip_steps``, a non-finite rollback's) adds ``"skipped": true``: its samples count
as used once (never again, never missing), and the report says how many were not trained on.

The line is written and flushed *before* the step's first collective. A step
can only complete if every rank reached its collectives, so every completed
step has a record from every rank; a rank killed mid-write leaves at most a
torn last line, which the checker ignores. The first line of each file is a
``header`` (dataset size, seed, shuffle, partial-batch rule, and ``order``: the
sampler's order kind, ``feistel`` or ``randperm``; a header without one is from
before order kinds, read as ``randperm``); rank 0 writes an ``end`` line when
the run finishes.

Replay rule: for each step, the records of the newest generation that wrote
it win (a restart that resumed from an earlier snapshot re-does those steps).
The checker then reports per epoch: samples seen, duplicates, missing (and
samples outside the epoch's expected order); any of those, a step without
records from all its ranks, or a changing global batch is a violation.

Records lost with a node: a run without a shared directory keeps each node's trail on the node and uploads it to
the bucket every ``snapshot.records_every_seconds`` (:mod:`elastic_runner.observe.records`); a node lost with its
disk takes the lines of its last interval along. Read from a bucket (:func:`.records_view.bucket_view`), a step
whose records lack some ranks is accepted only when all of these hold: each of those ranks has records of that
generation (its header at least, uploaded as soon as it is written) that *end before the step* (it started in the
attempt, agreed on the steps it recorded, and its upload stopped: never a hole, never a rank with no record at all,
never a file the bucket has a gap in); a later generation stepped (the loss ended this one); and this generation's
order is the elastic sampler's, whose shares ``window[rank::world]`` the other ranks' records of the step fix. Their
samples are counted from there and the report names the ranks and steps (``records_lost``). Anywhere else, and for
a custom sampler, it stays a violation.
"""

from __future__ import annotations

import json
import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, TextIO

import numpy as np

from ..data.order import DEFAULT_ORDER, LEGACY_ORDER, ORDERS, epoch_order
from ..files import makedirs, open_file
from .audit_derive import generation_rank, note_lost, proven_by_resumes, started_from, with_derived
from .records_view import bucket_view

AUDIT_DIR = "audit"


#: An audit file is closed and the next part opened beyond this size, so that no file grows without bound.
MAX_FILE_BYTES = 64 << 20


class AuditWriter:
    def __init__(self, run_dir: str | os.PathLike[str], *, generation: int, rank: int, world_size: int,
                 header: dict[str, Any], max_file_bytes: int = MAX_FILE_BYTES) -> None:
        self.directory = makedirs(Path(run_dir) / AUDIT_DIR)
        self.stem = f"gen-{generation:06d}-rank-{rank:05d}"
        self.path = self.directory / f"{self.stem}.jsonl"
        self.generation = generation
        self.rank = rank
        self.world_size = world_size
        self.max_file_bytes = max_file_bytes
        self._part = 0
        self._fh: TextIO = open_file(self.path, "a", buffering=1)
        self._written = self.path.stat().st_size
        # A header that names no order kind gets the sampler's default: a header without one is read as a run
        # from before order kinds (randperm). A run resumed from such a run's snapshot must say "randperm".
        self._write({"type": "header", "generation": generation, "rank": rank, "world_size": world_size,
                     "order": DEFAULT_ORDER} | header)

    def _write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":")) + "\n"
        if self._written + len(line) > self.max_file_bytes and self._written:
            self._rotate()
        self._fh.write(line)
        self._fh.flush()
        self._written += len(line)

    def _rotate(self) -> None:
        self._fh.close()
        self._part += 1
        self.path = self.directory / f"{self.stem}-part-{self._part:04d}.jsonl"
        self._fh = open_file(self.path, "a", buffering=1)
        self._written = self.path.stat().st_size

    def step(self, *, step: int, epoch: int, start: int, global_count: int, indices: list[int],
             micro_batch: int, accumulation: int, segments: tuple[tuple[int, int, int, int], ...] = (),
             skipped: bool = False) -> None:
        self._write({
            "type": "step", "generation": self.generation, "epoch": epoch, "step": step, "rank": self.rank,
            "world_size": self.world_size, "start": start, "global_count": global_count,
            "micro_batch": micro_batch, "accumulation": accumulation, "indices": indices,
        } | ({"segments": [list(g) for g in segments]} if segments else {}) | ({"skipped": True} if skipped else {}))

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
    skipped: int = 0  #: of ``seen``: samples of steps skipped by rule (consumed, not trained on)

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
    #: Spans of steps whose records some ranks' nodes took along (a bucket's view only: see the module docstring):
    #: ``{"generation", "ranks", "first_step", "last_step"}``.
    records_lost: list[dict[str, Any]] = field(default_factory=list)
    #: False when the run kept no audit trail (audit.samples off): nothing to judge, not a violation.
    audited: bool = True
    #: A mixture's sources (data.sources): what the run took from each (:mod:`.audit_mixture`).
    sources: list[Any] = field(default_factory=list)
    #: Where a run that began from another run's snapshot (snapshot.resume_from) started: earlier steps are that run's.
    started_from: dict[str, Any] | None = None
    #: Steps skipped by rule (train.skip_steps, a non-finite rollback's), as the owning generation recorded them.
    skipped_steps: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations and all(e.clean for e in self.epochs)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok, "audited": self.audited, "finished": self.finished, "final_step": self.final_step,
            "generations": self.generations, "world_sizes": {str(k): v for k, v in self.world_sizes.items()},
            "global_batches": self.global_batches, "torn_lines": self.torn_lines,
            "steps_superseded": self.steps_superseded, "records_lost": self.records_lost,
            "violations": self.violations, "sources": [source.to_dict() for source in self.sources],
            "started_from": self.started_from, "skipped_steps": self.skipped_steps,
            "epochs": [
                {"epoch": e.epoch, "complete": e.complete, "expected": e.expected, "seen": e.seen, "skipped": e.skipped,
                 "duplicates": len(e.duplicates), "missing": len(e.missing), "unexpected": len(e.unexpected),
                 "examples": {"duplicates": e.duplicates[:10], "missing": e.missing[:10], "unexpected": e.unexpected[:10]}}
                for e in self.epochs
            ],
        }

    def render(self) -> str:
        if not self.audited:
            return f"audit: NOT AUDITED — {self.violations[0]}"
        lines = [
            f"audit: {'CLEAN' if self.ok else 'VIOLATIONS FOUND'} — {'finished' if self.finished else 'not finished'} "
            f"at step {self.final_step}; generations {self.generations}; world sizes "
            f"{sorted(set(self.world_sizes.values()))}; global batch {sorted(set(self.global_batches))}",
        ]
        if (f := self.started_from) is not None:
            lines.append(f"  started from another run's snapshot {f['snapshot']} (snapshot.resume_from): steps "
                         f"1-{f['step']} and the first {f['consumed']} samples of epoch {f['epoch']} are that run's")
        lines += [f"  epoch {e.epoch}{'' if e.complete else ' (in progress)'}: seen {e.seen}/{e.expected}"
                  f"{f' ({e.skipped} skipped by rule: consumed, not trained on)' if e.skipped else ''}, duplicates "
                  f"{len(e.duplicates)}, missing {len(e.missing)}, unexpected {len(e.unexpected)}" for e in self.epochs]
        if self.skipped_steps:
            lines.append(f"  note: steps skipped by rule (train.skip_steps, non-finite rollbacks): {self.skipped_steps}")
        lines += [source.line() for source in self.sources]
        lines += [f"  violation: {v}" for v in self.violations]
        if self.torn_lines:
            lines.append(f"  note: {self.torn_lines} torn line(s) from killed writers were ignored")
        lines += [f"  note: generation {lost['generation']}, ranks {lost['ranks']}: the records of steps "
                  f"{lost['first_step']}-{lost['last_step']} were lost with their node before they were uploaded; their "
                  "samples follow from the sampler's order and the other ranks' records" if lost["ranks"] else
                  f"  note: every record of steps {lost['first_step']}-{lost['last_step']} was lost with the nodes that "
                  f"held them (records lost, not samples): the resume at step {lost['proved_by_step']} proves they were "
                  "trained, and their samples follow from the sampler's order" for lost in self.records_lost]
        return "\n".join(lines)


#: The fields each kind of record must have, with their types (a record without them is malformed, not a crash).
_SHAPES: dict[str, dict[str, type]] = {
    "header": {"generation": int, "rank": int, "world_size": int, "global_batch": int, "num_samples": int,
               "seed": int, "shuffle": bool, "partial_batch": str},
    "end": {"generation": int, "step": int},
    "step": {"generation": int, "step": int, "rank": int, "world_size": int, "epoch": int, "start": int,
             "global_count": int, "indices": list},
}
#: Counts no run reaches (a count past them would make the checker allocate what a writer of the trail chose).
_MOST, _MOST_RANKS = 1 << 40, 1 << 20


def _well_formed(record: Any) -> bool:
    if not isinstance(record, dict) or not isinstance(record.get("type"), str):
        return False
    shape = _SHAPES.get(record["type"])
    if shape is None:
        return True  # a kind the checker does not read
    for k, t in shape.items():
        value = record.get(k)
        if t is bool:
            if not isinstance(value, bool):
                return False
        elif not isinstance(value, t) or isinstance(value, bool) or (t is int and k != "seed" and not 0 <= value < _MOST):
            return False
    if "world_size" in shape and not 1 <= record["world_size"] <= _MOST_RANKS or record.get("global_batch") == 0:
        return False
    if record["type"] == "header" and not all(isinstance(record.get(k, ""), str) for k in ("order", "sampler")):
        return False
    return record["type"] != "step" or all(type(i) is int for i in record["indices"])


class _Lines:
    """The records of every audit file, read one line at a time (a second pass reads them again)."""

    def __init__(self, directory: Path) -> None:
        self.paths = sorted(directory.glob("gen-*-rank-*.jsonl"))
        self.torn = 0
        self.malformed: list[str] = []  #: the files of whole lines that are not records of ours

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self.torn, self.malformed = 0, []
        for path in self.paths:
            with open(path, errors="surrogateescape") as fh:  # bytes that are no UTF-8: a line that is no record
                for line in fh:
                    if not line.endswith("\n"):
                        self.torn += 1
                        continue
                    try:
                        record = json.loads(line)
                    except ValueError:
                        self.torn += 1
                        continue
                    except RecursionError:
                        record = None  # nested past any record of ours: malformed
                    if _well_formed(record):
                        yield record
                    else:
                        self.malformed.append(path.name)


def latest_step(run_dir: str | os.PathLike[str]) -> int:
    """The highest step the ranks of the two newest attempts have started, from the tails of their audit
    trails (cheap to poll, also after thousands of attempts: an attempt's file is named after its generation,
    ``gen-GGGGGG-rank-RRRRR.jsonl``, and the newest may not have stepped yet)."""
    best = 0
    paths = sorted((Path(run_dir) / AUDIT_DIR).glob("*.jsonl"))
    generations = sorted({p.name.split("-rank-")[0] for p in paths})[-2:]
    for path in (p for p in paths if p.name.split("-rank-")[0] in generations):
        try:
            with open(path, "rb") as fh:
                fh.seek(max(0, path.stat().st_size - 4096))
                tail = fh.read().decode(errors="replace").splitlines()
        except OSError:
            continue
        for line in reversed(tail):
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):
                continue
            if isinstance(record, dict) and record.get("type") == "step" and isinstance(record.get("step"), int):
                best = max(best, record["step"])
                break
    return best


def check_audit(run_dir: str | os.PathLike[str]) -> AuditReport:
    """Replay the audit trail in two streaming passes: memory grows with the number of steps and with
    one byte per sample and epoch, not with the size of the trail."""
    directory = Path(run_dir) / AUDIT_DIR
    report = AuditReport()
    if not directory.is_dir():
        report.audited = False
        root = Path(run_dir)
        if not root.is_dir():
            why = f"{run_dir} is not a directory: give the run directory (run.dir)"
        elif not any((root / name).exists() for name in ("events", "config.yaml", "snapshots")):
            why = (f"{run_dir} is not a run directory (it holds no events, config.yaml or snapshots): give the run "
                   "directory (run.dir), or the bucket URL of snapshot.dir")
        else:
            why = (f"no audit trail in {directory}: the run had audit.samples off (set audit.samples: true to record "
                   "which samples every step used)")
        report.violations.append(why)
        return report
    lines = _Lines(directory)
    headers, ends = [], []
    # Pass 1: every step record without its indices, to find the generation that owns each step.
    by_step: dict[int, dict[int, list[tuple[int, int, int, int, int, int]]]] = defaultdict(lambda: defaultdict(list))
    last_of: dict[tuple[int, int], int] = {}  # (generation, rank) -> the last step its trail reached
    present: set[tuple[int, int]] = set()  # (generation, rank) with any record (a header at least)
    segments_of: dict[tuple[int, int], tuple[tuple[int, int, int, int], ...]] = {}
    skipped_at: set[tuple[int, int]] = set()  # (step, generation) recorded as skipped by rule
    for r in lines:
        kind = r.get("type")
        if kind == "header":
            headers.append(r)
            present.add((r["generation"], r["rank"]))
        elif kind == "end":
            ends.append(r)
        elif kind == "step":
            by_step[r["step"]][r["generation"]].append(
                (r["rank"], r["world_size"], r["epoch"], r["start"], r["global_count"], len(r["indices"])))
            if r.get("skipped") is True:
                skipped_at.add((r["step"], r["generation"]))
            if "segments" in r:  # a mixture's: the same on every rank of a step (checked in the mixture's pass)
                segments_of.setdefault((r["step"], r["generation"]), _segments(r["segments"]))
            key = (r["generation"], r["rank"])
            last_of[key] = max(last_of.get(key, 0), r["step"])
            present.add(key)
    report.torn_lines = lines.torn
    if lines.malformed:
        report.violations.append(f"{len(lines.malformed)} record(s) of the audit trail are malformed (first in "
                                 f"{lines.malformed[0]}): written by something else, or changed")
    if not headers:
        report.violations.append("the audit trail has no header records")
        return report
    dataset_keys = ("num_samples", "seed", "shuffle", "partial_batch", "order")
    for h in headers:  # a header without an order kind was written before them, by a run in the randperm order
        h.setdefault("order", LEGACY_ORDER)
    variants = {tuple(h.get(k) for k in dataset_keys) for h in headers}
    if len(variants) > 1:
        report.violations.append(f"the dataset or order changed between generations: {sorted(variants, key=str)}")
    header = headers[-1]
    num_samples, seed, shuffle, partial, order = (header[k] for k in dataset_keys)
    report.started_from = started = started_from(headers)
    first = started["step"] + 1 if started else 1
    report.world_sizes = {h["generation"]: h["world_size"] for h in headers}
    report.generations = sorted(report.world_sizes)
    if ends:
        final = max(ends, key=lambda r: (r["generation"], r["step"]))
        report.finished = True
        report.final_step = final["step"]
    else:
        report.final_step = max(by_step, default=0)

    batch_of = {h["generation"]: h["global_batch"] for h in headers}
    canonical = header.get("sampler", "elastic") == "elastic"
    if canonical and not (isinstance(order, str) and order in ORDERS):
        report.violations.append(f"the audit trail names the order {order!r}, not one of {sorted(ORDERS)}")
        return report
    # Records may have been lost with a node only in a bucket's view, only in a generation that a later one ended
    # (one that stepped), and only where that generation's order is the elastic sampler's.
    view = bucket_view(run_dir)
    lossy = view is not None
    cut_short = {generation_rank(name) for name in (view or {}).get("cut_short", [])}  # a gap is no lost tail
    elastic_in = {h["generation"] for h in headers if h.get("sampler", "elastic") == "elastic"} \
        - {h["generation"] for h in headers if h.get("sampler", "elastic") != "elastic"}
    last_stepped = max((g for gens in by_step.values() for g in gens), default=0)
    # Steps whose records went with every node at once, which a later attempt's resume proves were trained.
    proven = proven_by_resumes(headers, by_step, num_samples, header["global_batch"], partial, first) \
        if lossy and canonical and len(set(batch_of.values())) == 1 else {}
    owner: dict[int, int] = {}  # step -> the generation whose records count
    # step -> (world size, ranks whose shares follow from the order, epoch, start, global batch)
    derived: dict[int, tuple[int, list[int], int, int, int]] = {}
    epoch_end: dict[int, tuple[int, int]] = {}  # epoch -> (end position, global batch there)
    for step in range(first, report.final_step + 1):
        gens = by_step.get(step)
        if not gens and step in proven:  # counted from the order, as generation 0, and said
            epoch, start, count, resumed = proven[step]
            owner[step], derived[step] = 0, (1, [0], epoch, start, count)
            note_lost(report.records_lost, 0, [], step, resumed)
            report.global_batches.append(count)
            if start + count >= epoch_end.get(epoch, (0, 0))[0]:
                epoch_end[epoch] = (start + count, header["global_batch"])
            continue
        if not gens:
            report.violations.append(f"step {step} has no records")
            continue
        newest = max(gens)
        report.steps_superseded += sum(1 for g in gens if g != newest)
        recs = gens[newest]
        world = recs[0][1]
        ranks = sorted(r[0] for r in recs)
        missing: list[int] = []
        lost_with_node = False
        if ranks != list(range(world)):
            missing = sorted(set(range(world)) - set(ranks))
            # Each missing rank's trail *ended* before the step: it has records of this generation (its header at
            # least: it started in this attempt; its steps agreed with the others'), none from this step on (an
            # upload that stopped, never a hole).
            lost_with_node = bool(lossy and newest in elastic_in and newest < last_stepped and missing
                                  and len(set(ranks)) == len(ranks) and set(ranks) <= set(range(world))
                                  and all((newest, r) in present and last_of.get((newest, r), 0) < step
                                          for r in missing)
                                  and not cut_short & {(newest, r) for r in missing})
            if lost_with_node:
                note_lost(report.records_lost, newest, missing, step)
            else:
                report.violations.append(
                    f"step {step} (generation {newest}) has records from ranks {ranks}, expected 0..{world - 1}")
        shape = {r[2:5] for r in recs}
        if len(shape) != 1:
            report.violations.append(f"step {step}: ranks disagree on (epoch, start, global batch): {sorted(shape)}")
            continue
        epoch, start, count = shape.pop()
        consumed = sum(r[5] for r in recs)
        if lost_with_node:
            derived[step] = (world, missing, epoch, start, count)
            consumed += sum(len(range(r, count, world)) for r in missing)
        if consumed != count:
            report.violations.append(f"step {step}: ranks consumed {consumed} samples, the global batch is {count}")
        nominal = batch_of.get(newest, count)
        last_partial = partial == "partial" and start + count == num_samples and count < nominal
        if count != nominal and not last_partial:
            report.violations.append(f"step {step}: global batch {count}, generation {newest} promised {nominal}")
        report.global_batches.append(count)
        owner[step] = newest
        end = start + count
        if end >= epoch_end.get(epoch, (0, 0))[0]:
            epoch_end[epoch] = (end, nominal)
    del by_step
    report.skipped_steps = sorted(step for step, generation in skipped_at if owner.get(step) == generation)

    if header.get("sampler") == "mixture":  # data.sources: the mixture's own replay
        from .audit_mixture import check_mixture

        report.sources, found = check_mixture(header, report.final_step, owner, segments_of, lines,
                                              first, started["taken"] if started else None, report.skipped_steps)
        report.violations += found
        return report
    # Pass 2: the indices of the owning records, counted per epoch (saturating at 255), plus any out of range.
    counts: dict[int, np.ndarray] = {}
    outside: dict[int, set[int]] = defaultdict(set)
    seen_total: Counter[int] = Counter()
    skipped_total: Counter[int] = Counter()
    for r in with_derived(lines, derived, owner, num_samples, seed, shuffle, order):
        if r.get("type") != "step" or owner.get(r["step"]) != r["generation"]:
            continue
        epoch, indices = r["epoch"], r["indices"]
        if epoch not in counts:
            counts[epoch] = np.zeros(num_samples, dtype=np.uint8)
        seen_total[epoch] += len(indices)
        if (r["step"], r["generation"]) in skipped_at:
            skipped_total[epoch] += len(indices)
        valid = [i for i in indices if isinstance(i, int) and 0 <= i < num_samples]
        outside[epoch].update(i for i in indices if not (isinstance(i, int) and 0 <= i < num_samples))
        if valid:
            arr = counts[epoch]
            for i in valid:  # per index: a record may (wrongly) repeat one
                if arr[i] < 255:
                    arr[i] += 1

    last_epoch = max(counts, default=-1)
    for epoch in sorted(counts):
        arr = counts.pop(epoch)
        usable, nominal = epoch_end[epoch]
        left = num_samples - usable
        complete = left == 0 or (partial == "drop" and left < nominal)
        if epoch < last_epoch and not complete:
            report.violations.append(f"epoch {epoch} ended after {usable} of {num_samples} samples")
        seen_set = set(np.flatnonzero(arr).tolist())
        begin = started["consumed"] if started and epoch == started["epoch"] else 0  # before: the other run's
        if canonical:
            expected = set(epoch_order(order, num_samples, seed, epoch, shuffle).slice(begin, usable - begin))
        elif begin:
            expected = set(seen_set)  # a custom sampler's order is unknown, and so is what the other run took
        else:
            # A custom sampler's order is unknown: hold it to exactly-once within the dataset.
            expected = set(range(num_samples)) if (complete and partial == "partial") else set(seen_set)
            if complete and len(seen_set) != usable:
                report.violations.append(f"epoch {epoch}: {len(seen_set)} distinct samples, expected {usable}")
        report.epochs.append(EpochReport(
            epoch=epoch, complete=complete, expected=len(expected), seen=seen_total[epoch], skipped=skipped_total[epoch],
            duplicates=np.flatnonzero(arr > 1).tolist(),
            missing=sorted(expected - seen_set),
            unexpected=sorted((seen_set - expected) | outside[epoch]),
        ))
    return report


def _segments(value: Any) -> tuple[tuple[int, int, int, int], ...]:
    try:
        return tuple((int(a), int(b), int(c), int(d)) for a, b, c, d in value)
    except (TypeError, ValueError, OverflowError):
        return ()
