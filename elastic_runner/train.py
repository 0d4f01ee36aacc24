"""The worker: ``python -m elastic_runner.train --config FILE [--set key=value ...]``.

Runs alone (world size 1), under ``torchrun --standalone``, or as part of a
multi-node elastic job; it reads its place in the job from the environment.
This module is the door: the arguments and the config are read in :mod:`elastic_runner.worker.main`
(where the agent's zygote starts its forked workers too); the process itself (logging, signals, the
process group, the exit status) is :func:`elastic_runner.worker.process.run`, and one training attempt
:class:`elastic_runner.worker.attempt.Attempt`.

Exit status (:mod:`elastic_runner.worker.ending` decides it): 0 finished or stopped gracefully
(SIGTERM/SIGINT), 2 a configuration or resume problem (the message says what
to fix), 3 the gradient became NaN or inf, 4 finished but the final snapshot
could not be written (the state is kept in node memory), 75 peers did not arrive in time,
76 a peer was lost, 1 anything else.
"""

from __future__ import annotations

import sys

from .worker.main import main, parse_args

__all__ = ["main", "parse_args"]

if __name__ == "__main__":
    sys.exit(main())
