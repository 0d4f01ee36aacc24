"""The port an agent offers as MASTER_PORT, held from the offer until the workers bind it.

A port found free and released at once (torch's ``get_free_port``) can be taken by any other local user before
rank 0's worker binds it, much later: that user's process would then receive the job's store traffic. Instead the
agent keeps a socket bound to the port with ``SO_REUSEPORT`` (and not ``SO_REUSEADDR``), not listening: Linux then
lets another socket bind the port only if it sets ``SO_REUSEPORT`` too *and* belongs to the same user — this
agent's own worker (:func:`elastic_runner.worker.group.up` binds it that way), nobody else. The socket is
dual-stack IPv6 where the host has IPv6 (one hold covers both families), else IPv4.

A worker program that is not ours binds the port the plain way, which the hold would refuse: for those the agent
lets the port go when its round begins, as torch does; :func:`hold_for_our_workers` (called by the agent set-up
when the program is ``-m elastic_runner.train``) keeps it held.
"""

from __future__ import annotations

import contextlib
import socket
import threading


def reuseport_socket(port: int = 0) -> socket.socket:
    """A TCP socket bound to ``port`` (0: any free one) on every address with ``SO_REUSEPORT`` and not
    ``SO_REUSEADDR``: dual-stack IPv6 where the host has IPv6, else IPv4. The agent's hold and rank 0's store (which
    shares the held port) are both made here. ``OSError`` where that is not possible."""
    reuse_port = getattr(socket, "SO_REUSEPORT", None)
    if reuse_port is None:  # pragma: no cover - not Linux
        raise OSError("SO_REUSEPORT is not available")
    return every_address_socket(port, reuse_port=True)


def every_address_socket(port: int = 0, reuse_port: bool = False) -> socket.socket:
    """A TCP socket bound to ``port`` (0: any free one) on every address of this host, not inherited by a new program:
    dual-stack IPv6 where the host has IPv6, else IPv4; with ``SO_REUSEPORT`` where asked. ``OSError`` where that is
    not possible."""
    try:
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        address: tuple[str, int] = ("::", port)
    except OSError:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        address = ("0.0.0.0", port)
    try:
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.set_inheritable(False)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


_ours = threading.Event()


def hold_for_our_workers() -> None:
    """This agent's workers are ours (they bind MASTER_PORT with ``SO_REUSEPORT``): keep offered ports held."""
    _ours.set()


class PortHold:
    """The port this agent offers now, held (one at a time: a new offer lets the previous one go)."""

    def __init__(self) -> None:
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def offer(self) -> int:
        """A new port, held from now on."""
        with self._lock:
            self._close()
            try:
                self._sock = reuseport_socket()
                return int(self._sock.getsockname()[1])
            except OSError:  # no SO_REUSEPORT: torch's way (found free, then released)
                from torch.distributed.elastic.utils.distributed import get_free_port

                return int(get_free_port())

    def round_begins(self) -> None:
        """The round is sealed: workers that are not ours bind the port themselves; let it go for them."""
        if not _ours.is_set():
            self.release()

    def release(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None
