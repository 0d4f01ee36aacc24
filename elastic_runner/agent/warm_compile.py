"""Imported by the zygote after :mod:`elastic_runner.agent.warm` when the workers compile their model.

``torch.compile``'s code generator and its caches: imported here once, not by every worker after every restart.
Imports only (no threads, no subprocesses: checked on torch 2.13 and 2.14; a forked child of a process with threads
can deadlock), see :mod:`elastic_runner.agent.warm`.

Not on a machine with a GPU: importing the code generator there asks the CUDA driver about the devices (torch
2.11 on an H200), and every worker forked from a process that did fails its first CUDA call ("Cannot re-initialize
CUDA in forked subprocess"). There each worker imports it itself (under a second; its CUDA start costs more).
"""

from elastic_runner.agent.zygote import _gpu_device_nodes

if not _gpu_device_nodes():
    import torch._functorch.aot_autograd  # noqa: F401
    import torch._inductor.codecache  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401
