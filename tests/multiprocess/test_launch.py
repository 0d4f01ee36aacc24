"""elastic-runner launch: torchrun's flags, elastic defaults, zygote workers, our agent."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from elastic_runner.agent import health

from elastic_runner.agent.launch import merge_rdzv_conf

from ..support import events, forkserver_context, run_bounded

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


def launch(*args: str, timeout: float = 180, env: dict[str, str] | None = None):  # noqa: ANN201
    import os

    return run_bounded([sys.executable, "-m", "elastic_runner", "launch", *args], timeout,
                       env=os.environ | {"PYTHONUNBUFFERED": "1"} | (env or {}))


def standalone_quickstart(launcher: str, quickstart: Path, run_dir: Path, *more: str):  # noqa: ANN201
    """The quickstart on two workers of one node, with 5 restarts, by ``elastic-runner launch`` or plain torchrun."""
    args = ("--standalone", "--nproc_per_node=2", "--max_restarts=5", "-m", "elastic_runner.train",
            "--config", str(quickstart), "--set", f"run.dir={run_dir}", *more)
    if launcher == "launch":
        return launch(*args)
    return run_bounded([sys.executable, "-m", "torch.distributed.run", *args], 180,
                       env=os.environ | {"PYTHONUNBUFFERED": "1"})


def test_rdzv_defaults_fill_only_missing_keys() -> None:
    assert merge_rdzv_conf("") == "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"
    assert merge_rdzv_conf("last_call_timeout=5,join_timeout=60") == (
        "last_call_timeout=5,join_timeout=60,keep_alive_interval=1,keep_alive_max_attempt=3")


def _big_parallel_op() -> None:
    import torch

    torch.set_num_threads(2)
    x = torch.ones(4_000_000)
    assert float((x * 2).sum()) == 8_000_000.0


def test_zygote_children_can_run_parallel_tensor_ops() -> None:
    # If the zygote ever starts torch's OpenMP team, forked children deadlock in
    # their first parallel region. This is that first region, with a deadline.
    proc = forkserver_context(["elastic_runner.agent.warm"]).Process(target=_big_parallel_op)
    proc.start()
    proc.join(timeout=120)
    alive = proc.is_alive()
    if alive:
        proc.kill()
        proc.join()
    assert not alive, "a child forked from the zygote hung in a parallel region"
    assert proc.exitcode == 0


def test_standalone_quickstart_runs_on_zygote_workers(small_config: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = launch("--standalone", "--nproc_per_node=2", "-m", "elastic_runner.train", "--config", str(small_config),
                    "--set", f"run.dir={run_dir}", "--set", "train.max_steps=20")
    assert result.returncode == 0, result.stdout[-3000:]
    starts = events(run_dir, "start")
    assert len(starts) == 2 and all(e["zygote"] for e in starts), "workers were forked from the warm zygote"
    agent_events = [e for e in events(run_dir) if e.get("role") == "agent"]
    assert any(e["kind"] == "agent_rendezvous" for e in agent_events), "the agent logs its rendezvous rounds"


def test_plain_script_entrypoints_still_work(tmp_path: Path) -> None:
    script = tmp_path / "hello.py"
    # One write() per line: both workers share the pipe, and print() with several arguments under
    # PYTHONUNBUFFERED writes piece by piece, so the two lines could interleave.
    script.write_text("import os; os.write(1, f\"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}\\n\".encode())\n")
    result = launch("--standalone", "--nproc_per_node=2", str(script), timeout=120)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "rank 0 of 2" in result.stdout and "rank 1 of 2" in result.stdout


HANDLED_FAILURE_NOISE = ("Traceback", "ProcessExitedException", "worker_main FAILED", "Root Cause", "ChildFailedError")


@pytest.mark.parametrize(("launcher", "mistake", "said"), [
    ("launch", ("--set", "batch.global_size=-1"), "elastic_runner: config error: "),
    ("torchrun", ("--set", "batch.global_size=-1"), "elastic_runner: config error: "),
    ("launch", ("--set", "model.name=nomod:Nothing"), "elastic_runner: model.name: cannot import module 'nomod'"),
    ("launch", ("--sett", "train.epochs=1"), "elastic-runner train: error: unrecognized arguments: --sett"),
])
def test_a_configuration_error_prints_its_one_line_and_is_not_retried(
        launcher: str, mistake: tuple[str, ...], said: str, quickstart: Path, tmp_path: Path) -> None:
    """In the config, in an import path met while the workload is built, on the command line: one line per node,
    whichever worker met it first, and no restart."""
    started = time.monotonic()
    result = standalone_quickstart(launcher, quickstart, tmp_path, *mistake)
    assert result.returncode == 2, result.stdout[-3000:]
    # Once: one line for the node (not one per worker), and never again (not restarted 5 times).
    errors = [line for line in result.stdout.splitlines() if said in line]
    assert len(errors) == 1 and errors[0].startswith(said), result.stdout[-3000:]
    noise = [word for word in (*HANDLED_FAILURE_NOISE, "every worker restarts") if word in result.stdout]
    assert not noise, f"{noise} on the terminal:\n{result.stdout[-3000:]}"
    assert time.monotonic() - started < 120


@pytest.mark.parametrize("launcher", ["launch", "torchrun"])
@pytest.mark.skipif(health.gpu_driver(), reason="this machine has a GPU driver: cuda is no fault here")
def test_a_node_that_fails_its_health_check_leaves_before_any_round_with_exit_5(
        launcher: str, quickstart: Path, tmp_path: Path) -> None:
    """dist.device: cuda on a node without the device: its agent says so in one line and leaves (exit 5) before
    the rendezvous; no worker starts, nothing is written."""
    run_dir = tmp_path / "run"
    result = standalone_quickstart(launcher, quickstart, run_dir, "--set", "dist.device=cuda")
    assert result.returncode == 5, result.stdout[-3000:]
    said = [line for line in result.stdout.splitlines() if "failed its health check" in line]
    assert len(said) == 1 and "dist.device is cuda, and this node has no GPU driver" in said[0], result.stdout
    assert "Traceback" not in result.stdout and not run_dir.exists()


def test_set_takes_several_values_at_once() -> None:
    from elastic_runner.train import parse_args

    args = parse_args(["--config", "x.yaml", "--set", "train.epochs=1", "run.dir=/tmp/r", "--set", "optim.lr=0.5"])
    assert args.overrides == ["train.epochs=1", "run.dir=/tmp/r", "optim.lr=0.5"]


def test_launch_help_says_what_launch_adds_before_torchruns_options() -> None:
    result = launch("--help", timeout=60)
    assert result.returncode == 0, result.stdout[-3000:]
    text = result.stdout
    assert text.startswith("usage: elastic-runner launch ")
    preamble = text.index("launch adds")
    assert preamble < text.index("--nnodes NNODES", text.index("options:"))
    for added in ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "last_call_timeout=1", "zygote", "ELASTIC_RUNNER_ZYGOTE=0"):
        assert added in text[preamble:text.index("options:")], added


def test_sigterm_ends_the_agent_with_128_plus_signal_and_no_traceback(small_config: Path, tmp_path: Path) -> None:
    import os
    import subprocess

    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "elastic_runner", "launch", "--standalone", "--nproc_per_node=2",
                             "-m", "elastic_runner.train", "--config", str(small_config), "--set", f"run.dir={run_dir}",
                             "--set", "train.max_steps=100000", "--set", "train.epochs=1000"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=os.environ | {"PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 120
        while not events(run_dir, "progress"):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "Traceback" not in out
    assert sorted(e["rank"] for e in events(run_dir, "stop")) == [0, 1]


def test_a_torch_patch_that_no_longer_fits_is_skipped_with_one_warning(small_config: Path, tmp_path: Path) -> None:
    # As if a torch upgrade had renamed a private method our agent overrides.
    code = (
        "import dataclasses, sys\n"
        "from elastic_runner import torch_patches as tp\n"
        "renamed = tp.Need(tp.LOCAL_AGENT, 'LocalElasticAgent._renamed_in_a_future_torch')\n"
        "tp.AGENT_CORRECTIONS = dataclasses.replace(tp.AGENT_CORRECTIONS, needs=tp.AGENT_CORRECTIONS.needs + (renamed,))\n"
        "from elastic_runner.agent.launch import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    run_dir = tmp_path / "run"
    result = run_bounded([sys.executable, "-c", code, "--standalone", "--nproc_per_node=1", "-m", "elastic_runner.train",
                          "--config", str(small_config), "--set", f"run.dir={run_dir}", "--set", "train.max_steps=5"],
                         180, env=os.environ | {"PYTHONUNBUFFERED": "1"})
    assert result.returncode == 0, result.stdout[-3000:]
    warnings = [line for line in result.stdout.splitlines() if "cannot apply" in line]
    assert len(warnings) == 1, result.stdout[-3000:]
    assert "LocalElasticAgent._renamed_in_a_future_torch does not exist" in warnings[0]
    assert "running with torch's behaviour instead: torch's LocalElasticAgent" in warnings[0]
    assert not [e for e in events(run_dir) if e["kind"] == "agent_rendezvous"], "torch's own agent ran the job"


ZYGOTE_PROBE = """
import multiprocessing.forkserver as fs, os, sys, threading, time
import torch
if sys.argv[1] == "busy":  # a thread of the agent's own: forking would copy a process mid-work
    threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
