"""Every reader of bytes that a writer of the run directory (or of a bucket) can plant, fuzzed.

Specified here, reader by reader: whatever bytes it is handed — a real file of the project mutated field by field
(another type, a huge or non-finite number, deep nesting, a field dropped or added), truncated, bit-flipped, not
UTF-8, or JSON that is no object — it either takes them as valid or rejects them as damaged, in the project's own
words:

- a snapshot marker (``meta.json``), a sharded snapshot's part list, parts and shard markers:
  :class:`CorruptSnapshotError` (``find_newest`` moves the snapshot aside and resumes from the one before); a part
  file's bytes on their own: :class:`PartFormatError`;
- an event line: skipped (one warning per file at most), and every consumer of events goes on (``report``, the
  failure story, goodput, the snapshot intervals, the steps recomputed);
- an audit record: ``check_audit`` counts it as torn or malformed and goes on; what the CLI prints is printable;
- a shard index: built again, or a :class:`DataError` naming it;
- a claimed generation, the run id, ``config.yaml``: the reader's own error (a stale writer, a ``SnapshotError``) or
  its default;

and never any other exception (TypeError, KeyError, RecursionError, OverflowError, UnicodeDecodeError, ...), nor
work or memory out of proportion to the bytes read (each case gets :data:`CASE_CPU_S` of CPU time).

The fuzzers are seeded and deterministic: case ``i`` of seed ``s`` of reader ``r`` draws from
``random.Random(f"{r}:{s}:{i}")``, and a failure names that string, the exception, the line of this project that
raised it (or let it through) and the input's first bytes: ``<mutation>(random.Random("r:s:i"), ...)`` gives the same
input again. Where a fuzzer rarely reaches a check (a field deep in a sealed marker), a sweep beside it sets each
field to each hostile value in turn; its cases are named by the field and the value (``written_at=HOSTILE[1]``).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import logging
import math
import random
import resource
import shutil
import signal
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import pytest
import torch

from elastic_runner.config import ConfigError
from elastic_runner.config.sources import PackSpec, parse_sources
from elastic_runner.data.packing import load_tokenizer
from elastic_runner.data.readers import DataError
from elastic_runner.data.sampler import ElasticSampler
from elastic_runner.data.shards import Source, open_source, token_meta
from elastic_runner.observe import goodput
from elastic_runner.observe.audit import AUDIT_DIR, AuditReport, AuditWriter, check_audit, latest_step
from elastic_runner.observe.events import (EVENTS_DIR, EventFollower, EventLog,
                                           furthest_step_reached, malformed, read_events)
from elastic_runner.observe.failure_story import failure_story
from elastic_runner.observe.records import FROM_BUCKET
from elastic_runner.observe.records_view import bucket_view, run_view
from elastic_runner.observe.report import RunSummary, summarize
from elastic_runner.snapshot import LocalStore, SnapshotWriter, find_newest, load_snapshot, require_ok
from elastic_runner.snapshot import part_file
from elastic_runner.snapshot.cli import inspect, snapshot_dir_of
from elastic_runner.snapshot.format import meta_digest, meta_signature, parse_meta, read_meta, signing_key
from elastic_runner.snapshot.interval import AutoSchedule, SharedInterval, failures_seen, losses_seen
from elastic_runner.snapshot.loader import Loaded
from elastic_runner.snapshot.part_file import PartFormatError
from elastic_runner.snapshot.publish import write_sharded
from elastic_runner.snapshot.shards import MARKER, PartReader, check_part_sizes, is_marker, place, verify_parts
from elastic_runner.snapshot.store import (META, STATE, CorruptSnapshotError, SnapshotError, SnapshotRef,
                                           StaleWriterError)

KEY = b"k" * 32
#: CPU seconds one case may take: the readers here take milliseconds for what they are given; a case past this is
#: work out of proportion to its input (a loop or an allocation sized by a planted number).
CASE_CPU_S = 1.0
#: The peak resident memory a whole fuzzer may add: the inputs are kilobytes.
MAX_GROWTH_BYTES = 512 << 20
SEEDS = (0, 1)

# == the contract, checked case by case =============================================================================


class Overran(BaseException):
    """A case used more than :data:`CASE_CPU_S` of CPU (a BaseException: a reader's ``except Exception`` must not
    take it for damage)."""


@contextlib.contextmanager
def cpu_budget(seconds: float) -> Iterator[None]:
    """Raise :class:`Overran` in this thread after ``seconds`` of the process' CPU time (SIGPROF: SIGALRM is
    pytest-timeout's)."""

    def overran(signum: int, frame: FrameType | None) -> None:
        raise Overran(f"more than {seconds} s of CPU")

    before = signal.signal(signal.SIGPROF, overran)
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, before)


def _where(exc: BaseException) -> str:
    """The line of this project that raised ``exc`` (or let it through), and the line that raised it first."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "/elastic_runner/" in f.filename]
    first = frames[-1] if frames else None
    spot = ours[-1] if ours else first
    text = f"{spot.filename.split('/elastic_runner/')[-1] if spot else '?'}:{spot.lineno if spot else '?'}"
    if spot is not None and first is not None and first is not spot:
        text = f"elastic_runner/{text} (raised in {Path(first.filename).name}:{first.lineno})"
    elif spot is not None:
        text = f"elastic_runner/{text}"
    return text


@dataclass
class Finding:
    case: str
    data: bytes  #: the input's first bytes (what the report shows)
    size: int  #: the input's length
    error: str
    where: str
    count: int = 1


@dataclass
class Findings:
    """The contract's violations one fuzzer found: one example per (exception type, line), with how often."""

    reader: str
    found: dict[tuple[str, str], Finding] = field(default_factory=dict)
    overran: int = 0
    cases: int = 0

    def add(self, case: str, data: bytes, error: str, where: str) -> None:
        key = (error.split(":", 1)[0], where)
        if key in self.found:
            self.found[key].count += 1
        else:
            self.found[key] = Finding(case, data[:160], len(data), error, where)

    @property
    def exhausted(self) -> bool:
        """Cases that overran cost a second each: after a few, the finding is made and the rest would only cost time."""
        return self.overran >= 2

    def run(self, case: str, data: bytes, call: Callable[[], Any],
            allowed: tuple[type[BaseException], ...] = ()) -> Any:
        """``call()``'s value, or the ``allowed`` exception it raised; any other exception is a finding (returned
        as :data:`CRASHED`)."""
        try:
            with cpu_budget(CASE_CPU_S):
                return call()
        except allowed as exc:
            return exc
        except Overran:
            self.overran += 1
            self.add(case, data, f"Overran: more than {CASE_CPU_S} s of CPU (unbounded work)", "?")
            return CRASHED
        except (Exception, RecursionError, MemoryError) as exc:  # noqa: BLE001 - precisely what is looked for
            self.add(case, data, f"{type(exc).__name__}: {str(exc)[:200]}", _where(exc))
            return CRASHED

    def violation(self, case: str, data: bytes, what: str) -> None:
        """A reader that returned, but not what the contract promises."""
        self.add(case, data, f"contract: {what}", "-")

    def check(self) -> None:
        if self.found:  # the report says it all: no traceback into this helper, no repr of every finding
            pytest.fail(self.report(), pytrace=False)

    def report(self) -> str:
        lines = [f"{self.reader}: {sum(f.count for f in self.found.values())} of {self.cases} cases broke the "
                 "contract; one example per exception and line:"]
        for finding in list(self.found.values())[:20]:
            # A fuzzed case is named by its seed string; the others (a fixed list's entries) by themselves.
            first = f"random.Random({finding.case!r})" if finding.case.count(":") == 2 else finding.case
            lines.append(f"- {finding.error}\n    at {finding.where} ({finding.count} case(s)); first: "
                         f"{first}, input {finding.data!r}"
                         f"{f' ... ({finding.size} bytes)' if finding.size > len(finding.data) else ''}")
        return "\n".join(lines)


#: What :meth:`Findings.run` returns for a case that broke the contract.
CRASHED = object()


