"""The README's own commands, taken from the README by the test itself, do what the README promises of them."""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path
from typing import Any

import pytest

from elastic_runner.observe.audit import check_audit
from elastic_runner.observe.events import read_events

from ..support import ROOT, kill_worker_at_step

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def readme_command(starting: str) -> list[str]:
    """The one command line of the README's shell blocks that starts with ``starting`` (its comment left off)."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    lines = [line for block in blocks for line in block.splitlines() if line.startswith(starting)]
    assert len(lines) == 1, f"README.md has {len(lines)} commands starting with {starting!r}: {lines}"
    return shlex.split(lines[0], comments=True)


def test_the_one_node_command_survives_a_killed_worker_and_ends_with_exit_0_and_a_clean_audit(
        local_job: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # As a user runs it: in a directory of their own holding the config, with nothing set in the environment.
    command = readme_command("elastic-runner launch --standalone")
    assert "--max-restarts" not in " ".join(command).replace("_", "-"), "launch's own restart budget is under test"
    (tmp_path / "configs").mkdir()
    shutil.copy(ROOT / "configs" / "quickstart.yaml", tmp_path / "configs")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    run_dir = tmp_path / "runs" / "quickstart"  # the config's run.dir, relative to where the command runs
    job = local_job(config="", run_dir=str(run_dir), argv=command, cwd=str(tmp_path), log_dir=str(tmp_path / "logs"))
    job.start_agent()

    victim = kill_worker_at_step(job, 60, rank=1, count=2)

    assert job.wait(timeout=240) == [0], job.logs_tail()
    report = check_audit(run_dir)
    assert report.ok and report.finished, report.render()
    replaced = [e for e in read_events(run_dir) if e["kind"] == "agent_worker_replaced"]
    assert [(e["rank"], e["pid"]) for e in replaced] == [(1, victim.pid)], job.logs_tail()
    output = job.agents[0].log_text()
    assert "finished step=264" in output, output[-3000:]
    assert "Setting OMP_NUM_THREADS" not in output, "torch's banner: launch chose the threads and said so"
    assert re.search(r"OMP_NUM_THREADS=\d+ for each of this node's 2 workers", output), output[-3000:]
