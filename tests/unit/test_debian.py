"""Installing the tests' Debian packages: one apt-get at a time, whichever test run asks (a fake apt-get on PATH)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from elastic_runner.testing import debian

#: Records each call's arguments between a start and an end line, slowly enough for two calls to overlap;
#: ``install`` fails until ``update`` ran (a fresh machine's stale package lists).
FAKE_APT_GET = """#!/bin/sh
echo "start $*" >> "{log}"
sleep 0.3
echo "end" >> "{log}"
case "$*" in
  *update*) touch "{updated}" ;;
  *install*) [ -e "{updated}" ] || exit 100 ;;
esac
"""


@pytest.fixture
def fake_apt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "apt.log"
    script = bin_dir / "apt-get"
    script.write_text(FAKE_APT_GET.format(log=log, updated=tmp_path / "updated"))
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setattr(debian, "LOCK", tmp_path / "lock" / "apt.lock")
    return log


def test_an_install_that_fails_on_stale_lists_updates_them_and_tries_again(fake_apt: Path) -> None:
    result = debian.apt_install("etcd-server")
    assert result.returncode == 0
    calls = [line.split()[1:] for line in fake_apt.read_text().splitlines() if line.startswith("start")]
    assert [c[-1] for c in calls] == ["etcd-server", "update", "etcd-server"]
    assert all("DPkg::Lock::Timeout=600" in c for c in calls), "apt-get waits for anyone else's dpkg lock"
    assert "--no-install-recommends" in calls[0]


def test_two_installs_at_once_never_run_apt_get_together(fake_apt: Path) -> None:
    results = []
    lanes = [threading.Thread(target=lambda p=p: results.append(debian.apt_install(p))) for p in ("etcd-server", "prometheus")]
    for lane in lanes:
        lane.start()
    for lane in lanes:
        lane.join(timeout=30)
    assert [r.returncode for r in results] == [0, 0]
    lines = fake_apt.read_text().splitlines()
    assert len(lines) >= 6
    # Every start is followed by its own end: no apt-get began while another was running.
    assert all(a.startswith("start") and b == "end" for a, b in zip(lines[::2], lines[1::2])), lines
    assert (debian.LOCK.stat().st_mode & 0o777) == 0o600


def test_the_lock_is_never_opened_through_a_planted_link_or_in_a_directory_others_can_write(tmp_path: Path) -> None:
    target = tmp_path / "precious"
    target.write_text("keep")
    safe = tmp_path / "safe"
    safe.mkdir(mode=0o700)
    (safe / "apt.lock").symlink_to(target)
    with pytest.raises(OSError):
        debian.open_root_lock(safe / "apt.lock")
    assert target.read_text() == "keep"
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # like /run/lock
    with pytest.raises(PermissionError, match="only root can write"):
        debian.open_root_lock(shared / "apt.lock")
    assert not (shared / "apt.lock").exists()
    fd = debian.open_root_lock(safe / "fresh.lock")
    os.close(fd)
    assert ((safe / "fresh.lock").stat().st_mode & 0o777) == 0o600