@contextlib.contextmanager
def bounded_memory(reader: str) -> Iterator[None]:
    """The peak resident memory grows by at most :data:`MAX_GROWTH_BYTES` over a fuzzer (an allocation sized by a
    planted number would show here, where a case's CPU budget cannot see it)."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    yield
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    assert grown <= MAX_GROWTH_BYTES, f"{reader}: the peak memory grew by {grown >> 20} MiB over its cases"


def fuzz(reader: str, seed: int, cases: int) -> Iterator[tuple[str, random.Random]]:
    """``(case name, its random numbers)`` for each case of ``reader``'s ``seed``."""
    for i in range(cases):
        name = f"{reader}:{seed}:{i}"
        yield name, random.Random(name)


# == mutations ======================================================================================================


def _deep_list(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


def _deep_dict(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = {"a": value}
    return value


#: Values of another type or range than a field holds: each a function, so that every draw is a fresh object.
HOSTILE: list[Callable[[], Any]] = [
    lambda: None, lambda: True, lambda: False, lambda: 0, lambda: -1, lambda: 1, lambda: 7, lambda: 2**63,
    lambda: -(2**63), lambda: 10**30, lambda: 10**400, lambda: 0.5, lambda: -0.0, lambda: 1e308,
    lambda: math.nan, lambda: math.inf, lambda: -math.inf, lambda: "", lambda: "x", lambda: "0" * 64,
    lambda: "g" * 64, lambda: "A" * 64, lambda: "\ud800", lambda: "\x00", lambda: "é∑", lambda: "x" * 5000,
    lambda: "part-00000.bin", lambda: "part-\x00.bin", lambda: "part-" + "9" * 300 + ".bin", lambda: "12",
    lambda: [], lambda: [0], lambda: [None], lambda: ["a", 1], lambda: [-1, 2**70], lambda: list(range(2000)),
    lambda: [{"rank": "x"}], lambda: {}, lambda: {"a": 1}, lambda: {"": None}, lambda: {"rank": 1},
    lambda: _deep_list(300), lambda: _deep_dict(300),
]

#: JSON text that Python objects cannot stand for (nesting past any recursion limit, numbers past the int limit,
#: escapes that decode to lone surrogates), spliced where a value was.
RAW: list[str] = [
    "[" * 100_000 + "]" * 100_000, "[" * 100_000, '{"a":' * 50_000 + "1" + "}" * 50_000, "[" * 2_000 + "]" * 2_000,
    "1" + "0" * 5_000, "9" * 4_000, "-" + "9" * 4_000, "1e999", "-1e999", "NaN", "Infinity", "-Infinity",
    '"\\ud800"', '"\\udfff\\ud800"', "1.0e-400", "-0", '"\\x"', "[1,]", "0x10", "1_000",
]
_PLACEHOLDER = "\x00raw-json\x00"


def hostile(rng: random.Random) -> Any:
    return rng.choice(HOSTILE)()


def inside_variants(value: str) -> list[str]:
    """``value`` with something put in its middle: a NUL, a lone surrogate, a path separator, a name too long for
    the filesystem, a line break."""
    middle = len(value) // 2
    return [value[:middle] + inside + value[middle:] for inside in ("\x00", "\ud800", "/", "/../", "9" * 300, "\n")]


def hostile_like(rng: random.Random, value: Any) -> Any:
    """A hostile value of ``value``'s own type (a number out of range or not finite, an odd string, an odd list):
    what passes a reader's type checks and reaches the code behind them."""
    if isinstance(value, bool) or value is None:
        return hostile(rng)
    if isinstance(value, int):
        # Never a count a reader could really allocate (2**31 list entries would take this machine's memory before
        # a case's CPU budget could stop it): an absurd one shows that a size is unchecked just as well.
        return rng.choice([0, -1, 1, 2**53 + 1, 2**63, -(2**63), 10**30, 10**400, -(10**400), value + 1, value - 1,
                           value * 1000])
    if isinstance(value, float):
        return rng.choice([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e308, -1e308, 5e-324, 10**400, -value,
                           value * 1e6])
    if isinstance(value, str):
        if rng.random() < 0.5:  # the string's ends kept (a reader that checks a prefix or suffix takes it)
            return rng.choice(inside_variants(value))
        return rng.choice(["", "\ud800", "x" * 5000, "\x00", value + "\ud800", "é", value * 3, ":", "rank "])
    if isinstance(value, list):
        return rng.choice([[], [None], value + [hostile(rng)], [value], list(range(2000)), [{}], [{"rank": "x"}],
                           value * 2])
    if isinstance(value, dict):
        return rng.choice([{}, {"a": hostile(rng)}, value | {"zz": hostile(rng)}])
    return hostile(rng)


def _slots(doc: Any, depth: int = 0) -> list[tuple[Any, Any]]:
    """The places in ``doc`` a mutation may change: (container, key or index), a few levels down."""
    out: list[tuple[Any, Any]] = []
    if depth > 5:
        return out
    if isinstance(doc, dict):
        for k, v in list(doc.items()):
            out.append((doc, k))
            out += _slots(v, depth + 1)
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:40]):
            out.append((doc, i))
            out += _slots(v, depth + 1)
    return out


def mutate_json(rng: random.Random, doc: Any, fields: Sequence[str], raw: bool = True) -> Any:
    """A copy of ``doc`` with one to three changes: a field (of ``fields``, or anywhere inside) set to a hostile
    value or to raw JSON (``raw``), dropped, or added."""
    doc = copy.deepcopy(doc)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        value = _PLACEHOLDER if raw and rng.random() < 0.15 else hostile(rng)
        slots = _slots(doc)
        # Half the time a value of the type that was there: it passes the reader's type checks.
        like = rng.random() < 0.5
        if isinstance(doc, dict) and (not slots or rng.random() < 0.5):
            # Mostly a field the document has (what its readers use), else one it may have, or a stranger.
            roll = rng.random()
            name = rng.choice(sorted(doc)) if doc and roll < 0.5 else rng.choice(fields) if fields and roll < 0.9 \
                else rng.choice(["zz", "", "__shard__"])
            if name in doc and rng.random() < 0.25:
                del doc[name]
            else:
                doc[name] = hostile_like(rng, doc[name]) if like and name in doc else value
            continue
        if not slots:
            return value
        container, key = rng.choice(slots)
        roll = rng.random()
        if roll < 0.7:
            container[key] = hostile_like(rng, container[key]) if like else value
        elif roll < 0.9:
            del container[key]
        elif isinstance(container, dict):
            container[rng.choice(fields) if fields else "zz"] = value
        else:
            container.insert(key, value)
    return doc


def dumps(rng: random.Random, doc: Any, indent: int | None = None) -> bytes:
    """``doc`` as JSON text, with each placeholder replaced by raw JSON text."""
    text = json.dumps(doc, indent=indent, sort_keys=True)
    while json.dumps(_PLACEHOLDER) in text:
        text = text.replace(json.dumps(_PLACEHOLDER), rng.choice(RAW), 1)
    return text.encode()


def garble(rng: random.Random, data: bytes) -> bytes:
    """``data`` damaged as bytes: truncated, bits flipped, bytes set, cut out, repeated or inserted (not UTF-8),
    a byte-order mark, another encoding, a number past the int limit."""
    b = bytearray(data)
    op = rng.randrange(10)
    n = max(1, len(b))
    if op == 0:
        return bytes(b[:rng.randrange(n)])
    if op == 1:
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(n) % max(1, len(b))] ^= 1 << rng.randrange(8)
    elif op == 2:
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(n) % max(1, len(b))] = rng.randrange(256)
    elif op == 3:
        i = rng.randrange(n)
        del b[i:i + rng.randint(1, 40)]
    elif op == 4:
        i = rng.randrange(n)
        b[i:i] = b[i:i + rng.randint(1, 200)] * rng.randint(1, 3)
    elif op == 5:
        i = rng.randrange(n)
        b[i:i] = rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80\x80", b"\xfe\xff", b"\x00", b"\r", b"\n"])
    elif op == 6:
        b[0:0] = b"\xef\xbb\xbf"
    elif op == 7:
        try:
            return bytes(b).decode().encode(rng.choice(["utf-16", "utf-32", "utf-16-le", "latin-1"]))
        except UnicodeError:
            return bytes(b)
    elif op == 8:
        digits = [i for i, c in enumerate(b) if 0x30 <= c <= 0x39]
        if digits:
            i = rng.choice(digits)
            b[i:i + 1] = b"9" * rng.choice([400, 4_400])
    else:
        b = bytearray(rng.randbytes(rng.randrange(1, 200)))
    return bytes(b)


