"""Plain ``torchrun -m elastic_runner.train`` — the project's own one-line usage, and what Kubeflow and
people's scripts start — is as safe and as fast as ``elastic-runner launch``, with no variable to set;
a torchrun job that is not elastic_runner's is left exactly as torch runs it."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Callable

import pytest

from elastic_runner.observe.audit import check_audit
from elastic_runner.testing.localjob import LocalJob, free_port

from ..support import (
    assert_told_once,
    continue_workers,
    events,
    run_bounded,
    start_agent_while_paused,
    stop_workers_at_step,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@pytest.mark.slow
def test_a_node_joins_a_plain_torchrun_job_with_torchs_defaults_and_it_trains_on_at_three(
        small_config: Path, local_job: Callable[..., LocalJob], monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the rank-0 agent died with DistStoreError ... role_info on the join, and the job with it,
    unless the user had set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1."""
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    # torch's keep-alive and shared store; only the last call is 1 s (not 30) so the join does not wait it out.
    job = local_job(config=str(small_config), nnodes="2:3", launcher="torchrun", rdzv_conf="last_call_timeout=1",
                    disable_shared_store=False,
                    overrides=["train.epochs=20", "train.max_steps=150",
                               "data.sampler=tests.broken_components:PacedSampler"])
    job.start_agent()
    job.start_agent()
    start_agent_while_paused(job, at_step=10, count=2, timeout=120)
    assert job.wait(timeout=200) == [0, 0, 0], job.logs_tail()
    report = check_audit(Path(job.run_dir))
    assert report.ok, report.render()
    assert report.finished and report.final_step == 150
    assert 3 in {e["world_size"] for e in events(Path(job.run_dir), "start")}, "never trained at world size 3"


def test_a_worker_kill_under_tuned_plain_torchrun_takes_launchs_fast_path(
        resume_config: Path, local_job: Callable[..., LocalJob]) -> None:
    # Every worker restarts (the path without in-process recovery; with it, the default: test_in_process.py).
    job = local_job(config=str(resume_config), nnodes="2:2", launcher="torchrun",
                    overrides=["recovery.in_process=false"])
    job.start_agent()
    job.start_agent()
    run_dir = Path(job.run_dir)
    workers, _ = stop_workers_at_step(job, 60, count=2, timeout=120)
    for w in workers:  # forked from the zygote, itself forked from the agent: no new interpreter anywhere
        zygote = parent(w.pid)
        assert zygote != w.agent.pid and parent(zygote) == w.agent.pid, "workers are forked from the zygote"
        assert cmdline(w.pid) == cmdline(zygote) == cmdline(w.agent.pid), "the zygote was forked from the agent"
    victim = next(w for w in workers if w.rank == 1)
    job.signal_worker(victim, signal.SIGKILL)
    continue_workers(job, [w for w in workers if w is not victim])
    assert job.wait(timeout=180) == [0, 0], job.logs_tail()
    assert_told_once(job, victim.pid)

    resumes = [e for e in events(run_dir, "resume") if e["generation"] > 1]
    assert resumes and min(resumes, key=lambda e: e["generation"])["tier"] == "memory", resumes
    agent_logs = sorted((run_dir / "events").glob("agent-*.jsonl"))
    assert len(agent_logs) == 2, "each torchrun agent runs ours and keeps its event log"
    seen = [json.loads(line)["kind"] for path in agent_logs for line in path.read_text().splitlines()]
    assert "agent_restart" in seen and "agent_rendezvous" in seen, sorted(set(seen))
    assert check_audit(run_dir).ok


def test_a_torchrun_job_that_is_not_elastic_runners_is_left_as_torch_runs_it(tmp_path: Path) -> None:
    script = tmp_path / "other.py"
    out = tmp_path / "seen.json"
    script.write_text(
        "import json, os, sys\n"
        f"json.dump({{'share': os.environ.get('TORCH_DISABLE_SHARE_RDZV_TCP_STORE'), 'argv0': sys.argv[0],\n"
        f"           'ours': [k for k in os.environ if k.startswith('ELASTIC_RUNNER_')]}}, open({str(out)!r}, 'w'))\n")
    env = {k: v for k, v in __import__("os").environ.items()
           if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" and not k.startswith("ELASTIC_RUNNER_")}
    result = run_bounded([sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=1",
                          "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}", str(script)],
                         timeout=90, env=env)
    assert result.returncode == 0, result.stdout[-3000:]
    seen = json.loads(out.read_text())
    assert seen == {"share": None, "argv0": str(script), "ours": []}, seen
    assert "[agent]" not in result.stdout, "no elastic_runner agent messages"

