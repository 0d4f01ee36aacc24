"""Who may read what a run writes: private by default.

Snapshots hold the model, the events and the audit trail describe the data; on a shared host other
users must not read them, nor plant files where the job looks. Everything elastic_runner creates is
created with an explicit mode, whatever the process umask:

- ``snapshot.mode: private`` (default): files 0600, directories 0700;
- ``snapshot.mode: group``: files 0640, directories 0750, for teams that share a volume (give the
  run directory the team's group, and the setgid bit, so new files inherit it).

New files are opened with ``O_NOFOLLOW`` (a planted symlink is not written through) and, where a
file must not exist yet, ``O_EXCL``. The process umask is left alone: a user's own code in the same
process keeps its behaviour.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import IO, Any

_MODES = {"private": (0o600, 0o700), "group": (0o640, 0o750)}
_file_mode, _dir_mode = _MODES["private"]
_sharing = "private"


def set_sharing(mode: str) -> None:
    """``private`` or ``group`` (``snapshot.mode``); called once when a worker starts."""
    global _file_mode, _dir_mode, _sharing
    _file_mode, _dir_mode = _MODES[mode]
    _sharing = mode


def sharing() -> str:
    return _sharing


def file_mode() -> int:
    return _file_mode


def dir_mode() -> int:
    return _dir_mode


def makedirs(path: str | os.PathLike[str]) -> Path:
    """``mkdir -p`` whose new directories get the directory mode (existing ones are left as they are)."""
    target = Path(path)
    missing = []
    probe = target
    while not probe.exists() and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=_dir_mode)
        except FileExistsError:
            continue
        os.chmod(directory, _dir_mode)  # mkdir's mode is masked by the umask
    return target


def open_file(path: str | os.PathLike[str], mode: str = "w", exclusive: bool = False, buffering: int = -1) -> IO[Any]:
    """``open(path, mode)`` for "w", "wb", "a" or "ab", creating the file with the file mode and never
    following a symlink at ``path``; ``exclusive``: the file must not exist yet."""
    flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    flags |= os.O_APPEND if mode.startswith("a") else os.O_TRUNC
    if exclusive:
        flags |= os.O_EXCL
    fd = os.open(path, flags, _file_mode)
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) & ~_file_mode and os.fstat(fd).st_uid == os.getuid():
            os.fchmod(fd, _file_mode)  # an older file of ours from a looser umask
        return os.fdopen(fd, mode, buffering, **({} if "b" in mode else {"encoding": "utf-8"}))
    except BaseException:
        os.close(fd)
        raise


def write_file_atomically(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to a new file beside ``path`` (an unpredictable name, the file mode), then rename."""
    import tempfile

    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), _file_mode)
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class UnsafeDirectoryError(OSError):
    """A directory we are about to trust is a symlink, someone else's, or open to other users."""


def check_private_dir(path: Path) -> None:
    """``path`` (checked with lstat) is a real directory, ours, closed to group and others."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise UnsafeDirectoryError(f"{path} is a symbolic link (to {os.readlink(path)}), not a directory of ours")
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeDirectoryError(f"{path} is not a directory")
    if info.st_uid != os.getuid():
        raise UnsafeDirectoryError(f"{path} belongs to uid {info.st_uid}, not to this user (uid {os.getuid()})")
    if stat.S_IMODE(info.st_mode) & 0o077:
        raise UnsafeDirectoryError(f"{path} has mode {stat.S_IMODE(info.st_mode):04o}: other users may write into it")


def private_dir(path: Path) -> Path:
    """Create ``path`` with mode 0700 (parents as needed) or verify an existing one (:func:`check_private_dir`)."""
    try:
        path.mkdir(mode=0o700, parents=False)
        os.chmod(path, 0o700)
    except FileExistsError:
        pass
    check_private_dir(path)
    return path