def not_an_object(rng: random.Random, doc: Any) -> bytes:
    """Valid JSON that is not the object a reader wants."""
    return dumps(rng, rng.choice([[], [doc], "meta", 1, None, True, 1.5, [[]], {"sha256": [doc]}]))


# == snapshot markers ===============================================================================================


#: What a marker holds; a mutation picks among these first.
META_FIELDS = ["format", "sha256", "size_bytes", "step", "generation", "written_at", "fingerprint", "run_uid",
               "config", "world_history", "epoch", "consumed", "world_size", "samples_total", "model_build", "script",
               "sharded", "meta_sha256", "meta_hmac", "name"]
NEWEST = SnapshotRef(generation=1, step=20)
PREVIOUS = SnapshotRef(generation=1, step=10)


def _capture(step: int) -> Callable[[], tuple[dict[str, Any], dict[str, Any]]]:
    return lambda: ({"model": {"w": torch.full((2,), float(step))}, "train": {"step": step}},
                    {"fingerprint": {"model": "x"}, "run_uid": "ours", "world_history": [1, 2], "epoch": 0,
                     "consumed": 5, "world_size": 2, "config": {"model": {"name": "mlp"}}})


def _written_store(root: Path, key: bytes | None) -> LocalStore:
    with signing_key(key):
        store = LocalStore(root)
        store.ensure()
        store.run_uid()
        writer = SnapshotWriter(store, generation=store.claim_generation({}), keep_last=3)
        for step in (PREVIOUS.step, NEWEST.step):
            require_ok(writer.save(step, _capture(step), sync=True))
    return store


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, LocalStore]:
    """Two real snapshot directories (steps 10 and 20), written without and with the job's key."""
    root = tmp_path_factory.mktemp("stores")
    return {keyed: _written_store(root / ("keyed" if keyed else "plain"), KEY if keyed else None)
            for keyed in (False, True)}


def sealed(meta: Any, key: bytes | None) -> Any:
    """``meta`` with its own checksum (and with ``key`` its signature) computed again: what a writer of the
    directory does without the key (or our writer would do, with it, for a marker it got wrong)."""
    if not isinstance(meta, dict):
        return meta
    meta = {k: v for k, v in meta.items() if k not in ("meta_sha256", "meta_hmac")}
    if key is not None:
        meta["meta_hmac"] = meta_signature(meta, key)
    meta["meta_sha256"] = meta_digest(meta)
    return meta


def mutated_meta(rng: random.Random, original: bytes, key: bytes | None) -> bytes:
    """A marker's bytes mutated: a field changed and the marker sealed again (most cases: only these reach the
    checks past the checksum), a field changed only, raw damage to the bytes, or JSON that is no object."""
    meta = json.loads(original)
    roll = rng.random()
    if roll < 0.55:
        changed = mutate_json(rng, meta, META_FIELDS)
        reseal = rng.random() < 0.8
        return dumps(rng, sealed(changed, key if rng.random() < 0.5 else None) if reseal else changed, indent=1)
    if roll < 0.9:
        return garble(rng, original)
    return not_an_object(rng, meta)


def _accepted_meta_is_sound(meta: Any) -> str | None:
    """What is wrong with a marker :func:`parse_meta` accepted (None: nothing)."""
    if not isinstance(meta, dict):
        return f"accepted a {type(meta).__name__}"
    for name in ("size_bytes", "step", "generation", "format"):
        value = meta.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            return f"accepted {name}={value!r:.60}"
    if not isinstance(meta.get("written_at"), (int, float)) or isinstance(meta.get("written_at"), bool):
        return f"accepted written_at={meta.get('written_at')!r:.60}"
    return None


@pytest.mark.parametrize("keyed", [False, True], ids=["unsigned", "signed"])
@pytest.mark.parametrize("seed", SEEDS)
def test_every_mutated_meta_json_is_accepted_or_called_damaged(stores: dict[bool, LocalStore], tmp_path: Path,
                                                                 keyed: bool, seed: int) -> None:
    """parse_meta and read_meta: 300 markers per seed, each a valid marker or CorruptSnapshotError. A marker that
    claims a format this version does not know may also be refused as SnapshotError naming the format (a newer
    version wrote it: it is not moved aside) — unsigned, or signed with the job's key; with the key, an unsigned
    one is damaged."""
    key = KEY if keyed else None
    original = (stores[keyed].path(NEWEST) / META).read_bytes()
    findings = Findings(f"parse_meta/read_meta ({'signed' if keyed else 'unsigned'})")
    directory = tmp_path / NEWEST.name
    directory.mkdir()
    with bounded_memory(findings.reader), signing_key(key):
        for case, rng in fuzz(f"meta-{keyed}", seed, 300):
            if findings.exhausted:
                break
            findings.cases += 1
            data = mutated_meta(rng, original, key)
            if rng.random() < 0.5:
                got = findings.run(case, data, lambda: parse_meta(NEWEST.name, data), (SnapshotError,))
            else:
                (directory / META).write_bytes(data)
                got = findings.run(case, data, lambda: read_meta(directory), (SnapshotError,))
            if isinstance(got, SnapshotError) and not isinstance(got, CorruptSnapshotError) \
                    and "is not supported" not in str(got):
                findings.violation(case, data, f"{type(got).__name__}, not CorruptSnapshotError: {got}")
            elif got is not CRASHED and not isinstance(got, SnapshotError):
                problem = _accepted_meta_is_sound(got)
                if problem is not None:
                    findings.violation(case, data, problem)
    findings.check()


def test_every_field_of_a_sealed_marker_set_to_every_hostile_value_is_accepted_or_called_damaged(
        stores: dict[bool, LocalStore]) -> None:
    """The sweep behind the fuzzer: each field a marker has (and "sharded", which it may have) set to each hostile
    value, the marker sealed again (so that the checks behind its checksum see it): parse_meta takes a marker whose
    fields have their documented types and ranges, and calls every other one damaged."""
    original = json.loads((stores[False].path(NEWEST) / META).read_bytes())
    findings = Findings("parse_meta (every field x every hostile value)")
    for name in sorted(set(original) - {"meta_sha256"} | {"sharded"}):
        for k, make in enumerate(HOSTILE):
            case = f"{name}=HOSTILE[{k}]"
            findings.cases += 1
            data = json.dumps(sealed(original | {name: make()}, None)).encode()
            got = findings.run(case, data, lambda: parse_meta(NEWEST.name, data), (SnapshotError,))
            if isinstance(got, SnapshotError) and not isinstance(got, CorruptSnapshotError) \
                    and "is not supported" not in str(got):
                findings.violation(case, data, f"{type(got).__name__}, not CorruptSnapshotError: {got}")
            elif got is not CRASHED and not isinstance(got, SnapshotError):
                problem = _accepted_meta_is_sound(got)
                if problem is not None:
                    findings.violation(case, data, problem)
    findings.check()


def _copy_store(template: LocalStore, into: Path) -> LocalStore:
    shutil.copytree(template.root, into, symlinks=True)
    return LocalStore(into)


