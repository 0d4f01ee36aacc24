"""Snapshots in object storage (``s3://``, ``gs://``): the contract of :class:`~.store.LocalStore` without a filesystem.

A snapshot is the prefix ``URL/step-<STEP>-gen-<GEN>/``; it counts only once its ``meta.json`` exists, and
``meta.json`` is uploaded last, *created* (``If-None-Match: *`` on S3, ``ifGenerationMatch=0`` on GCS): a reader
never takes a half-uploaded snapshot and a publish never replaces one. The files are written first into a private
staging directory on the node (``run.dir``'s disk, the same writer code as for a directory) and uploaded from there
by the writer, off the training interpreter. A read downloads a snapshot into a private cache on the node and the
format's own checks (SHA-256, the job key's signature, no unpickler on untrusted bytes) run there, as for a directory.

Fencing is the directory's, with conditional creates in place of ``O_EXCL``: an attempt claims generation N by
creating ``URL/generations/<N>`` (a create that finds it there takes N + 1), and a writer lists the generations just
before it creates ``meta.json``. The store's own precondition is the lock, so no filesystem and no rendezvous is
needed, and the same holds for any writer that can reach the bucket (a node back from a long pause included).

Credentials and the endpoint come from the ecosystem's conventions (``AWS_*`` variables and files,
``AWS_ENDPOINT_URL``, an instance or pod role; GCS application-default credentials): never from the URL or the
config file, which :func:`check_location` refuses.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import re
import shutil
import socket
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlsplit

from ..config.locations import is_url, location_problem
from ..files import makedirs, open_file, private_dir
from .format import current_signing_key, parse_meta
from ..object_client import default_local, is_missing_bucket, is_precondition_failure, is_refusal, open_filesystem
from .shards import listed_objects, part_name, read_record, record_name
from .store import (MAX_META_BYTES, META, AlreadyCommittedError, CorruptSnapshotError, LocalStore, SnapshotError,
                    SnapshotRef, SnapshotUnavailableError, StoreAccessError, fence_error)

#: Snapshots kept in the node's read cache (the newest by (generation, step)); older ones are deleted.
CACHE_KEEP = 3
_GEN_RE = re.compile(r"-gen-([0-9]{6})")


def check_location(location: str, key: str = "snapshot.dir") -> None:
    """:func:`~elastic_runner.config.locations.location_problem` as a :class:`StoreAccessError`."""
    problem = location_problem(location)
    if problem is not None:
        raise StoreAccessError(f"{key}: {problem[0]}. {problem[1]}")


class ObjectStore:
    """Snapshots under an ``s3://`` or ``gs://`` prefix; ``local``: a private directory on this node for staging
    and the read cache (its disk must hold about ``CACHE_KEEP + 1`` snapshots)."""

    #: The volume's free space is not the bucket's: :mod:`.space` checks only :attr:`root`, the node's staging disk.
    is_local = False

    def __init__(self, location: str, local: str | os.PathLike[str] | None = None, fs: Any = None) -> None:
        check_location(location)
        self.location = location.rstrip("/")
        if fs is None:
            try:
                fs, _ = open_filesystem(self.location)
            except (ImportError, ValueError, TypeError) as exc:
                raise StoreAccessError(f"snapshot.dir {self.location!r}: {exc}") from exc
        self.fs = fs
        parts = urlsplit(self.location)
        self.bucket = parts.netloc
        self.prefix = f"{parts.netloc}{parts.path}".rstrip("/")
        self._local = Path(local) if local is not None else None
        #: Where this node's copies are written before the upload (what :mod:`.space` measures); created on first use.
        self.root = self._local or Path(tempfile.gettempdir())
        #: Objects this store uploaded for a snapshot: a retry of that snapshot may replace them, no other writer's.
        self._uploaded: set[str] = set()
        self._bucket_exists = False  #: seen to exist: a "not found" then never asks again

    @property
    def local(self) -> Path:
        """This node's private directory for the store (created, checked private, on first use)."""
        if self._local is None:
            self._local = default_local(self.location)
            self.root = self._local
        makedirs(self._local.parent)
        return private_dir(self._local)

    def spec(self) -> dict[str, str]:
        """What another process needs to open the same store (:func:`~.store.store_from_spec`)."""
        return {"location": self.location, "local": str(self.local)}

    # -- errors ------------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _io(self, what: str) -> Iterator[None]:
        """Turn the store's errors into ours, each saying what to fix; every one that may pass is retryable."""
        try:
            yield
        except SnapshotError:
            raise
        except PermissionError as exc:
            raise self._refused(what, exc) from exc
        except FileNotFoundError as exc:
            # GCS answers 404 to a create only when the bucket is missing.
            if what.startswith("creating ") or self._bucket_missing(exc):
                raise StoreAccessError(
                    f"{what}: the bucket {self.bucket!r} does not exist at {self._endpoint()}; create it, or fix "
                    "snapshot.dir (or AWS_ENDPOINT_URL)") from exc
            raise
        except Exception as exc:  # noqa: BLE001 - connection errors of aiohttp/botocore/gcsfs: all may pass
            if is_refusal(exc):
                raise self._refused(what, exc) from exc
            if "Credentials" in type(exc).__name__ or "credentials" in str(exc).lower()[:200]:
                raise StoreAccessError(
                    f"{what}: no credentials for {self.location} were found ({_short(exc)}). Give them the usual way: "
                    "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE, the pod's or instance's role; "
                    "GOOGLE_APPLICATION_CREDENTIALS or workload identity") from exc
            raise SnapshotUnavailableError(
                f"{what}: {self.location} did not answer as expected ({_short(exc)}); is {self._endpoint()} "
                "reachable?") from exc

    def _bucket_missing(self, exc: FileNotFoundError) -> bool:
        """:func:`~elastic_runner.object_client.is_missing_bucket`, the bucket asked for at most until it was seen to exist."""
        missing = is_missing_bucket(exc, None if self._bucket_exists else self.fs, self.bucket)
        self._bucket_exists = not missing
        return missing

    def _refused(self, what: str, exc: BaseException) -> StoreAccessError:
        return StoreAccessError(
            f"{what}: the object store refused access to {self.location} ({_short(exc)}). Check the credentials "
            "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE, the pod's or instance's role; "
            "GOOGLE_APPLICATION_CREDENTIALS) and that they may read and write this prefix")

    def _endpoint(self) -> str:
        endpoint = str(getattr(self.fs, "endpoint_url", None) or os.environ.get("AWS_ENDPOINT_URL")
                       or f"the {urlsplit(self.location).scheme}:// service")
        return re.sub(r"://[^/@\s]*@", "://***@", endpoint)  # an endpoint with user:password in it

    # -- small objects -----------------------------------------------------------------------------------------

    def _create(self, key: str, data: bytes) -> bool:
        """Create ``key`` with ``data`` unless it exists (then False): the store's precondition decides."""
        try:
            self.fs.pipe_file(key, data, mode="create")
        except Exception as exc:  # noqa: BLE001 - precondition failures arrive as several types
            if is_precondition_failure(exc):
                return False
            with self._io(f"creating {key}"):
                raise
        return True

    def _upload_new(self, path: Path, key: str, replace: bool) -> bool:
        """Upload ``path`` as ``key`` unless the key exists (then False), or over it where ``replace``."""
        try:
            self.fs.put_file(str(path), key, mode="create")
        except Exception as exc:  # noqa: BLE001 - precondition failures arrive as several types
            if not is_precondition_failure(exc):
                raise
            if not replace:
                return False
            self.fs.put_file(str(path), key)
        return True

    def _names(self, sub: str = "") -> list[str]:
        """Names directly under the prefix (or ``sub`` below it)."""
        where = f"{self.prefix}/{sub}".rstrip("/")
        with self._io(f"listing {where}"):
            try:
                entries = self.fs.ls(where, detail=False, refresh=True)
            except FileNotFoundError as exc:
                if self._bucket_missing(exc):
                    raise
                return []
        return [e.rstrip("/").rsplit("/", 1)[-1] for e in entries]

    def _keys(self) -> set[str]:
        """Every object of a snapshot (``step-*``) below the prefix, relative to it: one recursive listing that leaves
        out the run's records (thousands of small objects in a long run) and the generations."""
        with self._io(f"listing {self.location}"):
            try:
                found = self.fs.find(self.prefix, detail=False, withdirs=False, prefix="step-")
            except FileNotFoundError as exc:
                if self._bucket_missing(exc):
                    raise
                return set()
        start = len(self.prefix) + 1
        return {k[start:] for k in found if k.startswith(self.prefix + "/")}

    # -- listing -----------------------------------------------------------------------------------------------

    def ensure(self) -> None:
        """The bucket exists and these credentials may list the run's prefix (only that: a policy that grants the
        job its prefix and nothing else of the bucket works); writing is checked by the generation claim."""
        self._names()

    def complete(self) -> list[SnapshotRef]:
        keys = self._keys()
        refs = [SnapshotRef.parse(k.split("/", 1)[0]) for k in keys if k.endswith("/" + META) and k.count("/") == 1]
        return sorted(r for r in refs if r is not None)

    def incomplete(self) -> list[str]:
        keys = self._keys()
        names = {k.split("/", 1)[0] for k in keys if "/" in k}
        return sorted(n for n in names if SnapshotRef.parse(n) and f"{n}/{META}" not in keys)

    def corrupt(self) -> list[str]:
        return sorted(n for n in self._names() if n.startswith("corrupt-"))

    def describe(self, ref: SnapshotRef) -> tuple[bytes, dict[str, int]]:
        """The bytes of ``ref``'s marker and the size of each of its objects: one listing and one small
        download, never the snapshot itself (``snapshot inspect`` of a bucket with large snapshots)."""
        remote = f"{self.prefix}/{ref.name}"
        with self._io(f"describing {ref.name}"):
            listing = self.fs.find(remote, detail=True)
            sizes = {key[len(remote) + 1:]: int(info.get("size") or 0) for key, info in listing.items()
                     if key.startswith(remote + "/") and "/" not in key[len(remote) + 1:]}
            if META not in sizes:
                raise CorruptSnapshotError(f"{ref.name}: no {META} (removed or incomplete)")
            if sizes[META] > MAX_META_BYTES:
                raise CorruptSnapshotError(f"{ref.name}: {META} has {sizes[META]} bytes, far more than any marker")
            try:
                return self.fs.cat_file(f"{remote}/{META}"), sizes
            except FileNotFoundError as exc:
                raise CorruptSnapshotError(f"{ref.name}: no {META} (removed meanwhile)") from exc

    def corrupt_reason(self, name: str) -> str | None:
        """Why a run moved ``name`` (``corrupt-...``) aside, as it wrote it."""
        with contextlib.suppress(Exception):
            return self.fs.cat_file(f"{self.prefix}/{name}/REASON", start=0, end=2000).decode(errors="replace").strip() \
                or None
        return None

    def path(self, ref: SnapshotRef) -> Path:
        """A local copy of ``ref`` (downloaded once into the node's private cache). Only the objects its marker lists
        are fetched, and only once the marker passed its checks (the job's signature among them) and the listing
        shows each at the size the marker says: nothing a writer of the bucket adds under the name is downloaded.
        The bytes are checked by whoever reads the copy, as for a directory."""
        cache = private_dir(self.local / "cache")
        target = cache / ref.name
        if (target / META).is_file():
            return target
        marker, sizes = self.describe(ref)
        wanted = listed_objects(ref.name, parse_meta(ref.name, marker), sizes)
        tmp = cache / f".tmp-{ref.name}-{os.getpid()}-{time.monotonic_ns()}"
        private_dir(tmp)
        try:
            remote = f"{self.prefix}/{ref.name}"
            with self._io(f"downloading {ref.name}"):
                for name in wanted:
                    self.fs.get_file(f"{remote}/{name}", str(tmp / name))
            with open_file(tmp / META, "wb") as fh:  # last: a copy without it is read as incomplete
                fh.write(marker)
            for child in tmp.iterdir():
                os.chmod(child, 0o600)
            try:
                os.rename(tmp, target)
            except OSError:  # another rank of this node fetched it first (same bytes: names are never reused)
                shutil.rmtree(tmp, ignore_errors=True)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        self._trim_cache(cache, keep=ref)
        return target

    def _trim_cache(self, cache: Path, keep: SnapshotRef) -> None:
        """The newest :data:`CACHE_KEEP` copies stay, and ``keep`` (just fetched: its reader is about to open it)."""
        cached = sorted((r, p) for p in cache.iterdir() if (r := SnapshotRef.parse(p.name)) is not None and r != keep)
        for _, stale in cached[:-(CACHE_KEEP - 1) or None]:
            shutil.rmtree(stale, ignore_errors=True)

    # -- writing -----------------------------------------------------------------------------------------------

    def staging(self, ref: SnapshotRef) -> Path:
        base = private_dir(self.local / "staging")
        path = base / f".tmp-{ref.name}-{socket.gethostname()}-{os.getpid()}-{time.monotonic_ns()}"
        try:
            private_dir(path)
        except OSError as exc:
            raise SnapshotError(f"cannot create {path} ({exc.strerror}); the node's run.dir must be writable and "
                                "hold one snapshot") from exc
        return path

    def shared_staging(self, ref: SnapshotRef) -> Path:
        """No directory is shared: each rank of a sharded snapshot writes its part into a staging directory of its own
        and uploads it (:meth:`share_part`) under the snapshot's name, where rank 0 finds it (:meth:`part_records`);
        rank 0 uploads its own part with ``state.pt`` and creates ``meta.json`` once every part is there."""
        return self.staging(ref)

    def share_part(self, staging: Path, ref: SnapshotRef, rank: int) -> None:
        """Upload this rank's part, then its record (what rank 0 waits for: the part is whole once it exists); the
        local copy goes. Invisible to readers until rank 0 publishes ``meta.json``. With the job's key the record
        is signed: rank 0 signs ``meta.json`` over the parts' checksums, and takes none that someone who can write
        the bucket (but lacks the key) planted under the snapshot's predictable name."""
        remote = f"{self.prefix}/{ref.name}"
        try:
            record = json.loads((staging / record_name(rank)).read_text())
            key = current_signing_key()
            if key is not None:
                record["hmac"] = _record_signature(ref, rank, record, key)
            with self._io(f"uploading {part_name(rank)} of {ref.name}"):
                self.fs.put_file(str(staging / part_name(rank)), f"{remote}/{part_name(rank)}")
                self.fs.pipe_file(f"{remote}/{record_name(rank)}", json.dumps(record).encode())
        finally:
            self.discard(staging)

    def part_records(self, staging: Path, ref: SnapshotRef) -> dict[str, Any]:
        """Rank 0 looks for the other ranks' records in the bucket (one listing a poll; a record is small JSON, never
        more than a few hundred bytes taken), its own in ``staging``."""
        remote = f"{self.prefix}/{ref.name}"

        def records_of(missing: list[int]) -> dict[int, dict[str, Any]]:
            found = read_record(staging, missing)
            wanted = {record_name(r): r for r in missing if r not in found}
            if not wanted:
                return found
            key = current_signing_key()
            with self._io(f"waiting for the parts of {ref.name}"):
                try:
                    present = [k.rsplit("/", 1)[-1] for k in self.fs.ls(remote, detail=False, refresh=True)]
                except FileNotFoundError:
                    return found
                for name in present:
                    if name not in wanted:
                        continue
                    rank = wanted[name]
                    with contextlib.suppress(ValueError, FileNotFoundError):
                        record = json.loads(self.fs.cat_file(f"{remote}/{name}", start=0, end=4096))
                        if not isinstance(record, dict):
                            continue
                        signature = record.pop("hmac", None)
                        if key is not None and not (isinstance(signature, str) and hmac.compare_digest(
                                signature, _record_signature(ref, rank, record, key))):
                            continue  # not signed with the job's key: never the part's checksum in meta.json
                        found[rank] = record
            return found

        # A listing every 0.2 s: a part takes about as long to upload as rank 0's own takes to write.
        return {"records_of": records_of, "poll_s": 0.2}

    def publish(self, staging: Path, ref: SnapshotRef, entries_synced: bool = False,
                replace_incomplete: bool = False) -> None:
        """Upload ``staging``'s files under ``ref``'s name, then create its ``meta.json``; the local copy goes.

        Each object is created only if it does not exist (the store's precondition), as the marker is: two writers of
        one name (every node's first worker writes on a stop) would otherwise interleave, one's ``state.pt`` under
        the other's marker — a directory's rename cannot mix them, a bucket's objects can. The writer that finds an
        object of the name there stops (:class:`AlreadyCommittedError`; its own copy stays in node memory), unless it
        uploaded that object itself in an earlier try whose marker never came. ``replace_incomplete``: the objects of
        a name without a marker are replaced (``snapshot persist``, once the job that left them has ended)."""
        del entries_synced  # the upload is what makes it durable
        remote = f"{self.prefix}/{ref.name}"
        files = sorted(p for p in staging.iterdir() if p.is_file() and p.name != META and not p.name.startswith("."))
        with self._io(f"uploading {ref.name}"):
            if self.fs.exists(f"{remote}/{META}"):
                raise AlreadyCommittedError(f"{ref.name} was already published")
            for path in files:
                key = f"{remote}/{path.name}"
                if not self._upload_new(path, key, replace=replace_incomplete or key in self._uploaded):
                    raise AlreadyCommittedError(f"{ref.name} is being published by another writer (its "
                                                f"{path.name} is there)")
                self._uploaded.add(key)
        # Fenced again after the upload (which may take minutes), right before the marker: a round that began
        # meanwhile may have swept what this writer uploaded.
        self.check_fence(ref.generation)
        if not self._create(f"{remote}/{META}", (staging / META).read_bytes()):
            raise AlreadyCommittedError(f"{ref.name} was already published")
        self._uploaded.difference_update(f"{remote}/{p.name}" for p in files)  # published: never retried
        self.discard(staging)

    def discard(self, staging: Path) -> None:
        shutil.rmtree(staging, ignore_errors=True)

    def remove(self, ref: SnapshotRef) -> None:
        # The marker first: from then on no reader takes it, whatever of the rest is still there.
        remote = f"{self.prefix}/{ref.name}"
        with self._io(f"deleting {ref.name}"):
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(f"{remote}/{META}")
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(remote, recursive=True)

    def quarantine(self, ref: SnapshotRef, reason: str) -> None:
        """Copy it to ``corrupt-<name>/`` with the reason (server-side), then remove it; best effort, as for a
        directory (another rank may have moved it first)."""
        remote = f"{self.prefix}/{ref.name}"
        target = f"{self.prefix}/corrupt-{ref.name}"
        with contextlib.suppress(Exception):
            for key in self.fs.find(remote, detail=False):
                self.fs.copy(key, target + key[len(remote):])
            self.fs.pipe_file(f"{target}/REASON", (reason + "\n").encode())
        with contextlib.suppress(Exception):
            self.remove(ref)
        shutil.rmtree(self.local / "cache" / ref.name, ignore_errors=True)

    def sweep(self, older_than_generation: int) -> list[str]:
        """Remove what writers of older generations (dead by now) left: uploads without a marker, unfinished
        multipart uploads, and this node's staging directories."""
        removed = []
        for name in self.incomplete():
            m = _GEN_RE.search(name)
            if m and int(m.group(1)) < older_than_generation:
                with contextlib.suppress(Exception):
                    self.fs.rm(f"{self.prefix}/{name}", recursive=True)
                    removed.append(name)
        removed += self._abort_multipart(older_than_generation)
        staging = self.local / "staging"
        if staging.is_dir():
            for leftover in staging.iterdir():
                m = _GEN_RE.search(leftover.name)
                if m and int(m.group(1)) < older_than_generation:
                    shutil.rmtree(leftover, ignore_errors=True)
                    removed.append(leftover.name)
        return removed

    def _abort_multipart(self, older_than_generation: int) -> list[str]:
        """S3 keeps the parts of a multipart upload whose writer died (billed, invisible); abort older rounds'."""
        if not hasattr(self.fs, "list_multipart_uploads"):
            return []
        aborted = []
        key_prefix = self.prefix[len(self.bucket) + 1:]
        with contextlib.suppress(Exception):
            for upload in self.fs.list_multipart_uploads(self.bucket):
                key = upload.get("Key", "")
                m = _GEN_RE.search(key)
                if key.startswith(key_prefix) and m and int(m.group(1)) < older_than_generation:
                    self.fs.call_s3("abort_multipart_upload", Bucket=self.bucket, Key=key, UploadId=upload["UploadId"])
                    aborted.append(f"multipart upload of {key}")
        return aborted

    # -- identity and fencing ----------------------------------------------------------------------------------

    def run_uid(self) -> str:
        key = f"{self.prefix}/run-id"
        self._create(key, uuid.uuid4().hex.encode())
        with self._io("reading run-id"):
            return self.fs.cat_file(key).decode().strip()

    def existing_run_uid(self) -> str:
        """The run id if the run has one ("" if not); creates nothing."""
        with self._io("reading run-id"):
            try:
                return self.fs.cat_file(f"{self.prefix}/run-id").decode().strip()
            except FileNotFoundError:
                return ""

    def _claimed(self) -> list[int]:
        return sorted(int(n) for n in self._names("generations") if n.isascii() and n.isdigit())

    def newest_generation(self) -> int:
        claimed = self._claimed()
        return claimed[-1] if claimed else 0

    def claim_generation(self, info: dict[str, Any]) -> int:
        """The next generation, created exclusively (a refused create takes the next number). The caller checked
        the store first (:meth:`ensure`: one request less on every attempt's start)."""
        candidate = self.newest_generation() + 1
        body = json.dumps({"claimed_at": time.time(), "host": socket.gethostname(), "pid": os.getpid()} | info)
        while not self._create(f"{self.prefix}/generations/{candidate:06d}", body.encode()):
            candidate += 1
        return candidate

    def generation_info(self, generation: int) -> dict[str, Any]:
        try:  # only for a message; a claim in the bucket that is no JSON object says nothing
            return info if isinstance(info := json.loads(self.fs.cat_file(f"{self.prefix}/generations/{generation:06d}")), dict) else {}
        except Exception:  # noqa: BLE001
            return {}

    def check_fence(self, generation: int) -> None:
        newest = self.newest_generation()
        if newest > generation:
            raise fence_error(generation, newest, self.generation_info(newest), self.location)


def _record_signature(ref: SnapshotRef, rank: int, record: dict[str, Any], key: bytes) -> str:
    """HMAC-SHA256 under the job's key of a part's record, bound to its snapshot and rank."""
    body = json.dumps({"snapshot": ref.name, "rank": rank} | {k: v for k, v in record.items() if k != "hmac"},
                      sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(key, body, hashlib.sha256).hexdigest()


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text[:200]


def open_store(location: str, local: str | os.PathLike[str] | None = None) -> LocalStore | ObjectStore:
    """The store at ``location``: a directory (or ``file://`` path), or an object-store URL (``s3://``, ``gs://``;
    ``local``: this node's private directory for its staging copies and read cache)."""
    if is_url(location):
        return ObjectStore(location, local)
    return LocalStore(location.removeprefix("file://"))


def store_from_spec(spec: dict[str, str]) -> LocalStore | ObjectStore:
    """The store another process described with ``store.spec()`` (the writer process opens the worker's)."""
    return open_store(spec["location"], spec.get("local"))
