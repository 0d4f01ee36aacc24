"""Imported once by the zygote (a forkserver) so that forked workers start warm.

A cold worker pays ~2.5 s for ``import torch`` and ~2.5 s more the first time
it constructs an optimizer (torch wraps ``Optimizer.__init__`` with a lazy
``torch._dynamo`` import). The zygote pays that once per agent; every worker
it forks, at the first start and at every restart, starts in milliseconds.
Nothing here may initialise CUDA, open sockets, start threads, or run a
tensor operation big enough to start torch's OpenMP thread team: a forked
child then deadlocks in its first parallel region (libgomp is not fork-safe).
Imports and one-element tensors only.
"""

import torch
import torch._dynamo  # noqa: F401 - the optimizer's lazy import, paid here once
import torch.distributed  # noqa: F401
from torch.nn.parallel import DistributedDataParallel  # noqa: F401

import elastic_runner.worker.main  # noqa: F401 - the whole worker and its dependencies

# The same lazy paths the first optimizer step takes.
_param = torch.nn.Parameter(torch.zeros(1))
torch.optim.SGD([_param], lr=0.1)
torch.optim.AdamW([_param], lr=0.1)
del _param