@pytest.mark.parametrize("keyed", [False, True], ids=["unsigned", "signed"])
def test_a_damaged_newest_marker_is_moved_aside_and_the_previous_snapshot_resumed(
        stores: dict[bool, LocalStore], tmp_path: Path, keyed: bool) -> None:
    """find_newest end to end, 100 stores: the newest snapshot's meta.json mutated (and, first, sealed with each of
    the odd run ids of inside_variants: another run's snapshot, whose id the reason names). The newest is resumed
    (the mutation left a valid marker of it) or moved aside as corrupt-<name> with its REASON and the previous
    snapshot resumed; never another exception (but the SnapshotError of a format this version does not know, which
    leaves the snapshot in place for the version that wrote it). ``snapshot inspect`` reads the same store without
    raising."""
    key = KEY if keyed else None
    template = stores[keyed]
    original = (template.path(NEWEST) / META).read_bytes()
    findings = Findings(f"find_newest ({'signed' if keyed else 'unsigned'})")
    cases = [(f"run_uid=inside_variants[{j}]", json.dumps(sealed(json.loads(original) | {"run_uid": run_uid}, key),
                                                           indent=1).encode())
             for j, run_uid in enumerate(inside_variants("theirs"))]
    cases += [(case, mutated_meta(rng, original, key)) for case, rng in fuzz(f"find-newest-{keyed}", 0, 100)]
    with bounded_memory(findings.reader), signing_key(key):
        for case, data in cases:
            if findings.exhausted:
                break
            findings.cases += 1
            store = _copy_store(template, tmp_path / case.replace(":", "-").replace("[", "-").replace("]", ""))
            (store.path(NEWEST) / META).write_bytes(data)
            findings.run(case, data, lambda: inspect(str(store.root)))
            got = findings.run(case, data, lambda: find_newest(store, run_uid="ours"), (SnapshotError,))
            if isinstance(got, SnapshotError):
                if "is not supported" not in str(got):
                    findings.violation(case, data, f"find_newest raised {type(got).__name__}: {got}")
            elif isinstance(got, Loaded):
                moved = store.root / f"corrupt-{NEWEST.name}"
                if got.ref == PREVIOUS and not (moved / "REASON").is_file():
                    findings.violation(case, data, "resumed the previous snapshot without moving the newest aside")
                elif got.ref not in (NEWEST, PREVIOUS):
                    findings.violation(case, data, f"resumed {got.ref}")
                elif not torch.equal(got.state["model"]["w"], torch.full((2,), float(got.ref.step))):
                    findings.violation(case, data, f"{got.ref.name} resumed with another state")
            elif got is not CRASHED:
                findings.violation(case, data, f"find_newest returned {got!r:.80}")
            shutil.rmtree(store.root)
    findings.check()


# == sharded snapshots: the part list, the parts, the shard markers ================================================


SHARDED_FIELDS = ["format", "world_size", "writers", "parts"]
PART_FIELDS = ["file", "sha256", "size_bytes"]
HEADER_FIELDS = ["format", "rank", "tensors"]
ENTRY_FIELDS = ["key", "dtype", "shape", "offset", "start", "nbytes"]
MARKER_FIELDS = [MARKER, "shape", "dtype"]
WHOLE_W = torch.arange(12.0).view(4, 3)


@pytest.fixture(scope="module")
def sharded_store(tmp_path_factory: pytest.TempPathFactory) -> LocalStore:
    """A store whose newest snapshot (step 20) is sharded in two parts (rows 0-1 and 2-3 of ``model/w``), after a
    whole one (step 10): written as two ranks write it, in one process."""
    store = _written_store(tmp_path_factory.mktemp("sharded") / "store", None)
    store.remove(NEWEST)
    replicated = {"model": {"w": {MARKER: "model/w", "shape": [4, 3], "dtype": "float32"}, "b": torch.zeros(3)},
                  "train": {"step": NEWEST.step}}
    for rank in (1, 0):
        part = {"tensors": {"model/w": WHOLE_W[2 * rank:2 * rank + 2].clone()}, "offsets": {"model/w": [2 * rank, 0]}}
        write_sharded(store, 1, 3, NEWEST, {"replicated": replicated if rank == 0 else None, "part": part},
                      {"step": NEWEST.step, "generation": 1, "world_size": 2, "run_uid": "ours",
                       "fingerprint": {"model": "x"}}, rank=rank, writers=[0, 1])
    meta, state = load_snapshot(store.path(NEWEST))
    assert torch.equal(state["model"]["w"], WHOLE_W) and len(meta["sharded"]["parts"]) == 2
    return store


def _part_bytes(rng: random.Random, data: bytes) -> bytes:
    """A part file's bytes mutated: a header field (the header re-encoded with its length), the length field, or
    raw damage."""
    length = int.from_bytes(data[8:16], "little")
    header = json.loads(data[16:16 + length])
    body = data[16 + length + (-(16 + length) % part_file.ALIGN):]
    roll = rng.random()
    if roll < 0.55:
        if rng.random() < 0.6 and header["tensors"]:
            header["tensors"][0] = mutate_json(rng, header["tensors"][0], ENTRY_FIELDS)
        else:
            header = mutate_json(rng, header, HEADER_FIELDS)
        text = dumps(rng, header)
        head = part_file.MAGIC + len(text).to_bytes(8, "little") + text
        return head + bytes(-len(head) % part_file.ALIGN) + body
    if roll < 0.7:
        size = rng.choice([0, 1, length - 1, length + 1, len(data), 2**63, 2**64 - 1, part_file.MAX_HEADER_BYTES + 1])
        return data[:8] + size.to_bytes(8, "little") + data[16:]
    return garble(rng, data)


def _marked_state(rng: random.Random, state_bytes: bytes) -> bytes:
    """``state.pt`` with its shard marker mutated (its shape, dtype or key), saved again."""
    state = torch.load(io.BytesIO(state_bytes), weights_only=True)
    state["model"]["w"] = mutate_json(rng, state["model"]["w"], MARKER_FIELDS, raw=False)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def test_every_field_of_a_part_record_set_to_every_hostile_value_is_called_damaged(sharded_store: LocalStore) -> None:
    """The sweep behind the part-list fuzzer: each field of a part's record in meta.json (file, sha256, size_bytes)
    and of the sharded section set to each hostile value (a file name also with a NUL, a lone surrogate, a
    separator or 300 more characters inside it): verify_parts, check_part_sizes (snapshot inspect) and PartReader
    take it or raise CorruptSnapshotError — a planted name must never make the job retry forever
    (SnapshotUnavailableError) nor crash it."""
    directory = sharded_store.path(NEWEST)
    original = json.loads((directory / META).read_bytes())
    sizes = {p.name: p.stat().st_size for p in directory.iterdir()}
    findings = Findings("sharded part records (every field x every hostile value)")
    variants: list[tuple[str, Callable[[dict[str, Any]], None]]] = []
    for k, make in enumerate(HOSTILE):
        for name in PART_FIELDS:
            variants.append((f"parts[1].{name}=HOSTILE[{k}]", lambda m, n=name, v=make: m["sharded"]["parts"][1]
                             .__setitem__(n, v())))
        for name in SHARDED_FIELDS:
            variants.append((f"sharded.{name}=HOSTILE[{k}]", lambda m, n=name, v=make: m["sharded"]
                             .__setitem__(n, v())))
    for j, file in enumerate(inside_variants("part-00001.bin")):
        variants.append((f"parts[1].file=inside_variants[{j}]", lambda m, f=file: m["sharded"]["parts"][1]
                         .__setitem__("file", f)))
    for case, change in variants:
        findings.cases += 1
        meta = copy.deepcopy(original)
        change(meta)
        data = json.dumps(meta["sharded"]).encode()
        findings.run(case, data, lambda: verify_parts(directory, meta), (CorruptSnapshotError,))
        findings.run(case, data, lambda: check_part_sizes(NEWEST.name, meta, sizes), (CorruptSnapshotError,))
        findings.run(case, data, lambda: PartReader(directory, meta), (CorruptSnapshotError,))
    findings.check()


def _reseal_parts(meta: dict[str, Any], directory: Path) -> dict[str, Any]:
    """``meta`` listing the parts' checksums and sizes as they are now, sealed: what a writer of the directory can
    do without the key, so that the parts' own checks are reached."""
    import hashlib

    for part in meta["sharded"]["parts"]:
        data = (directory / part["file"]).read_bytes()
        part["sha256"], part["size_bytes"] = hashlib.sha256(data).hexdigest(), len(data)
    state = (directory / STATE).read_bytes()
    meta["sha256"], meta["size_bytes"] = hashlib.sha256(state).hexdigest(), len(state)
    return sealed(meta, None)


