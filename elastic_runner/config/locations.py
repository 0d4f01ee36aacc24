"""Where a run may keep what it shares: a directory, or an object-store URL this installation can write to.

Checked when the config is read (no network): an unknown scheme, credentials in the URL, no bucket, or the
scheme's fsspec module missing is one line naming the key and the fix, before anything starts.
"""

from __future__ import annotations

import importlib.util
from urllib.parse import urlsplit

#: URL scheme -> (the fsspec module that serves it, the pip extra that installs that module).
SCHEMES = {"s3": ("s3fs", "s3"), "gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs")}


def is_url(location: str) -> bool:
    """An object-store URL (``file://`` is a directory)."""
    return "://" in location and not location.startswith("file://")


def location_problem(location: str) -> tuple[str, str] | None:
    """``(problem, fix)`` if ``location`` cannot work here, else None."""
    if not is_url(location):
        return None
    parts = urlsplit(location)
    scheme = parts.scheme.lower()
    if "@" in parts.netloc:  # never repeat what may be a secret
        location = location.replace(parts.netloc, "***@" + parts.netloc.rsplit("@", 1)[1], 1)
    if scheme not in SCHEMES:
        known = ", ".join(f"{s}://" for s in SCHEMES)
        return (f"{location!r} has the scheme {scheme}://, which elastic_runner cannot write to",
                f"Use a directory (or file://PATH), or one of {known}")
    if "@" in parts.netloc:
        return (f"{location!r} carries credentials",
                "Remove them from the URL and give them the usual way (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or "
                "AWS_PROFILE, a pod or instance role; GOOGLE_APPLICATION_CREDENTIALS or workload identity): never "
                "in a config file")
    if not parts.netloc:
        return f"{location!r} names no bucket", f"Write {scheme}://BUCKET/PREFIX"
    if parts.query or parts.fragment:
        return f"{location!r} has a query or fragment", f"Write {scheme}://BUCKET/PREFIX"
    module, extra = SCHEMES[scheme]
    if importlib.util.find_spec(module) is None:
        return (f"{location!r} needs the {module} package, which is not installed",
                f"pip install 'elastic-runner[{extra}]' (or pip install {module})")
    return None
