"""What the local servers of the tests (etcd, an S3 server) share: one process, ended by its PID only.

A subclass is a dataclass with ``proc`` (the server's ``Popen``, None before it started), ``log_path`` and a
``start()`` that returns the server once it serves.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any


class ServerProcess:
    """Stop (SIGTERM, then SIGKILL), crash-stop (SIGKILL), running, pid, log tail; a context manager that always
    stops it."""

    proc: subprocess.Popen[bytes] | None
    log_path: Path | None

    def start(self) -> Any:  # pragma: no cover - every server defines its own
        raise NotImplementedError

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """Graceful stop (SIGTERM, then SIGKILL after ``timeout``)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc.wait()

    def kill(self) -> None:
        """Crash stop (SIGKILL); a no-op once it has been reaped."""
        if self.proc is None:
            return
        self.proc.kill()
        self.proc.wait()

    def __enter__(self) -> Any:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:] if self.log_path else ""
        except OSError:
            return ""
