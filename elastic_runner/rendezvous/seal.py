"""What crosses etcd is checked before anything trusts it: signatures, size, and what a pickle may build.

etcd is a shared service; whoever can write the run's keys must not be able to run code in an agent
or steer the job. Three layers:

- **A restricted unpickler, always.** torch's rendezvous handler ``pickle.loads`` the state it reads
  from the backend. Before our backend hands it over, the exact bytes are unpickled here with an
  unpickler that admits only the classes a rendezvous state holds (``_RendezvousState``,
  ``_NodeDesc``, ``datetime``'s); anything else — a ``__reduce__`` that calls ``os.system`` — is
  refused and nothing runs.
- **Bounded decompression, always.** A state is at most :data:`MAX_STATE_BYTES` once decompressed
  (a real one of 1,024 nodes is ~200 KB): a 1.5 MiB value that would inflate to gigabytes is refused
  after reading at most that much.
- **Signatures, with a key.** With ``auth_key_file`` in ``--rdzv_conf`` (the same secret on every
  node), every state and every store value is signed with HMAC-SHA256 over its etcd key and its
  bytes, and refused unless the signature verifies — checked before decompressing. A writer without
  the key can neither plant a state, nor change one, nor move a signed value to another key.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import os
import pickle
import stat
import zlib
from pathlib import Path
from typing import Any

from ..printable import printable

#: The largest rendezvous state accepted, decompressed.
MAX_STATE_BYTES = 16 << 20
#: The shortest key accepted: 32 bytes, e.g. ``openssl rand -hex 32`` (64 hex characters).
MIN_KEY_BYTES = 32

_VALUE_MAGIC = b"ERS1"
#: How every signed value begins (an agent without the key recognises a keyed run by it).
SIGNED_MAGIC = _VALUE_MAGIC
_TAG = 32  # HMAC-SHA256


class AuthError(Exception):
    """A value read from etcd is not signed with this job's key (or the key is missing)."""


class StateContentError(Exception):
    """A state holds something other than a rendezvous state, or is too large."""


def read_key(path: str) -> bytes:
    """The job's secret from a file (its first line, stripped); refuses short keys."""
    data = Path(path).read_bytes().strip()
    if len(data) < MIN_KEY_BYTES:
        raise ValueError(f"The rendezvous key in '{path}' has {len(data)} bytes; use at least {MIN_KEY_BYTES} "
                         "random ones, e.g. 'openssl rand -hex 32 > FILE', the same file on every node.")
    return data


def loose_permissions(path: str) -> str | None:
    """A warning when a secret file is open to every user of the machine, else None.

    Group access is accepted: Kubernetes mounts a Secret for a non-root container as ``0440`` with
    the pod's ``fsGroup``, which is how the shipped manifests hand over keys.
    """
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if mode & stat.S_IRWXO:
        return (f"'{path}' holds a secret but every user of this machine may read or change it "
                f"(mode {stat.S_IMODE(mode):04o}); run 'chmod 600 {path}'.")
    return None


class Sealer:
    """Signs and checks values under the job's key; without a key it passes values through."""

    def __init__(self, key: bytes | None) -> None:
        self._key = key

    @property
    def enabled(self) -> bool:
        return self._key is not None

    def tag(self, etcd_key: bytes, data: bytes) -> bytes:
        assert self._key is not None
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        mac.update(len(etcd_key).to_bytes(4, "big") + etcd_key)
        mac.update(data)
        return mac.digest()

    def seal(self, etcd_key: bytes, value: bytes) -> bytes:
        if self._key is None:
            return value
        return _VALUE_MAGIC + self.tag(etcd_key, value) + value

    def open(self, etcd_key: bytes, blob: bytes) -> bytes:
        """The value of a sealed blob; :class:`AuthError` if it is not signed with this key."""
        if self._key is None:
            return blob
        if not blob.startswith(_VALUE_MAGIC) or len(blob) < len(_VALUE_MAGIC) + _TAG:
            raise AuthError("it is not signed (written by an agent without the job's key, or by something else)")
        tag, value = blob[len(_VALUE_MAGIC):len(_VALUE_MAGIC) + _TAG], blob[len(_VALUE_MAGIC) + _TAG:]
        if not hmac.compare_digest(tag, self.tag(etcd_key, value)):
            raise AuthError("its signature does not verify (another key, or the value was changed)")
        return value


def inflate(payload: bytes, limit: int = MAX_STATE_BYTES) -> bytes:
    """zlib-decompress at most ``limit`` bytes; :class:`StateContentError` beyond that."""
    inflater = zlib.decompressobj()
    try:
        data = inflater.decompress(payload, limit + 1)
    except zlib.error as exc:
        raise StateContentError(f"it does not decompress ({exc})") from exc
    if len(data) > limit or inflater.unconsumed_tail:
        raise StateContentError(f"it decompresses to more than {limit >> 20} MiB, far more than any rendezvous state")
    return data


_STATE_CLASSES = {
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_RendezvousState"),
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_NodeDesc"),
    ("datetime", "datetime"), ("datetime", "timezone"), ("datetime", "timedelta"),
}


class _StateUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _STATE_CLASSES:
            raise StateContentError(f"it would build {printable(module, 80)}.{printable(name, 80)}, which no rendezvous "
                                    "state holds")
        return super().find_class(module, name)


def check_state_pickle(data: bytes) -> None:
    """Unpickle ``data`` admitting only a rendezvous state's classes; raise if anything else is in it."""
    try:
        state = _StateUnpickler(io.BytesIO(data)).load()
    except StateContentError:
        raise
    except Exception as exc:  # noqa: BLE001 - truncated or foreign bytes
        raise StateContentError(f"it is not a rendezvous state ({type(exc).__name__}: {str(exc)[:100]})") from exc
    if type(state).__name__ != "_RendezvousState":
        raise StateContentError(f"it holds a {type(state).__name__}, not a rendezvous state")
