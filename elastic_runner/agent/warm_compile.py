"""Imported by the zygote after :mod:`elastic_runner.agent.warm` when the workers compile their model.

``torch.compile``'s code generator and its caches: imported here once, not by every worker after every restart.
Imports only (no threads, no subprocesses: checked on torch 2.13 and 2.14; a forked child of a process with threads
can deadlock), see :mod:`elastic_runner.agent.warm`.
"""

import torch._functorch.aot_autograd  # noqa: F401
import torch._inductor.codecache  # noqa: F401
import torch._inductor.compile_fx  # noqa: F401
