"""Debian packages the tests need (etcd-server, prometheus), installed as root, one ``apt-get`` at a time.

Two test runs at once (two checkouts, or parallel pytest workers) on a fresh machine may find etcd missing at
the same moment, and the second ``apt-get`` would fail on dpkg's lock. A file lock taken
around every install here serialises our own installs (the second one then finds the package there);
``DPkg::Lock::Timeout`` makes ``apt-get`` wait for anyone else's (unattended-upgrades) instead of failing.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import subprocess
from pathlib import Path

#: In a directory only root may write (not /var/lock, which is /run/lock, world-writable: another user could plant
#: a symlink there that root would follow); the lock is the open file, the file itself stays empty.
LOCK = Path("/var/lib/elastic-runner/apt.lock")


def can_install() -> bool:
    """Root on a machine with ``apt-get``."""
    return os.geteuid() == 0 and shutil.which("apt-get") is not None


def apt_install(package: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``apt-get install -y --no-install-recommends PACKAGE``, after ``apt-get update`` when the first try
    fails (a fresh machine's package lists may be missing or stale). Call only where :func:`can_install`."""
    env = os.environ | {"DEBIAN_FRONTEND": "noninteractive"}
    wait = ["-o", f"DPkg::Lock::Timeout={int(timeout)}"]
    install = ["apt-get", *wait, "install", "-y", "--no-install-recommends", package]
    fd = open_root_lock(LOCK)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        result = subprocess.run(install, env=env, capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            subprocess.run(["apt-get", *wait, "update"], env=env, capture_output=True, text=True, timeout=timeout)
            result = subprocess.run(install, env=env, capture_output=True, text=True, timeout=timeout)
        return result
    finally:
        os.close(fd)  # releases the lock


def open_root_lock(path: Path) -> int:
    """``path`` opened for locking, refusing anything another user could have planted: the directory must be a
    real directory owned by root and writable by root alone, the file a regular file (``O_NOFOLLOW``)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.lstat(path.parent)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o022:
        raise PermissionError(f"{path.parent} is not a directory that only root can write (mode "
                              f"{stat.S_IMODE(info.st_mode):o}, owner {info.st_uid}): remove it and run again")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise PermissionError(f"{path} is not a regular file: remove it and run again")
    return fd
