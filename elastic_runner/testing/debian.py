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
import subprocess
from pathlib import Path

#: Root-only (installing needs root anyway); the lock is the open file, the file itself stays empty.
LOCK = Path("/var/lock/elastic-runner-apt.lock")


def can_install() -> bool:
    """Root on a machine with ``apt-get``."""
    return os.geteuid() == 0 and shutil.which("apt-get") is not None


def apt_install(package: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``apt-get install -y --no-install-recommends PACKAGE``, after ``apt-get update`` when the first try
    fails (a fresh machine's package lists may be missing or stale). Call only where :func:`can_install`."""
    env = os.environ | {"DEBIAN_FRONTEND": "noninteractive"}
    wait = ["-o", f"DPkg::Lock::Timeout={int(timeout)}"]
    install = ["apt-get", *wait, "install", "-y", "--no-install-recommends", package]
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        result = subprocess.run(install, env=env, capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            subprocess.run(["apt-get", *wait, "update"], env=env, capture_output=True, text=True, timeout=timeout)
            result = subprocess.run(install, env=env, capture_output=True, text=True, timeout=timeout)
        return result
    finally:
        os.close(fd)  # releases the lock
