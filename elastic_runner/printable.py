"""Text that others wrote, made fit for one of our lines (a log line, an error, an exit or termination message).

A value read from a place another party can write (the run directory, a bucket, etcd, the job's store) may hold a
newline, which would forge a line of its own in the log or in ``elastic-runner report``, a control character, which
would move a terminal's cursor, or a lone surrogate (JSON's ``"\\udfff"``), which a strict UTF-8 stream (stdout, a
file) refuses to encode, so the line that says what is wrong would fail. :func:`printable` keeps every printable
character, in any script, and writes the others as Python escapes (``\\n``, ``\\x1b``, ``\\udfff``).
"""

from __future__ import annotations

__all__ = ["printable"]


def printable(value: object, limit: int = 200) -> str:
    """``str(value)``, its first ``limit`` characters, each one that is not printable written as its escape."""
    text = str(value)
    cut = len(text) > limit
    text = text[:limit]
    if not text.isprintable():
        text = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)
    return text + ("…" if cut else "")