def _is_whole(state: Any) -> bool:
    w = state["model"]["w"] if isinstance(state, dict) and isinstance(state.get("model"), dict) else None
    return isinstance(w, torch.Tensor) and w.shape == WHOLE_W.shape and w.dtype == WHOLE_W.dtype


@pytest.mark.parametrize("target", ["part list", "part bytes", "shard marker"])
def test_every_mutated_sharded_snapshot_is_loaded_whole_or_called_damaged(sharded_store: LocalStore, tmp_path: Path,
                                                                          target: str) -> None:
    """A sharded snapshot, mutated where a writer of the directory can (the marker's part list, a part file, the
    shard marker in state.pt; the marker sealed again each time): load_snapshot gives every tensor whole or raises
    CorruptSnapshotError, PartReader and verify_parts likewise, and find_newest resumes it or moves it aside and
    resumes the snapshot before; 60 cases each."""
    original = json.loads((sharded_store.path(NEWEST) / META).read_bytes())
    findings = Findings(f"sharded snapshot ({target})")
    with bounded_memory(findings.reader):
        for case, rng in fuzz(f"sharded-{target}", 0, 60):
            if findings.exhausted:
                break
            findings.cases += 1
            store = _copy_store(sharded_store, tmp_path / case.replace(":", "-").replace(" ", "-"))
            directory = store.path(NEWEST)
            meta = copy.deepcopy(original)
            if target == "part list":
                parts = meta["sharded"]["parts"]
                if rng.random() < 0.5:  # one part's record: its file name, checksum or size
                    i = rng.randrange(len(parts))
                    parts[i] = mutate_json(rng, parts[i], PART_FIELDS)
                else:
                    meta["sharded"] = mutate_json(rng, meta["sharded"], SHARDED_FIELDS + PART_FIELDS)
                meta = sealed(meta, None)
            elif target == "part bytes":
                name = rng.choice(["part-00000.bin", "part-00001.bin"])
                (directory / name).write_bytes(_part_bytes(rng, (directory / name).read_bytes()))
                meta = _reseal_parts(meta, directory)
            else:
                (directory / STATE).write_bytes(_marked_state(rng, (directory / STATE).read_bytes()))
                meta = _reseal_parts(meta, directory)
            data = dumps(rng, meta, indent=1)
            (directory / META).write_bytes(data)
            sharded = meta.get("sharded") if isinstance(meta, dict) else None
            shown = json.dumps(sharded).encode() if target == "part list" else \
                (directory / ("state.pt" if target == "shard marker" else "part-00000.bin")).read_bytes()[:400]
            got = findings.run(case, shown, lambda: load_snapshot(directory), (CorruptSnapshotError,))
            # A marker mutated into no marker is a plain value of state.pt, loaded as it is.
            if isinstance(got, tuple) and target != "shard marker" and not _is_whole(got[1]):
                findings.violation(case, shown, f"load_snapshot gave model/w as {got[1]['model']['w']!r:.80}")
            findings.run(case, shown, lambda: verify_parts(directory, meta), (CorruptSnapshotError,))
            findings.run(case, shown, lambda: inspect(str(store.root)))
            got = findings.run(case, shown, lambda: find_newest(store, run_uid="ours"), (SnapshotError,))
            if isinstance(got, SnapshotError):
                findings.violation(case, shown, f"find_newest raised {type(got).__name__}: {got}")
            elif isinstance(got, Loaded) and got.parts is not None and is_marker(got.state["model"]["w"]):
                # What a resuming rank does with the snapshot find_newest chose: its box of each sharded tensor.
                reader: PartReader = got.parts
                findings.run(case, shown, lambda: place(got.state["model"]["w"], None, reader), (CorruptSnapshotError,))
            shutil.rmtree(store.root)
    findings.check()


@pytest.mark.parametrize("seed", SEEDS)
def test_every_mutated_part_file_is_read_or_refused_as_a_part_format_error(sharded_store: LocalStore,
                                                                          seed: int) -> None:
    """part_file.read_bytes on 300 mutated parts (format 2, the magic kept): the part, or PartFormatError naming
    what is wrong — its docstring's promise, whoever calls it."""
    original = (sharded_store.path(NEWEST) / "part-00001.bin").read_bytes()
    findings = Findings("part_file.read_bytes")
    with bounded_memory(findings.reader):
        for case, rng in fuzz("part-file", seed, 300):
            if findings.exhausted:
                break
            findings.cases += 1
            data = _part_bytes(rng, original)
            if not data.startswith(part_file.MAGIC):
                data = part_file.MAGIC + data[8:]  # format 1 (torch.load) is another reader, fuzzed through PartReader
            got = findings.run(case, data, lambda: part_file.read_bytes(data, "part-00001.bin"), (PartFormatError,))
            if isinstance(got, dict) and not all(isinstance(t, torch.Tensor) for t in got["tensors"].values()):
                findings.violation(case, data, "a part whose tensors are not tensors")
    findings.check()


# == event lines and their consumers ================================================================================


#: The fields events carry (the readers' and the emitters' own).
EVENT_FIELDS = ["time", "kind", "source", "host", "role", "agent", "status", "snapshot", "tier", "error", "reason",
                "generation", "step", "rank", "world_size", "pid", "pids", "global_batch", "steps_recomputed",
                "furthest_step", "samples_per_s", "loss", "eval_loss", "eval_accuracy", "write_s", "blocking_s",
                "seconds", "process_start", "failures", "exitcode", "signal", "by_agent", "run_id"]
FAILED_PID = 4242


def _emit_run(run_dir: Path) -> None:
    """The events of a small run as its processes write them: generation 1 at world size 2 loses rank 1 (killed,
    seen by the agent), generation 2 resumes at world size 1 from disk and finishes."""
    agent = EventLog(run_dir, "agent-h-1", role="agent", agent="h:1:0")
    first = EventLog(run_dir, "gen-000001-rank-00000", generation=1, rank=0, agent="h:1:0")
    second = EventLog(run_dir, "gen-000001-rank-00001", generation=1, rank=1, pid=FAILED_PID, agent="h:1:0")
    now = time.time()
    for log in (first, second):
        log.emit("start", world_size=2, process_start=now - 1.0)
    first.emit("world", world_size=2, global_batch=8)
    for step in (1, 2, 3):
        first.emit("progress", step=step, loss=1.0 / step, samples_per_s=10.0, world_size=2)
        second.emit("progress", step=step, loss=1.0 / step, samples_per_s=10.0, world_size=2)
    first.emit("snapshot_saved", step=2, snapshot="step-000000002-gen-000001", write_s=0.02, blocking_s=0.01)
    first.emit("eval", step=3, eval_loss=0.4, eval_accuracy=0.9)
    agent.emit("agent_worker_failed", failures=[{"rank": 1, "pid": FAILED_PID, "exitcode": -9}])
    agent.emit("agent_stopping_workers", pids=[FAILED_PID, 17], reason="a new rendezvous round")
    first.emit("failure", error="Connection reset by peer: rank 1 stopped heartbeating")
    second.emit("stop", signal="SIGTERM", by_agent="node shutting down")
    agent.emit("agent_member_gone", member="h2")
    agent.emit("agent_rendezvous", seconds=0.5, world_size=1)
    agent.emit("agent_restart")
    third = EventLog(run_dir, "gen-000002-rank-00000", generation=2, rank=0, agent="h:1:0")
    third.emit("start", world_size=1, process_start=time.time())
    third.emit("resume", step=2, steps_recomputed=1, furthest_step=3, tier="disk")
    third.emit("snapshot_loaded", step=2, tier="disk", snapshot="step-000000002-gen-000001")
    third.emit("world", world_size=1, global_batch=8)
    for step in (3, 4, 5):
        third.emit("progress", step=step, loss=0.5 / step, samples_per_s=12.0, world_size=1)
    third.emit("snapshot_saved", step=5, snapshot="step-000000005-gen-000002", write_s=0.03, blocking_s=0.01)
    third.emit("end", status="finished", step=5)
    for log in (agent, first, second, third):
        log.close()


