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
import json
import os
import re
import shutil
import socket
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlsplit

from ..config.locations import is_url, location_problem
from ..files import makedirs, private_dir
from .shards import part_name, read_record, record_name
from .store import (META, AlreadyCommittedError, LocalStore, SnapshotError, SnapshotRef, SnapshotUnavailableError,
                    StoreAccessError, fence_error)

#: Snapshots kept in the node's read cache (the newest by (generation, step)); older ones are deleted.
CACHE_KEEP = 3
_GEN_RE = re.compile(r"-gen-([0-9]{6})")


def check_location(location: str, key: str = "snapshot.dir") -> None:
    """:func:`~elastic_runner.config.locations.location_problem` as a :class:`StoreAccessError`."""
    problem = location_problem(location)
    if problem is not None:
        raise StoreAccessError(f"{key}: {problem[0]}. {problem[1]}")


#: One filesystem per (process, scheme, bucket, credentials): its client is created once (botocore loads its
#: service description, ~0.2 s) and shared by the store, the record upload and a warm-up (:func:`prewarm`).
_FILESYSTEMS: dict[tuple[Any, ...], Any] = {}
_FILESYSTEMS_LOCK = threading.Lock()


def open_filesystem(location: str) -> tuple[Any, str]:
    """The fsspec filesystem of ``location`` (and the path in it), set to give up within seconds on a store that is
    down rather than minutes: a snapshot that cannot be uploaded is reported and the next one tried (a step waits
    for a write still in flight), and a worker's exit never waits long on a store. No listing cache (other nodes
    publish); fsspec's own instance cache is not used (a forked process, or other credentials, get their own)."""
    import fsspec

    parts = urlsplit(location)
    credentials = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(("AWS_", "GOOGLE_"))))
    key = (os.getpid(), parts.scheme, parts.netloc, credentials)
    path = f"{parts.netloc}{parts.path}"
    with _FILESYSTEMS_LOCK:
        fs = _FILESYSTEMS.get(key)
        if fs is None:
            options: dict[str, Any] = {}
            if location.startswith("s3://"):
                options["config_kwargs"] = {"connect_timeout": 5, "read_timeout": 60, "retries": {"max_attempts": 3}}
            fs, path = fsspec.core.url_to_fs(location, use_listings_cache=False, skip_instance_cache=True, **options)
            if hasattr(fs, "retries"):
                fs.retries = 2  # s3fs's own retries, on top of botocore's (5 by default)
            _FILESYSTEMS[key] = fs
    return fs, path


def prewarm(location: str) -> None:
    """Create the store's client in the background (a worker calls this before its process group is up, so the
    attempt's first request to the store does not pay for it); errors are left for the real requests to report."""
    def warm() -> None:
        with contextlib.suppress(Exception):
            fs, _ = open_filesystem(location)
            if hasattr(fs, "set_session"):
                fs.set_session()

    threading.Thread(target=warm, name="object-store-warmup", daemon=True).start()


def default_local(location: str) -> Path:
    """This user's private directory on this node for one object-store location (staging and read cache) where the
    caller names none: ``$TMPDIR/elastic-runner-objects-<uid>/<digest of the URL>``."""
    import hashlib

    base = private_dir(Path(tempfile.gettempdir()) / f"elastic-runner-objects-{os.getuid()}")
    return private_dir(base / hashlib.sha256(location.encode()).hexdigest()[:16])


