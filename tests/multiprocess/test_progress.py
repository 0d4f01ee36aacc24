"""What a user watching a run sees: a progress bar with the ETA on a terminal, lines with it in a log."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import sys
import termios
import time
from pathlib import Path

import pytest

from ..support import QUICKSTART, run_bounded

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

WORKER = [sys.executable, "-m", "elastic_runner.train", "--config", str(QUICKSTART), "--set", "train.epochs=4"]


def on_a_terminal(command: list[str], timeout: float = 120) -> tuple[int, str]:
    """Run ``command`` on a pseudo-terminal of 120 columns (as a user's); its exit status and everything it drew."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: the terminal is its stdin, stdout and stderr
        os.execvpe(command[0], command, os.environ | {"PYTHONUNBUFFERED": "1"})
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    drawn, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 1.0)
            if ready:
                try:
                    data = os.read(fd, 65536)
                except OSError:  # the child closed the terminal
                    break
                if not data:
                    break
                drawn += data
        else:
            os.kill(pid, 9)
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    return os.waitstatus_to_exitcode(status), drawn.decode(errors="replace")


def test_on_a_terminal_the_bar_shows_steps_epoch_loss_rate_and_eta_and_log_lines_never_tear_it(tmp_path: Path) -> None:
    code, drawn = on_a_terminal([*WORKER, "--set", f"run.dir={tmp_path / 'run'}"])
    assert code == 0, drawn[-3000:]
    bars = re.findall(r"epoch (\d+) +\d+%\|[^|]*\| (\d+)/176 steps \[(\d\d:\d\d)<(\d\d:\d\d), loss [\d.e-]+, "
                      r"[\d,]+ samples/s\]", drawn)
    assert bars, drawn[-3000:]
    assert bars[-1][:2] == ("3", "176"), "the bar ends at the last step, in the last epoch"
    # Log records and evaluation lines are written above the bar, each on a line of its own.
    assert not re.search(r"samples/s\]\S", drawn), "a line was written into the bar"
    assert re.search(r"\rstep=100 eval_loss=[\d.]+ eval_accuracy=[\d.]+\r\n", drawn), drawn[-3000:]
    assert "step=100 epoch=" not in drawn, "the bar holds the per-N-steps fields: no lines for them"


def test_in_a_log_each_progress_line_carries_the_total_and_the_eta(tmp_path: Path) -> None:
    result = run_bounded([*WORKER, "--set", f"run.dir={tmp_path / 'run'}"], timeout=120)
    assert result.returncode == 0, result.stdout[-3000:]
    lines = [line for line in result.stdout.splitlines() if re.match(r"step=\d+/176 epoch=", line)]
    assert len(lines) == 176 // 25 + 1, result.stdout[-3000:]  # logging.every_steps 25, and the last step
    assert all(re.search(r" eta=\d\d:\d\d$", line) for line in lines), lines
    assert lines[-1].startswith("step=176/176 ") and lines[-1].endswith(" eta=00:00")
    assert "\r" not in result.stdout and "%|" not in result.stdout, "no bar where there is no terminal"