from elastic_runner.agent import zygote
zygote.start_warming()
while fs._forkserver._forkserver_pid is None:
    time.sleep(0.05)
pid = fs._forkserver._forkserver_pid
print(open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\\0", b" ").decode())
"""


@pytest.mark.parametrize("agent, started_as", [("idle", "a fork of the agent"), ("busy", "a new interpreter")])
def test_the_zygote_is_forked_from_an_agent_that_imported_torch_unless_it_runs_threads(agent: str,
                                                                                      started_as: str) -> None:
    result = run_bounded([sys.executable, "-c", ZYGOTE_PROBE, agent], 120)
    assert result.returncode == 0, result.stdout[-3000:]
    forked = "multiprocessing.forkserver import main" not in result.stdout
    assert forked == (started_as == "a fork of the agent"), result.stdout[-3000:]


COMPILE_PROBE = """
import multiprocessing as mp, sys
import torch
from elastic_runner.agent import zygote

if __name__ == "__main__":
    zygote.start_warming(compiled=sys.argv[1] == "compiled")
    worker = mp.get_context("forkserver").Process(
        target=exec, args=("import sys; sys.exit(0 if 'torch._inductor.compile_fx' in sys.modules else 3)",))
    worker.start()
    worker.join(120)
    print("code generator preloaded" if worker.exitcode == 0 else f"not preloaded ({worker.exitcode})")
"""


@pytest.mark.parametrize("workers", ["compiled", "plain"])
def test_the_zygote_preloads_the_compilers_code_generator_only_for_compiled_models(workers: str, tmp_path: Path) -> None:
    """Restarted workers of a compiled model find it imported (0.85 s each here); others do not pay for it."""
    from elastic_runner.agent.zygote import worker_config

    config = tmp_path / "job.yaml"
    config.write_text("train: {epochs: 1}\n")
    args = ["--config", str(config)] + (["--set", "model.compile=true"] if workers == "compiled" else [])
    assert worker_config(args).model.compile == (workers == "compiled")  # what the agent reads to choose
    assert worker_config(["--config", str(tmp_path / "missing.yaml")]) is None
    script = tmp_path / "probe.py"
    script.write_text(COMPILE_PROBE)
    result = run_bounded([sys.executable, str(script), workers], 180)
    assert result.returncode == 0, result.stdout[-3000:]
    expected = "code generator preloaded" if workers == "compiled" else "not preloaded (3)"
    assert expected in result.stdout, result.stdout[-3000:]


@pytest.mark.parametrize("launcher", ["launch", "torchrun"])
def test_a_malformed_run_scope_ends_the_agent_with_one_line_naming_it_on_c10d_too(
        launcher: str, quickstart: Path, tmp_path: Path) -> None:
    """etcd-v3 puts a run's keys under its scope and refused a malformed one; on c10d it only binds the run's lasting
    records (exclusions, the job's configuration), and a malformed one went unnoticed. Now the agent says so before
    it joins a round, on both."""
    from elastic_runner.rendezvous.options import SCOPE_VAR

    args = ("--standalone", "--nproc_per_node=1", "-m", "elastic_runner.train", "--config", str(quickstart),
            "--set", f"run.dir={tmp_path}")
    env = {"PYTHONUNBUFFERED": "1", SCOPE_VAR: "uid/../other\nforged"}
    if launcher == "launch":
        result = launch(*args, env=env)
    else:
        result = run_bounded([sys.executable, "-m", "torch.distributed.run", *args], 180, env=os.environ | env)
    assert result.returncode == 2, result.stdout[-3000:]
    said = [line for line in result.stdout.splitlines() if f"{SCOPE_VAR} is 'uid/../other\\nforged'" in line]
    assert len(said) == 1 and "fix or unset it" in said[0], result.stdout[-3000:]
    assert "forged" not in result.stdout.replace(said[0], ""), "the planted newline forged no line of its own"
    assert not list(tmp_path.glob("events/*")), "no worker started"
