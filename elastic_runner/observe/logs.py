"""Logging set-up and progress output.

All ranks log warnings and errors (prefixed with their rank); progress lines,
the progress bar and other chatter come from rank 0 only (the logger level of
other ranks is WARNING, and the step's bookkeeping writes progress on rank 0),
so that N workers do not print N copies. Every line goes
out in one write (:func:`say`, logging's handler, :class:`Progress`), so the
lines of ranks that share a terminal never interleave mid-line.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, TextIO, TypeVar

T = TypeVar("T")


def say(text: str, stream: TextIO | None = None) -> None:
    """One line to the terminal in one write: the workers of a node share its stdout and stderr, and
    ``print`` writes the text and its newline separately (unbuffered, under ``PYTHONUNBUFFERED`` or
    torchrun's ``-u``), so another rank's line could land between them. A write of up to PIPE_BUF (4 KiB)
    bytes to a pipe is atomic."""
    stream = sys.stderr if stream is None else stream
    stream.write(text + "\n")
    stream.flush()


def setup_logging(level: str, rank: int, world_size: int) -> None:
    fmt = f"%(asctime)s [rank {rank}/{world_size}] %(levelname)s %(name)s: %(message)s"
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(fmt, datefmt="%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    # Non-zero ranks only speak up for warnings: one copy of the progress is enough.
    logging.getLogger("elastic_runner").setLevel(level if rank == 0 else max(logging.WARNING, logging.getLevelName(level)))


class Progress:
    """A progress bar on a terminal, one structured line per N steps otherwise."""

    def __init__(self, total_steps: int, every: int, fmt: str, bar: str, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout
        self.total = total_steps
        self.every = every
        self.fmt = fmt
        tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.bar = bar == "on" or (bar == "auto" and tty)
        self._last_bar = 0.0

    def line(self, fields: dict[str, Any]) -> None:
        if self.bar:
            self._clear()
        if self.fmt == "json":
            text = json.dumps(fields, separators=(",", ":"))
        else:
            text = " ".join(f"{k}={_fmt(v)}" for k, v in fields.items())
        self.stream.write(text + "\n")
        self.stream.flush()

    def tick(self, step: int, loss: float | None, rate: float | None) -> None:
        if not self.bar:
            return
        now = time.monotonic()
        if now - self._last_bar < 0.2 and step < self.total:
            return
        self._last_bar = now
        width = 30
        done = int(width * step / max(1, self.total))
        extra = f" loss {loss:.4f}" if loss is not None else ""
        extra += f" {rate:,.0f} samples/s" if rate else ""
        self.stream.write(f"\r[{'#' * done}{'.' * (width - done)}] {step}/{self.total}{extra}")
        self.stream.flush()

    def close(self) -> None:
        if self.bar:
            self.stream.write("\n")
            self.stream.flush()

    def _clear(self) -> None:
        self.stream.write("\r\033[K")


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}" if abs(value) < 1e5 else f"{value:.0f}"
    return str(value)
