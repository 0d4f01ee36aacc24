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


#: The bar: where the job is, its epoch, and the loss and rate of the last logging step, then elapsed < ETA.
BAR_FORMAT = "{desc}{percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} steps [{elapsed}<{remaining}{postfix}]"

#: The bar this process shows, if any: a new attempt in the same process (in-process recovery) ends the last one's.
_shown: list["Progress"] = []


class Progress:
    """Where training is, and when it will end: a progress bar on a terminal, a line every N steps otherwise.

    The bar is tqdm's (a maintained library: rate smoothing, terminal width, and lines written *above* the bar
    instead of through it): steps done of the total, the epoch, the loss and samples/s (tokens/s for a language
    model) of the last logging step, elapsed time and the ETA to the end of training. While it shows, log records
    and notes (the failure story of a recovery) are written above it, never into it, and the per-N-steps lines are
    left to the event log: the bar holds the same fields. Without a terminal, each line carries ``step=N/TOTAL``
    and ``eta=`` (``eta_s`` in JSON). Nothing here reads a device tensor: the loss comes from logging steps.
    """

    def __init__(self, total_steps: int, first_step: int, every: int, fmt: str, bar: str,
                 stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout
        self.total = total_steps
        self.every = every
        self.fmt = fmt
        tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.bar = bar == "on" or (bar == "auto" and tty)
        self._tqdm: Any = None
        self._redirect: Any = None
        if self.bar:
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            for earlier in list(_shown):
                earlier.close()
            # A worker that died mid-bar left its line unfinished: start on a clean one.
            self.stream.write("\r\033[K")
            self._tqdm = tqdm(total=total_steps, initial=first_step, file=self.stream, bar_format=BAR_FORMAT,
                              dynamic_ncols=True, mininterval=0.2, smoothing=0.1, leave=True)
            self._redirect = logging_redirect_tqdm()  # the root logger's records, above the bar
            self._redirect.__enter__()
            _shown.append(self)

    def tick(self, step: int) -> None:
        if self._tqdm is not None and step > self._tqdm.n:
            self._tqdm.update(step - self._tqdm.n)

    def report(self, fields: dict[str, Any]) -> None:
        """A logging step's fields (``step``, ``epoch``, ``loss``, ``samples_per_s``, ``eta_s``...): on the bar, or as
        a line with the total and the ETA."""
        if self._tqdm is None:
            self.line(fields | {"total_steps": self.total}, progress=True)
            return
        shown = (f"{fields['tokens_per_s']:,.0f} tokens/s" if "tokens_per_s" in fields else
                 f"{fields.get('samples_per_s') or 0.0:,.0f} samples/s")
        self._tqdm.set_description_str(f"epoch {fields['epoch']} ", refresh=False)
        loss = f"loss {fields['loss']:.4g}" if "loss" in fields else "no step trained (skipped by rule)"
        self._tqdm.set_postfix_str(f"{loss}, {shown}", refresh=False)
        self.tick(int(fields["step"]))
        self._tqdm.refresh()

    def line(self, fields: dict[str, Any], progress: bool = False) -> None:
        """One line of fields (an evaluation's results; with ``progress``, a logging step's)."""
        if self.fmt == "json":
            text = json.dumps(fields, separators=(",", ":"))
        else:
            shown = dict(fields)
            if progress:
                total = shown.pop("total_steps")
                shown["step"] = f"{shown['step']}/{total}"
                eta = shown.pop("eta_s", None)
                if eta is not None:
                    shown["eta"] = _interval(eta)
            text = " ".join(f"{k}={_fmt(v)}" for k, v in shown.items())
        self.note(text)

    def note(self, text: str) -> None:
        """A line for the terminal: above the bar while one shows."""
        if self._tqdm is not None:
            self._tqdm.write(text, file=self.stream)
        else:
            self.stream.write(text + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()
            self._tqdm = None
        if self._redirect is not None:
            self._redirect.__exit__(None, None, None)
            self._redirect = None
        if self in _shown:
            _shown.remove(self)


def _interval(seconds: float) -> str:
    """``1:06:40``, ``01:23``: how long, as the bar shows it."""
    from tqdm import tqdm

    return tqdm.format_interval(max(0.0, seconds))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}" if abs(value) < 1e5 else f"{value:.0f}"
    return str(value)
