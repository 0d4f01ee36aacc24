"""A state's tensors in one shared-memory arena, for a writer in another process.

The training process copies every tensor of a captured state into an anonymous shared-memory file
(``memfd``: nothing under /dev/shm to leak when a worker is SIGKILLed, nobody else can open it) and
sends the writer process the state's *skeleton*: the same containers, with each tensor replaced by
a :class:`Slot` naming its place in the arena. The writer maps the arena and rebuilds the tensors as
views of it, so the bytes are copied once (into the arena), not pickled through a pipe.

The skeleton travels between a worker and the writer process it started, over a private socket
pair: pickle is safe there (both ends are this program, the same user, no file or network hop).
"""

from __future__ import annotations

import logging
import mmap
import os
import pickle
import socket
import struct
import threading
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch

from .staging import SIDE_STREAM, Copier, Pending, copy_into

log = logging.getLogger(__name__)

#: Each tensor starts at a multiple of this (a cache line; every dtype's alignment divides it).
ALIGN = 64
#: An arena grows to the state's size rounded up to this, so a state that grows a little reuses it.
GRANULE = 1 << 20


class Slot(NamedTuple):
    """Where a tensor lives in the arena (its place in the skeleton)."""

    offset: int
    nbytes: int
    dtype: str  #: e.g. "float32": torch's attribute name
    shape: tuple[int, ...]


@dataclass
class Plan:
    """A captured state split into a skeleton (containers and :class:`Slot` markers) and the live tensors
    that fill the slots, in order."""

    skeleton: Any
    sources: list[torch.Tensor]
    slots: list[Slot]
    total: int


def supported() -> bool:
    """memfd exists (Linux); elsewhere the writer keeps its thread."""
    return hasattr(os, "memfd_create")


