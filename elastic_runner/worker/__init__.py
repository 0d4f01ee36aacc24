"""One worker process: its place in the job, its process group, one training attempt, and how it ends.

- ``process``    the process: logging, signals, the process group up and down, the exit status.
- ``attempt``    one training attempt, from a process group that is up to the end of training.
- ``ending``     how an attempt ends: its ``end`` event, what is kept, the exit status (one place).
- ``run_dir``    rank 0 claims the generation in the run directory; every rank learns the outcome.
- ``env``        what torchrun's environment says (rank, world, restart count, run id).
- ``dist``       device and backend, the process group (with a deadline), the few collectives we use.
- ``regroup``    the process group rebuilt for a new membership in the same process (in-process recovery's core).
- ``lifecycle``  exit statuses, stop signals, leaving at once, dying with the parent: process primitives
                 that the agent, the data loaders and the test tools use too.
- ``watchdog``   peer liveness: a dead or hung peer ends the attempt everywhere within seconds.
- ``preflight``  start-up warnings for launch settings known to fail.
"""
