"""Reading a run back from its records in a bucket (:mod:`elastic_runner.observe.records`): the whole run rebuilt
in a private local directory that ``elastic-runner audit``, ``report`` and the chaos checker read as they read a
shared ``run.dir``. What a writer of the bucket may have put there is bounded before it is read."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, BinaryIO

from ..files import makedirs, open_file, private_dir
from ..printable import printable
from .records import (APPEND_ONLY, FROM_BUCKET, MAX_CHUNK, WHOLE_FILES, filesystem_of, records_url, split_chunk,
                      write_private)

log = logging.getLogger("elastic_runner.records")

#: What a reader fetches of a whole file (``config.yaml``), and of a run's records in all.
MAX_WHOLE_FILE = 1 << 20
MAX_FETCH = 16 << 30


class RecordsError(RuntimeError):
    """The records under a URL cannot be a run's (far too many bytes): nothing more is fetched."""


def fetch_records(url: str, into: str | os.PathLike[str], fs: Any = None, max_bytes: int = MAX_FETCH) -> Path:
    """Rebuild the run's record files from ``url`` (``SNAPSHOT_URL/records``) in ``into``; returns ``into``.
    Chunks are downloaded once (kept in ``into/.chunks``), so a second fetch costs a listing and what is new.

    What a writer of the bucket may have put there is bounded before a byte of it is read: a chunk is fetched only
    where the listing shows it at the size its name says (at most :data:`MAX_CHUNK`; another is a gap, as a chunk
    never uploaded), a whole file only up to :data:`MAX_WHOLE_FILE`, every download streams to disk, and a fetch
    that would download more than ``max_bytes`` stops with :class:`RecordsError`."""
    target = private_dir(makedirs(Path(into)))
    if fs is None:
        fs, prefix = filesystem_of(url)
    else:
        prefix = url.split("://", 1)[-1].rstrip("/")
    chunks = private_dir(target / ".chunks")
    ranges: dict[str, dict[str, list[tuple[int, int, str]]]] = {}
    produced: set[str] = set()
    fetched = 0
    refused: list[str] = []
    gaps: set[str] = set()  # files with a chunk refused: they end before it

    def fetch(key: str, size: int, local: Path) -> None:
        nonlocal fetched
        fetched += size
        if fetched > max_bytes:
            raise RecordsError(f"the objects under {url} add up to more than {max_bytes >> 20} MiB, far more than a "
                               "run's records: something other than elastic_runner writes there; nothing more is "
                               "fetched (clean the prefix, or read a run directory instead)")
        _fetch_private(fs, key, local, size)

    for key, version, size in _listed_versions(fs, prefix):
        relative = key[len(prefix) + 1:]
        if relative in WHOLE_FILES:
            if size > MAX_WHOLE_FILE:
                refused.append(f"{printable(relative, 120)} ({size} bytes)")
                continue
            fetch(key, size, target / relative)
            produced.add(relative)
            continue
        chunk = split_chunk(relative)
        if chunk is None:
            continue  # not ours (and nothing planted may name a path outside ``into``: checked there)
        relative, incarnation, lo, hi = chunk
        if size != hi - lo or size > MAX_CHUNK:  # damaged or planted: the range is a gap, its bytes never read
            refused.append(f"{printable(key[len(prefix) + 1:], 120)} ({size} bytes)")
            ranges.setdefault(relative, {}).setdefault(incarnation, [])
            gaps.add(relative)
            continue
        # Named by the object's version too: a prefix emptied and used again holds objects of the same names (the
        # same header, the same ranges) with other bytes, which a copy kept from the earlier run must not stand for.
        local = chunks / relative.replace("/", "__") / incarnation / f"{lo:015d}-{hi:015d}-{version}"
        if not local.is_file():
            makedirs(local.parent)
            fetch(key, size, local)
        ranges.setdefault(relative, {}).setdefault(incarnation, []).append((lo, hi, str(local)))
    if refused:
        log.warning("%d object(s) under %s are not the size their names say, and were not fetched (a gap where they "
                    "would be): %s", len(refused), url, ", ".join(refused[:5]))
    cut_short = []
    for relative, incarnations in ranges.items():
        tmp = target / f".{relative.replace('/', '__')}.{os.getpid()}.tmp"
        with open_file(tmp, "wb") as out:
            short = [_assemble(spans, out) for _, spans in sorted(incarnations.items())]
        makedirs((target / relative).parent)
        os.replace(tmp, target / relative)
        produced.add(relative)
        if any(short) or relative in gaps:
            cut_short.append(relative)
    # What an earlier fetch of the same URL left and the bucket no longer has (a prefix emptied and used again).
    listed = {span[2] for incarnations in ranges.values() for spans in incarnations.values() for span in spans}
    for path in list(target.rglob("*")):
        relative = path.relative_to(target).as_posix()
        if path.is_file() and relative != FROM_BUCKET and (
                str(path) not in listed if relative.startswith(".chunks/") else relative not in produced):
            path.unlink()
    write_private(target / FROM_BUCKET, json.dumps({"url": url, "cut_short": sorted(cut_short)}).encode())
    return target


