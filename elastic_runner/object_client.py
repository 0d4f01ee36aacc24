"""The client side of an object store: one fsspec filesystem per process and credentials, set to fail fast; its
warm-up; the node's private directory for a bucket's staging copies and read cache; and what the store's error
answers mean (credentials refused, an object that already exists, a missing bucket).

On the ground floor, apart from :mod:`.snapshot.object_store` (the snapshot contract), because the run's records
(:mod:`~elastic_runner.observe.records`), the data sources in a bucket (:mod:`~elastic_runner.data.shards`) and the
worker's start (:func:`prewarm`) use it too.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import os
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlsplit

from .files import private_dir

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


def prewarm(location: str) -> threading.Thread:
    """Create the store's client in the background (a worker calls this before its process group is up, so the
    attempt's first request to the store does not pay for it); errors are left for the real requests to report.
    Returns the thread (a caller need not wait for it)."""
    def warm() -> None:
        with contextlib.suppress(Exception):
            fs, _ = open_filesystem(location)
            connect = getattr(fs, "set_session", None)
            if connect is None:
                return
            if inspect.iscoroutinefunction(connect):  # s3fs's: on the filesystem's own event loop, as its calls run
                from fsspec.asyn import sync

                sync(fs.loop, connect)
            else:
                connect()

    thread = threading.Thread(target=warm, name="object-store-warmup", daemon=True)
    thread.start()
    return thread


def default_local(location: str) -> Path:
    """This user's private directory on this node for one object-store location (staging and read cache) where the
    caller names none: ``$TMPDIR/elastic-runner-objects-<uid>/<digest of the URL>``."""
    base = private_dir(Path(tempfile.gettempdir()) / f"elastic-runner-objects-{os.getuid()}")
    return private_dir(base / hashlib.sha256(location.encode()).hexdigest()[:16])


def is_refusal(exc: BaseException) -> bool:
    """The store refused these credentials: gcsfs turns HTTP 403 into ``OSError("Forbidden: ...")`` and 401 into
    its ``HttpError`` with ``code`` 401 (S3's answers arrive as ``PermissionError`` from s3fs)."""
    if type(exc).__name__ == "HttpError" and getattr(exc, "code", None) == 401:
        return True
    return type(exc) is OSError and str(exc).startswith("Forbidden: ")


def answer_codes(exc: BaseException) -> Iterator[tuple[Any, Any]]:
    """(error code, HTTP status) of every structured store answer in ``exc``'s chain: botocore's ``response``
    (``Error.Code``, ``ResponseMetadata.HTTPStatusCode``) and gcsfs's ``HttpError.code``."""
    seen: BaseException | None = exc
    while seen is not None:
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            yield (response.get("Error") or {}).get("Code"), (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        if type(seen).__name__ == "HttpError":
            yield None, getattr(seen, "code", None)
        seen = seen.__cause__ or seen.__context__


def is_missing_bucket(exc: BaseException, fs: Any = None, bucket: str = "") -> bool:
    """Whether a "not found" means the bucket, not an object or an empty prefix. Decided from the answer's code (S3's
    ``NoSuchBucket``), else, given ``fs``, from asking for the bucket itself (a listing's 404 from GCS is not
    specific); never from a message's words: an empty prefix's ``FileNotFoundError`` says its path, and a bucket may
    be called ``my-bucket``. A refused or failed question is not "missing": the request's own error says the rest."""
    if any(code == "NoSuchBucket" for code, _ in answer_codes(exc)):
        return True
    if fs is None:
        return False
    try:
        fs.info(bucket)
    except FileNotFoundError:
        return True
    except Exception:  # noqa: BLE001 - a policy that grants only the prefix may refuse the bucket's own answer
        return False
    return False


def is_precondition_failure(exc: BaseException) -> bool:
    """The store refused a create because the object exists: S3's ``PreconditionFailed`` (HTTP 412) in botocore's
    structured error, GCS's HTTP 412, or fsspec's ``FileExistsError`` — never a guess from a message's text (a
    connection error's message carries the object's URL, whose name may hold "412")."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, FileExistsError):
            return True
        seen = seen.__cause__ or seen.__context__
    return any(code in ("PreconditionFailed", "412") or status == 412 for code, status in answer_codes(exc))