def _is_precondition_failure(exc: BaseException) -> bool:
    """The store refused a create because the object exists (S3: 412 PreconditionFailed, GCS: 412)."""
    if isinstance(exc, FileExistsError):
        return True
    seen: BaseException | None = exc
    while seen is not None:
        text = f"{type(seen).__name__} {seen}"
        if "PreconditionFailed" in text or "pre-condition" in text or "412" in text:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


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
            raise StoreAccessError(
                f"{what}: the object store refused access to {self.location} ({_short(exc)}). Check the credentials "
                "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE, the pod's or instance's role; "
                "GOOGLE_APPLICATION_CREDENTIALS) and that they may read and write this prefix") from exc
        except FileNotFoundError as exc:
            if "bucket" in str(exc).lower():
                raise StoreAccessError(
                    f"{what}: the bucket {self.bucket!r} does not exist at {self._endpoint()}; create it, or fix "
                    "snapshot.dir (or AWS_ENDPOINT_URL)") from exc
            raise
        except Exception as exc:  # noqa: BLE001 - connection errors of aiohttp/botocore/gcsfs: all may pass
            if "Credentials" in type(exc).__name__ or "credentials" in str(exc).lower()[:200]:
                raise StoreAccessError(
                    f"{what}: no credentials for {self.location} were found ({_short(exc)}). Give them the usual way: "
                    "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE, the pod's or instance's role; "
                    "GOOGLE_APPLICATION_CREDENTIALS or workload identity") from exc
            raise SnapshotUnavailableError(
                f"{what}: {self.location} did not answer as expected ({_short(exc)}); is {self._endpoint()} "
                "reachable?") from exc

    def _endpoint(self) -> str:
        return str(getattr(self.fs, "endpoint_url", None) or os.environ.get("AWS_ENDPOINT_URL")
                   or f"the {urlsplit(self.location).scheme}:// service")

    # -- small objects -----------------------------------------------------------------------------------------

    def _create(self, key: str, data: bytes) -> bool:
        """Create ``key`` with ``data`` unless it exists (then False): the store's precondition decides."""
        try:
            self.fs.pipe_file(key, data, mode="create")
        except Exception as exc:  # noqa: BLE001 - precondition failures arrive as several types
            if _is_precondition_failure(exc):
                return False
            with self._io(f"creating {key}"):
                raise
        return True

    def _names(self, sub: str = "") -> list[str]:
        """Names directly under the prefix (or ``sub`` below it)."""
        where = f"{self.prefix}/{sub}".rstrip("/")
        with self._io(f"listing {where}"):
            try:
                entries = self.fs.ls(where, detail=False, refresh=True)
            except FileNotFoundError as exc:
                if "bucket" in str(exc).lower():
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
                if "bucket" in str(exc).lower():
                    raise
                return set()
        start = len(self.prefix) + 1
        return {k[start:] for k in found if k.startswith(self.prefix + "/")}

    # -- listing -----------------------------------------------------------------------------------------------

    def ensure(self) -> None:
        """The bucket exists and these credentials may list it (writing is checked by the generation claim)."""
        with self._io("opening the snapshot store"):
            self.fs.ls(self.bucket, detail=False, refresh=True)

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

    def path(self, ref: SnapshotRef) -> Path:
        """A local copy of ``ref`` (downloaded once into the node's private cache). What it holds is checked by
        whoever reads it, as for a directory: a damaged or planted object fails its checksum there."""
        cache = private_dir(self.local / "cache")
        target = cache / ref.name
        if (target / META).is_file():
            return target
        tmp = cache / f".tmp-{ref.name}-{os.getpid()}-{time.monotonic_ns()}"
        private_dir(tmp)
        try:
            remote = f"{self.prefix}/{ref.name}"
            with self._io(f"downloading {ref.name}"):
                keys = [k for k in self.fs.find(remote, detail=False) if k.startswith(remote + "/")]
                files = [k for k in keys if "/" not in k[len(remote) + 1:]]
                # meta.json last: a snapshot removed meanwhile leaves a copy without it (read as incomplete).
                files.sort(key=lambda k: k.endswith("/" + META))
                for key in files:
                    self.fs.get_file(key, str(tmp / key.rsplit("/", 1)[-1]))
            for child in tmp.iterdir():
                os.chmod(child, 0o600)
            try:
                os.rename(tmp, target)
            except OSError:  # another rank of this node fetched it first (same bytes: names are never reused)
                shutil.rmtree(tmp, ignore_errors=True)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        self._trim_cache(cache)
        return target

    def _trim_cache(self, cache: Path) -> None:
        cached = sorted((r, p) for p in cache.iterdir() if (r := SnapshotRef.parse(p.name)) is not None)
        for _, stale in cached[:-CACHE_KEEP]:
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
        local copy goes. Invisible to readers until rank 0 publishes ``meta.json``."""
        remote = f"{self.prefix}/{ref.name}"
        try:
            with self._io(f"uploading {part_name(rank)} of {ref.name}"):
                self.fs.put_file(str(staging / part_name(rank)), f"{remote}/{part_name(rank)}")
                self.fs.put_file(str(staging / record_name(rank)), f"{remote}/{record_name(rank)}")
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
            with self._io(f"waiting for the parts of {ref.name}"):
                try:
                    present = [k.rsplit("/", 1)[-1] for k in self.fs.ls(remote, detail=False, refresh=True)]
                except FileNotFoundError:
                    return found
                for name in present:
                    if name in wanted:
                        with contextlib.suppress(ValueError, FileNotFoundError):
                            found[wanted[name]] = json.loads(self.fs.cat_file(f"{remote}/{name}")[:4096])
            return found

        return {"records_of": records_of, "poll_s": 0.05}

    def publish(self, staging: Path, ref: SnapshotRef, entries_synced: bool = False) -> None:
        """Upload ``staging``'s files under ``ref``'s name, then create its ``meta.json``; the local copy goes."""
        del entries_synced  # the upload is what makes it durable
        remote = f"{self.prefix}/{ref.name}"
        files = sorted(p for p in staging.iterdir() if p.is_file() and p.name != META and not p.name.startswith("."))
        with self._io(f"uploading {ref.name}"):
            if self.fs.exists(f"{remote}/{META}"):
                raise AlreadyCommittedError(f"{ref.name} was already published")
            if files:
                self.fs.put([str(p) for p in files], [f"{remote}/{p.name}" for p in files])
        if not self._create(f"{remote}/{META}", (staging / META).read_bytes()):
            raise AlreadyCommittedError(f"{ref.name} was already published")
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
        try:
            return json.loads(self.fs.cat_file(f"{self.prefix}/generations/{generation:06d}"))
        except Exception:  # noqa: BLE001 - only for a message
            return {}

    def check_fence(self, generation: int) -> None:
        newest = self.newest_generation()
        if newest > generation:
            raise fence_error(generation, newest, self.generation_info(newest), self.location)


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