def _fetch_private(fs: Any, key: str, path: Path, size: int) -> None:
    """Download ``key`` to ``path`` (private, atomic, streamed); one that is not ``size`` bytes once here (replaced
    meanwhile) is not kept."""
    makedirs(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open_file(tmp, "wb"):
            pass  # created private before any byte arrives
        fs.get_file(key, str(tmp))
        if tmp.stat().st_size != size:
            raise RecordsError(f"{key} changed while it was fetched; fetch again")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def bucket_view(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """What :func:`fetch_records` said about the directory it rebuilt (``url``; ``cut_short``: the files whose
    chunks in the bucket have a gap, so they end early), or None if ``run_dir`` is not such a directory."""
    try:
        info = json.loads((Path(run_dir) / FROM_BUCKET).read_bytes()[:1 << 20])
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(info, dict) or not isinstance(info.get("cut_short"), list) \
            or not all(isinstance(name, str) for name in info["cut_short"]):
        return None
    return info


def _assemble(spans: list[tuple[int, int, str]], out: BinaryIO) -> bool:
    """Write the file from its ranges to ``out``: from offset 0, each time the range that reaches furthest from where
    we are. Returns whether it ends before the furthest range does (a gap: a chunk missing or shorter than its name
    says), in which case it ends at its last whole line."""
    start, here = out.tell(), 0
    furthest = max((s[1] for s in spans), default=0)
    while True:
        best = max((s for s in spans if s[0] <= here < s[1]), key=lambda s: s[1], default=None)
        if best is None:
            return here < furthest
        with open(best[2], "rb") as fh:
            fh.seek(here - best[0])
            while here < best[1] and (piece := fh.read(min(best[1] - here, 1 << 20))):
                out.write(piece)
                here += len(piece)
        if here < best[1]:  # a chunk shorter than its name says (damaged on this disk): stop at the last whole line
            out.truncate(start + _last_line_end(out, start))
            out.seek(0, os.SEEK_END)
            return True


def _last_line_end(out: BinaryIO, start: int) -> int:
    """How many bytes after ``start`` of ``out`` end with its last newline (0: none)."""
    out.flush()
    end = out.seek(0, os.SEEK_END)
    while end > start:
        lo = max(start, end - (1 << 16))
        out.seek(lo)
        newline = out.read(end - lo).rfind(b"\n")
        if newline >= 0:
            return lo + newline + 1 - start
        end = lo
    return 0


def _listed_versions(fs: Any, prefix: str) -> list[tuple[str, str, int]]:
    """The keys below ``prefix`` with a short digest of what identifies their bytes (S3's ETag, GCS's generation or
    MD5, else size and modification time), and their sizes."""
    try:
        found = fs.find(prefix, detail=True)
    except FileNotFoundError:
        return []
    out = []
    for key, info in found.items():
        if key.startswith(prefix + "/"):
            tag = next((str(info[k]) for k in ("ETag", "etag", "generation", "md5Hash") if info.get(k)),
                       f"{info.get('size')}:{info.get('LastModified') or info.get('mtime') or info.get('updated')}")
            try:
                size = int(info.get("size") or 0)
            except (TypeError, ValueError):
                size = -1  # no size the listing vouches for: never fetched
            out.append((key, hashlib.sha256(tag.encode()).hexdigest()[:12], size))
    return out


RECORDS_FROM_HELP = ("the bucket that holds the run's snapshots and records (s3://BUCKET/PREFIX), read instead of "
                     "the one RUN_DIR/config.yaml names")


def run_view(location: str, records_from: str | None = None) -> str:
    """The directory that ``audit``, ``report`` and the chaos checker read for ``location``: a run directory as it is,
    or, for a run whose snapshots are in a bucket (``location`` is that URL, or a node's run directory whose effective
    config names one), the whole run's records fetched from the bucket into a private local directory.
    ``records_from``: the bucket to read them from, named by the caller (instead of the one ``config.yaml`` names).

    A URL read from the run directory's ``config.yaml`` is followed only where a job could have written to it
    (:func:`~elastic_runner.config.locations.location_problem`): a writer of the run directory must not make these
    commands fetch ``http://`` addresses or walk this machine's files into the cache."""
    from ..config.locations import is_url, location_problem
    from ..snapshot.object_store import check_location

    if records_from is not None:
        check_location(records_from, "--records-from")
        url: str | None = records_from
    elif is_url(location):
        check_location(location, "the run's location")
        url = location
    else:
        url = _snapshot_url_of(Path(location))
        problem = location_problem(url) if url is not None else None
        if problem is not None:
            from ..snapshot.store import StoreAccessError

            raise StoreAccessError(
                f"{Path(location) / 'config.yaml'}: snapshot.dir: {problem[0]}; it is not followed (a run's config "
                "names only a bucket its job could write to). If this run's snapshots and records are in a bucket, "
                "name it: --records-from s3://BUCKET/PREFIX")
    if url is None:
        return location
    from ..object_client import default_local

    view = fetch_records(records_url(url), default_local(url) / "run")
    if not is_url(location):
        _take_local(Path(location), view)
    return str(view)


def _take_local(run_dir: Path, view: Path) -> None:
    """Where ``run_dir``'s own record files go further than the bucket's (lines not uploaded yet; a shared directory
    holds every node's), the view takes them: whole lines, and only where the bucket's copy is their beginning."""
    info = bucket_view(view)
    cut_short = set(info["cut_short"]) if info is not None else set()
    for sub in APPEND_ONLY:
        for path in sorted((run_dir / sub).glob("*.jsonl")):
            try:
                data = path.read_bytes()
            except OSError:
                continue
            whole = data[:data.rfind(b"\n") + 1]
            target = view / sub / path.name
            fetched = target.read_bytes() if target.is_file() else b""
            if len(whole) > len(fetched) and whole.startswith(fetched):
                write_private(target, whole)
                cut_short.discard(f"{sub}/{path.name}")
    if info is not None:
        write_private(view / FROM_BUCKET, json.dumps(info | {"cut_short": sorted(cut_short)}).encode())


def _snapshot_url_of(run_dir: Path) -> str | None:
    import yaml

    from ..config.locations import is_url

    try:
        cfg = yaml.safe_load((run_dir / "config.yaml").read_bytes()[:MAX_WHOLE_FILE]) or {}
        custom = (cfg.get("snapshot") or {}).get("dir")
    except (OSError, yaml.YAMLError, AttributeError, ValueError, RecursionError):
        return None  # not a config of ours (UnicodeDecodeError is a ValueError): the directory is read as it is
    return custom if isinstance(custom, str) and is_url(custom) else None