def plan(state: Any) -> Plan:
    """Lay out every strided tensor of ``state`` in one arena. Other tensors (sparse, quantized, empty)
    stay in the skeleton as they are: rare, and pickled whole."""
    sources: list[torch.Tensor] = []
    slots: list[Slot] = []
    offset = 0

    def walk(obj: Any) -> Any:
        nonlocal offset
        if isinstance(obj, torch.Tensor):
            src = obj.detach()
            if src.layout != torch.strided or src.is_quantized or src.numel() == 0 or src.is_meta:
                return src.to("cpu", copy=True)
            nbytes = src.numel() * src.element_size()
            slot = Slot(offset, nbytes, str(src.dtype).removeprefix("torch."), tuple(src.shape))
            offset += -(-nbytes // ALIGN) * ALIGN
            sources.append(src)
            slots.append(slot)
            return slot
        if isinstance(obj, dict):
            return {k: walk(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        if isinstance(obj, tuple) and not isinstance(obj, Slot):
            return tuple(walk(v) for v in obj)
        return obj

    skeleton = walk(state)
    return Plan(skeleton, sources, slots, offset)


class Arena:
    """An anonymous shared-memory file and its mapping. Tensors made by :meth:`view` do not keep the
    mapping alive (``torch.frombuffer`` holds no reference): the arena must outlive them, so it is closed
    only by its owner once no write uses it."""

    def __init__(self, size: int, fd: int | None = None) -> None:
        self.size = max(GRANULE, -(-size // GRANULE) * GRANULE) if fd is None else size
        if fd is None:
            fd = os.memfd_create("elastic-runner-snapshot", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, self.size)
            except OSError:
                os.close(fd)
                raise
        self.fd: int | None = fd
        self.mm = mmap.mmap(fd, self.size)
        self.pinned = False
        self._pin_failed = False
        self._device = 0
        self._views: dict[Slot, torch.Tensor] = {}

    def view(self, slot: Slot) -> torch.Tensor:
        """The tensor at ``slot`` (kept: a state has the same layout from one snapshot to the next)."""
        view = self._views.get(slot)
        if view is None:
            flat = torch.frombuffer(self.mm, dtype=torch.uint8, count=slot.nbytes, offset=slot.offset)
            view = self._views[slot] = flat.view(getattr(torch, slot.dtype)).view(slot.shape)
        return view

    def pin(self, device: int | None = None) -> bool:
        """Page-lock the arena for fast device-to-host copies, as DCP pins its shared staging buffers
        (``cudaHostRegisterPortable``); pageable memory (slower copies) where that fails, tried once."""
        if self.pinned or self._pin_failed or not torch.cuda.is_available():
            return self.pinned
        self._device = torch.cuda.current_device() if device is None else device  # (another thread: say which)
        ptr = torch.frombuffer(self.mm, dtype=torch.uint8).data_ptr()
        code = _cuda_call(self._device, lambda cudart: cudart.cudaHostRegister(ptr, self.size, 1))
        self.pinned = code == 0
        if not self.pinned:
            self._pin_failed = True
            log.warning("could not page-lock the %.1f MB snapshot arena (%s); device-to-host copies go through "
                        "pageable memory", self.size / 1e6, code if isinstance(code, Exception) else f"cudaError {code}")
        return self.pinned

    def close(self) -> None:
        if self.pinned:
            ptr = torch.frombuffer(self.mm, dtype=torch.uint8).data_ptr()
            _cuda_call(self._device, lambda cudart: cudart.cudaHostUnregister(ptr))
            self.pinned = False
        self._views.clear()
        self.mm.close()
        self.release_fd()

    def release_fd(self) -> None:
        """The mapping stays; the descriptor is needed only until the writer process has its own."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _cuda_call(device: int, call: Callable[[Any], Any]) -> int | Exception:
    """``call(torch.cuda.cudart())``'s status code, run in a thread of its own: a failed runtime call
    leaves the CUDA runtime's per-thread last error set, which torch would raise at the training thread's
    next kernel launch, against an unrelated kernel."""
    outcome: list[int | Exception] = []

    def run() -> None:
        try:
            torch.cuda.set_device(device)  # this rank's device, not a new context on device 0
            outcome.append(int(call(torch.cuda.cudart())))
        except (RuntimeError, AttributeError) as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, name="snapshot-arena-cuda", daemon=True)
    thread.start()
    thread.join()
    return outcome[0] if outcome else RuntimeError("the CUDA call ended without a status")


def stage(arena: Arena, plan_: Plan, *, deferred: bool = False, copier: Copier = SIDE_STREAM) -> Pending | None:
    """Copy the live tensors into their slots (from any device; one call for them all: a small model's twenty tensors
    one by one cost more in Python than in copying). ``deferred``: a GPU's tensors are copied on a side stream and
    this returns what is under way (:mod:`.staging`)."""
    targets = [arena.view(slot) for slot in plan_.slots]
    return copy_into(targets, plan_.sources, deferred=deferred, copier=copier)


def rebuild(skeleton: Any, arena: Arena) -> Any:
    """The state with every :class:`Slot` replaced by a view of ``arena`` (writer side)."""
    if isinstance(skeleton, Slot):
        return arena.view(skeleton)
    if isinstance(skeleton, dict):
        return {k: rebuild(v, arena) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [rebuild(v, arena) for v in skeleton]
    if isinstance(skeleton, tuple):
        return tuple(rebuild(v, arena) for v in skeleton)
    return skeleton


# -- messages over the private socket pair: a length, a pickle, and at most one descriptor -------------------

_HEADER = struct.Struct("!Q")


def send(sock: socket.socket, message: Any, fd: int | None = None) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    header = _HEADER.pack(len(data))
    if fd is None:
        sock.sendall(header + data)
    else:
        socket.send_fds(sock, [header], [fd])
        sock.sendall(data)


def receive(sock: socket.socket) -> tuple[Any, int | None]:
    """The next message and the descriptor that came with it; ``EOFError`` when the peer is gone."""
    header, fds, _flags, _addr = socket.recv_fds(sock, _HEADER.size, 1)
    if not header:
        raise EOFError("the peer closed the socket")
    header += _read_exactly(sock, _HEADER.size - len(header))
    (length,) = _HEADER.unpack(header)
    message = pickle.loads(_read_exactly(sock, length))
    return message, (fds[0] if fds else None)


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise EOFError("the peer closed the socket mid-message")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)