@pytest.fixture(scope="module")
def event_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[bytes]]:
    """The lines of each event file of a real run (EventLog's), by file name."""
    run_dir = tmp_path_factory.mktemp("events")
    _emit_run(run_dir)
    files = {p.name: p.read_bytes().splitlines(keepends=True) for p in sorted((run_dir / EVENTS_DIR).iterdir())}
    assert len(read_events(run_dir)) == sum(len(lines) for lines in files.values())
    return files


def mutated_line(rng: random.Random, line: bytes) -> bytes:
    """An event line mutated: a field changed (its type, a huge or non-finite number, nesting), raw damage, or no
    JSON object; always one line."""
    roll = rng.random()
    if roll < 0.6:
        out = dumps(rng, mutate_json(rng, json.loads(line), EVENT_FIELDS))
    elif roll < 0.9:
        out = garble(rng, line.rstrip(b"\n"))
    else:
        out = not_an_object(rng, json.loads(line))
    return out.replace(b"\n", b" ").replace(b"\r", b" ") + b"\n"


class _Warnings(logging.Handler):
    """The event reader's warnings, counted by file."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.by_file: dict[str, int] = {}
        self.unsafe: list[str] = []  #: warnings a planted line could forge or break: a newline, no UTF-8 encoding

    def emit(self, record: logging.LogRecord) -> None:
        name = str(record.args[0]) if isinstance(record.args, tuple) and record.args else "?"
        self.by_file[name] = self.by_file.get(name, 0) + 1
        message = record.getMessage()
        try:
            message.encode("utf-8")
        except UnicodeEncodeError:
            self.unsafe.append(ascii(message))
        if "\n" in message or "\r" in message:
            self.unsafe.append(ascii(message))


def _drive_intervals(events: list[dict[str, Any]]) -> tuple[str, list[float]]:
    """The durable snapshot interval (snapshot.every_steps: auto) and the node-memory interval (memory_every_steps:
    auto) as the checkpointer drives them from a run's events: a few steps, a snapshot, a refresh."""
    auto = AutoSchedule(1.0, events, start_step=0)
    for step in (1, 2, 3):
        auto.due(step)
    auto.saving(3)
    auto.saved(0.01, 0.02)
    failures, started = failures_seen(events)
    shared = SharedInterval("auto", prior_mtbf_s=3600.0, failures=failures,
                            run_started=started if started is not None else time.time(), start_step=0)
    shared.step_done()
    shared.step_done()
    shared.pending = shared.measurements(0.01, 0.0, rank=0)
    shared.refreshing(10)
    return auto.estimate.explain(), shared.applied or []


