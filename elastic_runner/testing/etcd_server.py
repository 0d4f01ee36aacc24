"""A local etcd server for tests, benchmarks and the chaos tool: start, stop, kill, restart.

One ``EtcdServer`` is one single-member etcd on loopback with its own data directory and free
ports chosen at start. ``restart()`` keeps the data directory and the ports, which is what an etcd
restart (or a pod rescheduled with its volume) looks like to clients. The process is started in
its own session (signals to the caller's process group do not reach it), ended by its PID only,
and by default killed by the kernel if its starter dies without stopping it.

Settings chosen for local use: short heartbeat/election timeouts (a single member elects itself in
well under a second and leases can be as short as one second), revision-based auto-compaction
(the rendezvous state is rewritten by every heartbeat and etcd keeps each revision until it is
compacted), and the v2 API off (nothing here needs it).

``ensure_installed()`` finds the ``etcd`` binary or, when running as root on Debian/Ubuntu,
installs the ``etcd-server`` package non-interactively.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

from ..lifecycle import child_dies_with_starter
from . import debian
from .localjob import free_port
from .server_process import ServerProcess


@dataclass(frozen=True)
class ServerTLS:
    """Server-side TLS. ``ca`` signed ``cert``; with ``client_cert_auth`` etcd also demands client
    certificates signed by ``ca``, and ``client_cert``/``client_key`` are used for its health checks."""

    cert: str
    key: str
    ca: str
    client_cert_auth: bool = False
    client_cert: str | None = None
    client_key: str | None = None


def find_binary() -> str | None:
    return shutil.which("etcd") or next((p for p in ("/usr/bin/etcd", "/usr/local/bin/etcd") if os.access(p, os.X_OK)),
                                        None)


def ensure_installed(timeout: float = 600) -> str:
    """Path of the etcd binary; installs Debian's ``etcd-server`` first when missing and running as root."""
    found = find_binary()
    if found:
        return found
    if not debian.can_install():
        raise RuntimeError("etcd is not installed. Install it (Debian/Ubuntu: 'apt-get install -y etcd-server'; or a "
                           "release binary from github.com/etcd-io/etcd) so that 'etcd' is on PATH.")
    result = debian.apt_install("etcd-server", timeout=timeout)
    found = find_binary()
    if result.returncode != 0 or not found:
        raise RuntimeError(f"Installing etcd-server with apt-get failed (exit {result.returncode}): "
                           f"{result.stdout[-1500:]}{result.stderr[-1500:]}")
    return found


@dataclass
class EtcdServer(ServerProcess):
    """One local etcd member; see the module docstring. Use as a context manager to always stop it."""

    data_dir: Path
    host: str = "127.0.0.1"
    client_port: int = 0
    peer_port: int = 0
    tls: ServerTLS | None = None
    binary: str | None = None
    log_path: Path | None = None
    name: str = "er-etcd"
    #: SIGKILL etcd when its starter's process dies without stopping it (a crash, a hard-killed test
    #: run). The kernel ties this to the starting *thread*, so it applies only to starts from the main
    #: thread (a restart from a short-lived thread would otherwise kill etcd when that thread ends).
    die_with_parent: bool = True
    proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    auth: tuple[str, str] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir)
        self.log_path = Path(self.log_path) if self.log_path else self.data_dir.with_name(self.data_dir.name + ".log")

    # -- addresses ----------------------------------------------------------------------------------------------

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    @property
    def endpoint(self) -> str:
        """``host:port`` for ``--rdzv_endpoint`` (add ``https://`` or set ``cacert`` for a TLS server)."""
        return f"{self.host}:{self.client_port}"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.client_port}"

    # -- life cycle ------------------------------------------------------------------------------------------------

    def command(self) -> list[str]:
        peer = f"http://{self.host}:{self.peer_port}"
        cmd = [
            self.binary or ensure_installed(), "--name", self.name, "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"{self.name}={peer}", "--initial-cluster-state", "new",
            "--heartbeat-interval", "50", "--election-timeout", "500",
            "--auto-compaction-mode", "revision", "--auto-compaction-retention", "1000",
            "--enable-v2=false", "--logger", "zap", "--log-outputs", "stderr", "--log-level", "warn",
        ]
        if self.tls:
            cmd += ["--cert-file", self.tls.cert, "--key-file", self.tls.key]
            if self.tls.client_cert_auth:
                cmd += ["--trusted-ca-file", self.tls.ca, "--client-cert-auth"]
        return cmd

    def start(self, timeout: float = 20.0) -> "EtcdServer":
        if self.running():
            return self
        fresh_ports = not self.client_port
        for attempt in range(3):
            if fresh_ports:
                self.client_port, self.peer_port = free_port(), free_port()
            self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            assert self.log_path is not None
            cmd = self.command()
            with open(self.log_path, "ab") as log:
                log.write(f"--- start {time.strftime('%H:%M:%S')}: {' '.join(cmd)}\n".encode())
                log.flush()
                self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True,
                                             preexec_fn=child_dies_with_starter if self._tie_to_parent() else None)
            try:
                self._wait_healthy(timeout)
                return self
            except RuntimeError:
                self.kill()
                if fresh_ports and attempt < 2 and "address already in use" in self.log_tail():
                    continue  # another process took a port we chose; pick new ones
                raise
        raise AssertionError("unreachable: every attempt returns or raises")

    def _tie_to_parent(self) -> bool:
        return self.die_with_parent and threading.current_thread() is threading.main_thread()

    def _session(self) -> requests.Session:
        s = requests.Session()
        s.trust_env = False  # REQUESTS_CA_BUNDLE would otherwise override ``verify``
        if self.tls:
            s.verify = self.tls.ca
            if self.tls.client_cert and self.tls.client_key:
                s.cert = (self.tls.client_cert, self.tls.client_key)
        return s

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._session() as s:
            while time.monotonic() < deadline:
                if not self.running():
                    raise RuntimeError(f"etcd exited with status {self.proc.poll() if self.proc else None} during "
                                       f"start:\n{self.log_tail()}")
                with contextlib.suppress(requests.RequestException, ValueError):
                    if self.auth:
                        if s.get(self.url + "/version", timeout=1).ok:
                            time.sleep(0.5)  # /health needs a token once auth is on; give the election a moment
                            return
                    elif s.get(self.url + "/health", timeout=1).json().get("health") == "true":
                        return
                time.sleep(0.05)
        raise RuntimeError(f"etcd did not become healthy at {self.url} within {timeout:.0f} s:\n{self.log_tail()}")

    def restart(self, down_seconds: float = 0.0, crash: bool = False, timeout: float = 20.0) -> None:
        """Stop (or crash) and start again on the same data directory and ports."""
        self.kill() if crash else self.stop()
        if down_seconds > 0:
            time.sleep(down_seconds)
        self.start(timeout)

    # -- administration --------------------------------------------------------------------------------------------

    def enable_auth(self, user: str, password: str) -> None:
        """Turn on etcd's authentication with ``user`` as the root user (full access)."""
        def call(s: requests.Session, path: str, body: dict[str, object]) -> None:
            r = s.post(f"{self.url}/v3/auth/{path}", json=body, timeout=5)
            if not r.ok:
                raise RuntimeError(f"etcd auth setup step {path} failed: HTTP {r.status_code} {r.text}")

        with self._session() as s:
            call(s, "role/add", {"name": "root"})
            call(s, "user/add", {"name": user, "password": password})
            call(s, "user/grant", {"user": user, "role": "root"})
            call(s, "enable", {})
        self.auth = (user, password)
