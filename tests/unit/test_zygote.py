"""The zygote (a forkserver forked from the agent) must never hand its workers a CUDA driver state that a fork
spoils: torchrun's own agent asks the driver whether a GPU exists before our handler runs, and every worker forked
from such a process failed its first CUDA call ("Cannot re-initialize CUDA in forked subprocess", seen on an H200).
Such an agent starts the zygote as a new interpreter instead."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch


def in_fresh_python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def cuda_build_or_skip() -> None:
    if not torch.cuda._is_compiled():
        pytest.skip("this torch build has no CUDA driver to ask (the CPU wheel): no fork can be spoiled")


def test_a_process_that_asked_the_cuda_driver_spoils_its_forks() -> None:
    cuda_build_or_skip()
    out = in_fresh_python("import torch; from elastic_runner.agent import zygote as z; "
                          "before = z._child_in_bad_fork(torch); torch.cuda.is_available(); "
                          "print(before, z._child_in_bad_fork(torch))")
    assert out == "False True"


def test_without_a_gpu_device_the_zygote_is_forked_from_the_agent_whatever_the_driver_was_asked() -> None:
    # A CUDA build on a CPU machine: the workers never use CUDA, so the fast fork stays.
    out = in_fresh_python("import torch; from elastic_runner.agent import zygote as z; torch.cuda.is_available(); "
                          "z._gpu_device_nodes = lambda: []; print(z._fork_poisoned())")
    assert out == "False"


def test_with_a_gpu_device_a_spoilt_agent_starts_the_zygote_as_a_new_interpreter() -> None:
    cuda_build_or_skip()
    out = in_fresh_python("import torch; from elastic_runner.agent import zygote as z; "
                          "z._gpu_device_nodes = lambda: ['/dev/nvidia0']; clean = z._fork_poisoned(); "
                          "torch.cuda.is_available(); print(clean, z._fork_poisoned(), z.fork_zygote())")
    assert out == "False True False"



def test_warming_for_a_bucket_imports_its_client_library_and_starts_no_thread() -> None:
    # A thread in the zygote would be copied half-alive into every forked worker.
    out = in_fresh_python("import threading, sys; import elastic_runner.agent.warm; "
                          "import elastic_runner.agent.warm_object_store; "
                          "print(threading.active_count(), 's3fs' in sys.modules, 'botocore' in sys.modules)")
    assert out == "1 True True"