def _consume(findings: Findings, case: str, data: bytes, run_dir: Path, warnings: _Warnings) -> None:
    """Every consumer of a run's events, on ``run_dir``: none may raise."""
    warnings.by_file.clear()
    events = findings.run(case, data, lambda: read_events(run_dir))
    if any(count > 1 for count in warnings.by_file.values()):
        findings.violation(case, data, f"more than one warning for a file: {warnings.by_file}")
    if events is CRASHED:
        return
    bad = [e for e in events if not isinstance(e, dict) or malformed(e) is not None]
    if bad:
        findings.violation(case, data, f"read_events returned an event a reader cannot rely on: {bad[0]!r:.100}")
        return
    findings.run(case, data, lambda: furthest_step_reached(run_dir, 2))
    findings.run(case, data, lambda: failure_story(run_dir, 2, 1, {"step": 2, "steps_recomputed": 1,
                                                                   "furthest_step": 3, "tier": "disk"}, time.time()))
    findings.run(case, data, lambda: (failures_seen(events), losses_seen(events)))
    findings.run(case, data, lambda: _drive_intervals(events))
    findings.run(case, data, lambda: goodput.measure(events, [], 10.0, {2}).to_dict())

    def report() -> RunSummary:
        summary = summarize(str(run_dir), events)
        # `elastic-runner report` prints this: it must be text a terminal takes.
        summary.text().encode()
        if summary.goodput is not None:
            json.dumps(summary.goodput.to_dict())
        return summary

    findings.run(case, data, report)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_malformed_event_line_is_skipped_and_no_consumer_of_events_raises(event_files: dict[str, list[bytes]],
                                                                            tmp_path: Path, seed: int) -> None:
    """120 runs per seed, each with one to six of its real event lines mutated (in place, or added beside
    them): read_events and EventFollower return only well-formed events and warn at most once per file, and
    report, failure_story, goodput, failures_seen/losses_seen and the snapshot intervals (AutoSchedule,
    SharedInterval) and furthest_step_reached all go on."""
    findings = Findings("event lines")
    warnings = _Warnings()
    logger = logging.getLogger("elastic_runner.observe.events")
    logger.addHandler(warnings)
    try:
        with bounded_memory(findings.reader):
            for case, rng in fuzz("events", seed, 120):
                if findings.exhausted:
                    break
                findings.cases += 1
                files = copy.deepcopy(event_files)
                planted = plant_lines(rng, files, event_files, (1, 2, 3, 4, 6), lambda line: mutated_line(rng, line),
                                      insert=0.5)
                run_dir = write_run(tmp_path, case, EVENTS_DIR, files)
                data = b"".join(planted)
                _consume(findings, case, data, run_dir, warnings)
                # A follower reading the same files as they grow (a line split across two reads).
                follower = EventFollower(run_dir)
                path = run_dir / EVENTS_DIR / rng.choice(sorted(files))
                whole = path.read_bytes()
                path.write_bytes(whole[:len(whole) // 2])
                findings.run(case, data, follower.read_new)
                path.write_bytes(whole)
                findings.run(case, data, follower.read_new)
                shutil.rmtree(run_dir)
    finally:
        logger.removeHandler(warnings)
    findings.check()
    assert not warnings.unsafe, f"a planted line reached the log unescaped: {warnings.unsafe[:3]}"


def plant_lines(rng: random.Random, files: dict[str, list[bytes]], originals: dict[str, list[bytes]],
                counts: tuple[int, ...], make: Callable[[bytes], bytes], insert: float | None = None) -> list[bytes]:
    """Damage ``files`` (a copy of ``originals``: name -> lines) in place: ``rng.choice(counts)`` times, a line made by
    ``make`` from an original one takes its place, or (with chance ``insert``) goes before it. Returns what it
    planted."""
    planted = []
    for _ in range(rng.choice(counts)):
        name = rng.choice(sorted(files))
        i = rng.randrange(len(originals[name]))
        line = make(originals[name][i])
        planted.append(line)
        if insert is not None and rng.random() >= insert:
            files[name].insert(i, line)
        else:
            files[name][i] = line
    return planted


def write_run(tmp_path: Path, case: str, subdir: str, files: dict[str, list[bytes]]) -> Path:
    """A run directory for ``case`` with ``files`` (name -> lines) under ``subdir``."""
    run_dir = tmp_path / case.replace(":", "-")
    (run_dir / subdir).mkdir(parents=True)
    for name, lines in files.items():
        (run_dir / subdir / name).write_bytes(b"".join(lines))
    return run_dir


#: What the event sweep sets a field to (DROP: the field left out).
DROP = object()
EVENT_SWEEP: list[Callable[[], Any]] = [lambda: DROP, lambda: None, lambda: math.nan, lambda: math.inf,
                                        lambda: -math.inf, lambda: 10**400, lambda: -1, lambda: "", lambda: [None],
                                        lambda: [{}], lambda: {}]


def test_every_field_of_every_event_set_to_a_hostile_value_leaves_report_goodput_and_intervals_standing(
        event_files: dict[str, list[bytes]], tmp_path: Path) -> None:
    """The sweep behind the event fuzzer: each field of each real event (and of its failure records) dropped or set
    to each of EVENT_SWEEP's values in turn; of the events, those read_events would keep (malformed() finds nothing
    wrong) go to the consumers that take a list of events: report's summarize (and the text it prints), goodput,
    failures_seen/losses_seen and the snapshot intervals. None raises."""
    run_dir = tmp_path / "run"
    (run_dir / EVENTS_DIR).mkdir(parents=True)
    for name, lines in event_files.items():
        (run_dir / EVENTS_DIR / name).write_bytes(b"".join(lines))
    events = read_events(run_dir)
    findings = Findings("event consumers (every field x every hostile value)")

    def consume(changed: list[dict[str, Any]]) -> None:
        summary = summarize(str(run_dir), changed)
        summary.text().encode()
        if summary.goodput is not None:
            json.dumps(summary.goodput.to_dict())
        goodput.measure(changed, summary.gaps, summary.wall, {2})
        failures_seen(changed), losses_seen(changed)
        _drive_intervals(changed)

    for i, event in enumerate(events):
        places = [(event, key) for key in event] + [(f, key) for f in event.get("failures", []) for key in f]
        for container, key in places:
            for k, make in enumerate(EVENT_SWEEP):
                value = make()
                changed_event = copy.deepcopy(event)
                target = changed_event if container is event else changed_event["failures"][event["failures"]
                                                                                             .index(container)]
                if value is DROP:
                    del target[key]
                else:
                    target[key] = value
                if malformed(changed_event) is not None:
                    continue  # read_events skips it: what the event fuzzer checks
                case = f"events[{i}] ({event['kind']}).{'failures[].' if target is not changed_event else ''}" \
                       f"{key}=EVENT_SWEEP[{k}]"
                findings.cases += 1
                data = json.dumps(changed_event, allow_nan=True).encode()
                findings.run(case, data, lambda: consume(events[:i] + [changed_event] + events[i + 1:]))
    findings.check()


# == the audit trail ================================================================================================


AUDIT_FIELDS = ["type", "generation", "rank", "world_size", "global_batch", "num_samples", "seed", "shuffle",
                "partial_batch", "order", "sampler", "epoch", "step", "start", "global_count", "micro_batch",
                "accumulation", "indices", "segments"]
N_SAMPLES, BATCH = 40, 8


def _audit_run(run_dir: Path) -> None:
    """A real audit trail: generation 1 (2 ranks) steps 1-5, snapshot at 3; generation 2 (2 ranks) resumes there
    and finishes at step 12."""
    header = {"num_samples": N_SAMPLES, "seed": 0, "shuffle": True, "partial_batch": "drop", "global_batch": BATCH,
              "sampler": "elastic"}
    snapshot: dict[str, Any] | None = None
    for generation, first, steps in ((1, 0, 5), (2, 3, 9)):
        writers = [AuditWriter(run_dir, generation=generation, rank=r, world_size=2, header=header) for r in (0, 1)]
        samplers = [ElasticSampler(N_SAMPLES, BATCH, rank=r, world_size=2) for r in (0, 1)]
        for sampler in samplers:
            if snapshot is not None:
                sampler.load_state_dict(snapshot)
        for step in range(first + 1, first + steps + 1):
            if samplers[0].epoch_done():
                for sampler in samplers:
                    sampler.next_epoch()
            plans = [next(s.plans()) for s in samplers]
            for writer, plan in zip(writers, plans):
                writer.step(step=step, epoch=plan.epoch, start=plan.start, global_count=plan.global_count,
                            indices=list(plan.indices), micro_batch=len(plan.indices), accumulation=1)
            for sampler, plan in zip(samplers, plans):
                sampler.advance(plan)
            if generation == 1 and step == 3:
                snapshot = samplers[0].state_dict()
        if generation == 2:
            writers[0].end(first + steps)
        for writer in writers:
            writer.close()


@pytest.fixture(scope="module")
def audit_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[bytes]]:
    run_dir = tmp_path_factory.mktemp("audit")
    _audit_run(run_dir)
    report = check_audit(run_dir)
    assert report.ok and report.finished and report.final_step == 12, report.render()
    return {p.name: p.read_bytes().splitlines(keepends=True) for p in sorted((run_dir / AUDIT_DIR).iterdir())}


def _audit_checked(run_dir: Path) -> AuditReport:
    """``check_audit`` and what ``elastic-runner audit`` prints of it (text or --json)."""
    report = check_audit(run_dir)
    report.render().encode()
    json.dumps(report.to_dict())
    return report


@pytest.mark.parametrize("seed", SEEDS)
def test_a_damaged_audit_record_is_reported_and_the_check_goes_on(audit_files: dict[str, list[bytes]],
                                                                  tmp_path: Path, seed: int) -> None:
    """check_audit on 120 trails per seed, one to four records mutated (fields, bytes, nesting, huge counts) and
    sometimes a planted .records-from: an AuditReport (torn lines, malformed records or violations named; never
    "ok" for a trail whose bytes were cut), its text and JSON printable, latest_step an int; never an exception."""
    findings = Findings("audit records")
    with bounded_memory(findings.reader):
        for case, rng in fuzz("audit", seed, 120):
            if findings.exhausted:
                break
            findings.cases += 1
            files = copy.deepcopy(audit_files)

            def damaged(original: bytes) -> bytes:
                roll = rng.random()
                if roll < 0.65:
                    return dumps(rng, mutate_json(rng, json.loads(original), AUDIT_FIELDS)).replace(b"\n", b" ") + b"\n"
                if roll < 0.9:
                    return garble(rng, original.rstrip(b"\n")).replace(b"\n", b" ") + b"\n"
                return not_an_object(rng, json.loads(original)).replace(b"\n", b" ") + b"\n"

            planted = plant_lines(rng, files, audit_files, (1, 1, 2, 3, 4), damaged)
            run_dir = write_run(tmp_path, case, AUDIT_DIR, files)
            if rng.random() < 0.2:
                view = mutate_json(rng, {"url": "s3://b/r/records", "cut_short": ["audit/gen-000001-rank-00001.jsonl"]},
                                   ["url", "cut_short"])
                (run_dir / FROM_BUCKET).write_bytes(dumps(rng, view))
                planted.append(b"[.records-from] " + (run_dir / FROM_BUCKET).read_bytes())
            data = b"".join(planted)
            findings.run(case, data, lambda: bucket_view(run_dir))
            findings.run(case, data, lambda: latest_step(run_dir))
            got = findings.run(case, data, lambda: _audit_checked(run_dir))
            if isinstance(got, AuditReport) and got.ok and got.torn_lines == 0 and \
                    any(not line.endswith(b"}\n") for line in planted if not line.startswith(b"[")):
                findings.violation(case, data, "a trail with a cut record was judged clean, with no torn line")
            shutil.rmtree(run_dir)
    findings.check()


# == the shard index ================================================================================================


BYTES = load_tokenizer("bytes")
INDEX_FIELDS = ["version", "name", "size", "check", "tokens", "dtype", "arrays"]


def _jsonl_spec(corpus: Path) -> Any:
    return parse_sources([{"path": str(corpus / "a.jsonl")}])[0]


def _indexed_corpus(corpus: Path) -> int:
    """A JSONL corpus with its shard index built beside it (.elastic-runner-index/<way>/<shard>.json and .npz, named
    by the shard's path); its number of samples."""
    corpus.mkdir()
    (corpus / "a.jsonl").write_text("".join(json.dumps({"text": f"document {i} " * (i % 4 + 1)}) + "\n"
                                            for i in range(30)))
    source = open_source(_jsonl_spec(corpus), PackSpec(8), BYTES)
    assert len(source) > 0 and len(list((corpus / ".elastic-runner-index").rglob("*.npz"))) == 1
    return len(source)


def _hostile_arrays(rng: random.Random, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The index's arrays with one replaced by an empty, scalar, 2-D, string, float (NaN) or decreasing array."""
    name = rng.choice(sorted(arrays))
    arrays = dict(arrays)
    arrays[name] = rng.choice([
        lambda a: a[:0], lambda a: np.array(a[0] if len(a) else 0), lambda a: a.reshape(1, -1),
        lambda a: a.astype(str), lambda a: np.full(len(a), np.nan), lambda a: a[::-1].copy(),
        lambda a: np.concatenate([a, [2**62]]), lambda a: a.astype(np.uint8), lambda a: a - 2**40,
        lambda a: a[:1],
    ])(arrays[name])
    if rng.random() < 0.2:
        del arrays[rng.choice(sorted(arrays))]
    return arrays


def test_a_garbled_shard_index_is_built_again_or_a_data_error(tmp_path: Path) -> None:
    """open_source on a corpus whose index record (JSON) or arrays (.npz) are mutated, 150 times: a source (the
    index taken, or built again) that reads its samples, or a DataError/ConfigError; token_meta on 80 planted
    meta.json files beside a token file: a dict."""
    corpus = tmp_path / "corpus"
    samples = _indexed_corpus(corpus)
    record = next((corpus / ".elastic-runner-index").rglob("*.json"))
    arrays_path = record.with_suffix(".npz")
    # The index is found by the shard's path: each case restores it where it was, then mutates it.
    original_record, original_arrays = record.read_bytes(), arrays_path.read_bytes()
    findings = Findings("shard index")
    with bounded_memory(findings.reader):
        for case, rng in fuzz("index", 0, 150):
            if findings.exhausted:
                break
            findings.cases += 1
            record.write_bytes(original_record)
            arrays_path.write_bytes(original_arrays)
            roll = rng.random()
            if roll < 0.4:
                data = dumps(rng, mutate_json(rng, json.loads(original_record), INDEX_FIELDS))
                record.write_bytes(data)
            elif roll < 0.45:
                data = not_an_object(rng, json.loads(original_record))
                record.write_bytes(data)
            elif roll < 0.55:
                data = garble(rng, original_record)
                record.write_bytes(data)
            elif roll < 0.85:
                with np.load(io.BytesIO(original_arrays)) as loaded:
                    arrays = _hostile_arrays(rng, {k: loaded[k] for k in loaded.files})
                buffer = io.BytesIO()
                np.savez(buffer, **arrays)
                data = buffer.getvalue()
                arrays_path.write_bytes(data)
            else:
                data = garble(rng, original_arrays)
                arrays_path.write_bytes(data)

            def opened() -> Any:
                source = open_source(_jsonl_spec(corpus), PackSpec(8), BYTES)
                for i in (0, len(source) - 1):
                    source[i]
                return source

            got = findings.run(case, data, opened, (DataError, ConfigError))
            if isinstance(got, Source) and len(got) != samples:
                findings.violation(case, data, f"the source has {len(got)} samples, the corpus {samples}")
        tokens = tmp_path / "tokens"
        tokens.mkdir()
        (tokens / "x.bin").write_bytes(np.arange(100, dtype=np.uint16).tobytes())
        meta = {"vocab_size": 50304, "eod": 50256, "dtype": "uint16"}
        for case, rng in fuzz("token-meta", 0, 80):
            findings.cases += 1
            data = dumps(rng, mutate_json(rng, meta, list(meta))) if rng.random() < 0.6 \
                else garble(rng, dumps(rng, meta))
            (tokens / "meta.json").write_bytes(data)
            got = findings.run(case, data, lambda: token_meta(str(tokens / "x.bin")))
            if got is not CRASHED and not isinstance(got, dict):
                findings.violation(case, data, f"token_meta returned {got!r:.60}")
    findings.check()


# == small planted files: a claimed generation, the run id, config.yaml ============================================


def test_a_planted_generation_file_still_fences_the_stale_writer(stores: dict[bool, LocalStore],
                                                                 tmp_path: Path) -> None:
    """generations/<N> is whoever claimed generation N (JSON: when, which host and pid); check_fence of an older
    generation raises StaleWriterError whatever that file holds (200 cases), never an exception about its bytes."""
    store = _copy_store(stores[False], tmp_path / "store")
    newer = store.claim_generation({})
    path = store.generations / f"{newer:06d}"
    original = path.read_bytes()
    findings = Findings("generations/<N> (check_fence)")
    for case, rng in fuzz("fence", 0, 200):
        findings.cases += 1
        roll = rng.random()
        data = dumps(rng, mutate_json(rng, json.loads(original), ["claimed_at", "host", "pid"])) if roll < 0.6 \
            else garble(rng, original) if roll < 0.9 else not_an_object(rng, json.loads(original))
        path.write_bytes(data)
        got = findings.run(case, data, lambda: store.check_fence(newer - 1), (StaleWriterError,))
        if got is None:
            findings.violation(case, data, "check_fence let an older generation's writer go on")
    findings.check()


def test_a_planted_run_id_is_read_or_refused_as_a_snapshot_error(stores: dict[bool, LocalStore],
                                                                 tmp_path: Path) -> None:
    """RUN_DIR/snapshots/run-id (which a resume compares with a snapshot's run_uid): existing_run_uid and run_uid
    give a string or SnapshotError, whatever bytes are there (100 cases)."""
    store = _copy_store(stores[False], tmp_path / "store")
    original = (store.root / "run-id").read_bytes()
    findings = Findings("run-id")
    for case, rng in fuzz("run-id", 0, 100):
        findings.cases += 1
        data = garble(rng, original)
        (store.root / "run-id").write_bytes(data)
        for read in (store.existing_run_uid, store.run_uid):
            got = findings.run(case, data, read, (SnapshotError,))
            if got is not CRASHED and not isinstance(got, (str, SnapshotError)):
                findings.violation(case, data, f"{read.__name__} returned {got!r:.60}")
    findings.check()


CONFIG_YAML = b"run:\n  dir: /tmp/run\nsnapshot:\n  dir: /tmp/run/snapshots\n  keep_last: 3\n"
#: YAML a writer of the run directory can plant (nesting deep enough to exhaust a recursive parser, yet small: PyYAML
#: is pure Python, and 100 KB of nesting takes it seconds whatever a reader does).
CONFIG_HOSTILE = [b"[" * 1_100, b"{a: " * 2_000, b"- " * 2_000 + b"x", b"snapshot: [1, 2]", b"snapshot:\n  dir: [x]",
                  b"snapshot:\n  dir: 12", b"snapshot: !!python/object:os.system {}", b"\xff\xfe\x00", b"\x00\x01",
                  b"snapshot: &a [*a]", b"a: &a [" + b"*a," * 10 + b"]\nsnapshot: {dir: *a}", b"- 1\n- 2",
                  b"snapshot:\n  dir: \"\\ud800\"", b"snapshot: {dir: !!binary AAAA}", b"%YAML 9.9\n---\nx"]


def test_a_planted_config_yaml_gives_a_location_or_a_clear_refusal(tmp_path: Path) -> None:
    """RUN_DIR/config.yaml is read to find the snapshot directory (snapshot inspect/export: snapshot_dir_of) and a
    run's bucket (audit, report: run_view): each hostile file above once, then 80 damaged copies of a real one; each
    read gives a location (the default where the file says nothing usable) or SnapshotError, never an exception
    about the file's bytes."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    findings = Findings("config.yaml (snapshot_dir_of, run_view)")
    # The hostile files once each: a recursion error in PyYAML costs a good part of a second.
    cases = [(f"CONFIG_HOSTILE[{i}]", data) for i, data in enumerate(CONFIG_HOSTILE)]
    cases += [(case, garble(rng, CONFIG_YAML)) for case, rng in fuzz("config", 0, 80)]
    for case, data in cases:
        if findings.exhausted:
            break
        findings.cases += 1
        (run_dir / "config.yaml").write_bytes(data)
        for read in (lambda: snapshot_dir_of(str(run_dir)), lambda: run_view(str(run_dir))):
            got = findings.run(case, data, read, (SnapshotError,))
            if got is not CRASHED and not isinstance(got, (str, SnapshotError)):
                findings.violation(case, data, f"returned {got!r:.60}")
    findings.check()
