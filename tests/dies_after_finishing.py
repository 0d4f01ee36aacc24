"""A worker program for tests: it trains exactly as ``-m elastic_runner.train`` does, then rank 1 of the first
attempt dies with status 1 a few seconds later — a process that fails in its teardown, after the job is done (its final snapshot
durable)."""

from __future__ import annotations

import os
import sys
import time

from elastic_runner.train import main

if __name__ == "__main__":
    code = main(sys.argv[1:])
    if os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
        time.sleep(3)  # the other node's worker has exited by now, its agent waits in torch's exit barrier
        sys.stdout.flush()
        os._exit(1)
    sys.exit(code)
